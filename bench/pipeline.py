"""Benchmark of the memory-centric pipeline partitioner (tofu_tf.pipeline).

Prints two tables:

1. search time of ``partition(method="optimal")`` (median of 5 runs) on random
   synthetic chains: analytic (monotone) statistics at 1000 layers / 64 stages
   and 8192 layers / 1024 stages, and measured isolated/added statistics whose
   offsets make the stage cost non-monotone at 1000 / 64;
2. the largest stage peak of "optimal" against Megatron's uniform split,
   DeepSpeed's ``partition_method="parameters"`` and torchgpipe's
   ``balance_by_time``, under 1F1B, on a GPT-style chain (big embedding first,
   identical blocks, big LM head + loss last) and a CNN-like chain (large
   activations early, small state; a huge dense head last).

Run from the repository root: ``python bench/pipeline.py``. Imports no TensorFlow.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import numpy as np

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tofu_tf.pipeline import LayerStats, partition  # noqa: E402

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


def median_search_seconds(stats, num_stages, schedule, num_microbatches) -> float:
    runs = [partition(stats, num_stages, schedule=schedule, num_microbatches=num_microbatches)
            .search_seconds for _ in range(RUNS)]
    return statistics.median(runs)


def search_time_table() -> list[str]:
    cases = [
        ("monotone (analytic)", random_analytic_chain(1000, 0), 64, "1f1b", 64),
        ("monotone (analytic)", random_analytic_chain(8192, 0), 1024, "1f1b", 64),
        ("monotone (analytic)", random_analytic_chain(8192, 0), 1024, "gpipe", 64),
        ("monotone (analytic)", random_analytic_chain(8192, 0), 1024, "1f1b", 2048),
        ("non-monotone (measured)", random_measured_chain(1000, 0), 64, "1f1b", 64),
    ]
    rows = [f"{'statistics':<24} {'layers':>6} {'stages':>6} {'schedule':>8} {'m':>5} "
            f"{'search (median of 5)':>21}"]
    for label, stats, stages, schedule, micro in cases:
        seconds = median_search_seconds(stats, stages, schedule, micro)
        rows.append(f"{label:<24} {len(stats):>6} {stages:>6} {schedule:>8} {micro:>5} "
                    f"{seconds * 1e3:>18.1f} ms")
    return rows


def memory_table() -> list[str]:
    cases = [("GPT-style, 48 blocks", gpt_chain(), 8, 16),
             ("CNN-like, 48 convs + dense head", cnn_chain(), 8, 16)]
    methods = ("optimal", "uniform", "parameters", "time")
    rows = [f"{'chain (1F1B)':<32} {'p':>3} {'m':>3} "
            + " ".join(f"{m + ' GiB':>15}" for m in methods) + "  worst/optimal"]
    for label, stats, stages, micro in cases:
        peaks = {m: partition(stats, stages, schedule="1f1b", num_microbatches=micro, method=m)
                 .max_peak_bytes for m in methods}
        ratios = [peaks[m] / peaks["optimal"] for m in methods[1:]]
        rows.append(f"{label:<32} {stages:>3} {micro:>3} "
                    + " ".join(f"{peaks[m] / GIB:>15.2f}" for m in methods)
                    + "  " + " / ".join(f"{r:.2f}x" for r in ratios))
    return rows


def main() -> None:
    started = time.perf_counter()
    print("Search time, method='optimal' (exact lexicographic min-max):")
    print("\n".join(search_time_table()))
    print()
    print("Largest stage peak by method (ratios: uniform / parameters / time over optimal):")
    print("\n".join(memory_table()))
    print(f"\nbench wall time {time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    main()
