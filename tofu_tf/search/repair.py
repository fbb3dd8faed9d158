"""Local repair of a searched plan under a memory budget, priced by the step's own cost model.

The search solves each mesh axis as a problem of pairwise costs (``problem.AxisProblem``)
at a Lagrange multiplier, and prices the winners exactly (``cost.evaluate.StepPricer``).
Two things separate the two, and both cost the budgeted search its optimum:

* The problem prices every *use* of a tensor; the step converts a tensor once per layout
  its readers ask for (DTensor relayouts the value, not the use). A choice whose second
  reader shares a conversion already made looks no cheaper to the problem than one that
  converts another tensor, and the solver breaks the tie either way (on the issue's GPT
  at half its free peak: one more scalar all-reduce, 4% of the step).
* A multiplier's optimum is one end of the set of plans tied at it; the plan that best
  fills the budget may lie between two multipliers' optima (the Lagrangian's duality gap).

So the best plans the search found are improved by moves, each kept where the exact price
improves and the exact peak fits: one node of an axis problem set to another option, or
two nodes an edge joins, where the problem itself prices the move within ``tolerance`` of
the current choice (what the two models can disagree on: near ties); or a connected set
of nodes where a faster plan over the budget differs (what lies between two multipliers).
A move keeps every gradient tie (a broken tie costs ``problem.TIE_PENALTY`` in the
problem, far over any tolerance) and DTensor's rule that a tensor dim is split by at most
one mesh axis.

The module is TF-free; ``api._Search`` supplies the pricing.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

from tofu_tf.search.problem import AxisDecision, AxisProblem

# Passes over the moves, and how many plans the repairs of one search may price in all: a
# count, not seconds (the plan must not depend on the machine's load), as many as price in
# about as long whatever the graph (pricing is linear in its ops: a 2-layer GPT's 2k ops
# price in about 10 ms here, so 1000 of them in 10 s).
_MAX_PASSES = 3
_OP_PRICINGS = 2_000_000     # plans priced x ops per plan
_PRICED = (50, 1000)         # at least, at most


@dataclasses.dataclass(frozen=True)
class AxisChoice:
    """One mesh axis of a plan being repaired: its problem, the option chosen per node, the
    axis size, and which of the axis's role problems it is (``api._Search`` keeps that)."""

    problem: AxisProblem
    choice: tuple[int, ...]
    size: int
    role: int

    def decision(self) -> AxisDecision:
        return AxisDecision.of(self.problem, self.choice, self.size)


@dataclasses.dataclass(frozen=True)
class Move:
    """Nodes of one axis problem set to other options."""

    axis: int
    nodes: tuple[int, ...]
    options: tuple[int, ...]
    problem_delta: float     # the axis problem's change of modeled seconds (0 for a set)


class Allowance:
    """How many more plans the repairs of one search may price."""

    def __init__(self, priced: int):
        self.left = priced

    @classmethod
    def for_ops(cls, num_ops: int) -> "Allowance":
        """As many pricings as a graph of ``num_ops`` ops prices in the time 1000 of a 2k-op one take."""
        low, high = _PRICED
        return cls(max(low, min(high, _OP_PRICINGS // max(num_ops, 1))))

    def take(self) -> bool:
        if self.left <= 0:
            return False
        self.left -= 1
        return True


@dataclasses.dataclass(frozen=True)
class Repaired:
    axes: tuple[AxisChoice, ...]
    decisions: tuple[AxisDecision, ...]
    cost: object             # the pricer's StepCost of ``decisions``
    moves: int               # moves kept


def repair(axes: Sequence[AxisChoice], decisions: Sequence[AxisDecision], cost,
           price: Callable[[Sequence[AxisDecision]], object], better: Callable[[object, object], bool],
           tolerance: Sequence[float], toward: Sequence[AxisChoice] | None = None,
           allowance: "Allowance | None" = None) -> Repaired:
    """Improve a plan by moves while ``better(new_cost, cost)`` (which also checks the
    budget). ``tolerance[k]``: how far above the current choice axis ``k``'s problem may
    price a single-node move and still have it priced (a collective's latency there).

    ``toward``: a faster plan over the budget, on the same mesh. On each axis where it
    solved the very same problem (equal earlier decisions), every connected set of nodes
    where the two differ is a move too, taken whole: its nodes changed one at a time would
    each break the edges between them.

    A pass prices the moves of the plan as it stands (the sets first, then single nodes,
    the problem's cheapest first) and keeps each that improves the plan as it then stands
    (a move whose node moved already in this pass is skipped); passes repeat while one
    kept a move, while ``allowance`` (shared by the repairs of one search) lets it price."""
    axes, decisions = list(axes), list(decisions)
    kept = 0
    allowance = Allowance(_PRICED[1]) if allowance is None else allowance
    for _ in range(_MAX_PASSES):
        kept_before = kept
        moved_nodes: set[tuple[int, int]] = set()
        for move in _toward(axes, decisions, toward) + _moves(axes, decisions, tolerance):
            if any((move.axis, node) in moved_nodes for node in move.nodes):
                continue
            if not allowance.take():
                return Repaired(tuple(axes), tuple(decisions), cost, kept)
            changed = _moved(axes[move.axis], move)
            trial = list(decisions)
            trial[move.axis] = changed.decision()
            trial_cost = price(trial)
            if better(trial_cost, cost):
                axes[move.axis], decisions, cost = changed, trial, trial_cost
                moved_nodes.update((move.axis, node) for node in move.nodes)
                kept += 1
        if kept == kept_before:
            break
    return Repaired(tuple(axes), tuple(decisions), cost, kept)


def _moved(axis: AxisChoice, move: Move) -> AxisChoice:
    choice = list(axis.choice)
    for node, option in zip(move.nodes, move.options):
        choice[node] = option
    return dataclasses.replace(axis, choice=tuple(choice))


def _toward(axes: Sequence[AxisChoice], decisions: Sequence[AxisDecision],
            toward: Sequence[AxisChoice] | None) -> list[Move]:
    """The connected sets of nodes where ``toward`` differs, per axis whose problem it shares."""
    if toward is None:
        return []
    moves = []
    for k, (axis, target) in enumerate(zip(axes, toward)):
        if target.problem is not axis.problem:
            continue
        differ = {i for i, (a, b) in enumerate(zip(axis.choice, target.choice)) if a != b}
        adjacent = _adjacent(axis.problem)
        others = [d for j, d in enumerate(decisions) if j != k]
        while differ:
            component, stack = set(), [differ.pop()]
            while stack:
                i = stack.pop()
                component.add(i)
                for edge in adjacent[i]:
                    for j in (edge.u, edge.v):
                        if j in differ:
                            differ.discard(j)
                            stack.append(j)
            nodes = tuple(sorted(component))
            if not any(_splits_a_dim_twice(axis.problem.nodes[i], target.choice[i], others) for i in nodes):
                moves.append(Move(k, nodes, tuple(target.choice[i] for i in nodes), 0.0))
    return moves


def _moves(axes: Sequence[AxisChoice], decisions: Sequence[AxisDecision], tolerance: Sequence[float]) -> list[Move]:
    """The moves worth pricing, the problem's cheapest first: single nodes, and pairs of
    nodes joined by an edge where the pair prices below each of its halves alone (the
    edge between them is what a move of one breaks: a matmul and the reshape after it)."""
    moves = []
    for k, axis in enumerate(axes):
        problem, choice = axis.problem, axis.choice
        adjacent = _adjacent(problem)
        others = [d for j, d in enumerate(decisions) if j != k]
        single: dict[tuple[int, int], float] = {}
        for i, node in enumerate(problem.nodes):
            for option in range(len(node.options)):
                if option != choice[i] and not _splits_a_dim_twice(node, option, others):
                    single[i, option] = _delta(problem, choice, adjacent, {i: option})
        moves += [Move(k, (i,), (option,), delta) for (i, option), delta in single.items() if delta <= tolerance[k]]
        for edge in problem.edges:
            u, v = edge.u, edge.v
            if u == v:
                continue
            for a in range(len(problem.nodes[u].options)):
                for b in range(len(problem.nodes[v].options)):
                    if (u, a) not in single or (v, b) not in single:
                        continue
                    alone = min(single[u, a], single[v, b])
                    delta = _delta(problem, choice, adjacent, {u: a, v: b})
                    if delta <= tolerance[k] and delta < alone - 1e-12:
                        moves.append(Move(k, (u, v), (a, b), delta))
    moves.sort(key=lambda m: m.problem_delta)
    return moves


def _delta(problem: AxisProblem, choice: Sequence[int], adjacent, changes: dict[int, int]) -> float:
    """The change of ``problem``'s modeled seconds (multiplier 0) when ``changes`` (node ->
    option) are made to ``choice``: the changed nodes' own costs and their edges, each once."""
    def now(i):
        return changes.get(i, choice[i])
    delta, seen = 0.0, set()
    for i, option in changes.items():
        delta += float(problem.unary[i][option] - problem.unary[i][choice[i]])
        for edge in adjacent[i]:
            if id(edge) in seen:
                continue
            seen.add(id(edge))
            delta += float(edge.cost[now(edge.u), now(edge.v)] - edge.cost[choice[edge.u], choice[edge.v]])
    return delta


def _adjacent(problem: AxisProblem) -> list[list]:
    adjacent: list[list] = [[] for _ in problem.nodes]
    for edge in problem.edges:
        adjacent[edge.u].append(edge)
        adjacent[edge.v].append(edge)
    return adjacent


def _splits_a_dim_twice(node, option: int, others: Sequence[AxisDecision]) -> bool:
    """Whether ``option`` splits a dim of one of the node's tensors (or weights) that
    another axis already splits: DTensor gives each tensor dim at most one mesh axis."""
    chosen = node.options[option]
    for member, strategy in zip(node.members, chosen.strategies):
        for other in others:
            prior = other.op_strategies.get(member)
            if prior is None:
                continue
            for mine, theirs in ((strategy.inputs, prior.inputs), (strategy.outputs, prior.outputs)):
                if any(a.dim is not None and a.dim == b.dim for a, b in zip(mine, theirs)):
                    return True
    if chosen.var_split is not None and chosen.var_split.dim is not None:
        for other in others:
            if any(other.var_splits.get(path) is not None and other.var_splits[path].dim == chosen.var_split.dim
                   for path in node.paths):
                return True
    return False
