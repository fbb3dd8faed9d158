"""Benchmark: strategy derivation for a whole 24-layer GPT training step.

Captures ``tofu_tf.models.gpt(num_layers=24, d_model=256, num_heads=8,
seq_len=64)`` with batch 8 and Adam (capture time is not measured), then
times ``tofu_tf.semantics.strategies`` over every op of the step (loop bodies
included) for num_parts 2 and 8, each on a fresh registry so caches start
cold. Prints the median of 3 runs, the number of registered op types and the
coverage of the graph. Target: under 1 s per num_parts.

    python bench/semantics.py
"""

from __future__ import annotations

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def _capture():
    import tofu_tf
    from tofu_tf import models
    model = models.gpt(num_layers=24, d_model=256, num_heads=8, seq_len=64)
    return tofu_tf.capture_training_step(model, batch_size=8, loss="sparse_categorical_crossentropy",
                                         optimizer="adam")


def _ops(graph):
    for op in graph.ops:
        yield op, graph
        if op.body is not None:
            yield from _ops(op.body)


def _derive_all(ops, num_parts: int) -> tuple[float, int]:
    from tofu_tf import semantics
    registry = semantics.Registry()
    semantics.register_builtin_ops(registry)
    start = time.perf_counter()
    total = 0
    for op, graph in ops:
        total += len(registry.strategies(op, graph, num_parts))
    return time.perf_counter() - start, total


def main() -> None:
    from tofu_tf import semantics
    graph = _capture()
    ops = list(_ops(graph))
    print(f"GPT-24 (d_model 256, 8 heads, seq 64), batch 8, Adam: {len(ops)} ops")
    print(f"registered op types: {len(semantics.default_registry())}")
    for num_parts in (2, 8):
        runs = [_derive_all(ops, num_parts) for _ in range(3)]
        median = statistics.median(t for t, _ in runs)
        print(f"num_parts={num_parts}: strategy derivation {median:.3f} s (median of 3, cold cache), "
              f"{runs[0][1]} strategies")
    print(semantics.coverage(graph))


if __name__ == "__main__":
    main()
