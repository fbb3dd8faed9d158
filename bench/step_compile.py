"""What the first step compiles: keras-hub families' first fit and steady step with grappler on and off.

TensorFlow runs grappler on each device's part of a DTensor program. On a mesh of virtual
CPU devices, which share the host's cores, TofuStrategy calls its step programs with
grappler off (``tofu_tf.tf.compat.calls``). This prints, per family of
``tofu_tf.hub_models``, side by side in one process on the same 8 devices: one device's
first fit and steady step, and TofuStrategy's with ``graph_optimizations=True`` (TensorFlow's
default) and ``False`` (the CPU default), as medians over ``--repeats`` fresh models. The
flags are bench/zoo.py's. Run:
    python bench/step_compile.py [--families=t5,mixtral] [--repeats=3]
"""

import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from absl import app  # noqa: E402

import zoo  # noqa: E402  (its flags: --families, --repeats, --steps, --batch_size, --width, --num_devices)

FLAGS = zoo.FLAGS


def main(argv):
    del argv
    from absl import logging
    logging.set_verbosity(logging.WARNING)
    from tofu_tf.tf import devices
    devices.provide_devices(FLAGS.num_devices)
    import keras

    from tofu_tf.strategies import TofuStrategy
    from tofu_tf import hub_models

    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    sides = ("one", "on", "off")
    print(f"{'family':<9}{'first fit s: 1 dev':>19}{'grappler on':>12}{'off':>6}{'ratio on':>9}{'ratio off':>10}"
          f"{'steady ms: 1 dev':>17}{'on':>6}{'off':>6}{'off/on':>7}")
    for name in FLAGS.families or sorted(hub_models.FAMILIES):
        family = hub_models.FAMILIES[name]
        x, y = hub_models.data(family, FLAGS.batch_size * FLAGS.steps)
        rows = {side: [] for side in sides}
        for _ in range(FLAGS.repeats):
            for side in sides:           # the same order each repeat: one device, then each strategy
                keras.utils.set_random_seed(0)
                if side == "one":
                    model = family.build(FLAGS.width)
                    model.compile(optimizer="adam", loss=loss)
                else:
                    strategy = TofuStrategy(FLAGS.num_devices, plan_cache=False, graph_optimizations=side == "on")
                    with strategy.scope():
                        model = family.build(FLAGS.width)
                        model.compile(optimizer="adam", loss=loss)
                rows[side].append(zoo._fit(model, x, y, keras))  # pylint: disable=protected-access
        first = {side: statistics.median(r[0] for r in rows[side]) for side in sides}
        steady = {side: statistics.median(statistics.median(r[1][2:]) for r in rows[side]) for side in sides}
        print(f"{name:<9}{first['one']:>19.1f}{first['on']:>12.1f}{first['off']:>6.1f}"
              f"{first['on'] / first['one']:>9.1f}{first['off'] / first['one']:>10.1f}"
              f"{steady['one'] * 1e3:>17.1f}{steady['on'] * 1e3:>6.1f}{steady['off'] * 1e3:>6.1f}"
              f"{steady['off'] / steady['on']:>7.2f}", flush=True)
    print("first fit: seconds of the first fit (one epoch of --steps steps: planning, tracing, compiling); "
          "ratio: over one device's; steady: median step of steps 3..n; on/off: TofuStrategy with "
          "graph_optimizations=True/False; medians of --repeats fresh models.")


if __name__ == "__main__":
    app.run(main)
