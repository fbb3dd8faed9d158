r"""The exact per-axis solver: min-sum variable elimination, with repeated blocks solved once.

The per-axis problem (``tofu_tf.search.problem``) is a pairwise objective over
decision nodes,

.. math:: F(a) = \sum_v c_v(a_v) + \lambda m_v(a_v) + \sum_{(u,v)} w_{uv}(a_u, a_v).

Tofu's DP places nodes in forward order and keeps, per cut, the layouts of
the tensors crossing it. That is one *elimination order* of the same dynamic
program; this module lets the order follow the graph instead. Eliminating a
node :math:`x` with neighbours :math:`N(x)` replaces every term that mentions
:math:`x` by one table

.. math:: g(a_{N(x)}) = \min_{a_x} \sum_{f \ni x} f(a_x, a_{N(x)}),

and remembers the argmin, so the minimizer is read back in reverse order.
The result is exact for every order; the order only decides the table sizes.
Nodes are taken greedily by the smallest table they would create (the
"min-weight" heuristic). On a Transformer block a forward-order cut holds
every element-wise GELU value that a backward op will read (160,000 states
on GPT-12, above the cut DP's cap); eliminating the backward ops first keeps
every table under a few thousand entries.

**Repeated blocks.** When the problem says that blocks of nodes repeat
(``AxisProblem.blocks``), the nodes of a block that touch nothing outside it
(*interior* nodes) are eliminated once per distinct block, leaving a table over
the block's boundary nodes; every identical block reuses that table and those
argmins. Blocks are checked here, not trusted: a block is folded only if its
interior nodes' costs and the edges among them equal the first block's
(the same arrays, or equal ones). So the optimum is the optimum of the
unfolded problem -- folding changes the work, never the answer.

A table larger than ``max_entries`` makes ``solve`` return None; the caller
then falls back to the forward-order cut DP (``tofu_tf.search.tofu_dp``).
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from typing import Sequence

import numpy as np

from tofu_tf.errors import TofuError
from tofu_tf.search.problem import AxisProblem

DEFAULT_MAX_ENTRIES = 1 << 21


class _TooWide(TofuError):
    """An elimination would build a table above the size limit."""


@dataclasses.dataclass(frozen=True)
class _Record:
    """One eliminated node: its best option for every assignment of its neighbours."""

    node: int
    neighbours: tuple[int, ...]
    argmin: np.ndarray


@dataclasses.dataclass(frozen=True)
class EliminationResult:
    choice: tuple[int, ...]
    objective: float
    widest: int          # entries of the largest table built
    folded_blocks: int   # blocks whose interior was solved by reusing another block's tables


class _Factors:
    """Tables over sets of nodes, and per node the tables that mention it."""

    def __init__(self, domain: Sequence[int], max_entries: int):
        self.domain = domain
        self.max_entries = max_entries
        self.tables: dict[int, tuple[tuple[int, ...], np.ndarray]] = {}
        self.of_node: dict[int, set[int]] = {}
        self.constant = 0.0
        self.widest = 1
        self._next = 0

    def add(self, nodes: tuple[int, ...], table: np.ndarray) -> None:
        """Add a table whose axes follow ``nodes`` (any order, no repeats)."""
        if not nodes:
            self.constant += float(table)
            return
        fid = self._next
        self._next += 1
        self.tables[fid] = (nodes, table)
        for v in nodes:
            self.of_node.setdefault(v, set()).add(fid)

    def neighbours(self, x: int) -> set[int]:
        out: set[int] = set()
        for fid in self.of_node.get(x, ()):
            out.update(self.tables[fid][0])
        out.discard(x)
        return out

    def weight(self, x: int) -> int:
        return self.domain[x] * math.prod(self.domain[v] for v in self.neighbours(x))

    def eliminate(self, x: int) -> _Record:
        fids = self.of_node.pop(x, set())
        rest = sorted(set().union(*(self.tables[f][0] for f in fids)) - {x}) if fids else []
        order = [x] + rest
        where = {v: i for i, v in enumerate(order)}
        shape = tuple(self.domain[v] for v in order)
        size = math.prod(shape)
        if size > self.max_entries:
            raise _TooWide
        self.widest = max(self.widest, size)
        aligned = []
        for fid in fids:
            nodes, table = self.tables.pop(fid)
            perm = sorted(range(len(nodes)), key=lambda a: where[nodes[a]])
            if perm != list(range(len(nodes))):
                table = table.transpose(perm)
            present = {nodes[a] for a in perm}
            aligned.append(table.reshape(tuple(self.domain[v] if v in present else 1 for v in order)))
            for v in nodes:
                if v != x:
                    self.of_node[v].discard(fid)
        argmin, best = min_of_sum(aligned, shape)
        self.add(tuple(rest), best)
        return _Record(x, tuple(rest), argmin)

    def eliminate_in_order(self, order: Sequence[int]) -> list[_Record]:
        """Eliminate nodes in a known order (one ``eliminate_greedily`` chose before)."""
        return [self.eliminate(x) for x in order]

    def eliminate_greedily(self, candidates: set[int]) -> list[_Record]:
        """Eliminate ``candidates``, always the one whose table would be smallest."""
        heap = [(self.weight(x), x) for x in candidates]
        heapq.heapify(heap)
        left = set(candidates)
        records = []
        while heap:
            w, x = heapq.heappop(heap)
            if x not in left:
                continue
            current = self.weight(x)
            if current != w:
                heapq.heappush(heap, (current, x))
                continue
            touched = self.neighbours(x)
            records.append(self.eliminate(x))
            left.discard(x)
            for v in touched & left:
                heapq.heappush(heap, (self.weight(v), v))
        return records


# Tables at least this large are summed and minimized one option of the eliminated node at a time.
ROWWISE_ENTRIES = 1 << 15


def min_of_sum(tables: Sequence[np.ndarray], shape: tuple[int, ...],
               rowwise_entries: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """For ``total = 0 + tables[0] + tables[1] + ...`` (each broadcast to ``shape``, whose
    first axis is the eliminated node, present in every table): ``(total.argmin(axis=0),
    total.min(axis=0))``, the first minimum on ties.

    A large ``total`` is never built: per option of the node, its slice of the sum (a
    fraction of the table, which stays in cache) is added up and kept where smaller --
    strictly, so the first minimum stays. numpy's argmin over a leading axis would also
    copy the whole table into that axis's order first. Each entry is the same additions
    in the same order either way, so the results are equal; a NaN (never in these costs)
    takes the whole-table path, whose argmin picks it as numpy does."""
    limit = ROWWISE_ENTRIES if rowwise_entries is None else rowwise_entries
    if math.prod(shape) < limit or shape[0] == 1:
        return _min_of_whole_sum(tables, shape)
    rest = shape[1:]
    best = np.zeros(rest)
    for table in tables:
        best += table[0]
    argmin = np.zeros(rest, dtype=np.intp)
    row = np.empty(rest)
    better = np.empty(rest, dtype=bool)
    for option in range(1, shape[0]):
        row.fill(0.0)
        for table in tables:
            row += table[option]
        np.less(row, best, out=better)
        argmin[better] = option
        np.minimum(best, row, out=best)
    if np.isnan(best).any():
        return _min_of_whole_sum(tables, shape)
    return argmin, best


def _min_of_whole_sum(tables, shape):
    total = np.zeros(shape)
    for table in tables:
        total += table                   # in place
    return total.argmin(axis=0), total.min(axis=0)


class _Orders:
    """Elimination orders already chosen, by the problem's structure.

    The greedy order depends only on which nodes the tables mention and how many
    options each node has, not on the costs. A search solves the same structure
    many times (each mesh-shape prefix, each multiplier of a budgeted search): the
    coarsened nodes and edges are the graph's, and the option counts often repeat.
    Replaying a known order gives the same tables, so the same optimum, without the
    heap; and a structure known to be too wide fails at once. Bounded, oldest out."""

    _LIMIT = 64

    def __init__(self):
        self._orders: dict[tuple, tuple | None] = {}

    def get(self, key: tuple):
        return self._orders.get(key, _UNKNOWN)

    def put(self, key: tuple, orders: tuple | None) -> None:
        if len(self._orders) >= self._LIMIT:
            del self._orders[next(iter(self._orders))]
        self._orders[key] = orders


_UNKNOWN = object()
_ORDERS = _Orders()


def solve(problem: AxisProblem, lam: float = 0.0, *,
          max_entries: int = DEFAULT_MAX_ENTRIES) -> EliminationResult | None:
    """Minimize ``problem``'s objective exactly; None if some table would exceed ``max_entries``."""
    folds = _foldable(problem) if problem.blocks is not None else []
    key = (max_entries, problem.structure,
           tuple((tuple(members), tuple(sorted(interior))) for _, members, interior, _ in folds))
    known = _ORDERS.get(key)
    if known is None:
        return None
    try:
        result, orders = _solve(problem, lam, max_entries, folds, None if known is _UNKNOWN else known)
    except _TooWide:
        _ORDERS.put(key, None)
        return None
    if known is _UNKNOWN:
        _ORDERS.put(key, orders)
    return result


def _solve(problem: AxisProblem, lam: float, max_entries: int, folds, known: tuple | None):
    """The optimum, and the elimination orders used (per fold, then the rest), which
    replay ``known`` when given."""
    domain = [len(node.options) for node in problem.nodes]
    skip_nodes: set[int] = set()
    skip_edges: set[int] = set()
    block_records: list[tuple[list[_Record], list[int]]] = []
    factors = _Factors(domain, max_entries)
    for f, (start, members, interior, edge_ids) in enumerate(folds):
        local = _Factors(domain, max_entries)       # indices of the first block of the group
        first = members[0]
        for i in range(first, first + problem.blocks.period):
            local.add((i,), problem.unary[i] + lam * problem.memory[i])
        for e in edge_ids[first]:
            edge = problem.edges[e]
            local.add((edge.u, edge.v), edge.cost)
        if known is None:
            records = local.eliminate_greedily({first + r for r in interior})
        else:
            records = local.eliminate_in_order(known[f])
        factors.widest = max(factors.widest, local.widest)
        leftovers = list(local.tables.values())
        for b in members:
            shift = b - first
            for nodes, table in leftovers:
                factors.add(tuple(v + shift for v in nodes), table)
            factors.constant += local.constant
            skip_nodes.update(b + r for r in interior)
            skip_edges.update(edge_ids[b])
        block_records.append((records, [b - first for b in members]))
    folded_starts = {b for _, members, _, _ in folds for b in members}
    for i in range(len(problem.nodes)):
        if i in skip_nodes:
            continue
        if problem.blocks is None or problem.blocks.block_start(i) not in folded_starts:
            factors.add((i,), problem.unary[i] + lam * problem.memory[i])
    for e, edge in enumerate(problem.edges):
        if e not in skip_edges:
            factors.add((edge.u, edge.v), edge.cost)
    if known is None:
        records = factors.eliminate_greedily(set(range(len(problem.nodes))) - skip_nodes)
    else:
        records = factors.eliminate_in_order(known[-1])
    orders = tuple(tuple(r.node for r in block) for block, _ in block_records) + (tuple(r.node for r in records),)
    choice = [0] * len(problem.nodes)
    _read_back(records, choice, 0)
    values = np.asarray(choice, dtype=np.int64)
    for block, shifts in block_records:
        _read_back_blocks(block, values, np.asarray(shifts, dtype=np.int64))
    choice = values.tolist()
    objective = factors.constant
    return EliminationResult(tuple(choice), float(objective), factors.widest,
                             sum(len(m) - 1 for _, m, _, _ in folds)), orders


def _read_back(records: list[_Record], choice: list[int], shift: int) -> None:
    for record in reversed(records):
        index = tuple(choice[v + shift] for v in record.neighbours)
        choice[record.node + shift] = int(record.argmin[index]) if index else int(record.argmin)


def _read_back_blocks(records: list[_Record], choice: np.ndarray, shifts: np.ndarray) -> None:
    """``_read_back`` for every block of a group at once (same records, shifted nodes)."""
    for record in reversed(records):
        index = tuple(choice[v + shifts] for v in record.neighbours)
        choice[record.node + shifts] = record.argmin[index] if index else int(record.argmin)


def _foldable(problem: AxisProblem):
    """Groups of identical blocks: (template, block starts, interior offsets, edge ids per block).

    A block joins its template's group only if every node's costs and every edge
    inside it equal the template block's; interior nodes are those no block of the
    group connects to anything outside the block."""
    blocks = problem.blocks
    period, starts = blocks.period, list(blocks.starts())
    count = len(problem.edges)
    ends = np.empty((count, 2), dtype=np.int64)
    ends[:, 0] = np.fromiter((e.u for e in problem.edges), dtype=np.int64, count=count)
    ends[:, 1] = np.fromiter((e.v for e in problem.edges), dtype=np.int64, count=count)
    block = np.where((ends >= blocks.start) & (ends < blocks.stop), (ends - blocks.start) // period, -1)
    same = (block[:, 0] == block[:, 1]) & (block[:, 0] >= 0)
    inside: dict[int, list[int]] = {b: [] for b in starts}
    for e, b in zip(np.nonzero(same)[0].tolist(), block[same, 0].tolist()):
        inside[starts[b]].append(e)
    boundary: dict[int, set[int]] = {b: set() for b in starts}
    for side in (0, 1):
        crossing = ~same & (block[:, side] >= 0)
        for b, node in zip(block[crossing, side].tolist(), ends[crossing, side].tolist()):
            boundary[starts[b]].add(node - starts[b])
    groups: dict[int, list[int]] = {}
    for b, template in zip(starts, blocks.templates):
        groups.setdefault(template, []).append(b)
    folds = []
    for members_ in groups.values():
        first = members_[0]
        members = [b for b in members_ if b == first or _same_block(problem, first, b, period, inside)]
        if len(members) < 2:
            continue
        outside = set().union(*(boundary[b] for b in members))
        interior = frozenset(r for r in range(period) if r not in outside)
        if interior:
            folds.append((first, members, interior, inside))
    return folds


def _same_block(problem: AxisProblem, a: int, b: int, period: int, inside) -> bool:
    """Equal costs on every node and equal edges inside (edges are sorted, so a block's
    internal edges come in the same order in every block that has the same ones)."""
    for r in range(period):
        if not (_same(problem.unary[a + r], problem.unary[b + r])
                and _same(problem.memory[a + r], problem.memory[b + r])):
            return False
    edges_a, edges_b = inside[a], inside[b]
    if len(edges_a) != len(edges_b):
        return False
    for ea, eb in zip(edges_a, edges_b):
        x, y = problem.edges[ea], problem.edges[eb]
        if x.u - a != y.u - b or x.v - a != y.v - b or not _same(x.cost, y.cost):
            return False
    return True


def _same(x: np.ndarray, y: np.ndarray) -> bool:
    return x is y or (x.shape == y.shape and bool(np.array_equal(x, y)))
