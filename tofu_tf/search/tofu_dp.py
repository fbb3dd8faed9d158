r"""Tofu's recursive dynamic program, generalized to mesh axes of any size and to replication.

**Recursion over mesh axes.** A mesh shape :math:`(n_1, \dots, n_m)` is solved
one axis at a time (Tofu cuts the devices in two, then each half in two, ...).
Axis :math:`k` is decided with the shapes left after axes :math:`1..k-1`
(each tensor shrinks by :math:`n_j` on the dims earlier axes split), and a
dim an earlier axis split is never split again (DTensor: one axis per dim).

**Exact DP per axis.** The coarsened problem of one axis
(``tofu_tf.search.coarsen``) has nodes :math:`v_1..v_N` in DP order, each with
options :math:`a \in A_v`, a unary cost :math:`c_v(a)` (communication inside the
node plus :math:`\lambda` times its memory), and pairwise edge costs
:math:`w_{uv}(a_u, a_v)` (the collective that converts a tensor between the
producer's and the consumer's layout). Minimize

.. math:: F(a) = \sum_v c_v(a_v) + \sum_{(u,v)} w_{uv}(a_u, a_v).

After placing :math:`v_1..v_i`, the *cut* :math:`C_i` is the set of edges with
one end placed and one not; only the placed end's layout on each such edge
(the layouts of the tensors crossing the cut) affects the rest. With state
:math:`s \in \prod_{e \in C_i} L_e` (the placed end's split class on each
crossing edge),

.. math::

   D_0(\emptyset) = 0, \qquad
   D_i(s') = \min_{s,\ a \in A_{v_i}:\ \pi(s, a) = s'} \Big[ D_{i-1}(s) + c_{v_i}(a)
             + \sum_{e=(u, v_i) \in C_{i-1}} w_e(s_e, a) \Big],

where :math:`\pi` drops the edges :math:`v_i` closes and appends :math:`v_i`'s
split class on the edges it opens. :math:`\min F = D_N(\emptyset)`, and the
argmins are recovered backwards. This is exact for every graph; its cost is
:math:`\sum_i |S_i| \cdot |A_{v_i}|`, small when the coarsened graph is close to a
chain (a layer's forward and backward share a stage, so a cut between layers
crosses only the activation and its gradient). If a cut ever holds more than
``max_states`` states, the cheapest are kept and the result is flagged inexact.

**The order.** Forward order is one elimination order of this DP; a
Transformer's GELU keeps five element-wise forward values open until their
backward ops (160,000 cut states on GPT-12, far past the cap).
``solve_axis`` therefore runs the same minimization in the order
``tofu_tf.search.elimination`` picks (backward ops first: tables of a few
thousand entries), which also solves each repeated block once; the cut DP
above (``solve_by_cuts``) remains the fallback and the reference.

**Memory budget.** The budget enters as a Lagrange multiplier :math:`\lambda`
on each option's memory; ``tofu_tf.search.api`` bisects :math:`\lambda` until
the exact liveness peak (``tofu_tf.cost.memory``) fits, then refines it per mesh
and per axis (:math:`\lambda_k \in \{0, \lambda\}`, :math:`\lambda` bisected per
mesh and subset of axes): a budget is often best met by spending memory on one
axis and none on another.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import numpy as np

from tofu_tf.search import elimination
from tofu_tf.search.problem import AxisProblem

DEFAULT_MAX_STATES = 256


@dataclasses.dataclass(frozen=True)
class AxisSolution:
    """Option index per node, the objective reached, whether it is proved optimal, and the
    largest DP state (cut states, or entries of the largest elimination table)."""

    choice: tuple[int, ...]
    objective: float
    exact: bool
    max_states: int
    incumbents: tuple[tuple[float, float], ...] = ()   # ILP: (seconds, objective) of each improving solution


@dataclasses.dataclass(frozen=True)
class _EdgeCodes:
    """An edge's cost table indexed by split classes: options of ``u`` (``v``) with
    identical cost rows (columns) share a class, so the DP state stays small."""

    u: int
    v: int
    u_codes: tuple[int, ...]
    v_codes: tuple[int, ...]
    table: tuple[tuple[float, ...], ...]


def _codes(edge) -> _EdgeCodes:
    rows, u_codes = np.unique(edge.cost, axis=0, return_inverse=True)
    table, v_codes = np.unique(rows, axis=1, return_inverse=True)
    return _EdgeCodes(edge.u, edge.v, tuple(int(c) for c in np.ravel(u_codes)),
                      tuple(int(c) for c in np.ravel(v_codes)), tuple(map(tuple, table.tolist())))


def solve_axis(problem: AxisProblem, lam: float = 0.0, *, max_states: int = DEFAULT_MAX_STATES,
               max_entries: int = elimination.DEFAULT_MAX_ENTRIES,
               too_wide: Callable[[AxisProblem, float], AxisSolution] | None = None) -> AxisSolution:
    """Minimize ``problem``'s objective (communication + ``lam`` * memory) exactly.

    The same DP in the elimination order of ``tofu_tf.search.elimination`` (identical
    blocks solved once). A problem whose tables would pass ``max_entries`` entries in
    that order has no small elimination order at all in practice: an unrolled RNN,
    where each of a layer's timesteps reads the layer's weights, keeps every weight
    of every layer in the tables. Such a problem goes to ``too_wide`` (the planner
    passes HiGHS on the same problem, ``tofu_tf.search.ilp``), whose answer is taken
    when it proves it optimal; otherwise the forward-order cut DP below, capped at
    ``max_states`` states, and the better of the two. (The capped cut DP alone was
    137% above the proved optimum on a 4-layer LSTM unrolled over 16 steps.)"""
    found = solve_by_elimination(problem, lam, max_entries=max_entries)
    if found is not None:
        return found
    return solve_too_wide(problem, lam, max_states=max_states, too_wide=too_wide)


def solve_by_elimination(problem: AxisProblem, lam: float = 0.0, *,
                         max_entries: int = elimination.DEFAULT_MAX_ENTRIES) -> AxisSolution | None:
    """The exact minimum by elimination, or None when its tables would pass ``max_entries``."""
    found = elimination.solve(problem, lam, max_entries=max_entries)
    if found is None:
        return None
    return AxisSolution(found.choice, found.objective, True, found.widest)


def solve_too_wide(problem: AxisProblem, lam: float = 0.0, *, max_states: int = DEFAULT_MAX_STATES,
                   too_wide: Callable[[AxisProblem, float], AxisSolution] | None = None) -> AxisSolution:
    """``solve_axis`` for a problem elimination cannot solve: ``too_wide``'s answer when it
    proves it optimal, else the better of it and the capped cut DP."""
    other = too_wide(problem, lam) if too_wide is not None else None
    if other is not None and other.exact:
        return other
    cuts = solve_by_cuts(problem, lam, max_states=max_states)
    return cuts if other is None or cuts.objective <= other.objective else other


def solve_by_cuts(problem: AxisProblem, lam: float = 0.0, *, max_states: int = DEFAULT_MAX_STATES) -> AxisSolution:
    """Minimize ``problem``'s objective by the forward-order cut DP above."""
    edges = [_codes(e) for e in problem.edges]
    opening: list[list[int]] = [[] for _ in problem.nodes]
    for index, edge in enumerate(edges):
        opening[edge.u].append(index)
    open_edges: list[int] = []
    states: dict[tuple, float] = {(): 0.0}
    back: list[dict[tuple, tuple[tuple, int]]] = []
    exact, widest = True, 1
    for i, node in enumerate(problem.nodes):
        closing = [p for p, e in enumerate(open_edges) if edges[e].v == i]
        keep = [p for p, e in enumerate(open_edges) if edges[e].v != i]
        groups = _option_groups(problem, i, lam, [edges[open_edges[p]] for p in closing],
                                [edges[e] for e in opening[i]])
        tables = [edges[open_edges[p]].table for p in closing]
        new_states: dict[tuple, float] = {}
        pointers: dict[tuple, tuple[tuple, int]] = {}
        for key, cost in states.items():
            kept = tuple(key[p] for p in keep)
            codes = [key[p] for p in closing]
            for (sig_in, sig_out), (value, option) in groups.items():
                total = cost + value
                for table, row, col in zip(tables, codes, sig_in):
                    total += table[row][col]
                new_key = kept + sig_out
                if total < new_states.get(new_key, np.inf):
                    new_states[new_key] = total
                    pointers[new_key] = (key, option)
        if len(new_states) > max_states:
            exact = False
            best = sorted(new_states, key=new_states.get)[:max_states]
            new_states = {k: new_states[k] for k in best}
        widest = max(widest, len(new_states))
        states = new_states
        back.append(pointers)
        open_edges = [open_edges[p] for p in keep] + opening[i]
    (final_key, objective), = states.items()
    return AxisSolution(_trace_back(back, final_key), float(objective), exact, widest)


def _option_groups(problem: AxisProblem, i: int, lam: float, closing: Sequence[_EdgeCodes],
                   opening: Sequence[_EdgeCodes]) -> dict[tuple, tuple[float, int]]:
    """Options of node ``i`` that look the same across the cut, keeping the cheapest."""
    values = problem.unary[i] + lam * problem.memory[i]
    groups: dict[tuple, tuple[float, int]] = {}
    for option in range(len(problem.nodes[i].options)):
        sig = (tuple(e.v_codes[option] for e in closing), tuple(e.u_codes[option] for e in opening))
        value = float(values[option])
        if sig not in groups or value < groups[sig][0]:
            groups[sig] = (value, option)
    return groups


def _trace_back(back: list[dict[tuple, tuple[tuple, int]]], key: tuple) -> tuple[int, ...]:
    choice = [0] * len(back)
    for i in range(len(back) - 1, -1, -1):
        key, choice[i] = back[i][key]
    return tuple(choice)
