"""Capacity: the largest MLP that trains one step on 8 virtual CPUs within a memory cap.

The model is the memory anchor's MLP (4 x Dense(width) + Dense(10), Adam, fp32, batch
16) grown by width. Each size runs in its own process, under data parallel (TF's DTensor
MirroredStrategy: every device holds the weights, gradients and Adam slots) or under
TofuStrategy (no layout written). A watchdog samples the child's resident memory and
kills it when it passes --memory_gib, so "fits" means: built, planned, initialized and
one full training step finished without the process ever exceeding the cap (or being
refused memory, or TofuStrategy's planner finding no plan within the profile's
per-device memory). The search per method doubles the width until a size fails, then
bisects between the last fit and the first failure until they are within --precision.

The default cap, 22 GiB, is this 24 GiB machine less what the OS and the parent keep;
run it when nothing else holds memory. A smaller cap (e.g. --memory_gib=10) gives a
scaled-down answer in a shared session.

    python bench/capacity.py [--memory_gib=22] [--methods=data_parallel,tofu]
"""

from __future__ import annotations

import dataclasses
import json
import os
import resource
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app, flags, logging  # noqa: E402

from bench import capacity_search  # noqa: E402

flags.DEFINE_float("memory_gib", 22.0, "Resident-memory cap for one training process, GiB.")
flags.DEFINE_list("methods", ["data_parallel", "tofu"], "Methods to size.")
flags.DEFINE_integer("start_width", 2048, "First width tried (doubled until a size fails).")
flags.DEFINE_float("precision", 0.1, "Bisection stops when the failing width is within this fraction of the fitting one.")
flags.DEFINE_integer("depth", 4, "Hidden Dense layers.")
flags.DEFINE_integer("batch_size", 16, "Global batch size.")
flags.DEFINE_integer("run_width", None, "Internal: train one step at this width and print JSON.")
flags.DEFINE_string("run_method", None, "Internal: method of --run_width.")
FLAGS = flags.FLAGS

NUM_DEVICES = 8
WIDTH_STEP = 256  # bisection widths are multiples of this (and of the 8 devices)
# What a child that was refused memory prints; any other failure stops the bench.
# InfeasibleBudgetError: TofuStrategy's planner found no plan within the hardware profile's
# per-device memory (it refuses before allocating).
OUT_OF_MEMORY_SIGNS = ("ResourceExhaustedError", "MemoryError", "std::bad_alloc", "OOM when allocating",
                       "InfeasibleBudgetError")


def mlp_parameters(width: int, depth: int) -> int:
    return depth * (width * width + width) + width * 10 + 10


@dataclasses.dataclass(frozen=True)
class Trial:
    """One size under one method: whether it fit, and the memory it reached."""
    method: str
    width: int
    fits: bool
    peak_rss_bytes: int
    seconds: float
    why: str = ""

    @property
    def parameters(self) -> int:
        return mlp_parameters(self.width, FLAGS.depth)


# -- the child: one training step --------------------------------------------------


def _strategy(method):
    if method == "tofu":
        from tofu_tf import TofuStrategy
        return TofuStrategy(NUM_DEVICES, plan_cache=False)   # each size searched, not read back
    from tensorflow.experimental import dtensor
    from tensorflow.python.distribute.experimental import mirrored_strategy
    mesh = dtensor.create_mesh([("batch", NUM_DEVICES)], devices=[f"CPU:{i}" for i in range(NUM_DEVICES)])
    return mirrored_strategy.MirroredStrategy(mesh=mesh)


def _train_one_step(method: str, width: int) -> None:
    import numpy as np
    import tf_keras as keras
    from tofu_tf.tf import devices
    devices.configure_virtual_cpus(NUM_DEVICES)
    with _strategy(method).scope():
        layers = [keras.Input((width,))]
        layers += [keras.layers.Dense(width, activation="relu", name=f"d{i}") for i in range(FLAGS.depth)]
        layers.append(keras.layers.Dense(10, name="head"))
        model = keras.Sequential(layers, name="capacity_mlp")
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(FLAGS.batch_size, width)).astype("float32")
    y = rng.integers(0, 10, FLAGS.batch_size).astype("int32")
    history = model.fit(x, y, batch_size=FLAGS.batch_size, epochs=1, verbose=0, shuffle=False)
    loss = history.history["loss"][-1]
    if not np.isfinite(loss):
        raise FloatingPointError(f"loss is {loss} after one step")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    print(json.dumps({"peak_rss_bytes": peak, "loss": float(loss)}))


# -- the parent: watchdog and search ----------------------------------------------


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:160] if lines else ""


def try_size(method: str, width: int, cap_bytes: int) -> Trial:
    """Runs one size in a child process, killing it if it passes the cap."""
    args = [sys.executable, os.path.abspath(__file__), f"--run_method={method}", f"--run_width={width}",
            f"--depth={FLAGS.depth}", f"--batch_size={FLAGS.batch_size}"]
    run = capacity_search.run_capped(args, cap_bytes, dict(os.environ, PYTHONPATH=ROOT))
    if run.over_cap:
        return Trial(method, width, False, run.peak_rss_bytes, run.seconds,
                     f"passed the {cap_bytes / 2**30:.1f} GiB cap")
    if run.returncode < 0:
        return Trial(method, width, False, run.peak_rss_bytes, run.seconds,
                     f"killed by signal {-run.returncode} (out of memory)")
    if run.returncode != 0:
        if not any(sign in run.stderr for sign in OUT_OF_MEMORY_SIGNS):
            raise RuntimeError(f"{method} at width {width} failed for a reason other than memory:\n{run.stderr[-3000:]}")
        return Trial(method, width, False, run.peak_rss_bytes, run.seconds, _last_line(run.stderr))
    result = json.loads(run.stdout.strip().splitlines()[-1])
    return Trial(method, width, True, max(run.peak_rss_bytes, result["peak_rss_bytes"]), run.seconds)


def largest_fit(method: str, cap_bytes: int) -> tuple[Trial | None, Trial | None, list[Trial]]:
    """Doubling then bisection on width; returns (largest fit, smallest failure, all trials)."""
    def attempt(width):
        trial = try_size(method, width, cap_bytes)
        logging.info("%s width %d (%.0fM params): %s, peak %.2f GiB, %.0f s%s", method, width,
                     trial.parameters / 1e6, "fits" if trial.fits else "fails", trial.peak_rss_bytes / 2**30,
                     trial.seconds, f" ({trial.why})" if trial.why else "")
        return trial
    return capacity_search.largest_fit(attempt, start_width=FLAGS.start_width, precision=FLAGS.precision,
                                       step=WIDTH_STEP)


def main(argv):
    del argv
    if FLAGS.run_width:
        _train_one_step(FLAGS.run_method, FLAGS.run_width)
        return
    logging.set_verbosity(logging.INFO)
    cap = int(FLAGS.memory_gib * 2**30)
    rows = {method: largest_fit(method, cap) for method in FLAGS.methods}
    print(f"Largest MLP ({FLAGS.depth} x Dense(width) + Dense(10), Adam, batch {FLAGS.batch_size}) training one "
          f"step on {NUM_DEVICES} virtual CPUs under a {FLAGS.memory_gib:g} GiB resident-memory cap")
    print(f"{'method':<16}{'width':>8}{'params':>12}{'peak RSS GiB':>14}{'runs':>6}   first failure")
    for method, (fit, fail, trials) in rows.items():
        width = fit.width if fit else 0
        params = f"{fit.parameters / 1e6:.0f}M" if fit else "none"
        peak = f"{fit.peak_rss_bytes / 2**30:.2f}" if fit else "-"
        failure = f"width {fail.width} ({fail.parameters / 1e6:.0f}M): {fail.why}" if fail else ""
        print(f"{method:<16}{width:>8}{params:>12}{peak:>14}{len(trials):>6}   {failure}")
    fits = {method: row[0] for method, row in rows.items()}
    if fits.get("tofu") and fits.get("data_parallel"):
        ratio = fits["tofu"].parameters / fits["data_parallel"].parameters
        print(f"target: TofuStrategy trains >= 6x the parameters of data parallel: "
              f"{'met' if ratio >= 6 else 'not met'} ({ratio:.1f}x)")


if __name__ == "__main__":
    app.run(main)
