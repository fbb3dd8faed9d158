"""Tofu's DP is exact: it equals brute force (and the ILP) on small problems."""

import itertools

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from tests.search_helpers import GraphBuilder, mlp_graph, stub_strategies

from tofu_tf.cost.hardware import H100_NVLINK
from tofu_tf.search import elimination, ilp, tofu_dp
from tofu_tf.search.coarsen import GraphIndex
from tofu_tf.search.problem import AxisProblem, Edge, Node, Option, ProblemBuilder


def _brute_force(problem: AxisProblem, lam: float) -> float:
    ranges = [range(len(n.options)) for n in problem.nodes]
    return min(problem.objective(choice, lam) for choice in itertools.product(*ranges))


@st.composite
def random_problems(draw):
    """Arbitrary pairwise problems (not only chains): up to 7 nodes, 1-3 options each."""
    num = draw(st.integers(1, 7))
    sizes = [draw(st.integers(1, 3)) for _ in range(num)]
    nodes = tuple(Node(f"n{i}", tuple(Option(str(a), (), None, 0.0, 0.0) for a in range(s)))
                  for i, s in enumerate(sizes))
    pairs = [(u, v) for u in range(num) for v in range(u + 1, num)]
    chosen = draw(st.lists(st.sampled_from(pairs), unique=True, max_size=len(pairs))) if pairs else []
    cost = st.floats(0, 10, allow_nan=False)
    edges = tuple(Edge(u, v, np.asarray([[draw(cost) for _ in range(sizes[v])] for _ in range(sizes[u])]))
                  for u, v in sorted(chosen))
    unary = tuple(np.asarray([draw(cost) for _ in range(s)]) for s in sizes)
    memory = tuple(np.asarray([draw(cost) for _ in range(s)]) for s in sizes)
    return AxisProblem(nodes, edges, unary, memory)


@settings(max_examples=150, deadline=None)
@given(random_problems(), st.sampled_from([0.0, 0.5]))
def test_dp_equals_brute_force_on_random_problems(problem, lam):
    solution = tofu_dp.solve_axis(problem, lam)
    assert solution.exact
    assert abs(solution.objective - problem.objective(solution.choice, lam)) < 1e-9
    best = _brute_force(problem, lam)
    assert abs(solution.objective - best) < 1e-9
    cuts = tofu_dp.solve_by_cuts(problem, lam, max_states=10_000)      # the forward-order reference
    assert cuts.exact and abs(cuts.objective - best) < 1e-9


def test_too_wide_elimination_falls_back_to_the_cut_dp():
    problem = ProblemBuilder(GraphIndex(mlp_graph(), stub_strategies), (), 4, H100_NVLINK.intra_node).build()
    assert elimination.solve(problem, max_entries=1) is None
    fallback = tofu_dp.solve_axis(problem, max_entries=1, max_states=10_000)
    assert fallback.exact and abs(fallback.objective - tofu_dp.solve_axis(problem).objective) < 1e-15


@settings(max_examples=60, deadline=None)
@given(random_problems(), st.integers(0, 2**32 - 1))
def test_a_known_structure_replays_its_order_and_stays_exact(problem, seed):
    """The second problem of a structure (same option counts and edges, other costs) reuses
    the first one's elimination order, with no greedy search, and is still the optimum."""
    rng = np.random.default_rng(seed)
    other = AxisProblem(problem.nodes, tuple(Edge(e.u, e.v, rng.uniform(0, 10, e.cost.shape)) for e in problem.edges),
                        tuple(rng.uniform(0, 10, u.shape) for u in problem.unary), problem.memory)
    elimination.solve(problem)
    greedy_calls = []
    original = elimination._Factors.eliminate_greedily
    elimination._Factors.eliminate_greedily = lambda self, c: greedy_calls.append(c) or original(self, c)
    try:
        solution = elimination.solve(other)
    finally:
        elimination._Factors.eliminate_greedily = original
    assert not greedy_calls
    assert abs(solution.objective - _brute_force(other, 0.0)) < 1e-9
    assert abs(other.objective(solution.choice, 0.0) - solution.objective) < 1e-9


def test_a_structure_too_wide_once_is_refused_without_eliminating():
    problem = ProblemBuilder(GraphIndex(mlp_graph(), stub_strategies), (), 4, H100_NVLINK.intra_node).build()
    assert elimination.solve(problem, max_entries=1) is None
    original = elimination._Factors.eliminate
    elimination._Factors.eliminate = lambda self, x: pytest.fail("eliminated a node of a known too-wide structure")
    try:
        assert elimination.solve(problem, max_entries=1) is None
    finally:
        elimination._Factors.eliminate = original
    assert elimination.solve(problem) is not None


@settings(max_examples=40, deadline=None)
@given(random_problems(), st.sampled_from([0.0, 0.5]))
def test_too_wide_problems_go_to_the_ilp_and_keep_its_proved_optimum(problem, lam):
    """Where elimination's tables are too wide, the planner's HiGHS pass answers
    (proved optimal), not the capped cut DP."""
    solution = tofu_dp.solve_axis(problem, lam, max_entries=0, max_states=1,
                                  too_wide=lambda p, l: ilp.solve_axis(p, l))
    assert solution.exact
    best = _brute_force(problem, lam)
    assert abs(solution.objective - best) < 1e-6 * max(1.0, abs(best))      # HiGHS's feasibility tolerance


def test_an_unproved_wide_solution_loses_to_a_better_cut_dp():
    problem = ProblemBuilder(GraphIndex(mlp_graph(), stub_strategies), (), 4, H100_NVLINK.intra_node).build()
    best = tofu_dp.solve_axis(problem)
    worst = max(range(len(problem.nodes[0].options)), key=lambda a: problem.objective((a,) + best.choice[1:], 0.0))
    choice = (worst,) + best.choice[1:]
    poor = tofu_dp.AxisSolution(choice, problem.objective(choice, 0.0), False, 0)
    assert poor.objective > best.objective
    chosen = tofu_dp.solve_axis(problem, max_entries=0, max_states=10_000, too_wide=lambda p, l: poor)
    assert chosen.exact and abs(chosen.objective - best.objective) < 1e-15
    assert tofu_dp.solve_axis(problem, max_entries=0, max_states=10_000, too_wide=lambda p, l: None).exact


@st.composite
def random_graphs(draw):
    """Random MLP-shaped training steps (forward, backward, update) with random widths."""
    depth = draw(st.integers(1, 2))
    widths = tuple(draw(st.sampled_from([4, 8, 12])) for _ in range(depth + 1))
    return mlp_graph(batch=draw(st.sampled_from([4, 8])), widths=widths)


@settings(max_examples=15, deadline=None)
@given(random_graphs(), st.sampled_from([2, 4]), st.sampled_from([0.0, 1e-9]))
def test_dp_equals_brute_force_on_random_graphs(graph, n, lam):
    problem = ProblemBuilder(GraphIndex(graph, stub_strategies), (), n, H100_NVLINK.intra_node).build()
    if np.prod([len(node.options) for node in problem.nodes]) > 4_000:
        return
    solution = tofu_dp.solve_axis(problem, lam)
    assert abs(solution.objective - _brute_force(problem, lam)) <= 1e-12 + 1e-9 * solution.objective


def test_ilp_matches_dp_and_proves_optimality():
    problem = ProblemBuilder(GraphIndex(mlp_graph(), stub_strategies), (), 4, H100_NVLINK.intra_node).build()
    for lam in (0.0, 1e-9):
        dp, exact = tofu_dp.solve_axis(problem, lam), ilp.solve_axis(problem, lam)
        assert exact.exact and abs(dp.objective - exact.objective) <= 1e-9 * max(dp.objective, 1e-12)


def test_state_cap_flags_inexact_results():
    b = GraphBuilder()
    x = b.input("x", (8, 8))
    outs = [b.op(f"r{i}", "Relu", (x,), [(8, 8)]) for i in range(6)]
    b.op("sum", "AddN", tuple(outs), [(8, 8)])
    problem = ProblemBuilder(GraphIndex(b.build(), stub_strategies), (), 2, H100_NVLINK.intra_node).build()
    assert not tofu_dp.solve_by_cuts(problem, max_states=2).exact
    assert tofu_dp.solve_by_cuts(problem, max_states=10_000).exact


def test_ilp_reports_incumbents_and_stops_at_a_target(monkeypatch):
    import sys
    problem = ProblemBuilder(GraphIndex(mlp_graph(), stub_strategies), (), 4, H100_NVLINK.intra_node).build()
    dp = tofu_dp.solve_axis(problem)
    solved = ilp.solve_axis(problem, stop_at=dp.objective * (1 + 1e-9))
    assert solved.incumbents and solved.incumbents[-1][1] <= dp.objective * (1 + 1e-6)
    assert all(t >= 0 for t, _ in solved.incumbents)
    monkeypatch.setitem(sys.modules, "highspy", None)        # scipy's HiGHS: same answer, no timeline
    plain = ilp.solve_axis(problem)
    assert plain.exact and plain.incumbents == ()
    assert abs(plain.objective - dp.objective) <= 1e-9 * max(dp.objective, 1e-12)


def test_ilp_prints_nothing():
    """HiGHS prints a banner on its first construction in a process, from C; tofu hands HiGHS
    wide axes while a user's script trains, so the solve must keep stdout clean. A fresh
    process, so that no earlier test has already printed (and used up) the banner."""
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = ("from tests.search_helpers import mlp_graph, stub_strategies\n"
              "from tofu_tf.cost.hardware import H100_NVLINK\n"
              "from tofu_tf.search import ilp\n"
              "from tofu_tf.search.coarsen import GraphIndex\n"
              "from tofu_tf.search.problem import ProblemBuilder\n"
              "problem = ProblemBuilder(GraphIndex(mlp_graph(), stub_strategies), (), 4,"
              " H100_NVLINK.intra_node).build()\n"
              "assert ilp.solve_axis(problem).exact\n")
    out = subprocess.run([sys.executable, "-c", script], cwd=root, env=dict(os.environ, PYTHONPATH=root),
                         capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout == ""


@settings(max_examples=60, deadline=None)
@given(random_problems(), st.sampled_from([0.0, 0.5]))
def test_the_relaxation_bounds_the_optimum_and_an_integral_one_is_the_optimum(problem, lam):
    relaxation = ilp.solve_relaxation(problem, lam)
    best = _brute_force(problem, lam)
    tolerance = 1e-6 * max(1.0, abs(best))          # HiGHS's feasibility tolerance, as below
    assert relaxation.bound <= best + tolerance
    if relaxation.integral is not None:
        assert relaxation.integral.exact
        assert abs(relaxation.integral.objective - best) < tolerance


@settings(max_examples=60, deadline=None)
@given(random_problems(), st.integers(0, 2**32 - 1), st.sampled_from([0.0, 0.5]))
def test_a_relaxation_started_from_another_costs_basis_is_the_cold_optimum(problem, seed, lam):
    """The relaxation of a structure solved before starts from that solve's basis; its
    bound is the cold solve's, and an integral one is the optimum."""
    rng = np.random.default_rng(seed)
    other = AxisProblem(problem.nodes, tuple(Edge(e.u, e.v, rng.uniform(0, 10, e.cost.shape)) for e in problem.edges),
                        tuple(rng.uniform(0, 10, u.shape) for u in problem.unary),
                        tuple(rng.uniform(0, 10, m.shape) for m in problem.memory))
    ilp.solve_relaxation(problem, lam)
    warm = ilp.solve_relaxation(other, lam)
    saved, ilp._WARM = ilp._WARM, ilp._WarmStarts()
    try:
        cold = ilp.solve_relaxation(other, lam)
    finally:
        ilp._WARM = saved
    assert abs(warm.bound - cold.bound) < 1e-7
    best = _brute_force(other, lam)
    assert warm.bound <= best + 1e-7
    if warm.integral is not None:
        assert abs(warm.integral.objective - best) < 1e-7


@settings(max_examples=40, deadline=None)
@given(random_problems(), st.sampled_from([0.0, 0.5]))
def test_a_too_wide_problem_is_dropped_only_where_it_cannot_beat_the_other_role(problem, lam):
    """The planner solves a problem elimination cannot (too wide) after the other role's, and
    drops it where its relaxation's bound shows it cannot win; otherwise it is solved exactly."""
    from tofu_tf.search.api import _solve_too_wide
    best = _brute_force(problem, lam)
    for beat in (best - 1.0, best, best + 1.0, float("inf")):
        found = _solve_too_wide(problem, lam, beat, max_states=1, time_limit_s=10.0)
        # HiGHS accepts an optimum within its feasibility tolerance (about 1e-7): objectives are
        # compared to that, not to float equality.
        tolerance = 1e-6 * max(1.0, abs(best))
        if found is None:
            assert best > beat - tolerance                  # dropped: no solution below beat exists
        else:
            assert found.exact and abs(found.objective - best) < tolerance
    assert _solve_too_wide(problem, lam, float("inf"), max_states=1, time_limit_s=10.0) is not None


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_a_large_table_is_minimized_option_by_option_as_whole(data):
    """``elimination.min_of_sum`` over a large table (one option's slice of the sum at a
    time) gives the whole table's argmin and min, ties (few distinct values) to the first."""
    rank = data.draw(st.integers(1, 4))
    shape = tuple(data.draw(st.integers(1, 4)) for _ in range(rank + 1))
    tables = []
    for _ in range(data.draw(st.integers(1, 3))):
        present = [True] + [data.draw(st.booleans()) for _ in range(rank)]
        sub = tuple(s if keep else 1 for s, keep in zip(shape, present))
        values = data.draw(st.lists(st.sampled_from([0.0, -0.0, 0.25, 1.0, 3.0, np.inf]),
                                    min_size=int(np.prod(sub)), max_size=int(np.prod(sub))))
        tables.append(np.asarray(values).reshape(sub))
    whole = elimination.min_of_sum(tables, shape, rowwise_entries=1 << 40)
    rowwise = elimination.min_of_sum(tables, shape, rowwise_entries=0)
    np.testing.assert_array_equal(rowwise[0], whole[0])
    np.testing.assert_array_equal(rowwise[1], whole[1])
    total = sum(np.broadcast_to(t, shape) for t in tables)
    np.testing.assert_array_equal(whole[0], total.argmin(axis=0))


def test_a_nan_takes_the_whole_table_path():
    tables = [np.asarray([[1.0, np.nan], [np.nan, 0.0]])]
    argmin, best = elimination.min_of_sum(tables, (2, 2), rowwise_entries=0)
    np.testing.assert_array_equal(argmin, np.asarray([[1.0, np.nan], [np.nan, 0.0]]).argmin(axis=0))


@settings(max_examples=40, deadline=None)
@given(random_problems(), st.sampled_from([0.0, 0.5]))
def test_elimination_with_every_table_minimized_option_by_option_is_unchanged(problem, lam):
    """Same choice and objective, bit for bit, whichever way the tables are minimized."""
    elimination._ORDERS.__init__()
    whole = elimination.solve(problem, lam)
    saved = elimination.ROWWISE_ENTRIES
    elimination.ROWWISE_ENTRIES = 0
    try:
        elimination._ORDERS.__init__()
        rowwise = elimination.solve(problem, lam)
    finally:
        elimination.ROWWISE_ENTRIES = saved
    assert (rowwise.choice, rowwise.objective) == (whole.choice, whole.objective)
