"""The ``Example:`` sections of the public entry points' docstrings run as written.

Each docstring's examples run as a doctest. The ``Plan`` methods' examples use the ``plan``
the class docstring's example makes, so they run after it, in its namespace. Files the
examples write land in a temporary directory; ``register_op``'s example registers into a
copy of the default registry, which the test then drops.
"""

import doctest
import sys

import pytest

import tofu_tf
from tofu_tf import pipeline, semantics
from tofu_tf.plan import Plan
from tofu_tf.semantics import registry as registry_module
from tofu_tf.tf import capture

_PLAN_METHODS = ("summary", "to_json", "from_json", "from_file", "to_html", "to_png")


def _run(obj, name: str, globs: dict) -> None:
    test = doctest.DocTestParser().get_doctest(obj.__doc__, globs, name, None, 0)
    test.globs = globs      # get_doctest copies them; the Plan methods share the class's
    assert test.examples, f"{name} has no examples"
    runner = doctest.DocTestRunner()
    failures = []
    runner.run(test, out=failures.append, clear_globs=False)
    assert runner.failures == 0, "".join(failures)


@pytest.fixture(autouse=True)
def _sandbox(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    fresh = semantics.Registry()
    semantics.register_builtin_ops(fresh)
    monkeypatch.setattr(registry_module, "_default", fresh)


@pytest.mark.parametrize("name", ["plan_model", "plan_graph", "capture_training_step", "register_op",
                                  "coverage", "partition", "layer_stats", "recommend_hybrid"])
def test_entry_point_examples_run(name):
    objects = {
        "plan_model": tofu_tf.plan_model, "plan_graph": tofu_tf.plan_graph,
        "capture_training_step": capture.capture_training_step, "register_op": semantics.register_op,
        "coverage": semantics.coverage, "partition": pipeline.partition, "layer_stats": pipeline.layer_stats,
        "recommend_hybrid": pipeline.recommend_hybrid,
    }
    globs = {}
    if name == "partition":     # its example calls it by its name in its own module
        globs = dict(vars(sys.modules["tofu_tf.pipeline.partition"]))
    _run(objects[name], name, globs)


def test_plan_examples_run():
    pytest.importorskip("matplotlib")       # Plan.to_png's example draws
    globs = {}
    _run(Plan, "Plan", globs)
    for method in _PLAN_METHODS:
        _run(getattr(Plan, method), f"Plan.{method}", globs)
