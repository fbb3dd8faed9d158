"""plan_graph / plan_model end to end: legal plans, costs that recompute, budgets."""

import pytest
from tests.search_helpers import mlp_graph, stub_strategies

from tofu_tf import ir
from tofu_tf.cost.hardware import H100_NVLINK
from tofu_tf.cost.memory import alias_map
from tofu_tf.mesh import host_aligned_factorizations
from tofu_tf.plan import Method, Plan
from tofu_tf.search import InfeasibleBudgetError, plan_graph
from tofu_tf.search.legality import check_plan
from tofu_tf.semantics.strategy import REPLICATED, Reduction, TensorSplit

METHODS = ["tofu", "ilp", "data_parallel", "megatron"]


def _plan(graph, method, n=4, **kwargs):
    return plan_graph(graph, num_devices=n, method=method, strategy_provider=stub_strategies, **kwargs)


def _split(layout, axis):
    return TensorSplit(layout.index(axis)) if axis in layout else REPLICATED


def _recompute_comm(graph: ir.Graph, plan: Plan) -> float:
    """Seconds of communication from the plan's layouts and strategy names alone (ring formulas
    written out here, independent of tofu_tf.cost)."""
    aliases, ops = alias_map(graph), {op.name: op for op in graph.ops}
    names, sizes = list(plan.mesh_shape), list(plan.mesh_shape.values())
    mesh = plan.mesh_axes
    from tofu_tf.mesh import MeshSpec
    spec = MeshSpec(tuple(mesh))
    total, converted = 0.0, set()     # a tensor is converted once per layout its readers ask for
    for op_name, strategy_names in plan.op_strategies.items():
        op = ops[op_name]
        for j, name in enumerate(op.inputs):
            source = aliases.get(name, name)
            tensor = graph.tensors.get(source)
            if tensor is None or tensor.role is ir.Role.RESOURCE or source not in plan.tensor_layouts:
                continue
            src_layout, partial = plan.tensor_layouts[source], plan.partial_tensors.get(source, ())
            dst = [_required(graph, plan, op, j, k, strategy_names[k], sizes[k]) for k in range(len(names))]
            if (source, tuple(dst)) in converted:
                continue
            converted.add((source, tuple(dst)))
            for k, axis in enumerate(names):
                src = TensorSplit(partial=Reduction.SUM) if axis in partial else _split(src_layout, axis)
                div = 1
                for i in range(len(names)):
                    if (i < k and dst[i].dim is not None) or (i > k and _split(src_layout, names[i]).dim is not None):
                        div *= sizes[i]
                total += _ring_seconds(src, dst[k], tensor.num_bytes / div, sizes[k], H100_NVLINK.axis_link(spec, k))
    return total


def _required(graph, plan, op, j, k, name, n):
    axis = plan.mesh_axes[k][0]
    if name == "assign":
        return _split(plan.variable_layouts[graph.tensors[op.inputs[0]].variable_path], axis) if j else REPLICATED
    strategy = next(s for s in stub_strategies(op, graph, n) if s.name == name)
    return strategy.inputs[j]


def _ring_seconds(src, dst, nbytes, n, link):
    if src.partial is not None:
        scatter = dst.dim is not None and not link.gathers_by_all_reduce     # else run as an all-reduce
        factor, steps = ((n - 1) / n, n - 1) if scatter else (2 * (n - 1) / n, 2 * (n - 1))
        if dst.partial is not None:
            return 0.0
    elif src.dim is None or dst.partial is not None or src.dim == dst.dim:
        return 0.0
    elif dst.dim is None:     # an all-gather: DTensor runs it as an all-reduce of the gathered size
        factor, steps = ((2 * (n - 1) / n, 2 * (n - 1)) if link.gathers_by_all_reduce else ((n - 1) / n, n - 1))
    else:
        factor, steps = (n - 1) / (n * n), n - 1
    return steps * link.latency + factor * nbytes / link.bandwidth


@pytest.mark.parametrize("method", METHODS)
def test_plans_are_legal_and_their_cost_recomputes(method):
    graph = mlp_graph()
    for budget in (None, 16_000):
        if method in ("data_parallel", "megatron") and budget:
            continue
        plan = _plan(graph, method, memory_budget_bytes=budget)
        check_plan(graph, plan, num_devices=4)
        assert plan.comm_seconds == pytest.approx(_recompute_comm(graph, plan), rel=1e-9, abs=1e-15)
        assert plan.method is Method(method)
        assert Plan.from_json(plan.to_json()) == plan
        if budget:
            assert plan.peak_memory_bytes <= budget


def test_single_axis_search_cost_equals_the_plan_cost():
    """On one axis the DP's objective is the plan's modeled communication, exactly."""
    from tofu_tf.cost.evaluate import step_cost
    from tofu_tf.mesh import MeshSpec
    from tofu_tf.search import tofu_dp
    from tofu_tf.search.coarsen import GraphIndex
    from tofu_tf.search.problem import ProblemBuilder
    graph = mlp_graph()
    problem = ProblemBuilder(GraphIndex(graph, stub_strategies), (), 4, H100_NVLINK.intra_node).build()
    for lam in (0.0, 1e-10, 1e-8):
        solution = tofu_dp.solve_axis(problem, lam)
        strategies, splits = {}, {}
        for node, option in zip(problem.nodes, solution.choice):
            strategies.update({k: (v,) for k, v in node.strategies(option).items()})
            splits.update({k: (v,) for k, v in node.var_splits(option).items()})
        cost = step_cost(graph, MeshSpec((("x", 4),)), H100_NVLINK, strategies, splits)
        assert solution.exact
        assert cost.comm_seconds == pytest.approx(problem.comm(solution.choice), rel=1e-12, abs=1e-18)


def test_baseline_layouts():
    graph = mlp_graph()
    dp = _plan(graph, "data_parallel")
    assert dp.mesh_shape == {"batch": 4} and dp.input_layouts == {"x:0": ("batch", None)}
    assert all(set(layout) == {None} for layout in dp.variable_layouts.values())
    assert set(dp.comm_by_collective) == {"all-reduce"}
    mt = _plan(graph, "megatron")
    assert mt.variable_layouts["dense_0/kernel"] == (None, "model")
    assert mt.variable_layouts["dense_1/kernel"] == ("model", None)
    assert mt.variable_layouts["opt/m/dense_1/kernel"] == ("model", None)


def test_tofu_is_no_worse_than_baselines_at_their_memory():
    graph = mlp_graph(batch=16, widths=(32, 64, 64, 32))
    for method in ("data_parallel", "megatron"):
        base = _plan(graph, method)
        tofu = _plan(graph, "tofu", memory_budget_bytes=base.peak_memory_bytes)
        assert tofu.peak_memory_bytes <= base.peak_memory_bytes
        assert tofu.comm_seconds <= base.comm_seconds * (1 + 1e-9)


def test_infeasible_budget_names_budget_best_peak_and_contributors():
    with pytest.raises(InfeasibleBudgetError,
                       match=r"memory budget of 1000 B per device: the best achievable peak is .*KiB.*"
                             r"Largest contributors: .*dense_1/kernel"):
        _plan(mlp_graph(), "tofu", memory_budget_bytes=1000)


def test_memory_objective_minimizes_peak():
    graph = mlp_graph()
    lean = _plan(graph, "tofu", objective="memory")
    assert lean.peak_memory_bytes <= _plan(graph, "data_parallel").peak_memory_bytes
    assert lean.peak_memory_bytes <= _plan(graph, "tofu").peak_memory_bytes


def test_plan_model_captures_and_plans():
    from tofu_tf import models
    from tofu_tf.search import plan_model
    model = models.mlp(input_dim=16, width=32, depth=2)
    plan = plan_model(model, num_devices=4, batch_size=8, method="data_parallel",
                      strategy_provider=stub_strategies)
    assert plan.input_layouts["x:0"] == ("batch", None)
    assert "dense_0/kernel" in plan.variable_layouts and "Adam/m/dense_0/kernel" in plan.variable_layouts
    assert plan.comm_by_collective["all-reduce"].bytes > 0


def test_planning_pauses_the_garbage_collector_and_restores_it():
    import gc
    assert gc.isenabled()
    _plan(mlp_graph(), "tofu")
    assert gc.isenabled()
    with pytest.raises(InfeasibleBudgetError):
        _plan(mlp_graph(), "tofu", memory_budget_bytes=1000)
    assert gc.isenabled()
    gc.disable()
    try:
        _plan(mlp_graph(), "tofu")
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_a_long_search_logs_each_axis_problem_at_info(monkeypatch, caplog):
    import logging
    from tofu_tf.search import progress
    monkeypatch.setattr(progress, "QUIET_SECONDS", 0.0)
    with caplog.at_level(logging.INFO, logger="absl"):
        _plan(mlp_graph(), "tofu", n=4)
    lines = [r.getMessage() for r in caplog.records if "tofu_tf planner" in r.getMessage()]
    # meshes 4 and 2x2: axis problems (4), (2) and (2, 2), the 2x2 mesh's first axis solved once
    assert len(lines) == 3, lines
    assert [line.split(";")[1].strip().split(" axis")[0] for line in lines] == ["1 of 3", "2 of 3", "3 of 3"]
    assert sum("axis 2 of 2 (size 2" in line for line in lines) == 1
    assert all("solved to optimality" in line for line in lines)


def test_a_quick_search_keeps_its_progress_out_of_the_info_log(caplog):
    import logging
    from tofu_tf.search.progress import SearchProgress
    now = [0.0]
    progress = SearchProgress(2, quiet_seconds=5.0, clock=lambda: now[0])
    with caplog.at_level(logging.DEBUG, logger="absl"):
        progress.axis_solved("a0=8", 0, 1, 8, 12, True, 0.1)
        now[0] = 6.0
        progress.axis_solved("a0=2 x a1=4", 1, 2, 4, 12, False, 5.9)
        progress.axis_solved("a0=2 x a1=4", 1, 2, 4, 12, True, 0.1)
    levels = [record.levelno for record in caplog.records if "tofu_tf planner" in record.getMessage()]
    assert levels == [logging.DEBUG, logging.INFO, logging.INFO]
    messages = [record.getMessage() for record in caplog.records]
    assert "optimality not proved" in messages[1] and "2 of 2 axis problems" in messages[1]
    assert "3 axis problems solved (searching for a plan within the memory budget)" in messages[2]


def test_a_mesh_the_user_names_keeps_its_names():
    """Before, mesh_shape={"data": 2, "tensor": 2} planned on axes renamed by role ("model",
    "model1"), so the user's plan named axes the user never wrote."""
    graph = mlp_graph()
    plan = _plan(graph, "tofu", mesh_shape={"data": 2, "tensor": 2})
    assert list(plan.mesh_shape) == ["data", "tensor"]
    check_plan(graph, plan)
    used = {axis for layout in plan.variable_layouts.values() for axis in layout if axis}
    assert used <= {"data", "tensor"}
    unnamed = _plan(graph, "tofu", mesh_shape=(2, 2))      # sizes only: named by role
    assert set(unnamed.mesh_shape) <= {"batch", "model", "model1"}


@pytest.mark.parametrize("method", ["data_parallel", "megatron"])
def test_a_baseline_refuses_a_mesh_it_would_ignore(method):
    """Before, megatron and data_parallel planned their own one-axis mesh whatever mesh_shape said."""
    with pytest.raises(ValueError, match=rf"method='{method}' plans its own one-axis mesh of 4 devices.*\(a=2, b=2\)"):
        _plan(mlp_graph(), method, mesh_shape={"a": 2, "b": 2})
    assert list(_plan(mlp_graph(), method, mesh_shape=(4,)).mesh_shape.values()) == [4]


def test_beyond_one_host_the_search_keeps_to_meshes_that_follow_the_hosts():
    plan = _plan(mlp_graph(batch=64, widths=(64, 128, 128, 64)), "tofu", n=64)
    assert tuple(plan.mesh_shape.values()) in host_aligned_factorizations(64, H100_NVLINK.devices_per_node)
    assert any("searched 6 of the 32 mesh shapes of 64 devices" in note for note in plan.notes), plan.notes


def test_where_no_mesh_that_follows_the_hosts_fits_every_mesh_is_searched(caplog):
    """36-wide kernels on 16 devices, 8 per host: the host-aligned meshes split a kernel at most
    8 ways (no axis of 8 or 16 divides 36); 4 x 4 splits it 16 ways, under a budget only it meets."""
    graph = mlp_graph(batch=12, widths=(36, 36, 36, 36))
    aligned = min(_plan(graph, "tofu", n=16, mesh_shape=shape, objective="memory").peak_memory_bytes
                  for shape in host_aligned_factorizations(16, 8))
    square = _plan(graph, "tofu", n=16, mesh_shape=(4, 4), objective="memory").peak_memory_bytes
    assert square < aligned
    budget = (square + aligned) // 2
    with caplog.at_level("INFO", logger="absl"):      # another test may have set absl's level
        plan = _plan(graph, "tofu", n=16, memory_budget_bytes=budget)
    assert plan.peak_memory_bytes <= budget
    assert tuple(plan.mesh_shape.values()) not in host_aligned_factorizations(16, 8)
    assert "searching the other" in caplog.text
    assert not any("searched" in note for note in plan.notes)     # every mesh was searched in the end


@pytest.mark.parametrize("method", METHODS)
def test_one_device_is_planned_whole(method):
    """One device (``TofuStrategy(num_gpus=1)``): a plan on a one-device mesh with every tensor
    whole and nothing moved, not an error from the search over no mesh axes."""
    graph = mlp_graph()
    plan = plan_graph(graph, num_devices=1, method=method, strategy_provider=stub_strategies)
    check_plan(graph, plan, num_devices=1)
    assert list(plan.mesh_shape.values()) == [1] and plan.comm_seconds == 0
    assert plan.peak_memory_bytes == plan_graph(graph, num_devices=1, method="data_parallel",
                                                strategy_provider=stub_strategies).peak_memory_bytes


def test_one_device_under_a_budget_it_cannot_meet_is_infeasible_and_no_device_count_is_not_a_plan():
    from tofu_tf.mesh import LayoutError
    graph = mlp_graph()
    whole = plan_graph(graph, num_devices=1, strategy_provider=stub_strategies).peak_memory_bytes
    with pytest.raises(InfeasibleBudgetError):
        plan_graph(graph, num_devices=1, memory_budget_bytes=whole // 2, strategy_provider=stub_strategies)
    with pytest.raises(LayoutError, match="num_devices=0: a plan needs a positive number of devices"):
        plan_graph(graph, num_devices=0, strategy_provider=stub_strategies)


def test_gradient_all_reduces_share_one_latency_where_the_link_pays_it_per_collective():
    """DTensor combines a step's gradient all-reduces (bench/executed.py: the data-parallel MLP's
    7 run as 1). On the CPU profile, whose latency is milliseconds a collective, each gradient
    used to pay it: data parallelism was overpriced and the CPU plans of the GPT and keras-hub
    Llama sharded weights, measured 1.5-2.2x slower than data parallel (bench/vs_mirrored.py).
    Now the combined all-reduce pays it once; on a ring link (h100) nothing changes."""
    from tofu_tf.cost.hardware import profile, without_combining
    graph = mlp_graph()
    gradients = sum(1 for v in graph.variables.values() if v.gradient)
    assert gradients > 1
    for name, combined in (("cpu-virtual", True), ("h100-nvlink", False), ("cpu-virtual uncombined", False)):
        hardware = without_combining(profile("cpu-virtual")) if name.endswith("uncombined") else profile(name)
        link = hardware.intra_node
        assert link.combines_gradient_all_reduces is combined
        plan = plan_graph(graph, num_devices=4, method="data_parallel", hardware=hardware,
                          strategy_provider=stub_strategies)
        cost = plan.comm_by_collective["all-reduce"]
        per_latency = link.latency if link.latency_per_collective else 2 * 3 * link.latency
        latencies = 1 if combined else gradients
        # Combined, each gradient is also copied into the one buffer and out (its bytes, of the
        # all-reduce's 2 (n-1)/n times them, at the link's combine_copy_bandwidth).
        packing = cost.bytes * 4 / 6 / link.combine_copy_bandwidth if combined else 0.0
        assert plan.packing_seconds == pytest.approx(packing, rel=1e-9)
        assert plan.all_reduces_combined is (True if combined else None)
        assert cost.seconds == pytest.approx(cost.bytes / link.bandwidth + latencies * per_latency + packing,
                                             rel=1e-9)


def test_what_only_gradients_read_is_on_the_gradient_side():
    """``gradient_side``: a kernel gradient, and the tensors it is only reshaped from, lead only to
    the optimizer; the backward signal also feeds the input's gradient, so it is not on that side."""
    from tofu_tf.cost.collectives import gradient_side
    graph = mlp_graph(reshaped_gradients=True)
    side = gradient_side(graph)
    for i in range(3):
        for step in ("grad_k", "flat", "shaped"):
            assert f"gradient_tape/dense_{i}/matmul/{step}:0" in side
    assert "gradient_tape/dense_1/relu/grad:0" not in side          # read by grad_k and grad_x
    assert "gradient_tape/loss/grad:0" not in side


def test_all_reduces_before_a_gradients_reshapes_share_one_latency():
    """An einsum's kernel gradient is a batch sum two reshapes before the gradient the optimizer
    reads; data parallel all-reduces it at the sum, and DTensor runs those all-reduces as one
    (bench/executed.py: BERT's data-parallel step, 45 expressed, 1 run). Before, only an all-reduce
    of the gradient itself shared the latency: on the CPU profile each of these paid 2 ms, data
    parallel was overpriced, and the CPU plans of keras-hub BERT, GPT-2, Gemma and Qwen3-MoE sharded
    weights, measured 1.4-1.8x slower than data parallel (bench/vs_mirrored.py)."""
    from tofu_tf.cost.hardware import profile
    graph = mlp_graph(reshaped_gradients=True)
    link = profile("cpu-virtual").intra_node
    plan = plan_graph(graph, num_devices=4, method="data_parallel", hardware="cpu-virtual",
                      strategy_provider=stub_strategies)
    cost = plan.comm_by_collective["all-reduce"]
    assert plan.all_reduces_combined
    assert cost.seconds == pytest.approx(cost.bytes / link.bandwidth + link.latency + plan.packing_seconds, rel=1e-9)
