"""Repeated blocks: where the node order repeats one block of identical nodes.

A Transformer's layers, an unrolled RNN's steps: the coarsened graph is the
same block of nodes again and again. This module finds the longest such run
so that a per-axis problem builds each distinct block once
(``tofu_tf.search.problem``) and the solver eliminates it once
(``tofu_tf.search.elimination``).

**When two nodes are the same.** Node ``i`` and node ``i + L`` are the same if
everything the problem builder reads about the node itself is equal:

* op nodes: the op's view (type, attributes, input/output shapes and dtypes,
  small constant inputs -- what the operator semantics derive strategies from),
  its layer *kind* (the layer name without digits: lowering targets treat
  recurrent layers apart), its compute work, which outputs are alive at the
  memory peak, which outputs are gradient-tied, and whether it is a backward op;
* variable nodes: the weight's shape and bytes, whether the target pins it, and
  the views and work of every member op (reads, assigns, folded update ops);
* input nodes: the op's view.

Strategy providers are assumed to depend on an op's view and layer kind only,
as the operator registry does. Equal nodes get equal options whenever the
earlier axes decided them alike (the builder checks that per block). Edges are
not part of the signature: ``GraphIndex`` keeps a use (or tie) inside a block
only if every block has the same use at the same place with its producer at
the same place; every other use is priced one by one. The solver then compares
the arrays themselves before folding.
"""

from __future__ import annotations

import dataclasses
import re
from typing import TYPE_CHECKING, Iterable

import numpy as np

from tofu_tf.semantics.view import view_key

if TYPE_CHECKING:
    from tofu_tf.search.coarsen import GraphIndex

_DIGITS = re.compile(r"\d+")


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


def find_run(index: "GraphIndex", *, min_count: int = 2) -> Run | None:
    """The run of equal blocks that saves the most nodes, its blocks cut where fewest uses cross."""
    names = index.node_names()
    ids: dict[tuple, int] = {}
    signature = np.asarray([ids.setdefault(s, len(ids)) for s in _signatures(index, names)], dtype=np.int64)
    best = None
    for period in _candidate_periods(signature, len(names) // min_count):
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
    start = _phase(index, first, period, span)
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


def _phase(index: "GraphIndex", first: int, period: int, span: int) -> int:
    """Where in the periodic span to cut blocks: the boundary fewest uses cross."""
    ends = np.asarray([(use.consumer_node, use.producer_node) for use in index.use_table],
                      dtype=np.int64).reshape(-1, 2)
    crossing = np.zeros(len(index.node_names()) + 2, dtype=np.int64)
    np.add.at(crossing, ends.min(axis=1) + 1, 1)     # a use crosses boundary x (between x-1 and x)
    np.add.at(crossing, ends.max(axis=1) + 1, -1)    # for lo < x <= hi
    crossing = np.cumsum(crossing)
    last = min(first + period - 1, first + span - 2 * period)     # keep at least two blocks
    candidates = range(first, max(first, last) + 1)
    return min(candidates, key=lambda x: (crossing[x], x))


def _signatures(index: "GraphIndex", names: list[str]) -> list[tuple]:
    return [_static(index, name) for name in names]


def _static(index: "GraphIndex", name: str) -> tuple:
    graph = index.graph
    if name.startswith("var:"):
        group = index.groups[name[4:]]
        members = index.members[name]
        return ("var", group.shape, group.nbytes, group.key in index.pinned,
                tuple(sorted(index.unsplit_dims.get(group.key, ()))), len(group.paths), len(group.reads),
                len(group.assigns), tuple(view_key(index.ops[m], graph) for m in members),
                tuple(index.work.get(m, 0.0) for m in members))
    op = index.ops[name]
    if name in index.input_ops:
        return ("input", view_key(op, graph))
    return ("op", view_key(op, graph), _DIGITS.sub("", op.layer or ""), index.work.get(name, 0.0),
            tuple(t in index.peak_live for t in op.outputs), index.tied_outputs.get(name, ()),
            name in index.backward)
