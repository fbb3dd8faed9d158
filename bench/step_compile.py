"""What the first step compiles: keras-hub families' first fit and steady step with grappler on and off.

TensorFlow runs grappler on each device's part of a DTensor program. On a mesh of virtual
CPU devices, which share the host's cores, TofuStrategy calls its step programs with
grappler off (``tofu_tf.tf.compat.calls``). This prints, per family of
``tofu_tf.hub_models``, side by side in one process on the same 8 devices: one device's
first fit and steady step, and TofuStrategy's with ``graph_optimizations=True`` (TensorFlow's
default) and ``False`` (the CPU default), as medians over ``--repeats`` fresh models. The
steady step is given in wall time and in the process's CPU time (all threads), which another
job on the machine disturbs less. The flags are bench/zoo.py's. Run:
    python bench/step_compile.py [--families=t5,mixtral] [--repeats=3]
"""

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from absl import app  # noqa: E402

import zoo  # noqa: E402  (its flags: --families, --repeats, --steps, --batch_size, --width, --num_devices)

FLAGS = zoo.FLAGS


def _fit(model, x, y, keras):
    """(first fit seconds, per-step wall seconds, per-step CPU seconds) of one epoch."""
    ends = []

    def record(batch, logs=None):
        ends.append((time.perf_counter(), time.process_time()))
    callback = keras.callbacks.LambdaCallback(on_train_begin=lambda logs=None: record(None),
                                              on_train_batch_end=record)
    start = time.perf_counter()
    model.fit(x, y, batch_size=FLAGS.batch_size, shuffle=False, verbose=0, callbacks=[callback])
    first = time.perf_counter() - start
    wall = [b[0] - a[0] for a, b in zip(ends, ends[1:])]
    cpu = [b[1] - a[1] for a, b in zip(ends, ends[1:])]
    return first, wall, cpu


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
          f"{'steady ms: 1 dev':>17}{'on':>6}{'off':>6}{'off/on':>7}{'CPU ms: on':>12}{'off':>6}{'off/on':>7}")
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
                rows[side].append(_fit(model, x, y, keras))
        first = {side: statistics.median(r[0] for r in rows[side]) for side in sides}
        wall = {side: statistics.median(statistics.median(r[1][2:]) for r in rows[side]) for side in sides}
        cpu = {side: statistics.median(statistics.median(r[2][2:]) for r in rows[side]) for side in sides}
        print(f"{name:<9}{first['one']:>19.1f}{first['on']:>12.1f}{first['off']:>6.1f}"
              f"{first['on'] / first['one']:>9.1f}{first['off'] / first['one']:>10.1f}"
              f"{wall['one'] * 1e3:>17.1f}{wall['on'] * 1e3:>6.1f}{wall['off'] * 1e3:>6.1f}"
              f"{wall['off'] / wall['on']:>7.2f}{cpu['on'] * 1e3:>12.1f}{cpu['off'] * 1e3:>6.1f}"
              f"{cpu['off'] / cpu['on']:>7.2f}", flush=True)
    print("first fit: seconds of the first fit (one epoch of --steps steps: planning, tracing, compiling); "
          "ratio: over one device's; steady: median step of steps 3..n, wall and process CPU time; on/off: "
          "TofuStrategy with graph_optimizations=True/False; medians of --repeats fresh models.")


if __name__ == "__main__":
    app.run(main)
