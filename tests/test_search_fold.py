"""Repeated blocks: found where layers repeat, and folding never changes the optimum."""

import itertools

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from tests.search_helpers import mlp_graph, stub_strategies

from tofu_tf.cost.hardware import H100_NVLINK
from tofu_tf.search import elimination, tofu_dp
from tofu_tf.search.coarsen import GraphIndex
from tofu_tf.search.problem import AxisDecision, AxisProblem, Blocks, Edge, Node, Option, ProblemBuilder

LINK = H100_NVLINK.intra_node


def _deep_mlp():
    return mlp_graph(batch=8, widths=(8,) * 8)


def test_identical_layers_form_a_run_of_blocks():
    index = GraphIndex(_deep_mlp(), stub_strategies)
    run = index.run
    assert run is not None and run.count >= 3
    names = index.node_names()
    first = names[run.start: run.start + run.period]
    second = names[run.start + run.period: run.start + 2 * run.period]
    def kind(name):
        return "var" if name.startswith("var:") else index.ops[name].type
    assert [kind(n) for n in first] == [kind(n) for n in second]
    assert first != second
    assert GraphIndex(mlp_graph(widths=(16, 32, 8)), stub_strategies).run is None


@pytest.mark.parametrize("sizes", [(4,), (2, 2), (2, 4)])
def test_folded_problems_solve_to_the_unfolded_optimum(sizes):
    """Axis by axis, the folded build and solve reach the same objective as the unfolded one."""
    graph = _deep_mlp()
    folded, plain = GraphIndex(graph, stub_strategies), GraphIndex(graph, stub_strategies, fold_blocks=False)
    prior_f, prior_p = [], []
    for n in sizes:
        pf = ProblemBuilder(folded, prior_f, n, LINK).build()
        pp = ProblemBuilder(plain, prior_p, n, LINK).build()
        assert pf.blocks is not None and pp.blocks is None
        for lam in (0.0, 1e-9):
            sf, sp = tofu_dp.solve_axis(pf, lam), tofu_dp.solve_by_cuts(pp, lam, max_states=100_000)
            assert sp.exact
            assert sf.objective == pytest.approx(sp.objective, rel=1e-12)
            assert pf.objective(sf.choice, lam) == pytest.approx(sf.objective, rel=1e-12)
            assert pp.objective(sf.choice, lam) == pytest.approx(sf.objective, rel=1e-12)
        result = elimination.solve(pf, 0.0)
        assert result.folded_blocks >= 1
        prior_f.append(AxisDecision.of(pf, sf.choice, n))
        prior_p.append(AxisDecision.of(pp, sf.choice, n))


def test_a_block_with_different_costs_is_not_folded():
    graph = _deep_mlp()
    problem = ProblemBuilder(GraphIndex(graph, stub_strategies), (), 4, LINK).build()
    blocks = problem.blocks
    changed = list(problem.unary)
    target = blocks.start + blocks.period * (len(blocks.templates) - 1)   # first node of the last block
    changed[target] = changed[target] + np.arange(len(changed[target])) * 1e-3
    altered = AxisProblem(problem.nodes, problem.edges, tuple(changed), problem.memory, blocks)
    folded = elimination.solve(altered, 0.0)
    reference = tofu_dp.solve_by_cuts(altered, 0.0, max_states=100_000)
    assert folded.objective == pytest.approx(reference.objective, rel=1e-12)
    assert folded.folded_blocks == elimination.solve(problem, 0.0).folded_blocks - 1


@st.composite
def repeated_problems(draw):
    """Random blocks repeated 2-3 times (shared arrays), random edges between neighbours,
    random extra nodes before and after, and sometimes one block's costs perturbed."""
    period, count = draw(st.integers(1, 3)), draw(st.integers(2, 3))
    sizes = [draw(st.integers(1, 3)) for _ in range(period)]
    cost = st.floats(0, 10, allow_nan=False)
    block_unary = [np.asarray([draw(cost) for _ in range(s)]) for s in sizes]
    inner = [(u, v) for u in range(period) for v in range(u + 1, period)]
    inner = draw(st.lists(st.sampled_from(inner), unique=True)) if inner else []
    inner_cost = {e: np.asarray([[draw(cost) for _ in range(sizes[e[1]])] for _ in range(sizes[e[0]])]) for e in inner}
    cross = draw(st.lists(st.tuples(st.integers(0, period - 1), st.integers(0, period - 1)), unique=True, max_size=2))
    cross_cost = {e: np.asarray([[draw(cost) for _ in range(sizes[e[1]])] for _ in range(sizes[e[0]])]) for e in cross}
    head = draw(st.integers(0, 1))
    total = head + period * count
    all_sizes = [2] * head + sizes * count
    unary = [np.asarray([draw(cost) for _ in range(2)]) for _ in range(head)] + block_unary * count
    if draw(st.booleans()):
        k = head + draw(st.integers(0, total - head - 1))
        unary[k] = unary[k] + 1.0
    edges = {}
    for b in range(count):
        base = head + b * period
        for (u, v), c in inner_cost.items():
            edges[base + u, base + v] = c
        if b + 1 < count:
            for (u, v), c in cross_cost.items():
                edges[base + u, base + period + v] = c
    if head:
        v = head + draw(st.integers(0, period - 1))
        edges[0, v] = np.asarray([[draw(cost) for _ in range(all_sizes[v])] for _ in range(2)])
    nodes = tuple(Node(f"n{i}", tuple(Option(str(a), (), None, 0.0, 0.0) for a in range(s)))
                  for i, s in enumerate(all_sizes))
    memory = tuple(np.zeros(s) for s in all_sizes)
    return AxisProblem(nodes, tuple(Edge(u, v, c) for (u, v), c in sorted(edges.items())), tuple(unary), memory,
                       Blocks(head, period, (0,) * count))


@settings(max_examples=120, deadline=None)
@given(repeated_problems())
def test_folding_equals_brute_force(problem):
    solution = elimination.solve(problem, 0.0)
    ranges = [range(len(n.options)) for n in problem.nodes]
    best = min(problem.objective(c, 0.0) for c in itertools.product(*ranges))
    assert solution.objective == pytest.approx(best, abs=1e-9)
    assert problem.objective(solution.choice, 0.0) == pytest.approx(best, abs=1e-9)


@pytest.fixture(scope="module")
def tiny_gpt():
    """A captured 3-block GPT train step (Adam): gradient ties, scalar reads, repeated blocks."""
    from tofu_tf import models
    from tofu_tf.tf.capture import capture_training_step
    model = models.gpt(num_layers=3, d_model=16, num_heads=2, seq_len=8, vocab_size=32)
    return capture_training_step(model, batch_size=8, loss="sparse_categorical_crossentropy", optimizer="adam")


def test_captured_gpt_blocks_fold_and_solve_to_the_unfolded_optimum(tiny_gpt):
    from tofu_tf.cost.evaluate import op_work_seconds
    from tofu_tf.semantics import strategies
    work = op_work_seconds(tiny_gpt, H100_NVLINK)
    folded = GraphIndex(tiny_gpt, strategies, work=work)
    plain = GraphIndex(tiny_gpt, strategies, work=work, fold_blocks=False)
    assert folded.run is not None and folded.run.count == 3
    for n in (2, 4):
        pf = ProblemBuilder(folded, (), n, LINK).build()
        pp = ProblemBuilder(plain, (), n, LINK).build()
        sf, sp = tofu_dp.solve_axis(pf), tofu_dp.solve_axis(pp)
        assert sf.exact and sp.exact
        assert sf.objective == pytest.approx(sp.objective, rel=1e-12)
        assert pp.objective(sf.choice, 0.0) == pytest.approx(sf.objective, rel=1e-12)


@pytest.mark.parametrize("sizes", [(8,), (2, 4)])
def test_captured_gpt_plan_cost_equals_the_search_on_one_axis_and_never_less_on_more(tiny_gpt, sizes):
    """On one axis the search's objective is the priced plan (communication and compute);
    on more axes it can only overestimate the communication, never the compute."""
    from tofu_tf.search import api
    seen = []
    real = AxisDecision.of

    def spy(problem, choice, size):
        seen.append((problem.comm(choice), problem.compute(choice)))
        return real(problem, choice, size)
    api.AxisDecision.of = spy
    try:
        plan = api.plan_graph(tiny_gpt, num_devices=8, mesh_shape=sizes, target="ideal")
    finally:
        api.AxisDecision.of = real
    comm, compute = sum(c for c, _ in seen), seen[-1][1]
    assert plan.compute_seconds == pytest.approx(compute, rel=1e-12)
    if len(sizes) == 1:
        assert plan.comm_seconds == pytest.approx(comm, rel=1e-12)
    else:
        assert plan.comm_seconds <= comm * (1 + 1e-12)
