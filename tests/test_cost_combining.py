"""DTensor's all-reduce combining, as the step's price models it (``tofu_tf.cost.combining``).

DTensor runs a step's all-reduces as one collective per level of their dependence (and per
element type, reduction and device group). On the CPU profile a collective's fixed cost is
milliseconds, so the count decides plans: before, only the gradients' all-reduces shared one
latency, each other all-reduce (a mixture-of-experts' router statistics, all-reduced in each
layer's forward) paid its own, and keras-hub Mixtral planned a sharded mesh measured 1.4-1.6x
slower than data parallel, which its price then ranked behind (bench/vs_mirrored.py,
bench/executed.py)."""

import dataclasses

import pytest

from tofu_tf.cost.combining import AllReduceLevels, combining_pays, run_groups, run_roles
from tofu_tf.cost.evaluate import step_cost
from tofu_tf.cost.hardware import profile
from tofu_tf.mesh import MeshSpec
from tofu_tf.semantics.strategy import REPLICATED, OpStrategy, TensorSplit

from tests.search_helpers import P_SUM, GraphBuilder

BATCH = TensorSplit(0)


def _statistics_graph(chained: bool, width: int = 4):
    """Two batch sums (partial under data parallelism) read whole by a ``Relu`` each: all-reduced
    twice. ``chained``: the second sum is computed from the first's all-reduced value (as each
    Megatron layer's all-reduce feeds the next layer); else both come from the input alone."""
    b = GraphBuilder(batch=8)
    x = b.input("x", (8, width))
    first = b.op("sum_1", "Sum", (x,), [(width,)])
    first_whole = b.op("relu_1", "Relu", (first,), [(width,)])
    source = (b.op("scaled", "Mul", (x, first_whole), [(8, width)]) if chained
              else b.op("square", "Square", (x,), [(8, width)]))
    second = b.op("sum_2", "Sum", (source,), [(width,)])
    b.op("relu_2", "Relu", (second,), [(width,)])
    graph = b.build()
    whole = OpStrategy("whole", (REPLICATED,), (REPLICATED,))
    strategies = {"x": OpStrategy("S0", (), (BATCH,)),
                  "sum_1": OpStrategy("d0", (BATCH,), (P_SUM,)), "sum_2": OpStrategy("d0", (BATCH,), (P_SUM,)),
                  "relu_1": whole, "relu_2": whole,
                  "scaled": OpStrategy("S0", (BATCH, REPLICATED), (BATCH,)), "square": OpStrategy("S0", (BATCH,), (BATCH,))}
    return graph, {op.name: (strategies[op.name],) for op in graph.ops}


@pytest.mark.parametrize("chained, runs", [(False, 1), (True, 2)])
def test_independent_all_reduces_share_one_latency_and_a_chain_pays_each(chained, runs):
    """Fails before combining was modeled beyond gradients: the two independent all-reduces paid two
    latencies on the CPU profile. On a ring link (h100) every all-reduce pays its own, as before."""
    graph, strategies = _statistics_graph(chained)
    mesh = MeshSpec((("batch", 8),))
    for name, latencies in (("cpu-virtual", runs), ("h100-nvlink", 2)):
        link = profile(name).intra_node
        cost = step_cost(graph, mesh, profile(name), strategies, {})
        moved, seconds = cost.by_collective["all-reduce"]
        per_latency = link.latency if link.latency_per_collective else 2 * 7 * link.latency
        assert seconds == pytest.approx(moved / link.bandwidth + latencies * per_latency + cost.packing_seconds,
                                        rel=1e-9), name
        assert cost.packing_seconds == (pytest.approx(2 * 4 * 4 / link.combine_copy_bandwidth, rel=1e-9)
                                        if latencies == 1 else 0.0), name


def test_an_all_gather_runs_in_the_all_reduce_of_its_level():
    """DTensor lowers an all-gather to an all-reduce of a zero-padded buffer before its combining
    pass: an all-gather and an all-reduce that do not depend on each other run as one."""
    b = GraphBuilder(batch=8)
    x = b.input("x", (8, 4))
    b.op("relu_1", "Relu", (b.op("sum_1", "Sum", (x,), [(4,)]),), [(4,)])
    b.op("relu_2", "Relu", (b.op("square", "Square", (x,), [(8, 4)]),), [(8, 4)])
    graph = b.build()
    whole = OpStrategy("whole", (REPLICATED,), (REPLICATED,))
    strategies = {"x": (OpStrategy("S0", (), (BATCH,)),), "sum_1": (OpStrategy("d0", (BATCH,), (P_SUM,)),),
                  "square": (OpStrategy("S0", (BATCH,), (BATCH,)),), "relu_1": (whole,), "relu_2": (whole,)}
    hardware = profile("cpu-virtual")
    cost = step_cost(graph, MeshSpec((("batch", 8),)), hardware, strategies, {})
    assert set(cost.by_collective) == {"all-reduce", "all-gather"}
    link = hardware.intra_node
    # one run of two: the sum's 4 floats and the gathered 8 x 4 are packed
    assert cost.packing_seconds == pytest.approx((4 + 32) * 4 / link.combine_copy_bandwidth, rel=1e-9)
    assert cost.comm_seconds == pytest.approx(cost.comm_bytes / link.bandwidth + link.latency + cost.packing_seconds,
                                              rel=1e-9)


@pytest.mark.parametrize("width, combined", [(4, True), (2**18, False)])
def test_all_reduces_run_one_by_one_where_packing_them_costs_more_than_the_latencies_saved(width, combined):
    """DTensor's combining copies each all-reduce it combines into one buffer and out again: on
    the CPU profile two independent all-reduces of 1 MiB each cost more to pack (5.4 ms) than the
    one latency (2 ms) combining saves, and the step runs them one by one (``Plan.all_reduces_combined``
    False, which TofuStrategy compiles the step with). Before, the price combined them for free:
    the data-parallel 2 x 1024 MLP, priced so, ran 1.2-1.3x MirroredStrategy's step, the packing
    being the difference (bench/README.md, "Beside MirroredStrategy")."""
    graph, strategies = _statistics_graph(chained=False, width=width)
    hardware = profile("cpu-virtual")
    link = hardware.intra_node
    cost = step_cost(graph, MeshSpec((("batch", 8),)), hardware, strategies, {})
    buffers = 2 * width * 4
    assert cost.all_reduces_combined is combined
    packing = buffers / link.combine_copy_bandwidth if combined else 0.0
    assert cost.packing_seconds == pytest.approx(packing, rel=1e-9)
    latencies = 1 if combined else 2
    assert cost.comm_seconds == pytest.approx(cost.comm_bytes / link.bandwidth + latencies * link.latency + packing,
                                              rel=1e-9)
    assert (buffers / link.combine_copy_bandwidth > link.latency) is not combined
    # a link that packs for free (no combine_copy_bandwidth) always combines
    free = dataclasses.replace(hardware, intra_node=dataclasses.replace(link, combine_copy_bandwidth=None))
    assert step_cost(graph, MeshSpec((("batch", 8),)), free, strategies, {}).all_reduces_combined is True


def test_combining_pays_weighs_the_packing_of_shared_runs_against_the_latencies_they_save():
    import numpy as np
    runs, latency = np.array([0, 0, 1]), np.array([2.0, 2.0, 2.0])
    assert [mask.tolist() for mask in run_roles(runs)] == [[True, False, True], [True, True, False]]
    assert combining_pays(*run_roles(runs), latency, np.array([1.0, 0.9, 50.0]))     # 1.9 packed <= 2.0 saved
    assert not combining_pays(*run_roles(runs), latency, np.array([1.0, 1.1, 0.0]))  # 2.1 packed > 2.0 saved
    assert combining_pays(*run_roles(np.array([0, 1])), latency[:2], np.array([9.0, 9.0])) is None   # no run shared
    assert combining_pays(*run_roles(np.array([], dtype=np.int64)), np.zeros(0), np.zeros(0)) is None


def test_an_all_reduces_level_is_the_longest_chain_of_all_reduces_it_starts():
    graph, _ = _statistics_graph(chained=True)
    ids = {"sum_1:0": 0, "sum_2:0": 1, "x:0": 2}
    levels = AllReduceLevels(graph, ids)
    assert levels.levels([0, 1]) == {0: 2, 1: 1}
    assert levels.levels([1]) == {1: 1}
    independent, _ = _statistics_graph(chained=False)
    assert AllReduceLevels(independent, {"sum_1:0": 0, "sum_2:0": 1}).levels([0, 1]) == {0: 1, 1: 1}


def test_runs_split_by_level_axis_reduction_and_element_type():
    import numpy as np
    runs = run_groups(np.array([1, 1, 2, 1, 1, 1]), np.array([0, 0, 0, 1, 0, 0]), np.array([-2, -2, -2, -2, -3, -2]),
                      np.array([0, 0, 0, 0, 0, 1]))
    assert runs.tolist() == [0, 0, 1, 2, 3, 4]


def test_keras_hub_mixtral_plans_data_parallel_where_its_price_ranks_it_first():
    """The CPU profile's price of Mixtral's data parallelism (its router statistics all-reduced with
    the gradients) is below any sharded plan's; the search's axis problems, which price each
    all-reduce alone, returned model=8 (measured 1.4-1.6x data parallel's step). The plan is never
    priced worse than data parallelism."""
    import keras
    from tofu_tf import hub_models
    from tofu_tf.search import plan_graph
    from tofu_tf.tf.capture import capture_training_step
    family = hub_models.FAMILIES["mixtral"]
    keras.utils.set_random_seed(0)
    model = family.build(64)
    x, _ = hub_models.data(family, 16)
    graph = capture_training_step(model, batch_size=16, optimizer="adam",
                                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                                  features={k: v[:16] for k, v in x.items()} if isinstance(x, dict) else x[:16])
    tofu = plan_graph(graph, num_devices=8, hardware="cpu-virtual")
    data_parallel = plan_graph(graph, num_devices=8, hardware="cpu-virtual", method="data_parallel")
    assert tofu.step_seconds <= data_parallel.step_seconds * (1 + 1e-9)
    assert dict(tofu.mesh_shape) == {"batch": 8}
