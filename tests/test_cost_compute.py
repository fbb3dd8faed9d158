"""The compute term: work estimates from shapes, divided by the devices an op is split over."""

import pytest
from tests.search_helpers import GraphBuilder, mlp_graph, stub_strategies

from tofu_tf.cost.compute import op_work, split_factor
from tofu_tf.cost.evaluate import step_cost
from tofu_tf.cost.hardware import H100_NVLINK, PROFILES
from tofu_tf.mesh import MeshSpec
from tofu_tf.search import plan_graph
from tofu_tf.semantics.strategy import REPLICATED, OpStrategy, TensorSplit, replicate_all


def test_flops_of_contractions_and_bytes_of_the_rest():
    b = GraphBuilder()
    x = b.input("x", (8, 16))
    w = b.weight("d/kernel", (16, 32), "d")
    y = b.op("mm", "MatMul", (x, w), [(8, 32)])
    e = b.op("es", "Einsum", (x, w), [(8, 32)], attrs={"equation": "ab,bc->ac"})
    b.op("relu", "Relu", (y,), [(8, 32)])
    graph = b.build()
    ops = {op.name: op for op in graph.ops}
    assert op_work(ops["mm"], graph).flops == 2 * 8 * 32 * 16
    assert op_work(ops["es"], graph).flops == 2 * 8 * 32 * 16
    assert op_work(ops["relu"], graph).bytes == 2 * 8 * 32 * 4 and op_work(ops["relu"], graph).flops == 0
    assert op_work(ops["d/kernel/read"], graph).bytes == 0
    del e


def test_split_factor_counts_axes_that_split_the_op():
    rep = replicate_all(2, 1)
    row = OpStrategy("i", (TensorSplit(0), REPLICATED), (TensorSplit(0),))
    assert split_factor((rep, rep), (2, 4)) == 1
    assert split_factor((row, rep), (2, 4)) == 2
    assert split_factor((row, row), (2, 4)) == 8


def test_every_profile_prices_compute():
    for hw in PROFILES.values():
        assert hw.flops > 0 and hw.memory_bandwidth > 0


def test_step_cost_compute_is_full_work_when_replicated_and_shared_when_split():
    graph = mlp_graph(batch=64, widths=(256, 512, 512, 256))
    mesh = MeshSpec((("x", 4),))
    ops = {op.name: op for op in graph.ops}
    full = {name: op_work(op, graph).seconds(H100_NVLINK) for name, op in ops.items()}
    rep = {name: (replicate_all(len(op.inputs), len(op.outputs)),) for name, op in ops.items()}
    cost = step_cost(graph, mesh, H100_NVLINK, rep, {})
    assert cost.compute_seconds == pytest.approx(sum(full.values()))
    assert cost.comm_seconds == 0
    plan = plan_graph(graph, num_devices=4, strategy_provider=stub_strategies, target="ideal", hardware=H100_NVLINK)
    assert plan.compute_seconds <= cost.compute_seconds * (1 + 1e-9)
    # On the (calibrated, slow-collective) CPU profile splitting pays once layers are wide.
    wide = mlp_graph(batch=256, widths=(2048, 4096, 4096, 2048))
    wide_rep = {op.name: (replicate_all(len(op.inputs), len(op.outputs)),) for op in wide.ops}
    slow = plan_graph(wide, num_devices=4, strategy_provider=stub_strategies, target="ideal",
                      hardware="cpu-virtual")
    assert slow.compute_seconds < step_cost(wide, mesh, PROFILES["cpu-virtual"], wide_rep, {}).compute_seconds / 2


def test_default_objective_does_not_replicate_everything():
    """Without a budget a comm-only objective may replicate all ops at 0 comm; step time may not."""
    graph = mlp_graph(batch=64, widths=(256, 512, 512, 256))
    plan = plan_graph(graph, num_devices=4, strategy_provider=stub_strategies, hardware="cpu-virtual")
    assert any(s != "replicate" for strategies in plan.op_strategies.values() for s in strategies
               if s not in ("read", "assign", "input"))
    for method in ("data_parallel", "megatron"):
        base = plan_graph(graph, num_devices=4, method=method, strategy_provider=stub_strategies,
                          hardware="cpu-virtual")
        assert plan.step_seconds <= base.step_seconds * (1 + 1e-9)
