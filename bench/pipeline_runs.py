"""Pipelines run for real: each stage's measured peak on a running ``TofuStrategy(pipeline=...)``
against the predicted peaks, for CAPSlog's optimal split and the parameter-balanced split
(DeepSpeed's ``partition_method="parameters"``), on a GPT and a CNN with a large dense head.

Run from the repository root: ``python bench/pipeline_runs.py`` (``--models=gpt,cnn``,
``--stages=4``, ``--num_microbatches=8``). It sets ``TF_CPU_ALLOCATOR_USE_BFC=true`` and one
virtual CPU device per stage itself, before TensorFlow starts.

How a running stage's peak is measured. Virtual CPU devices share one allocator, so the
allocator's statistics are the process's, not a device's. The pipeline's controller runs one
stage's work at a time (a forward, a backward, a transfer into a stage), and each such piece of
work allocates on that stage's device only; the runner's ``memory_probe`` hook wraps each piece,
and the probe charges to that stage what the allocator holds more after it (what the stage
keeps: activations under its tapes, gradient sums, received tensors, less what it released) and
how far above the start it peaked during it. A stage's peak is then its variables' bytes
(weights and optimizer slots, summed from their shapes) plus the highest it held plus the
peak of one piece of its work. Measured in the second step (the first makes the slots); the
optimizer's update, run once for all stages after the schedule, is not in the per-stage figures.
A transfer stages its tensor on the host for an instant, which the receiving stage's figure
includes.

Predictions, per stage at its in-flight count ``k``: mCAP's predictor on profiled unit figures
(``layer_stats(profile=True)``; isolated + added + (k - 1) activations), the regression shipped
with tofu_tf (``default_regression``) on the analytic figures, and the analytic stage model.
"""

from __future__ import annotations

import gc
import os
import sys
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ["TF_CPU_ALLOCATOR_USE_BFC"] = "true"
os.environ["TOFU_PLAN_CACHE"] = "off"
if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from absl import app, flags  # noqa: E402

flags.DEFINE_list("models", ["gpt", "cnn"], "Models to run: gpt, cnn.")
flags.DEFINE_integer("stages", 4, "Pipeline stages (one virtual CPU device each).")
flags.DEFINE_integer("num_microbatches", 8, "Micro-batches per step.")
flags.DEFINE_string("schedule", "1f1b", "Pipeline schedule.")
FLAGS = flags.FLAGS
MIB = 1 << 20


from bench.pipeline_models import cnn_model, gpt_model  # noqa: E402

MODELS = {
    "gpt": ("GPT-6 d128 seq64 vocab8192", gpt_model, 2),         # (label, builder, micro-batch)
    "cnn": ("VGG-style CNN 64px head1024", cnn_model, 8),
}


def loss_for(kind: str):
    import tf_keras as keras
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def batch_for(kind: str, batch: int):
    import numpy as np
    rng = np.random.default_rng(0)
    if kind == "gpt":
        tokens = rng.integers(0, 8192, size=(batch, 64)).astype("int32")
        return tokens, np.roll(tokens, -1, axis=1)
    return rng.normal(size=(batch, 64, 64, 3)).astype("float32"), rng.integers(0, 100, size=(batch,)).astype("int32")


class StageMemory:
    """The ``memory_probe`` of a running pipeline: per stage, what its work left held and the
    highest it stood, from the allocator's statistics around each piece of its work."""

    def __init__(self, num_stages: int):
        self.held = [0] * num_stages
        self.peak = [0] * num_stages

    @staticmethod
    def _info():
        import tensorflow as tf
        return tf.config.experimental.get_memory_info("CPU:0")

    def measure(self, stage: int, work):
        """Python's cycle collector frees tensors (a released tape's) whenever it runs: it runs
        here, between pieces of work, and never inside one, so each release is charged to the
        stage whose work dropped the tensors."""
        import tensorflow as tf
        gc.collect()
        before = self._info()["current"]
        tf.config.experimental.reset_memory_stats("CPU:0")
        gc.disable()
        try:
            result = work()
        finally:
            gc.enable()
        gc.collect()
        info = self._info()
        self.peak[stage] = max(self.peak[stage], self.held[stage] + info["peak"] - before)
        self.held[stage] += info["current"] - before
        return result


def variable_bytes_by_stage(model, plan) -> list[int]:
    """Bytes of the variables (weights, slots) on each stage's device."""
    from tensorflow.experimental import dtensor
    meshes = [stage.mesh for stage in plan.stages]
    totals = [0] * len(meshes)
    from tofu_tf.tf import keras_adapter
    for weight in list(model.weights) + list(model.optimizer.variables):
        variable = keras_adapter.backing_variable(weight)
        layout = getattr(variable, "layout", None)         # none: a host variable (the step counter)
        mesh = layout.mesh if isinstance(layout, dtensor.Layout) else None
        if mesh is not None and mesh in meshes:
            totals[meshes.index(mesh)] += variable.shape.num_elements() * variable.dtype.size
    return totals


def run_split(kind: str, stage_plan, *, batch: int) -> list[float]:
    """Train the model pipelined by ``stage_plan`` for two steps; each stage's measured peak (bytes)."""
    from tofu_tf import TofuStrategy
    label, build, _ = MODELS[kind]
    strategy = TofuStrategy(FLAGS.stages, pipeline=stage_plan, schedule=FLAGS.schedule)
    with strategy.scope():
        model = build()
        model.compile(optimizer="adam", loss=loss_for(kind))
    x, y = batch_for(kind, 2 * batch)
    model.fit(x[:batch], y[:batch], batch_size=batch, epochs=1, verbose=0)     # plans, makes the slots
    probe = StageMemory(FLAGS.stages)
    strategy.pipeline.memory_probe = probe
    model.fit(x[batch:], y[batch:], batch_size=batch, epochs=1, verbose=0)
    state = variable_bytes_by_stage(model, strategy.plan)
    assert strategy.pipeline.inflight_peaks == tuple(
        _inflight(r, FLAGS.stages, FLAGS.schedule, FLAGS.num_microbatches) for r in range(FLAGS.stages))
    peaks = [state[r] + probe.peak[r] for r in range(FLAGS.stages)]
    del model, strategy
    gc.collect()
    return peaks


def _inflight(stage: int, stages: int, schedule: str, micro: int) -> int:
    from tofu_tf.pipeline import inflight_microbatches
    return inflight_microbatches(stage, stages, schedule, micro)


def model_rows(kind: str) -> list[str]:
    from tofu_tf.pipeline import default_regression, layer_stats, partition
    label, build, micro = MODELS[kind]
    m, p = FLAGS.num_microbatches, FLAGS.stages
    batch = micro * m
    loss = loss_for(kind)
    analytic = layer_stats(build(), batch_size=batch, loss=loss, optimizer="adam", num_microbatches=m)
    measured = layer_stats(build(), batch_size=batch, loss=loss, optimizer="adam", num_microbatches=m,
                           profile=True, model_fn=build)
    regression = default_regression()
    rows = [f"{label}: {len(analytic)} units, micro-batch {micro}, {m} micro-batches, {FLAGS.schedule}, "
            f"{p} stages of one device",
            f"{'split':<11} {'stage':>5} {'units':>7} {'k':>2} {'measured MiB':>12} {'mCAP MiB':>9} "
            f"{'regr. MiB':>9} {'analytic MiB':>12}"]
    largest = {}
    for method in ("optimal", "parameters"):
        plan = partition(measured, p, schedule=FLAGS.schedule, num_microbatches=m, method=method)
        peaks = run_split(kind, plan, batch=batch)
        predicted = {"mcap": [], "regression": [], "analytic": []}
        for r, (a, b) in enumerate(plan.stage_ranges):
            k = _inflight(r, p, FLAGS.schedule, m)
            predicted["mcap"].append(plan.stage_peak_bytes[r])
            predicted["regression"].append(regression.predict_stage(analytic[a:b], k))
            stats = analytic[a:b]
            predicted["analytic"].append(sum(s.state_bytes for s in stats) + k * sum(s.activation_bytes for s in stats)
                                         + max(s.transient_bytes for s in stats))
            rows.append(f"{method:<11} {r:>5} {f'{a}-{b - 1}':>7} {k:>2} {peaks[r] / MIB:>12.2f} "
                        f"{predicted['mcap'][r] / MIB:>9.2f} {predicted['regression'][r] / MIB:>9.2f} "
                        f"{predicted['analytic'][r] / MIB:>12.2f}")
        largest[method] = {"measured": max(peaks), **{name: max(values) for name, values in predicted.items()}}
    for name in ("measured", "mcap", "regression", "analytic"):
        reduction = 1 - largest["optimal"][name] / largest["parameters"][name]
        rows.append(f"  largest stage, optimal vs parameter-balanced, {name:<10}: "
                    f"{largest['optimal'][name] / MIB:8.2f} vs {largest['parameters'][name] / MIB:8.2f} MiB "
                    f"({100 * reduction:+.1f}% lower)")
    return rows


def main(argv) -> None:
    del argv
    from tofu_tf.tf import devices
    devices.configure_virtual_cpus(FLAGS.stages)
    for kind in FLAGS.models:
        print("\n".join(model_rows(kind)), flush=True)
        print(flush=True)


if __name__ == "__main__":
    app.run(main)
