r"""The exact reference: the same per-axis problem as an integer program (HiGHS).

Same decision space and cost model as ``tofu_dp`` (Alpa's formulation of it):
binary :math:`x_{v,a}` picks option :math:`a` of node :math:`v`; for every edge
:math:`(u, v)` a coupling :math:`y_{uv,ab} \ge 0` with marginals
:math:`\sum_b y_{uv,ab} = x_{u,a}` and :math:`\sum_a y_{uv,ab} = x_{v,b}` (with
:math:`x` integral, :math:`y` is forced to the product, so :math:`y` need not be
integral). Minimize

.. math:: \sum_{v,a} (c_v(a) + \lambda m_v(a))\, x_{v,a} + \sum_{uv,ab} w_{uv}(a,b)\, y_{uv,ab}
          \quad \text{s.t.} \quad \sum_a x_{v,a} = 1.

Solved with HiGHS under a time limit; the solution says whether HiGHS proved
optimality. Through ``highspy`` (when installed; ``scipy.optimize.milp`` runs the
same HiGHS otherwise) it also lists every improving solution HiGHS found as
(seconds, objective), so a benchmark can read off when the ILP first matched
another method's objective (``stop_at`` ends the solve there).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import threading
import time

import numpy as np
from scipy import sparse

from tofu_tf.errors import TofuError
from tofu_tf.search.problem import AxisProblem
from tofu_tf.search.tofu_dp import AxisSolution


class ILPError(TofuError, RuntimeError):
    """HiGHS found no feasible solution within the time limit."""


def solve_axis(problem: AxisProblem, lam: float = 0.0, *, time_limit_s: float = 60.0,
               mip_rel_gap: float = 1e-6, stop_at: float | None = None) -> AxisSolution:
    """The exact minimum of ``problem``'s objective (if HiGHS proves it within ``time_limit_s``).

    ``stop_at``: stop as soon as a solution with objective <= ``stop_at`` is found."""
    started = time.perf_counter()
    cost, matrix, rhs, offsets, num_x = _model(problem, lam)
    try:
        import highspy
    except ImportError:
        values, exact, incumbents = _solve_scipy(cost, matrix, rhs, num_x, time_limit_s, mip_rel_gap)
    else:
        values, exact, incumbents = _solve_highspy(highspy, cost, matrix, rhs, num_x, time_limit_s, mip_rel_gap,
                                                   stop_at, started)
    if values is None:
        raise ILPError(f"HiGHS found no solution in {time_limit_s} s; raise time_limit_s")
    choice = tuple(int(np.argmax(values[offsets[i]: offsets[i] + len(node.options)]))
                   for i, node in enumerate(problem.nodes))
    return AxisSolution(choice, problem.objective(choice, lam), exact, 0, incumbents)


def _solve_scipy(cost, matrix, rhs, num_x, time_limit_s, mip_rel_gap):
    from scipy import optimize   # only without highspy: importing it costs most of a second
    integrality = np.zeros(len(cost))
    integrality[:num_x] = 1
    result = optimize.milp(
        cost, constraints=optimize.LinearConstraint(matrix, rhs, rhs), integrality=integrality,
        bounds=optimize.Bounds(0, 1), options={"time_limit": time_limit_s, "mip_rel_gap": mip_rel_gap, "disp": False})
    return result.x, result.status == 0, ()


@dataclasses.dataclass(frozen=True)
class Relaxation:
    """The linear relaxation of an axis problem: a lower bound on its objective, and the
    solution itself when the relaxation's optimum picks one option per node (then it is
    the integer program's optimum too: with integral ``x`` the marginals force ``y``)."""

    bound: float
    integral: AxisSolution | None


def solve_relaxation(problem: AxisProblem, lam: float = 0.0) -> Relaxation | None:
    """The relaxation's optimum (HiGHS' LP solver, no branching), or None without ``highspy``.

    A fraction of the integer program's time: often integral, and otherwise a bound that
    can prove another solution at least as good. A problem with the structure of one
    solved before (``_WarmStarts``) starts from that one's optimal basis."""
    try:
        import highspy
    except ImportError:
        return None
    cost, offsets, num_x = _costs(problem, lam)
    with _WARM.lock:
        highs = _WARM.solver(highspy, problem, cost, lambda: _constraints(problem, offsets, len(cost)), num_x)
        highs.run()
        if highs.getModelStatus() != highspy.HighsModelStatus.kOptimal:
            return None
        values = np.asarray(highs.getSolution().col_value)
        bound = float(highs.getInfo().objective_function_value)
    picks = [values[offsets[i]: offsets[i] + len(node.options)] for i, node in enumerate(problem.nodes)]
    if all(np.max(x) > 1 - 1e-7 for x in picks):
        choice = tuple(int(np.argmax(x)) for x in picks)
        return Relaxation(bound, AxisSolution(choice, problem.objective(choice, lam), True, 0))
    return Relaxation(bound, None)


class _WarmStarts:
    """HiGHS solvers of relaxations already solved, by the problem's structure.

    A search solves the same structure many times (each mesh-shape prefix and role
    builds the graph's nodes and edges again, often with the same option counts):
    same constraint matrix, other costs. HiGHS keeps the optimal basis of its last
    solve, and after a change of costs only its primal simplex runs from there, which
    typically takes a few iterations instead of thousands. Bounded, oldest out."""

    _LIMIT = 8

    def __init__(self):
        self.lock = threading.Lock()
        self._solvers: dict[tuple, object] = {}

    def solver(self, highspy, problem: AxisProblem, cost, constraints, num_x):
        """A solver holding ``problem``'s relaxation (``cost`` set), warm where it can be;
        ``constraints()`` gives the (matrix, right-hand side) a cold one needs."""
        key = problem.structure
        highs = self._solvers.get(key)
        if highs is not None:
            highs.changeColsCost(len(cost), np.arange(len(cost), dtype=np.int32), cost)
            return highs
        with _stdout_silenced():
            highs = highspy.Highs()
        highs.setOptionValue("output_flag", False)
        # HiGHS' presolve finds little to remove in these problems (one equality per node and
        # per edge endpoint) and takes most of a cold solve's time; dual simplex without it is
        # several times faster to the same optimum (bench/README.md, planner table).
        highs.setOptionValue("presolve", "off")
        matrix, rhs = constraints()
        lp = _lp(highspy, cost, matrix, rhs, num_x)
        lp.integrality_ = []
        highs.passModel(lp)
        if len(self._solvers) >= self._LIMIT:
            del self._solvers[next(iter(self._solvers))]
        self._solvers[key] = highs
        return highs


_WARM = _WarmStarts()


def _solve_highspy(highspy, cost, matrix, rhs, num_x, time_limit_s, mip_rel_gap, stop_at, started):
    with _stdout_silenced():
        highs = highspy.Highs()
    highs.setOptionValue("output_flag", False)
    highs.setOptionValue("time_limit", float(time_limit_s))
    highs.setOptionValue("mip_rel_gap", float(mip_rel_gap))
    highs.passModel(_lp(highspy, cost, matrix, rhs, num_x))
    incumbents: list[tuple[float, float]] = []

    def improved(event):
        incumbents.append((time.perf_counter() - started, float(event.data_out.objective_function_value)))

    def interrupt(event):
        if stop_at is not None and incumbents and incumbents[-1][1] <= stop_at:
            event.interrupt()
    highs.cbMipImprovingSolution.subscribe(improved)
    highs.cbMipInterrupt.subscribe(interrupt)
    highs.run()
    optimal = highs.getModelStatus() == highspy.HighsModelStatus.kOptimal
    values = np.asarray(highs.getSolution().col_value)
    if len(values) != len(cost) or not (optimal or incumbents):
        return None, False, tuple(incumbents)
    return values, optimal, tuple(incumbents)


def _model(problem: AxisProblem, lam: float):
    cost, offsets, num_x = _costs(problem, lam)
    matrix, rhs = _constraints(problem, offsets, len(cost))
    return cost, matrix, rhs, offsets, num_x


def _costs(problem: AxisProblem, lam: float):
    """The objective's coefficients: an ``x`` per node option, then a ``y`` per edge entry
    (row-major); with the offset of each node's first ``x`` and the number of ``x``."""
    parts = [problem.unary[i] + lam * problem.memory[i] for i in range(len(problem.nodes))]
    offsets = np.cumsum([0] + [len(part) for part in parts[:-1]]).tolist() if parts else []
    num_x = sum(len(part) for part in parts)
    parts += [edge.cost.ravel() for edge in problem.edges]
    cost = np.concatenate(parts).astype(np.float64, copy=False) if parts else np.zeros(0)
    return cost, offsets, num_x


def _constraints(problem: AxisProblem, offsets, num_cols: int):
    """One option per node (``sum_a x_a = 1``), and each edge's ``y`` marginals equal to
    its ends' ``x``: a function of the problem's structure only."""
    rows, cols, vals, rhs = [], [], [], []
    for i, node in enumerate(problem.nodes):
        row = len(rhs)
        for a in range(len(node.options)):
            rows.append(row), cols.append(offsets[i] + a), vals.append(1.0)
        rhs.append(1.0)
    base = sum(len(node.options) for node in problem.nodes)
    for edge in problem.edges:
        nu, nv = edge.cost.shape
        for a in range(nu):                      # sum_b y_ab - x_ua = 0
            row = len(rhs)
            rows.extend([row] * (nv + 1)), cols.extend([base + a * nv + b for b in range(nv)] + [offsets[edge.u] + a])
            vals.extend([1.0] * nv + [-1.0]), rhs.append(0.0)
        for b in range(nv):                      # sum_a y_ab - x_vb = 0
            row = len(rhs)
            rows.extend([row] * (nu + 1)), cols.extend([base + a * nv + b for a in range(nu)] + [offsets[edge.v] + b])
            vals.extend([1.0] * nu + [-1.0]), rhs.append(0.0)
        base += nu * nv
    matrix = sparse.csc_array((vals, (rows, cols)), shape=(len(rhs), num_cols))
    return matrix, np.asarray(rhs, dtype=np.float64)


@contextlib.contextmanager
def _stdout_silenced():
    """Drop what C code writes to stdout meanwhile.

    The first ``highspy.Highs()`` of a process prints HiGHS' banner before any
    option can turn output off, into the output of a user's training script
    (tofu hands HiGHS the axis problems too wide for elimination)."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 1)
            yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)


def _lp(highspy, cost: np.ndarray, matrix: sparse.csc_array, rhs: np.ndarray, num_x: int):
    lp = highspy.HighsLp()
    lp.num_col_, lp.num_row_ = len(cost), len(rhs)
    lp.col_cost_ = cost
    lp.col_lower_, lp.col_upper_ = np.zeros(len(cost)), np.ones(len(cost))
    lp.row_lower_ = lp.row_upper_ = rhs
    lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
    lp.a_matrix_.start_, lp.a_matrix_.index_, lp.a_matrix_.value_ = matrix.indptr, matrix.indices, matrix.data
    lp.a_matrix_.num_col_, lp.a_matrix_.num_row_ = len(cost), len(rhs)
    lp.integrality_ = [highspy.HighsVarType.kInteger] * num_x + [highspy.HighsVarType.kContinuous] * (len(cost) - num_x)
    return lp
