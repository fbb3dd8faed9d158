"""Planning under a memory budget (issue #38 item 1): tofu's search against references.

The references here solve the same per-axis problems as the search does, but by brute
force over a grid of per-axis Lagrange multipliers (each axis its own), so they see
plans that one multiplier for every axis misses: a budget met by spending memory on
one axis and none on another."""

import itertools

import pytest

from tofu_tf.cost.evaluate import StepPricer, op_work_seconds
from tofu_tf.cost.hardware import H100_NVLINK
from tofu_tf.cost.memory import Liveness
from tofu_tf.mesh import MeshSpec
from tofu_tf.search import plan_graph, tofu_dp
from tofu_tf.search.coarsen import GraphIndex
from tofu_tf.search.problem import AxisDecision, ProblemBuilder
from tofu_tf.search.targets import Target, axis_roles, pinned_variables, restrict_provider, unsplit_variable_dims
from tofu_tf.semantics import strategies

GRID = (0.0, 1e-12, 1e-11, 3e-11, 1e-10, 3e-10, 1e-9, 1e-8)   # seconds per byte


@pytest.fixture(scope="module")
def tiny_gpt():
    """The issue's model: a 2-layer tf-keras GPT (d_model 64, 4 heads, seq 32, vocab 256), batch 16, Adam."""
    from tofu_tf import models
    from tofu_tf.tf.capture import capture_training_step
    return capture_training_step(models.gpt(num_layers=2, d_model=64, num_heads=4, seq_len=32, vocab_size=256),
                                 batch_size=16, loss="sparse_categorical_crossentropy", optimizer="adam")


def _grid_reference(graph, sizes, budget) -> float:
    """The least modeled step (``cost.evaluate``) within ``budget`` over every vector of
    per-axis multipliers from ``GRID``: each axis solved exactly by the DP at its own
    multiplier, in each DTensor role, the cheaper kept, as the search does."""
    target = Target.DTENSOR
    work, liveness = op_work_seconds(graph, H100_NVLINK), Liveness(graph)
    index = GraphIndex(graph, restrict_provider(strategies, target, graph), pinned=pinned_variables(graph, target),
                       unsplit_dims=unsplit_variable_dims(graph, target), work=work, liveness=liveness)
    mesh = MeshSpec(tuple((f"a{k}", size) for k, size in enumerate(sizes)))
    pricer, decided, best = StepPricer(graph, liveness), {}, float("inf")

    def axis(prior, k, lam):
        key = (tuple(id(d) for d in prior), k, lam)
        if key not in decided:
            found = []
            for role in axis_roles(target):
                builder = ProblemBuilder(index, prior, sizes[k], H100_NVLINK.axis_link(mesh, k), None, role)
                if builder.can_build():
                    problem = builder.build()
                    solution = tofu_dp.solve_axis(problem, lam)
                    found.append((problem.objective(solution.choice, lam), len(found), problem, solution))
            _, _, problem, solution = min(found, key=lambda item: item[:2])
            decided[key] = AxisDecision.of(problem, solution.choice, sizes[k])
        return decided[key]

    for lams in itertools.product(GRID, repeat=len(sizes)):
        prior = ()
        for k, lam in enumerate(lams):
            prior += (axis(prior, k, lam),)
        splits = {}
        for d in prior:
            for path, split in d.var_splits.items():
                splits.setdefault(path, []).append(split)
        cost = pricer.price_axes(mesh, H100_NVLINK, [d.op_strategies for d in prior],
                                 {p: tuple(s) for p, s in splits.items()}, work_seconds=work)
        if cost.memory.peak_bytes <= budget:
            best = min(best, cost.step_seconds)
    return best


@pytest.mark.slow   # captures the GPT with TensorFlow (the planning itself is TF-free)
def test_a_budget_met_on_one_axis_is_found(tiny_gpt):
    """At half the free plan's peak on a 4 x 2 mesh, one multiplier for both axes gave
    0.287 ms; spending memory on the first axis only gives 0.235 ms (before the per-axis
    refinement, tofu was 1.22x this reference)."""
    free = plan_graph(tiny_gpt, num_devices=8)
    budget = int(free.peak_memory_bytes * 0.5)
    plan = plan_graph(tiny_gpt, num_devices=8, memory_budget_bytes=budget, mesh_shape=(4, 2))
    assert plan.peak_memory_bytes <= budget
    reference = _grid_reference(tiny_gpt, (4, 2), budget)
    assert plan.step_seconds <= reference * 1.02, (plan.step_seconds, reference)
    # and the free search, which may pick another mesh, does no worse than this mesh
    searched = plan_graph(tiny_gpt, num_devices=8, memory_budget_bytes=budget)
    assert searched.peak_memory_bytes <= budget
    assert searched.step_seconds <= plan.step_seconds * (1 + 1e-9)
