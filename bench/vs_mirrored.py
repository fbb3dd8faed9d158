"""TofuStrategy beside what a user would pick instead: MirroredStrategy, and one device.

For each model (the reference models of ``tofu_tf.models`` and the keras-hub families of
``tofu_tf.hub_models``, small configurations, random weights), in one process on 8 virtual
CPUs (or ``--num_devices`` GPUs):

* ``steady``: the median steady ``fit`` step (steps 3..n of one epoch, medians over
  ``--repeats`` fresh models) under ``tf.distribute.MirroredStrategy`` over the same devices,
  under ``TofuStrategy`` with no layout written, and on one device. The three sides run
  interleaved, repeat by repeat, so load on the machine falls on all of them alike; the
  ratios are TofuStrategy's step over the others'.
* ``state/dev``: the largest per-device bytes of weights and optimizer slots as placed
  (MirroredStrategy holds a full copy on every device: its figure is one device's).
* ``peak MiB``: with ``--memory``, each side trains once more in a fresh process of its own,
  and the process's peak resident memory above the same process's just before the model is
  built is reported (CPU devices share one process: per device it is this over the device
  count). TF's per-device allocator statistics are not read: on CPU they need
  ``TF_CPU_ALLOCATOR_USE_BFC``, under which DTensor misbehaves.
* ``tofu dp``: ``TofuStrategy(method="data_parallel")``, the plan MirroredStrategy runs, which
  should cost no more than MirroredStrategy's step computing the same thing. For a model with
  BatchNormalization that is ``sync mirr``: MirroredStrategy with every BatchNormalization
  ``synchronized`` (statistics over the global batch, what one device and TofuStrategy compute);
  its default normalizes each replica's slice by its own statistics, a cheaper, different step.
  So for keras-hub's mixture-of-experts load-balancing loss, whose token fractions and router
  means MirroredStrategy takes over each replica's tokens: ``sync mirr`` takes them over the
  global batch (``compared_models.global_load_balancing``).
  ``dp/same`` is the ratio against that side where the model has one, else against ``mirrored``; ``tofu``: the strategy's own plan (mesh in
  the last column). A plan measured slower than data parallel is listed after the table: the
  hardware profile ranked it first, and the gap is the cost model's.

* ``--profile``: after the table's repeats, one more fit of each model under MirroredStrategy and
  under TofuStrategy's data parallel (and under its own plan, where that measured slower than data
  parallel) runs under TensorFlow's profiler, and the op types whose kernels' CPU time differs most
  between them are printed (``bench/step_profile.py``).

    python bench/vs_mirrored.py [--models=mlp,cnn,gpt2] [--repeats=5] [--memory] [--profile]

Exits non-zero when TofuStrategy's data-parallel steady step is over ``--dp_limit`` times
MirroredStrategy's computing the same step (``dp/same``).
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

from absl import app, flags  # noqa: E402

from bench import compared_models, step_profile  # noqa: E402
from tofu_tf.strategies import step_measurement  # noqa: E402

flags.DEFINE_list("models", [], "Models (default: every reference model and keras-hub family).")
flags.DEFINE_integer("repeats", 5, "Fresh models per side; medians are reported.")
flags.DEFINE_integer("steps", 8, "Steps in the measured fit (one epoch).")
flags.DEFINE_integer("batch_size", 16, "Global batch size.")
flags.DEFINE_integer("num_devices", 8, "Devices (virtual CPUs when no GPU is visible).")
flags.DEFINE_bool("memory", False, "Also measure each side's peak process memory in a fresh process.")
flags.DEFINE_bool("profile", False, "Also profile MirroredStrategy's and TofuStrategy's data-parallel step "
                  "(and TofuStrategy's own plan where it measured slower than data parallel) and print where "
                  "their kernels' time differs.")
flags.DEFINE_float("dp_limit", 1.05, "Largest TofuStrategy/MirroredStrategy steady ratio allowed where the "
                   "plan is data parallel.")
flags.DEFINE_string("run_model", None, "Internal: train --run_model under --run_side once and print JSON.")
flags.DEFINE_string("run_side", None, "Internal: 'mirrored', 'tofu' or 'one'.")
FLAGS = flags.FLAGS

SIDES = ("mirrored", "mirrored_sync", "tofu_dp", "tofu", "one")
MEMORY_SIDES = ("mirrored", "tofu_dp", "tofu", "one")


_MIRRORED = []


def _strategy(side):
    """The side's strategy. One MirroredStrategy serves the whole run: a second one in the same
    process reuses its collective instance keys, and its all-reduces meet the first's."""
    import tensorflow as tf
    from tofu_tf.strategies import TofuStrategy
    if side.startswith("mirrored") and _MIRRORED:
        return _MIRRORED[0]
    if side.startswith("mirrored"):
        devices = [d.name for d in tf.config.list_logical_devices("GPU")][:FLAGS.num_devices]
        if len(devices) < FLAGS.num_devices:
            devices = [d.name for d in tf.config.list_logical_devices("CPU")][:FLAGS.num_devices]
        _MIRRORED.append(compared_models.mirrored_strategy(devices))
        return _MIRRORED[0]
    if side == "tofu":
        return TofuStrategy(FLAGS.num_devices, plan_cache=False)
    if side == "tofu_dp":
        return TofuStrategy(FLAGS.num_devices, plan_cache=False, method="data_parallel")
    return tf.distribute.get_strategy()


def _train(spec, side, x, y, profile_dir=None):
    """(steady step seconds, per-device state bytes, mesh or None, op times or None) of one fresh
    model; the op times of one more epoch under the profiler when ``profile_dir`` is given."""
    import keras
    times = []
    strategy = _strategy(side)
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = spec.build()
        if side == "mirrored_sync":
            compared_models.synchronize_batch_norms(model)
        api = compared_models.compile_for_training(model)
    global_statistics = contextlib.ExitStack()
    if side == "mirrored_sync":
        global_statistics.enter_context(compared_models.global_load_balancing(model))

    class StepEnds(api.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            times.append(time.perf_counter())

    with global_statistics:
        start = time.perf_counter()
        model.fit(x, y, batch_size=FLAGS.batch_size, shuffle=False, verbose=0, callbacks=[StepEnds()])
        steps = [b - a for a, b in zip([start] + times, times)]
        op_times = None
        if profile_dir:
            op_times = step_profile.profile_fit(model, x, y, batch_size=FLAGS.batch_size, logdir=profile_dir)
    plan = getattr(strategy, "plan", None) if side == "tofu" else None
    return statistics.median(steps[2:]), step_measurement.placed_state_bytes(model), plan, op_times


def _per_replica_statistics(spec) -> int:
    """How many BatchNormalization layers and keras-hub load-balancing losses the model has (built
    once on one device): statistics MirroredStrategy takes per replica by default."""
    import keras
    keras.utils.set_random_seed(0)
    model = spec.build()
    return compared_models.synchronize_batch_norms(model) + len(compared_models.load_balancing_modules(model))


def _peak_in_fresh_process(name, side):
    """Peak resident MiB of a fresh process training ``name`` under ``side``, above its level
    just before the model was built."""
    out = subprocess.run([sys.executable, os.path.abspath(__file__), f"--run_model={name}", f"--run_side={side}",
                          f"--batch_size={FLAGS.batch_size}", f"--steps={FLAGS.steps}",
                          f"--num_devices={FLAGS.num_devices}"],
                         capture_output=True, text=True, timeout=1800)
    if out.returncode:
        raise RuntimeError(f"{name} under {side} failed in its own process:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])["peak_mib"]


def _run_one():
    """--run_model: one side, one fit, its process's peak memory above the level before the build."""
    spec = compared_models.all_models()[FLAGS.run_model]
    x, y = spec.data(FLAGS.batch_size * FLAGS.steps)
    import tensorflow as tf
    tf.constant(0.0)                                             # the runtime is up before the baseline
    before = _resident_mib()
    reset_peak = _reset_peak_resident()
    _train(spec, FLAGS.run_side, x, y)
    print(json.dumps({"peak_mib": _peak_resident_mib() - (before if reset_peak else 0.0)}))


def _resident_mib():
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 20


def _peak_resident_mib():
    """The kernel's peak-resident mark (``VmHWM``), which ``clear_refs`` resets (``ru_maxrss`` is not)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def _reset_peak_resident() -> bool:
    """Resets the kernel's peak-resident mark (Linux ``clear_refs`` 5) so ``VmHWM`` counts from
    here; False where the kernel refuses (the peak is then absolute)."""
    try:
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")
        return True
    except OSError:
        return False


def main(argv):
    del argv
    from absl import logging
    logging.set_verbosity(logging.WARNING)        # the strategy's plan summaries would bury the table
    from tofu_tf.tf import devices
    devices.provide_devices(FLAGS.num_devices)
    if FLAGS.run_model:
        _run_one()
        return
    specs = compared_models.all_models()
    names = FLAGS.models or list(specs)
    print(f"{'model':<9}{'mirrored ms':>12}{'sync mirr':>10}{'tofu dp ms':>11}{'tofu ms':>9}{'1 dev ms':>9}{'dp/mirr':>8}{'dp/same':>8}"
          f"{'tofu/mirr':>10}{'tofu/1dev':>10}{'state/dev KiB m|t':>19}"
          + (f"{'peak MiB m|dp|t|1':>19}" if FLAGS.memory else "") + "  plan")
    over, misranked, profiles = [], [], {}
    for name in names:
        spec = specs[name]
        x, y = spec.data(FLAGS.batch_size * FLAGS.steps)
        synchronized = _per_replica_statistics(spec) > 0
        sides = [side for side in SIDES if synchronized or side != "mirrored_sync"]
        same = "mirrored_sync" if synchronized else "mirrored"
        steady = {side: [] for side in sides}
        ratios = {"dp": [], "same": [], "tofu": [], "one": []}
        state = {}
        plan = None
        for _ in range(FLAGS.repeats):
            for side in sides:
                seconds, state[side], side_plan, _ = _train(spec, side, x, y)
                steady[side].append(seconds)
                plan = side_plan or plan
            ratios["dp"].append(steady["tofu_dp"][-1] / steady["mirrored"][-1])
            ratios["same"].append(steady["tofu_dp"][-1] / steady[same][-1])
            ratios["tofu"].append(steady["tofu"][-1] / steady["mirrored"][-1])
            ratios["one"].append(steady["tofu"][-1] / steady["one"][-1])
        ms = {side: statistics.median(steady[side]) * 1e3 for side in sides}
        ratio = {key: statistics.median(values) for key, values in ratios.items()}
        if ratio["same"] > FLAGS.dp_limit:
            over.append(f"{name}: {ratio['same']:.2f}x")
        slower_than_dp = ms["tofu"] > FLAGS.dp_limit * ms["tofu_dp"]
        if slower_than_dp:
            misranked.append(f"{name} ({plan.mesh_shape}: {ms['tofu'] / ms['tofu_dp']:.2f}x data parallel's step)")
        peaks = ""
        if FLAGS.memory:
            peaks = "|".join(f"{_peak_in_fresh_process(name, side):.0f}" for side in MEMORY_SIDES)
        if FLAGS.profile:
            profiles[name] = {}
            # The planner's own plan too where it measured slower than data parallel: where its time goes.
            profiled = (same, "tofu_dp") + (("tofu",) if slower_than_dp else ())
            for side in profiled:
                with tempfile.TemporaryDirectory(prefix="vs_mirrored_") as trace_dir:
                    profiles[name][side] = _train(spec, side, x, y, profile_dir=trace_dir)[3]
        sync_ms = f"{ms['mirrored_sync']:>10.1f}" if synchronized else f"{'-':>10}"
        print(f"{name:<9}{ms['mirrored']:>12.1f}{sync_ms}{ms['tofu_dp']:>11.1f}{ms['tofu']:>9.1f}{ms['one']:>9.1f}"
              f"{ratio['dp']:>8.2f}{ratio['same']:>8.2f}{ratio['tofu']:>10.2f}{ratio['one']:>10.2f}"
              f"{state['mirrored'] / 1024:>10.0f}|{state['tofu'] / 1024:<8.0f}"
              + (f"{peaks:>19}" if FLAGS.memory else "") + f"  {plan.mesh_shape}", flush=True)
    print(f"medians of {FLAGS.repeats} fresh models per side, sides interleaved; tofu dp: TofuStrategy("
          f"method='data_parallel'); sync mirr: MirroredStrategy with batch statistics over the global batch "
          f"(synchronized BatchNormalization, keras-hub's load-balancing loss; models with one); dp/same: tofu dp over the MirroredStrategy side computing the same step; tofu: "
          f"TofuStrategy's own plan; ratios: medians of each repeat's ratio of "
          f"steady steps; state/dev: weights + "
          f"optimizer slots per device as placed (MirroredStrategy | TofuStrategy's plan).")
    for name, sides_times in profiles.items():
        print(f"\n{name}: kernels' CPU time per step, every device (bench/step_profile.py)")
        print(step_profile.table(sides_times))
    if misranked:
        print("plans slower than data parallel measured (the hardware profile ranked them first): "
              + ", ".join(misranked))
    if over:
        print(f"TofuStrategy's data parallel slower than {FLAGS.dp_limit}x MirroredStrategy computing the same "
              f"step: {', '.join(over)}")
        sys.exit(1)


if __name__ == "__main__":
    app.run(main)
