r"""The exact reference: the same per-axis problem as an integer program (HiGHS).

Same decision space and cost model as ``tofu_dp`` (Alpa's formulation of it):
binary :math:`x_{v,a}` picks option :math:`a` of node :math:`v`; for every edge
:math:`(u, v)` a coupling :math:`y_{uv,ab} \ge 0` with marginals
:math:`\sum_b y_{uv,ab} = x_{u,a}` and :math:`\sum_a y_{uv,ab} = x_{v,b}` (with
:math:`x` integral, :math:`y` is forced to the product, so :math:`y` need not be
integral). Minimize

.. math:: \sum_{v,a} (c_v(a) + \lambda m_v(a))\, x_{v,a} + \sum_{uv,ab} w_{uv}(a,b)\, y_{uv,ab}
          \quad \text{s.t.} \quad \sum_a x_{v,a} = 1.

Solved with ``scipy.optimize.milp`` (HiGHS) under a time limit; the solution
says whether HiGHS proved optimality.
"""

from __future__ import annotations

import numpy as np
from scipy import optimize, sparse

from tofu_tf.search.problem import AxisProblem
from tofu_tf.search.tofu_dp import AxisSolution


class ILPError(RuntimeError):
    """HiGHS found no feasible solution within the time limit."""


def solve_axis(problem: AxisProblem, lam: float = 0.0, *, time_limit_s: float = 60.0,
               mip_rel_gap: float = 1e-6) -> AxisSolution:
    offsets, cost = [], []
    for i, node in enumerate(problem.nodes):
        offsets.append(len(cost))
        cost.extend(problem.unary[i] + lam * problem.memory[i])
    num_x = len(cost)
    rows, cols, vals, rhs = [], [], [], []
    for i, node in enumerate(problem.nodes):
        row = len(rhs)
        for a in range(len(node.options)):
            rows.append(row), cols.append(offsets[i] + a), vals.append(1.0)
        rhs.append(1.0)
    for edge in problem.edges:
        base = len(cost)
        nu, nv = edge.cost.shape
        cost.extend(edge.cost.ravel())
        for a in range(nu):                      # sum_b y_ab - x_ua = 0
            row = len(rhs)
            rows.extend([row] * (nv + 1)), cols.extend([base + a * nv + b for b in range(nv)] + [offsets[edge.u] + a])
            vals.extend([1.0] * nv + [-1.0]), rhs.append(0.0)
        for b in range(nv):                      # sum_a y_ab - x_vb = 0
            row = len(rhs)
            rows.extend([row] * (nu + 1)), cols.extend([base + a * nv + b for a in range(nu)] + [offsets[edge.v] + b])
            vals.extend([1.0] * nu + [-1.0]), rhs.append(0.0)
    matrix = sparse.csr_array((vals, (rows, cols)), shape=(len(rhs), len(cost)))
    integrality = np.zeros(len(cost))
    integrality[:num_x] = 1
    result = optimize.milp(
        np.asarray(cost), constraints=optimize.LinearConstraint(matrix, rhs, rhs), integrality=integrality,
        bounds=optimize.Bounds(0, 1),
        options={"time_limit": time_limit_s, "mip_rel_gap": mip_rel_gap, "disp": False})
    if result.x is None:
        raise ILPError(f"HiGHS found no solution in {time_limit_s} s ({result.message}); raise time_limit_s")
    choice = tuple(int(np.argmax(result.x[offsets[i]: offsets[i] + len(node.options)]))
                   for i, node in enumerate(problem.nodes))
    return AxisSolution(choice, problem.objective(choice, lam), result.status == 0, 0)
