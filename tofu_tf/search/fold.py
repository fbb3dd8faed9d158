"""Repeated blocks: where the node order repeats one block of identical nodes.

A Transformer's layers, an unrolled RNN's steps: the coarsened graph is the
same block of nodes again and again. This module finds the longest such run
so that a per-axis problem builds each distinct block once
(``tofu_tf.search.problem``) and the solver eliminates it once
(``tofu_tf.search.elimination``).

It works on plain data, not on the graph: one *signature* per node in node
order (``GraphIndex.node_signature`` says what makes two nodes the same:
everything the problem builder reads about the node itself) and, per use
between nodes, the positions of its two ends. ``GraphIndex`` calls
``find_run`` with both, so this module needs nothing from ``coarsen``.

Edges are not part of the signature: ``GraphIndex`` keeps a use (or tie)
inside a block only if every block has the same use at the same place with
its producer at the same place; every other use is priced one by one. The
solver then compares the arrays themselves before folding.
"""

from __future__ import annotations

import dataclasses
from typing import Hashable, Iterable, Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class Run:
    """``count`` blocks of ``period`` nodes from node ``start``, each equal to the next."""

    start: int
    period: int
    count: int

    @property
    def stop(self) -> int:
        return self.start + self.period * self.count

    def block(self, position: int) -> int:
        return (position - self.start) // self.period if self.start <= position < self.stop else -1

    def common_block(self, positions: Iterable[int]) -> int:
        """The block holding every position, or -1."""
        blocks = {self.block(p) for p in positions}
        return blocks.pop() if len(blocks) == 1 else -1


def find_run(signatures: Sequence[Hashable], use_ends: Sequence[tuple[int, int]], *,
             min_count: int = 2) -> Run | None:
    """The run of equal blocks that saves the most nodes, its blocks cut where fewest uses cross.

    ``signatures`` has one entry per node in node order; nodes with equal entries are
    interchangeable. ``use_ends`` has one ``(consumer position, producer position)`` per
    use between nodes."""
    ids: dict[Hashable, int] = {}
    signature = np.asarray([ids.setdefault(s, len(ids)) for s in signatures], dtype=np.int64)
    best = None
    for period in _candidate_periods(signature, len(signature) // min_count):
        equal = signature[:-period] == signature[period:]
        edges = np.diff(np.concatenate(([0], equal.astype(np.int8), [0])))
        starts, ends = np.nonzero(edges == 1)[0], np.nonzero(edges == -1)[0]
        if not len(starts):
            continue
        k = int(np.argmax(ends - starts))
        span = int(ends[k] - starts[k]) + period          # nodes [a, a + span) are period-periodic
        saved = (span // period - 1) * period
        if span // period >= min_count and (best is None or saved > best[0]):
            best = (saved, period, int(starts[k]), span)
    if best is None:
        return None
    _, period, first, span = best
    start = _phase(use_ends, len(signature), first, period, span)
    count = (first + span - start) // period
    return Run(start, period, count) if count >= min_count else None


def _candidate_periods(signature: np.ndarray, longest: int) -> list[int]:
    """Periods worth testing: in a run of period ``L`` a node's next equal node is at most
    ``L`` later, and the nodes that occur once per block are exactly ``L`` apart, so ``L``
    is one of the gaps between consecutive equal signatures. (The distinct gaps are
    taken with a set: ``np.unique`` imports ``numpy.ma`` on first use, 0.03 s of a
    cold first plan.)"""
    order = np.argsort(signature, kind="stable")
    same = signature[order][1:] == signature[order][:-1]
    gaps = (order[1:] - order[:-1])[same]
    return sorted(g for g in set(gaps.tolist()) if 0 < g <= longest)


def _phase(use_ends: Sequence[tuple[int, int]], num_nodes: int, first: int, period: int, span: int) -> int:
    """Where in the periodic span to cut blocks: the boundary fewest uses cross."""
    ends = np.asarray(use_ends, dtype=np.int64).reshape(-1, 2)
    crossing = np.zeros(num_nodes + 2, dtype=np.int64)
    np.add.at(crossing, ends.min(axis=1) + 1, 1)     # a use crosses boundary x (between x-1 and x)
    np.add.at(crossing, ends.max(axis=1) + 1, -1)    # for lo < x <= hi
    crossing = np.cumsum(crossing)
    last = min(first + period - 1, first + span - 2 * period)     # keep at least two blocks
    candidates = range(first, max(first, last) + 1)
    return min(candidates, key=lambda x: (crossing[x], x))
