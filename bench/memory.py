"""Who pays what for memory: the NOTES.md anchor, reproduced in one run.

A 4 x Dense(4096) + Dense(10) MLP (67.2M parameters, Adam, fp32), batch 16, 4 fit
steps including tracing, on 8 virtual CPU devices, trained three ways:

* ``data_parallel``: TF's DTensor MirroredStrategy (replicated weights, batch split on 8);
* ``megatron_layoutmap``: a hand-written tf-keras LayoutMap, kernels alternating column/row
  on a model=8 axis, with tf-keras' DTensor Adam;
* ``tofu``: TofuStrategy(8), no layout written.

Each run is its own process (peak RSS is per process); the table shows the median of
--repeats runs and ratios against the hand-written plan. Times per run:

* ``build s``: strategy/mesh, model and compile under the scope (the hand-written plan and
  data parallel initialize their variables here; TofuStrategy defers them to the plan);
* ``fit s``: the first ``fit`` of --steps steps, tracing included (and, for TofuStrategy,
  capture, planning and creating the variables shard by shard);
* ``total s``: build + fit, what a user waits for;
* ``wait s``: the part of ``fit`` after its last step ended (``on_train_end``): deleting
  an autotuned tf.data iterator waits out tf.data's tuning thread (TF 2.21), a sleep of
  seconds that depends on when the thread last woke, not on the partitioning.
  TofuStrategy turns autotuning off for the datasets it distributes; the hand-written
  plan and data parallel run as written;
* ``work s``: total - wait, the figure the target is judged on (each method's own work:
  building, planning, creating variables, tracing and running the steps);
* ``cpu s``: process CPU time over build + fit (all threads), steadier than wall time when
  other jobs share the machine;
* ``step ms``: median step once traced (a second ``fit`` of --steps steps).

The target (peak RSS and time within 10% of the hand-written plan) is judged per TofuStrategy
method on the interleaved runs as pairs (run k of each method saw the same machine load): the
ratio of medians with a 95% bootstrap interval over the pairs (2000 resamples, fixed seed); met
when the interval's upper end is at most 1.10, for peak RSS and for time, time read two ways:
``total`` (what a user waits, the anchor's measure) and ``work`` (the stricter one). One run's
noise on this shared machine can widen the interval past the target; ``--save_runs`` keeps each
run's figures and ``--pool_runs`` judges several runs' pairs together (``--repeats=0``: only them).

A second table (``--side_by_side``, default on) trains the hand-written plan and each
TofuStrategy method in *one* process and alternates their fits, step by step timing each:
a steady-step ratio measured side by side, which drift in machine load cannot tilt.

Run:
    python bench/memory.py [--repeats=3] [--methods=data_parallel,megatron_layoutmap,tofu]
                           [--save_runs=FILE] [--pool_runs=FILE,...]
"""

import functools
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app, flags  # noqa: E402

flags.DEFINE_integer("repeats", 3, "Runs per method; medians are reported.")
flags.DEFINE_list("methods", ["data_parallel", "megatron_layoutmap", "tofu"], "Methods to run.")
flags.DEFINE_string("run", None, "Internal: run one method in this process and print JSON.")
flags.DEFINE_integer("width", 4096, "MLP width.")
flags.DEFINE_integer("depth", 4, "Hidden layers.")
flags.DEFINE_integer("batch_size", 16, "Global batch size.")
flags.DEFINE_integer("steps", 4, "Fit steps (the first includes tracing).")
flags.DEFINE_bool("side_by_side", True, "Also time steady steps of the hand-written plan and the "
                  "TofuStrategy methods alternating in one process.")
flags.DEFINE_string("save_runs", None, "Append every run (JSON, one per line) to this file, for --pool_runs.")
flags.DEFINE_list("pool_runs", [], "Files an earlier --save_runs wrote: their interleaved pairs join this run's "
                  "in the target's verdict (--repeats=0 judges them alone).")
flags.DEFINE_integer("side_by_side_rounds", 5, "Alternating fits per model in the side-by-side table.")
FLAGS = flags.FLAGS

NUM_DEVICES = 8


def _build(keras):
    layers = [keras.Input((FLAGS.width,))]
    layers += [keras.layers.Dense(FLAGS.width, activation="relu", name=f"d{i}") for i in range(FLAGS.depth)]
    layers.append(keras.layers.Dense(10, name="head"))
    return keras.Sequential(layers, name="anchor_mlp")


def _data():
    import numpy as np
    rng = np.random.default_rng(0)
    n = FLAGS.batch_size * FLAGS.steps
    return rng.normal(size=(n, FLAGS.width)).astype("float32"), rng.integers(0, 10, n).astype("int32")


def _run_data_parallel():
    import tf_keras as keras
    from tensorflow.experimental import dtensor
    from tensorflow.python.distribute.experimental import mirrored_strategy

    def make_strategy():
        mesh = dtensor.create_mesh([("batch", NUM_DEVICES)], devices=[f"CPU:{i}" for i in range(NUM_DEVICES)])
        return mirrored_strategy.MirroredStrategy(mesh=mesh)
    return _fit_in_scope(make_strategy, keras)[0]


def _fit_in_scope(make_strategy, keras):
    """Build and compile under the strategy, then time ``fit`` on numpy arrays."""
    start, cpu_start = time.perf_counter(), time.process_time()
    strategy = make_strategy()
    with strategy.scope():
        model = _build(keras)
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    build_seconds = time.perf_counter() - start
    x, y = _data()
    return _timed_fits(keras, model, build_seconds, cpu_start,
                       lambda **kw: model.fit(x, y, batch_size=FLAGS.batch_size, epochs=1, verbose=0,
                                              shuffle=False, **kw)), strategy


def _timed_fits(keras, model, build_seconds, cpu_start, fit):
    """Times a first fit (tracing included) and the steady steps of a second one.

    ``total_cpu_seconds`` (process CPU time, every thread, from the start of the
    build to the end of the first fit) is the figure least moved by other jobs
    on a shared machine."""
    stamps = []
    ended = []

    class StepClock(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            stamps.append(time.perf_counter())

    class EndClock(keras.callbacks.Callback):
        def on_train_end(self, logs=None):
            ended.append(time.perf_counter())

    start = time.perf_counter()
    fit(callbacks=[EndClock()])
    fit_seconds = time.perf_counter() - start
    total_cpu_seconds = time.process_time() - cpu_start
    wait_seconds = start + fit_seconds - ended[0]
    stamps.clear()
    stamps.append(time.perf_counter())
    fit(callbacks=[StepClock()])
    steps = [later - earlier for earlier, later in zip(stamps, stamps[1:])]
    return {"build_seconds": build_seconds, "fit_seconds": fit_seconds, "wait_seconds": wait_seconds,
            "total_cpu_seconds": total_cpu_seconds, "step_seconds": statistics.median(steps)}


def _megatron_layoutmap_model():
    """The hand-written plan: a model under a LayoutMap, DTensor Adam, a DTensorDataset."""
    import tensorflow as tf
    import tf_keras as keras
    from tensorflow.experimental import dtensor
    mesh = dtensor.create_mesh([("batch", 1), ("model", NUM_DEVICES)], devices=[f"CPU:{i}" for i in range(NUM_DEVICES)])
    keras.utils.set_random_seed(0)
    layout_map = keras.dtensor.experimental.LayoutMap(mesh=mesh)
    for i in range(FLAGS.depth):
        column = i % 2 == 0
        layout_map[f"d{i}.*kernel"] = dtensor.Layout(
            [dtensor.UNSHARDED, "model"] if column else ["model", dtensor.UNSHARDED], mesh)
        layout_map[f"d{i}.*bias"] = dtensor.Layout(["model"] if column else [dtensor.UNSHARDED], mesh)
    with layout_map.scope():
        model = _build(keras)
    model.compile(optimizer=keras.dtensor.experimental.optimizers.Adam(mesh=mesh),
                  loss="sparse_categorical_crossentropy")
    x, y = _data()
    dataset = tf.data.Dataset.from_tensor_slices((x, y))
    layouts = (dtensor.Layout.batch_sharded(mesh, "batch", 2), dtensor.Layout.batch_sharded(mesh, "batch", 1))
    dataset = dtensor.DTensorDataset(dataset=dataset, mesh=mesh, layouts=layouts,
                                     global_batch_size=FLAGS.batch_size, batch_dim="batch",
                                     dataset_already_batched=False)
    return model, lambda **kw: model.fit(dataset, epochs=1, steps_per_epoch=FLAGS.steps, verbose=0, **kw)


def _run_megatron_layoutmap():
    import tf_keras as keras
    start, cpu_start = time.perf_counter(), time.process_time()
    model, fit = _megatron_layoutmap_model()
    build_seconds = time.perf_counter() - start
    return _timed_fits(keras, model, build_seconds, cpu_start, fit)


def _run_tofu(method="tofu"):
    import tf_keras as keras
    from tofu_tf import TofuStrategy
    timings, strategy = _fit_in_scope(lambda: TofuStrategy(NUM_DEVICES, method=method), keras)
    print(strategy.plan.summary(), file=sys.stderr)
    return timings


def _run_side_by_side():
    """Steady steps of the hand-written plan and each TofuStrategy method, alternating in one
    process; returns per method the median wall and CPU seconds of a step."""
    import tf_keras as keras
    from tofu_tf import TofuStrategy
    fits = {"megatron_layoutmap": _megatron_layoutmap_model()[1]}
    x, y = _data()
    for method in [m for m in FLAGS.methods if m in TOFU_METHODS]:
        with TofuStrategy(NUM_DEVICES, method=TOFU_METHODS[method]).scope():
            model = _build(keras)
            model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
        fits[method] = functools.partial(model.fit, x, y, batch_size=FLAGS.batch_size, epochs=1, verbose=0,
                                         shuffle=False)
    stamps = []

    class StepClock(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            stamps.append((time.perf_counter(), time.process_time()))

        def on_train_batch_end(self, batch, logs=None):
            stamps.append((time.perf_counter(), time.process_time()))

    for fit in fits.values():  # trace and warm up each
        fit()
    steps = {method: [] for method in fits}
    for _ in range(FLAGS.side_by_side_rounds):
        for method, fit in fits.items():
            stamps.clear()
            fit(callbacks=[StepClock()])
            steps[method] += [(end[0] - begin[0], end[1] - begin[1]) for begin, end in zip(stamps[::2], stamps[1::2])]
    return {method: {"step_seconds": statistics.median(w for w, _ in runs),
                     "step_cpu_seconds": statistics.median(c for _, c in runs), "steps": len(runs)}
            for method, runs in steps.items()}


TOFU_METHODS = {"tofu": "tofu", "tofu_megatron": "megatron"}
RUNNERS = {"data_parallel": _run_data_parallel, "megatron_layoutmap": _run_megatron_layoutmap, "tofu": _run_tofu,
           # the Megatron pattern chosen through TofuStrategy: separates the plan from the machinery
           "tofu_megatron": lambda: _run_tofu("megatron"), "side_by_side": _run_side_by_side}


def _child(method):
    from tofu_tf.tf import devices
    devices.configure_virtual_cpus(NUM_DEVICES)
    timings = RUNNERS[method]()
    if method == "side_by_side":
        print(json.dumps(timings))
        return
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    print(json.dumps({"method": method, "peak_rss_bytes": peak, **timings}))


def _measure(method):
    args = [sys.executable, os.path.abspath(__file__), f"--run={method}", f"--width={FLAGS.width}",
            f"--depth={FLAGS.depth}", f"--batch_size={FLAGS.batch_size}", f"--steps={FLAGS.steps}",
            f"--methods={','.join(FLAGS.methods)}", f"--side_by_side_rounds={FLAGS.side_by_side_rounds}"]
    out = subprocess.run(args, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=ROOT))
    if out.returncode != 0:
        raise RuntimeError(f"{method} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv):
    del argv
    if FLAGS.run:
        _child(FLAGS.run)
        return
    results = {}
    for repeat in range(FLAGS.repeats):
        for method in FLAGS.methods:  # interleaved, so drift in machine load hits every method alike
            run = _measure(method)
            results.setdefault(method, []).append(run)
            print(f"  run {repeat + 1}/{FLAGS.repeats} {method}: {run}", file=sys.stderr)
            if FLAGS.save_runs:
                with open(FLAGS.save_runs, "a") as file:
                    file.write(json.dumps({"repeat": repeat, **run}) + "\n")
    for runs in results.values():
        for run in runs:
            _add_derived(run)
    if results:
        _print_medians(results)
    pairs = _hand_pairs(results) + [pair for path in FLAGS.pool_runs for pair in _hand_pairs(_load_runs(path))]
    if pairs:
        _print_target(pairs, pooled=bool(FLAGS.pool_runs))
    if FLAGS.side_by_side and "megatron_layoutmap" in FLAGS.methods and set(FLAGS.methods) & set(TOFU_METHODS):
        _print_side_by_side(_measure("side_by_side"))


COLUMNS = ("peak_rss_bytes", "build_seconds", "fit_seconds", "wait_seconds", "total_seconds", "work_seconds",
           "total_cpu_seconds", "step_seconds")


def _add_derived(run):
    run["total_seconds"] = run["build_seconds"] + run["fit_seconds"]
    run["work_seconds"] = run["total_seconds"] - run["wait_seconds"]


def _load_runs(path) -> dict:
    """Runs an earlier ``--save_runs`` wrote, by method, in the order they ran."""
    results = {}
    with open(path) as file:
        for line in file:
            if line.strip():
                run = json.loads(line)
                _add_derived(run)
                results.setdefault(run["method"], []).append(run)
    return results


def _hand_pairs(results) -> list:
    """(method, hand-written run, that method's run) for every TofuStrategy run, paired by repeat."""
    hand = results.get("megatron_layoutmap", [])
    return [(method, a, b) for method in results if method in TOFU_METHODS for a, b in zip(hand, results[method])]


def _print_medians(results):
    medians = {m: {c: statistics.median(r[c] for r in rs) for c in COLUMNS} for m, rs in results.items()}
    base = medians.get("megatron_layoutmap")
    params = FLAGS.depth * (FLAGS.width * FLAGS.width + FLAGS.width) + FLAGS.width * 10 + 10
    print(f"MLP {FLAGS.depth} x Dense({FLAGS.width}) + Dense(10), {params / 1e6:.1f}M params, Adam, batch "
          f"{FLAGS.batch_size}, {FLAGS.steps} fit steps, {NUM_DEVICES} virtual CPUs; median of {FLAGS.repeats}")
    # Where PYTHONDONTWRITEBYTECODE is set, every run compiles tofu_tf's modules from source
    # while it plans (the hand-written plan imports none of them): say which case this is.
    print("tofu_tf modules: " + ("compiled from source in every run (PYTHONDONTWRITEBYTECODE is set)"
                                 if sys.flags.dont_write_bytecode else "loaded from bytecode caches"))
    print(f"{'method':<22}{'peak RSS GiB':>14}{'build s':>9}{'fit s':>8}{'wait s':>8}{'total s':>9}{'work s':>8}"
          f"{'cpu s':>7}{'step ms':>9}{'RSS / hand':>12}{'total / hand':>14}{'work / hand':>13}{'cpu / hand':>12}"
          f"{'step / hand':>13}")
    for method, m in medians.items():
        ratio = ""
        if base:
            ratio = (f"{m['peak_rss_bytes'] / base['peak_rss_bytes']:>12.2f}"
                     f"{m['total_seconds'] / base['total_seconds']:>14.2f}"
                     f"{m['work_seconds'] / base['work_seconds']:>13.2f}"
                     f"{m['total_cpu_seconds'] / base['total_cpu_seconds']:>12.2f}"
                     f"{m['step_seconds'] / base['step_seconds']:>13.2f}")
        print(f"{method:<22}{m['peak_rss_bytes'] / 2**30:>14.2f}{m['build_seconds']:>9.1f}{m['fit_seconds']:>8.1f}"
              f"{m['wait_seconds']:>8.1f}{m['total_seconds']:>9.1f}{m['work_seconds']:>8.1f}"
              f"{m['total_cpu_seconds']:>7.1f}{m['step_seconds'] * 1e3:>9.0f}{ratio}")


TARGET_RATIO = 1.10


def ratio_interval(pairs, rounds=2000, seed=0):
    """Ratio of medians (second / first) over ``pairs`` and its 95% bootstrap interval.

    Runs are interleaved, so run k of each method saw the same machine load; resampling
    whole pairs keeps that pairing."""
    ratio = statistics.median(b for _, b in pairs) / statistics.median(a for a, _ in pairs)
    rng = random.Random(seed)
    draws = sorted(statistics.median(b for _, b in sample) / statistics.median(a for a, _ in sample)
                   for sample in ([rng.choice(pairs) for _ in pairs] for _ in range(rounds)))
    return ratio, draws[int(0.025 * rounds)], draws[int(0.975 * rounds) - 1]


def _print_target(pairs, pooled):
    where = "this run's and the pooled runs' " if pooled else ""
    print(f"\nTarget: peak RSS and time within {TARGET_RATIO - 1:.0%} of the hand-written plan: ratio of medians "
          f"over {where}interleaved pairs, 95% bootstrap interval; met when the upper end is <= {TARGET_RATIO:.2f} "
          "for peak RSS and for time (total: what a user waits, the anchor's measure; work: total less the "
          "hand-written plan's tf.data teardown wait, the stricter measure)")
    for method in dict.fromkeys(method for method, _, _ in pairs):
        runs = [(a, b) for m, a, b in pairs if m == method]
        intervals = {label: ratio_interval([(a[column], b[column]) for a, b in runs])
                     for column, label in (("peak_rss_bytes", "peak RSS"), ("total_seconds", "total"),
                                           ("work_seconds", "work"), ("total_cpu_seconds", "cpu"))}
        verdict = {time: intervals["peak RSS"][2] <= TARGET_RATIO and intervals[time][2] <= TARGET_RATIO
                   for time in ("total", "work")}
        print(f"  {method} ({len(runs)} pairs): "
              + "; ".join(f"{label} {ratio:.3f}x ({low:.3f}-{high:.3f})" for label, (ratio, low, high) in intervals.items())
              + f" -> on total: {'MET' if verdict['total'] else 'NOT MET'}; on work: "
              + ("MET" if verdict["work"] else "NOT MET"))


def _print_side_by_side(steps):
    base = steps["megatron_layoutmap"]
    print(f"\nSteady steps side by side in one process ({FLAGS.side_by_side_rounds} alternating fits of "
          f"{FLAGS.steps} steps each; median step)")
    print(f"{'method':<22}{'step ms':>9}{'step cpu ms':>13}{'step / hand':>13}{'cpu / hand':>12}")
    for method, m in steps.items():
        print(f"{method:<22}{m['step_seconds'] * 1e3:>9.0f}{m['step_cpu_seconds'] * 1e3:>13.0f}"
              f"{m['step_seconds'] / base['step_seconds']:>13.2f}{m['step_cpu_seconds'] / base['step_cpu_seconds']:>12.2f}")


if __name__ == "__main__":
    app.run(main)
