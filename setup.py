"""Install tofu_tf, with the strategies built on it as tofu_tf.strategies."""

import ast
import os

from setuptools import find_packages, setup


def _tested_ranges():
    """``TESTED`` of tofu_tf/versions.py, read from its text: setup.py runs before the
    dependencies are installed, so it cannot import the package."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tofu_tf", "versions.py")
    with open(path, encoding="utf-8") as handle:
        tree = ast.parse(handle.read(), path)
    for node in tree.body:
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["TESTED"]:
            return ast.literal_eval(node.value)
    raise RuntimeError(f"{path} defines no TESTED")


TESTED = _tested_ranges()

setup(
    name="tofu_tf",
    version="0.1.0",
    license="Apache-2.0",
    description="Automatic partitioning of TensorFlow/Keras training steps across devices (Tofu on DTensor)",
    # The strategies/ folder is the package tofu_tf.strategies: no top-level `strategies`
    # lands in site-packages, where it would collide with any other package of that name.
    packages=[*find_packages(include=["tofu_tf", "tofu_tf.*"]),
              *("tofu_tf." + name for name in find_packages(include=["strategies", "strategies.*"]))],
    package_dir={"tofu_tf.strategies": "strategies"},
    # The pipeline memory regression's measured samples.
    package_data={"tofu_tf.pipeline": ["data/*.json"], "tofu_tf.search": ["dtensor_support.json"]},
    python_requires=">=3.10,<3.13",
    install_requires=[
        # The tested ranges are tofu_tf/versions.py's, which also checks them at run time.
        # TensorFlow's wheel ships both CPU and CUDA kernels. Do not add
        # tensorflow-cpu beside it: tf-keras requires the `tensorflow` distribution
        # and two distributions would share one module tree.
        "tensorflow" + TESTED["tensorflow"],
        "tf-keras" + TESTED["tf-keras"],
        "keras" + TESTED["keras"],
        "absl-py>=2.1",
        "numpy>=1.26",
        "scipy>=1.11",
    ],
    extras_require={
        # highspy: the ILP reference reads HiGHS's improving solutions through it (tests
        # cover that path and the scipy.optimize.milp fallback); bench/planner.py's ILP race too.
        # keras-hub: the tests and bench/zoo.py train its models (small configs, no downloads).
        # matplotlib: Plan.to_png and tofu-plan --png (the HTML page needs nothing); the tests draw one.
        # pytest-xdist: the README's test command runs the suite on two workers, a file each.
        # tensorboard: Keras' TensorBoard callback needs it (its users have it); the tests read
        # back what it writes of weights on the mesh.
        "test": ["pytest>=8", "pytest-xdist>=3.5", "hypothesis>=6.100", "highspy>=1.7",
                 "keras-hub" + TESTED["keras-hub"], "matplotlib>=3.8", "tensorboard" + TESTED["tensorboard"]],
        "bench": ["highspy>=1.7", "keras-hub" + TESTED["keras-hub"]],
        "plot": ["matplotlib>=3.8"],
    },
    entry_points={"console_scripts": ["tofu-plan=tofu_tf.plan_command:entry_point",
                                      "tofu-launch=tofu_tf.launch:entry_point"]},
)
