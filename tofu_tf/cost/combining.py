"""Which of a step's collectives DTensor runs as one: its all-reduce combining, modeled.

After SPMD expansion DTensor lowers each all-gather to an all-reduce of a zero-padded buffer
(outside TPUs), fuses an all-reduce followed by a slice into a reduce-scatter, and then combines
all-reduces (its all-reduce combining pass, TensorFlow's
``tensorflow/dtensor/mlir/dtensor_allreduce_combine_optimization.cc``; the order of the passes is
``dtensor_mlir_passes.cc``'s): it orders the all-reduces by dependence, peels off, again and again,
every all-reduce no remaining one depends on, and merges each peeled set, split by element type,
reduction and device group, into one all-reduce of a concatenated buffer. So a step runs one
all-reduce per (level, element type, reduction, mesh axis), where an all-reduce's level is the
length of the longest chain of all-reduces that starts at it (1: nothing all-reduced after it is
computed from it). Reduce-scatters and all-to-alls run one each.

Where a collective's fixed cost is paid once per collective (``Link.latency_per_collective``: on
the CPU profile it is milliseconds), that count is what the step pays: data parallelism's gradient
all-reduces run as one; a mixture-of-experts' router statistics, all-reduced in each layer's
forward pass, run with them when nothing all-reduced is computed from them; Megatron's all-reduces,
each feeding the next layer, pay one latency each.

Combining is not free: the pass writes each member into a zero-filled buffer and slices it out
after the all-reduce, a copy of every byte combined (``Link.combine_copy_bandwidth``; on the CPU
profile, gradients of a few MiB cost more to pack than the latencies they save). DTensor reads a
cap on the members of a combined all-reduce each time it compiles a program
(``DTENSOR_ALLREDUCE_COMBINE_OPTIMIZATION_GROUP_SIZE``; 1 runs every all-reduce alone), so the
price takes the cheaper of the two for the whole step (``combining_pays``) and the strategy
compiles the training step so (``tofu_tf.tf.compat.calls``).

A chain is followed through the graph's tensors: an all-reduce of tensor ``t`` comes before one of
every tensor computed from ``t``. The counts this gives were set beside the collectives DTensor's
lowered program runs by ``bench/executed.py`` (bench/README.md, "The plan is what runs").
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from tofu_tf import ir


class AllReduceLevels:
    """A graph's ops and readers, laid out once, to find the level of each tensor all-reduced
    under many plans (``levels``)."""

    def __init__(self, graph: ir.Graph, source_of: dict[str, int]):
        """``source_of``: tensor name -> the id its conversions are priced under (a tensor and its
        aliases share one)."""
        readers: dict[str, list[int]] = {}
        for i, op in enumerate(graph.ops):
            for name in op.inputs:
                readers.setdefault(name, []).append(i)
        # Per op, per output: (the output's source id or -1, the ops that read it).
        self._outputs = [tuple((source_of.get(name, -1), tuple(readers.get(name, ()))) for name in op.outputs)
                         for op in graph.ops]

    def levels(self, sources: Sequence[int]) -> dict[int, int]:
        """Per source id in ``sources`` (the tensors a plan all-reduces), its level: 1 + the
        highest level among the all-reduced tensors computed from it."""
        marked = set(sources)
        if len(marked) <= 1:
            return {source: 1 for source in marked}
        found: dict[int, int] = {}
        below = [0] * len(self._outputs)      # per op: the highest level among what is computed from it
        for i in range(len(self._outputs) - 1, -1, -1):
            highest = 0
            for source, readers in self._outputs[i]:
                level = 0
                for reader in readers:
                    if below[reader] > level:
                        level = below[reader]
                if source in marked:
                    level += 1
                    found[source] = level
                if level > highest:
                    highest = level
            below[i] = highest
        return found


def run_groups(levels: np.ndarray, axis: np.ndarray, reduction: np.ndarray, dtype: np.ndarray) -> np.ndarray:
    """Per combined collective, the index of the run it belongs to (entries with equal level, mesh
    axis, reduction and element type share one run), numbered in order of first appearance."""
    if not len(levels):
        return np.zeros(0, dtype=np.int64)
    keys = np.column_stack([levels, axis, reduction, dtype])
    _, first, inverse = np.unique(keys, axis=0, return_index=True, return_inverse=True)
    order = np.argsort(np.argsort(first))          # runs numbered by their first member
    return order[np.asarray(inverse).ravel()]


def run_roles(runs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per member of ``runs`` (``run_groups``): whether it is its run's first (the one that pays
    the run's latency) and whether its run has two or more members (it is packed)."""
    first = np.zeros(len(runs), dtype=bool)
    first[np.unique(runs, return_index=True)[1]] = True
    shared = np.bincount(runs)[runs] >= 2 if len(runs) else np.zeros(0, dtype=bool)
    return first, shared


def combining_pays(first: np.ndarray, shared: np.ndarray, latency: np.ndarray, packing: np.ndarray) -> bool | None:
    """Whether a step runs its all-reduces cheaper combined than one by one.

    Per combinable collective: its ``run_roles``, the ``latency`` it pays alone and the
    ``packing`` seconds combining adds for it (its buffer bytes over the link's
    ``combine_copy_bandwidth``). Combined, each member of a run of two or more pays its packing
    and only the run's first member its latency; one by one, every member pays its latency and
    none packs. Ties go to combining, DTensor's default. None when no run has two members (the
    choice changes nothing)."""
    if not shared.any():
        return None
    return float(packing[shared].sum()) <= float(latency[shared & ~first].sum())
