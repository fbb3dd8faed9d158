"""Benchmark of the memory-centric pipeline partitioner and hybrid recommender.

Prints, in order:

1. search time of ``partition(method="optimal")`` (median of 5 runs) on random
   synthetic chains: analytic (monotone) statistics at 1000 layers / 64 stages
   and 8192 layers / 1024 stages, and measured isolated/added statistics whose
   offsets make the stage cost non-monotone at 1000 / 64;
2. the largest stage peak of "optimal" against Megatron's uniform split,
   DeepSpeed's ``partition_method="parameters"`` and torchgpipe's
   ``balance_by_time``, under 1F1B: on ``layer_stats`` of real Keras models (a
   GPT and a VGG-style CNN with a large dense head) and on synthetic chains at
   GPU scale (Megatron's accounting);
3. profiling (``profile=True``): runs needed against mCAP's scheme, and the
   error of mCAP's predictor (isolated + added + in-flight activations) against
   the measured peak of every stage of optimal partitions, each stage run for
   real (CPU, TF's BFC allocator, subprocesses);
4. the memory regression (``tofu_tf.pipeline.regression``): coefficients,
   in-sample and leave-one-out error on its calibration samples (overall and
   per model), and its error on the stages of 3 (models it was not fitted on);
5. ``recommend_hybrid`` for the GPT on 8 devices, without and with a budget;
6. the pipelines run for real (``bench/pipeline_runs.py``, in a subprocess: it needs the BFC
   allocator and its own device count before TensorFlow starts): each running stage's measured
   peak against mCAP's predictor, the regression and the analytic model, for the optimal and the
   parameter-balanced split of a GPT and a CNN with a large dense head.

``--calibrate`` re-measures the regression's samples and writes them to
``tofu_tf/pipeline/data/cpu_bfc_samples.json``; ``--quick`` skips 3, 4 and 6.
Run from the repository root: ``python bench/pipeline.py``.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from absl import app, flags  # noqa: E402

from tofu_tf.pipeline import LayerStats, partition  # noqa: E402

flags.DEFINE_bool("calibrate", False, "Re-measure the memory regression's samples first.")
flags.DEFINE_bool("quick", False, "Skip the profiling runs (sections 3 and 4).")
FLAGS = flags.FLAGS
LOSS = "sparse_categorical_crossentropy"

GIB = 1 << 30
RUNS = 5


# --------------------------------------------------------------------------- chains


def random_analytic_chain(num_layers: int, seed: int) -> list[LayerStats]:
    """Layers of 1-16 MiB state, 0.25-4 MiB activations, 64 KiB-1 MiB transients."""
    rng = np.random.default_rng(seed)
    state = rng.integers(1 << 20, 1 << 24, num_layers)
    act = rng.integers(1 << 18, 1 << 22, num_layers)
    transient = rng.integers(1 << 16, 1 << 20, num_layers)
    columns = enumerate(zip(state, act, transient))
    return [LayerStats(name=f"layer_{i}", state_bytes=int(s), activation_bytes=int(a),
                       transient_bytes=int(t)) for i, (s, a, t) in columns]


def random_measured_chain(num_layers: int, seed: int) -> list[LayerStats]:
    """Profiled-style figures: isolated peaks of 16-64 MiB, added 1-16 MiB, so
    ``isolated_{l-1} + added_l < isolated_l`` often holds (non-monotone cost)."""
    rng = np.random.default_rng(seed)
    layers = random_analytic_chain(num_layers, seed)
    isolated = rng.integers(1 << 24, 1 << 26, num_layers)
    added = rng.integers(1 << 20, 1 << 24, num_layers)
    return [LayerStats(name=l.name, state_bytes=l.state_bytes, activation_bytes=l.activation_bytes,
                       transient_bytes=l.transient_bytes, isolated_bytes=int(i), added_bytes=int(a))
            for l, i, a in zip(layers, isolated, added)]


def gpt_chain(blocks=48, hidden=2048, seq=2048, vocab=50304, micro_batch=1) -> list[LayerStats]:
    """Mixed-precision Adam (16 bytes/param, Megatron's accounting); activations
    per Megatron's ~34 * s * b * h bytes per block; head keeps fp32 logits."""
    tokens = seq * micro_batch
    flops_per_second = 100e12

    def layer(name, params, activation, transient, flops):
        return LayerStats(name=name, state_bytes=16 * params, activation_bytes=activation,
                          transient_bytes=transient, param_count=params,
                          compute_seconds=flops / flops_per_second)

    chain = [layer("embedding", vocab * hidden, 2 * tokens * hidden, 4 * tokens * hidden,
                   2 * tokens * hidden)]
    block_params = 12 * hidden * hidden
    chain += [layer(f"block_{i}", block_params, 34 * tokens * hidden, 8 * tokens * 4 * hidden,
                    6 * 2 * tokens * block_params) for i in range(blocks)]
    chain.append(layer("lm_head_loss", vocab * hidden, 4 * tokens * vocab, 8 * tokens * vocab,
                       6 * 2 * tokens * vocab * hidden))
    return chain


def cnn_chain(micro_batch=32) -> list[LayerStats]:
    """ResNet-like: 4 resolutions x 12 conv layers, channels doubling as the
    resolution halves (activations shrink, state grows), then a 25088 x 16384
    dense layer and a 16384 x 1000 classifier."""
    flops_per_second = 50e12
    chain = []
    for stage, (size, channels) in enumerate([(112, 64), (56, 128), (28, 256), (14, 512)]):
        for i in range(12):
            params = 9 * channels * channels
            pixels = micro_batch * size * size
            chain.append(LayerStats(
                name=f"conv{stage}_{i}", state_bytes=16 * params,
                activation_bytes=4 * 2 * pixels * channels,
                transient_bytes=4 * pixels * channels, param_count=params,
                compute_seconds=6 * pixels * params / flops_per_second))
    for name, fan_in, fan_out in [("fc", 512 * 7 * 7, 16384), ("classifier", 16384, 1000)]:
        params = fan_in * fan_out
        chain.append(LayerStats(
            name=name, state_bytes=16 * params,
            activation_bytes=4 * micro_batch * (fan_in + fan_out),
            transient_bytes=4 * micro_batch * fan_out, param_count=params,
            compute_seconds=6 * micro_batch * params / flops_per_second))
    return chain


# --------------------------------------------------------------------------- tables


def search_seconds(stats, num_stages, schedule, num_microbatches) -> list[float]:
    return [partition(stats, num_stages, schedule=schedule, num_microbatches=num_microbatches)
            .search_seconds for _ in range(RUNS)]


def search_time_table() -> list[str]:
    cases = [
        ("monotone (analytic)", random_analytic_chain(1000, 0), 64, "1f1b", 64),
        ("monotone (analytic)", random_analytic_chain(8192, 0), 1024, "1f1b", 64),
        ("monotone (analytic)", random_analytic_chain(8192, 0), 1024, "gpipe", 64),
        ("monotone (analytic)", random_analytic_chain(8192, 0), 1024, "1f1b", 2048),
        ("non-monotone (measured)", random_measured_chain(1000, 0), 64, "1f1b", 64),
    ]
    rows = [f"{'statistics':<24} {'layers':>6} {'stages':>6} {'schedule':>8} {'m':>5} "
            f"{'median of 5':>12} {'best of 5':>10}"]
    for label, stats, stages, schedule, micro in cases:
        runs = search_seconds(stats, stages, schedule, micro)
        rows.append(f"{label:<24} {len(stats):>6} {stages:>6} {schedule:>8} {micro:>5} "
                    f"{statistics.median(runs) * 1e3:>9.1f} ms {min(runs) * 1e3:>7.1f} ms")
    return rows


def memory_table() -> list[str]:
    cases = [("GPT-16 d512 (Keras, layer_stats)", keras_gpt_stats(), 8, 16),
             ("VGG-style CNN + 2x4096 head (Keras)", keras_cnn_stats(), 8, 16),
             ("GPT-style, 48 blocks (synthetic)", gpt_chain(), 8, 16),
             ("CNN-like, 48 convs + head (synthetic)", cnn_chain(), 8, 16)]
    methods = ("optimal", "uniform", "parameters", "time")
    rows = [f"{'chain (1F1B)':<38} {'units':>5} {'p':>3} {'m':>3} "
            + " ".join(f"{m + ' GiB':>15}" for m in methods)
            + "  vs parameters  vs uniform"]
    for label, stats, stages, micro in cases:
        peaks = {m: partition(stats, stages, schedule="1f1b", num_microbatches=micro, method=m)
                 .max_peak_bytes for m in methods}
        lower = {m: 1 - peaks["optimal"] / peaks[m] for m in ("parameters", "uniform")}
        rows.append(f"{label:<38} {len(stats):>5} {stages:>3} {micro:>3} "
                    + " ".join(f"{peaks[m] / GIB:>15.3f}" for m in methods)
                    + f"  {100 * lower['parameters']:>12.1f}%  {100 * lower['uniform']:>8.1f}%")
    return rows


# --------------------------------------------------------------------------- real Keras models


_ANALYSES = {}  # label -> ChainAnalysis of the section-2 Keras models, for the run counts


def keras_gpt_stats() -> list[LayerStats]:
    """``layer_stats`` of a GPT-16 (d512, 8 heads, seq 256, vocab 32000), micro-batch 4, Adam."""
    from tofu_tf import models
    from tofu_tf.pipeline import keras_stats
    model = models.gpt(num_layers=16, d_model=512, num_heads=8, seq_len=256, vocab_size=32000)
    analysis = keras_stats.analyze_model(model, micro_batch=4, loss=LOSS, optimizer="adam")
    _ANALYSES["GPT-16 d512"] = analysis
    return list(analysis.stats)


def vgg_head(*, image_size=64, widths=(64, 128, 256, 512), head=4096, num_classes=1000):
    """A VGG-style CNN: per width two 3x3 convs and a 2x2 max-pool, then two
    Dense(4096) layers and a classifier -- activations early, parameters late."""
    import tf_keras as keras
    layers = [keras.Input((image_size, image_size, 3))]
    for group, width in enumerate(widths):
        layers += [keras.layers.Conv2D(width, 3, padding="same", activation="relu",
                                       name=f"conv{group}_{i}") for i in range(2)]
        layers.append(keras.layers.MaxPooling2D(2, name=f"pool{group}"))
    layers += [keras.layers.Flatten(name="flatten"),
               keras.layers.Dense(head, activation="relu", name="fc1"),
               keras.layers.Dense(head, activation="relu", name="fc2"),
               keras.layers.Dense(num_classes, name="classifier")]
    return keras.Sequential(layers, name="vgg_head")


def keras_cnn_stats() -> list[LayerStats]:
    """``layer_stats`` of ``vgg_head()`` at micro-batch 32, Adam."""
    from tofu_tf.pipeline import keras_stats
    analysis = keras_stats.analyze_model(vgg_head(), micro_batch=32, loss=LOSS, optimizer="adam")
    _ANALYSES["VGG-style CNN"] = analysis
    return list(analysis.stats)


def planned_runs_table() -> list[str]:
    """Profiling runs this scheme and mCAP's need, from the plans alone (nothing runs)."""
    from tofu_tf.pipeline import profile
    rows = [f"{'model':<20} {'units':>5} {'distinct stages':>15} {'devices':>7} "
            f"{'steps/device':>12} " + " ".join(f"{f'runs@{p} (mCAP)':>18}" for p in (4, 8))]
    for label, analysis in _ANALYSES.items():
        plan = profile.plan_probes(analysis)
        cells = []
        for p in (4, 8):
            runs = len(plan.runs(p))
            units = len(analysis.units)
            mcap = profile.mcap_run_count(units, p) if units >= 2 * p - 2 else None
            cells.append(f"{runs} ({mcap}) {runs / mcap:.2f}x" if mcap else f"{runs} (-)")
        rows.append(f"{label:<20} {len(analysis.units):>5} {len(plan.probes):>15} "
                    f"{len(plan.devices):>7} {plan.steps_per_device():>12} "
                    + " ".join(f"{c:>18}" for c in cells))
    return rows


# --------------------------------------------------------------------------- profiling


def profiled_models():
    """(label, picklable builder, micro-batch) of the models profiled in section 3."""
    import functools
    from tofu_tf import models
    return [
        ("GPT-12 d64 seq32", functools.partial(models.gpt, num_layers=12, d_model=64, num_heads=4,
                                               seq_len=32, vocab_size=512), 4),
        ("WRN-16-2 16px", functools.partial(models.wide_resnet, depth=16, width=2,
                                            image_size=16), 4),
        ("MLP 8x256", functools.partial(models.mlp, input_dim=128, width=256, depth=8), 16),
    ]


def profiling_tables() -> tuple[list[str], list, list]:
    """Runs vs mCAP and predictor error per stage; also the measured stages as
    regression samples (for section 4)."""
    from tofu_tf.pipeline import keras_stats, profile
    from tofu_tf.pipeline.regression import StageSample

    runs_rows = [f"{'model':<18} {'units':>5} {'devices':>7} {'stages run':>10} {'runs':>4} "
                 f"{'mCAP runs':>9} {'ratio':>6} {'steps/device':>12} {'profile s':>9}"]
    error_rows = [f"{'model':<18} {'p':>2} {'sched':>5} {'m':>2} {'stage':>5} {'units':>7} "
                  f"{'k':>2} {'measured MiB':>12} {'mCAP pred MiB':>13} {'error':>7} "
                  f"{'analytic err':>12}"]
    errors, samples = [], []
    for label, builder, micro in profiled_models():
        model = builder()
        analysis = keras_stats.analyze_model(model, micro_batch=micro, loss=LOSS, optimizer="adam")
        started = time.perf_counter()
        result = keras_stats.profile_model(model, analysis, micro_batch=micro, loss=LOSS,
                                           optimizer="adam", model_fn=builder, num_devices=4)
        seconds = time.perf_counter() - started
        ratio = "-" if result.run_ratio is None else f"{result.run_ratio:.2f}x"
        runs_rows.append(f"{label:<18} {len(analysis.units):>5} {4:>7} {len(result.probes):>10} "
                         f"{result.runs:>4} {result.mcap_runs or '-':>9} {ratio:>6} "
                         f"{result.steps_per_device:>12} {seconds:>9.1f}")
        plans = []
        for stages, schedule, micro_count in ((2, "1f1b", 8), (4, "1f1b", 8), (8, "1f1b", 8),
                                              (4, "gpipe", 2)):
            if stages <= len(analysis.units):
                plans.append((stages, schedule, micro_count,
                              partition(result.stats, stages, schedule=schedule,
                                        num_microbatches=micro_count)))
        probes = [profile.StageProbe(a, b, (_inflight(r, p, s, m),))
                  for p, s, m, plan in plans for r, (a, b) in enumerate(plan.stage_ranges)]
        measured = profile.measure_stage_peaks(analysis, builder, probes, micro_batch=micro,
                                               loss=LOSS, optimizer="adam")
        flat = iter(measured)
        for p, s, m, plan in plans:
            for r, (a, b) in enumerate(plan.stage_ranges):
                real = next(flat)[0]
                k = _inflight(r, p, s, m)
                predicted = plan.stage_peak_bytes[r]
                stats = analysis.stats[a:b]
                analytic = (sum(x.state_bytes for x in stats) + k * sum(x.activation_bytes
                                                                         for x in stats)
                            + max(x.transient_bytes for x in stats))
                error = (predicted - real) / real
                errors.append(abs(error))
                samples.append(StageSample.of(label, stats, k, real))
                error_rows.append(
                    f"{label:<18} {p:>2} {s:>5} {m:>2} {r:>5} {f'{a}-{b - 1}':>7} {k:>2} "
                    f"{real / 2**20:>12.3f} {predicted / 2**20:>13.3f} {100 * error:>+6.1f}% "
                    f"{100 * (analytic - real) / real:>+11.1f}%")
    error_rows.append(f"mCAP-style predictor: MAPE {100 * statistics.mean(errors):.2f}% over "
                      f"{len(errors)} stages, worst {100 * max(errors):.1f}% (target < 5%)")
    return runs_rows + [""] + error_rows, errors, samples


def _inflight(stage: int, stages: int, schedule: str, micro: int) -> int:
    from tofu_tf.pipeline import inflight_microbatches
    return inflight_microbatches(stage, stages, schedule, micro)


def calibration_models():
    """The models whose measured stages the shipped regression is fitted on: two
    GPTs, two MLPs and three small CNNs (convolution workspaces); section 3's
    models (GPT-12, WRN-16-2, MLP 8x256) are left out, to test it on."""
    import functools
    from tofu_tf import models
    return [
        ("gpt-2 d64", functools.partial(models.gpt, num_layers=2, d_model=64, num_heads=4,
                                        seq_len=32, vocab_size=256), 4),
        ("gpt-3 d128", functools.partial(models.gpt, num_layers=3, d_model=128, num_heads=4,
                                         seq_len=16, vocab_size=1024), 4),
        ("mlp 4x256", functools.partial(models.mlp, input_dim=64, width=256, depth=4), 16),
        ("mlp 2x512", functools.partial(models.mlp, input_dim=256, width=512, depth=2), 8),
        ("cnn 16px c8", functools.partial(models.cnn, image_size=16, channels=8), 8),
        ("cnn 32px c16", functools.partial(models.cnn, image_size=32, channels=16), 4),
        ("wrn-10-1 16px", functools.partial(models.wide_resnet, depth=10, width=1,
                                            image_size=16), 8),
    ]


def calibrate() -> None:
    """Measure the regression's samples and write them next to tofu_tf.pipeline.regression."""
    from tofu_tf.pipeline import keras_stats, profile, regression
    samples = []
    for label, builder, micro in calibration_models():
        model = builder()
        analysis = keras_stats.analyze_model(model, micro_batch=micro, loss=LOSS, optimizer="adam")
        probes = keras_stats.calibration_probes(len(analysis.units), 12)
        peaks = profile.measure_stage_peaks(analysis, builder, probes, micro_batch=micro,
                                            loss=LOSS, optimizer="adam")
        for probe, measured in zip(probes, peaks):
            for k, peak in zip(probe.inflights, measured):
                samples.append(regression.StageSample.of(
                    label, analysis.stats[probe.start:probe.stop], k, peak))
        print(f"calibrated on {label}: {len(probes)} stages")
    regression.save_samples(samples, regression.DEFAULT_SAMPLES,
                            source="python bench/pipeline.py --calibrate (CPU, TF 2.21, "
                                   "TF_CPU_ALLOCATOR_USE_BFC=true, eager pipeline steps, Adam)")


def regression_rows(validation) -> list[str]:
    """The shipped regression on stages it was not fitted on, and, per model, a
    regression fitted on that model's own measured stages (what
    ``recommend_hybrid(profile=True)`` does), with its leave-one-out error."""
    from tofu_tf.pipeline import MemoryRegression, default_regression, regression
    model = default_regression()
    rows = [f"shipped regression: {model.describe()}"]
    for label, (fit, loo) in regression.errors_by_model(regression.load_samples()).items():
        rows.append(f"  {label:<18} calibration: fit {100 * fit:4.1f}%, leave-one-out "
                    f"{100 * loo:4.1f}%")
    for label in sorted({s.model for s in validation}):
        own = [s for s in validation if s.model == label]
        mape = statistics.mean(abs(model.predict(s) - s.measured_bytes) / s.measured_bytes
                               for s in own)
        fitted = MemoryRegression.fit(own)
        rows.append(f"  {label:<18} shipped: MAPE {100 * mape:5.1f}% on its {len(own)} stages; "
                    f"fitted on them: fit {100 * fitted.fit_mape:4.1f}%, "
                    f"leave-one-out {100 * fitted.loo_mape:4.1f}%")
    return rows


def hybrid_rows() -> list[str]:
    from tofu_tf import models
    from tofu_tf.pipeline import recommend_hybrid
    model = models.gpt(num_layers=16, d_model=512, num_heads=8, seq_len=256, vocab_size=32000)
    best = recommend_hybrid(model, num_devices=8, batch_size=64, loss=LOSS, optimizer="adam")
    rows = [best.table(top=8), ""]
    budget = int(best.candidates[len(best.candidates) // 2].predicted_peak_bytes)
    fast = recommend_hybrid(model, num_devices=8, batch_size=64, loss=LOSS, optimizer="adam",
                            memory_budget_bytes=budget)
    rows.append(fast.table(top=5))
    return rows


def main(argv) -> None:
    del argv
    started = time.perf_counter()
    if FLAGS.calibrate:
        calibrate()
    print("1. Search time, method='optimal' (exact lexicographic min-max):")
    print("\n".join(search_time_table()))
    print()
    print("2. Largest stage peak by method, and how much lower optimal is:")
    print("\n".join(memory_table()))
    print()
    print("Profiling runs planned for those models (a device holds at most two units and "
          "measures the stages nested in them):")
    print("\n".join(planned_runs_table()))
    validation = []
    if not FLAGS.quick:
        print()
        print("3. Profiling (4 devices per run) and mCAP's predictor against measured stage peaks:")
        rows, _, validation = profiling_tables()
        print("\n".join(rows))
        print()
        print("4. Memory regression:")
        print("\n".join(regression_rows(validation)))
    print()
    print("5. recommend_hybrid, GPT-16 d512, 8 devices, global batch 64:")
    print("\n".join(hybrid_rows()))
    if not FLAGS.quick:
        print()
        print("6. Pipelines run for real, measured stage peaks against the predictions:", flush=True)
        import subprocess
        subprocess.run([sys.executable, str(Path(__file__).with_name("pipeline_runs.py"))], check=True)
    print(f"\nbench wall time {time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    app.run(main)
