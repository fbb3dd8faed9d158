"""Lowering targets: the DTensor target drops what DTensor cannot lower; "ideal" keeps Tofu's space."""

import pytest
from tests.search_helpers import GraphBuilder, mlp_graph, stub_strategies

from tofu_tf.cost.hardware import H100_NVLINK
from tofu_tf.search import UnsupportedOpError, plan_graph
from tofu_tf.search.coarsen import GraphIndex
from tofu_tf.search.legality import check_plan
from tofu_tf.search.problem import ProblemBuilder
from tofu_tf.search.targets import (AxisRole, Target, as_target, axis_roles, check_lowerable, dtensor_lowerable,
                                    pinned_variables, unlowerable_ops, unsplit_variable_dims)
from tofu_tf.semantics.strategy import REPLICATED, OpStrategy, Reduction, TensorSplit

P = TensorSplit(partial=Reduction.SUM)


def _conv_graph():
    b = GraphBuilder()
    x = b.input("x", (8, 16, 16, 4))
    f = b.weight("conv/kernel", (3, 3, 4, 8), "conv")
    b.op("conv/Conv2D", "Conv2D", (x, f), [(8, 16, 16, 8)], layer="conv")
    return b.build()


def test_conv_runs_batch_split_only():
    graph = _conv_graph()
    op = graph.op("conv/Conv2D")
    batch = OpStrategy("n", (TensorSplit(0), REPLICATED), (TensorSplit(0),))
    channels = OpStrategy("co", (REPLICATED, TensorSplit(3)), (TensorSplit(3),))
    reduce_ci = OpStrategy("ci", (TensorSplit(3), TensorSplit(2)), (P,))
    spatial = OpStrategy("h", (TensorSplit(1), REPLICATED), (TensorSplit(1),))
    assert dtensor_lowerable(op, graph, batch, has_conv=True)
    assert not any(dtensor_lowerable(op, graph, s, has_conv=True) for s in (channels, reduce_ci, spatial))


def test_split_and_unpack_keep_their_axis_whole():
    b = GraphBuilder()
    x = b.input("x", (8, 4, 6))
    axis = b.tensor("axis:0", (), dtype="int32", const_value=2)
    b.op("split", "Split", (axis, x), [(8, 4, 3), (8, 4, 3)])
    b.op("unpack", "Unpack", (x,), [(8, 6)] * 4, attrs={"axis": 1})
    graph = b.build()
    split, unpack = graph.op("split"), graph.op("unpack")
    along = OpStrategy("d2", (REPLICATED, TensorSplit(2)), (TensorSplit(2), TensorSplit(2)))
    across = OpStrategy("d0", (REPLICATED, TensorSplit(0)), (TensorSplit(0), TensorSplit(0)))
    assert not dtensor_lowerable(split, graph, along) and dtensor_lowerable(split, graph, across)
    stacked = OpStrategy("d1", (TensorSplit(1),), (REPLICATED,) * 4)
    batch = OpStrategy("d0", (TensorSplit(0),), (TensorSplit(0),) * 4)
    assert not dtensor_lowerable(unpack, graph, stacked) and dtensor_lowerable(unpack, graph, batch)


def test_unknown_target_names_the_choices():
    assert as_target("ideal") is Target.IDEAL
    with pytest.raises(ValueError, match="'dtensor'.*'ideal'"):
        as_target("xla")


@pytest.fixture(scope="module")
def captured():
    from tofu_tf import models
    from tofu_tf.tf.capture import capture_training_step
    kwargs = dict(loss="sparse_categorical_crossentropy", optimizer="adam")
    return {
        "cnn": capture_training_step(models.cnn(image_size=8, channels=8), batch_size=8, **kwargs),
        "rnn": capture_training_step(models.rnn(num_layers=2, hidden=16, seq_len=4, input_dim=8, unroll=True),
                                     batch_size=8, **kwargs),
        "conv1d": capture_training_step(_text_cnn(), batch_size=8, **kwargs),
    }


def _text_cnn():
    """Embedding -> Conv1D -> pooling -> Dense: the Conv1D adds its bias to 3-D tensors."""
    import tf_keras as keras
    keras.utils.set_random_seed(3)
    return keras.Sequential([keras.Input((16,), dtype="int32"), keras.layers.Embedding(512, 128),
                             keras.layers.Conv1D(128, 3, padding="same", activation="relu", name="conv1d"),
                             keras.layers.GlobalMaxPooling1D(), keras.layers.Dense(256, activation="relu"),
                             keras.layers.Dense(10)])


@pytest.mark.parametrize("key,kinds", [("cnn", ("conv_", "bn_")), ("rnn", ("lstm",)), ("conv1d", ("conv1d/",))])
def test_dtensor_plans_keep_conv_bn_and_lstm_weights_replicated(captured, key, kinds):
    graph = captured[key]
    plan = plan_graph(graph, num_devices=8, target="dtensor", hardware="cpu-virtual")
    check_plan(graph, plan, num_devices=8)
    pinned = pinned_variables(graph, Target.DTENSOR)
    watched = [p for p in graph.variables if any(k in p for k in kinds) and graph.variables[p].shape]
    assert watched and all(p in pinned or graph.variables[p].slot_of in pinned for p in watched)
    for path in watched:
        assert set(plan.variable_layouts[path]) == {None}, (path, plan.variable_layouts[path])
    assert plan.target == "dtensor"
    for name, layout in plan.tensor_layouts.items():
        tensor = graph.tensors[name]
        if key == "cnn" and tensor.rank == 4:
            assert all(a is None for a in layout[1:]), (name, layout)
        if key == "conv1d" and tensor.producer and (graph.op(tensor.producer).layer or "").startswith("conv1d"):
            assert all(a is None for a in layout[1:]), (name, layout)


def _sliced(rank: int, tokens: int, **masks):
    b = GraphBuilder()
    x = b.input("x", (8,) * rank)
    spec = [b.tensor(f"spec{i}:0", (tokens,), dtype="int32", const_value=(0,) * tokens) for i in range(3)]
    b.op("position/strided_slice", "StridedSlice", (x, *spec), [(8,) * rank], attrs=masks, layer="position")
    return b.build()


@pytest.mark.parametrize("written, rank, tokens, masks, refused", [
    ("t[None]", 2, 1, dict(new_axis_mask=1), True),
    ("t[None, ...]", 2, 2, dict(new_axis_mask=1, ellipsis_mask=2), True),
    ("t[:, None]", 2, 2, dict(new_axis_mask=2, begin_mask=1, end_mask=1), True),
    ("t[None, ..., :]", 3, 3, dict(new_axis_mask=1, ellipsis_mask=2, begin_mask=4, end_mask=4), True),
    ("t[None, :, :]", 2, 3, dict(new_axis_mask=1, begin_mask=6, end_mask=6), False),
    ("t[:, None, :]", 2, 3, dict(new_axis_mask=2, begin_mask=5, end_mask=5), False),
    ("t[..., None]", 2, 2, dict(new_axis_mask=2, ellipsis_mask=1), False),
    ("t[None, 0]", 3, 2, dict(new_axis_mask=1, shrink_axis_mask=2), False),
    ("t[0]", 3, 1, dict(shrink_axis_mask=1), False),
])
def test_new_axis_before_implicit_axes_is_refused(written, rank, tokens, masks, refused):
    """DTensor reads an implicit axis's layout at its output position; after a new axis
    that is another dim's, or past the end (tests/test_dtensor_expanders.py)."""
    graph = _sliced(rank, tokens, **masks)
    assert bool(unlowerable_ops(graph, Target.DTENSOR)) is refused, written
    assert not unlowerable_ops(graph, Target.IDEAL)
    if refused:
        with pytest.raises(UnsupportedOpError,
                           match=r"StridedSlice 'position/strided_slice' \(Keras layer 'position'.*t\[None, :, :\]"):
            plan_graph(graph, num_devices=8, strategy_provider=stub_strategies)


def test_ops_without_layout_propagation_are_refused_unless_on_constants():
    """DTensor folds ops on constants (a causal mask's band_part) before it expands any."""
    b = GraphBuilder()
    x = b.input("x", (8, 4))
    ones = b.tensor("ones:0", (4, 4), const_value=1.0)
    bounds = [b.tensor(f"bound{i}:0", (), dtype="int64", const_value=v) for i, v in enumerate((-1, 0))]
    b.op("attn/MatrixBandPart", "MatrixBandPart", (ones, *bounds), [(4, 4)], layer="attn")
    b.op("attn/strided_slice", "StridedSlice", (ones, *[b.tensor(f"spec{i}:0", (1,), const_value=(0,))
                                                       for i in range(3)]), [(1, 4, 4)],
         attrs=dict(new_axis_mask=1), layer="attn")
    b.op("spectral/Svd", "Svd", (x,), [(4,), (8, 4), (4, 4)], layer="spectral")
    graph = b.build()
    found = unlowerable_ops(graph, Target.DTENSOR)
    assert [(u.type, u.layer) for u in found] == [("Svd", "spectral")]
    with pytest.raises(UnsupportedOpError, match=r"(?s)1 op\(s\).*Svd 'spectral/Svd' \(Keras layer 'spectral', "
                                                 r"from tf\.linalg\.svd.*not even replicated"):
        check_lowerable(graph, Target.DTENSOR)
    check_lowerable(graph, Target.IDEAL)


# -- what one mesh axis may split -------------------------------------------------

def _problem(role, batch=8, n=4):
    graph = mlp_graph(batch=batch)
    builder = ProblemBuilder(GraphIndex(graph, stub_strategies), (), n, H100_NVLINK.intra_node, role=role)
    return builder


def test_a_batch_axis_splits_every_input_and_no_variable_and_a_model_axis_no_input():
    assert axis_roles(Target.DTENSOR) == (AxisRole.BATCH, AxisRole.MODEL)
    assert axis_roles(Target.IDEAL) == (AxisRole.ANY,)
    batch = _problem(AxisRole.BATCH).build()
    model = _problem(AxisRole.MODEL).build()
    free = _problem(AxisRole.ANY).build()
    for problem, inputs, variables in ((batch, {"S0"}, {"R"}), (model, {"R"}, None), (free, None, None)):
        for node in problem.nodes:
            labels = {o.label for o in node.options}
            if node.name == "x":
                assert inputs is None or labels == inputs, (node.name, labels)
            elif node.name.startswith("var:"):
                assert variables is None or labels == variables, (node.name, labels)
                assert variables is not None or len(labels) > 1, (node.name, labels)


def test_a_batch_axis_needs_a_batch_it_divides():
    assert _problem(AxisRole.BATCH, batch=8, n=4).can_build()
    assert not _problem(AxisRole.BATCH, batch=6, n=4).can_build()
    assert _problem(AxisRole.MODEL, batch=6, n=4).can_build()


@pytest.fixture(scope="module")
def keras3_gpt():
    """A Keras 3 GPT and a budget (6/10 of its free plan's peak) whose plan, in Tofu's full space,
    splits both the batch and the weights (the embedding's input and the labels, and the kernels).
    (The free plan is data parallel since the all-reduces on the gradients' side share one latency
    on the CPU profile; 4/10 of its peak fits no plan, 5/10 splits only weights, and neither would
    prove anything.)"""
    import keras as keras3

    from tofu_tf import models
    from tofu_tf.tf.capture import capture_training_step
    model = models.gpt(num_layers=2, d_model=32, num_heads=4, seq_len=8, vocab_size=64, keras=keras3)
    graph = capture_training_step(model, batch_size=8, loss="sparse_categorical_crossentropy", optimizer="sgd")
    free = plan_graph(graph, num_devices=8, hardware="cpu-virtual")
    return graph, free.peak_memory_bytes * 6 // 10


def _axis_use(plan):
    """Per mesh axis: the set of (input splits its batch on it) and whether a variable is split on it."""
    return {name: ({layout[0] == name for layout in plan.input_layouts.values()},
                   any(name in layout for layout in plan.variable_layouts.values()))
            for name, _ in plan.mesh_axes}


def test_dtensor_plans_split_the_batch_or_the_weights_on_each_axis(keras3_gpt):
    """DTensor's layout propagation does not converge where one axis splits both, and its
    reduce expander then fails (tests/test_dtensor_expanders.py); the lowering lays every
    batch input out on one axis. Before: the half-budget plan split the weights on one axis
    and, on the same axis, the batch of some inputs."""
    graph, budget = keras3_gpt
    plan = plan_graph(graph, num_devices=8, hardware="cpu-virtual", memory_budget_bytes=budget)
    check_plan(graph, plan, num_devices=8)
    assert plan.peak_memory_bytes <= budget
    use = _axis_use(plan)
    assert any(weights for _, weights in use.values()), use
    for name, (inputs, weights) in use.items():
        assert inputs in ({True}, {False}), (name, inputs)
        assert not (weights and inputs == {True}), (name, use)


def test_dtensor_plans_keep_an_embedding_table_whole_by_rows():
    """DTensor's ResourceGather refuses a table split by rows (tests/test_dtensor_expanders.py);
    the lowering used to unsplit what the plan had priced split. Before: the least-memory plan
    of a narrow table split its rows."""
    import keras as keras3

    from tofu_tf.tf.capture import capture_training_step
    keras3.utils.set_random_seed(3)
    tokens = keras3.Input((8,), dtype="int32")
    x = keras3.layers.Embedding(1024, 4, name="table")(tokens)
    graph = capture_training_step(keras3.Model(tokens, keras3.layers.Dense(16, name="head")(x)), batch_size=8,
                                  loss="sparse_categorical_crossentropy", optimizer="sgd")
    assert unsplit_variable_dims(graph, Target.DTENSOR) == {"table/embeddings": frozenset({0})}
    assert unsplit_variable_dims(graph, Target.IDEAL) == {}
    plan = plan_graph(graph, num_devices=8, hardware="cpu-virtual", objective="memory")
    rows, features = plan.variable_layouts["table/embeddings"]
    assert rows is None and features is not None, plan.variable_layouts


# -- the batch on a model axis ----------------------------------------------------

def test_a_model_axis_splits_no_dim_that_carries_the_batch():
    """With the batch inputs whole, DTensor splits no activation along the batch (nothing
    it propagates from asks for it); the planner used to price such a split as a free
    local slice and the op's work divided by the axis, a data parallelism that never ran."""
    index = GraphIndex(mlp_graph(), stub_strategies)
    dims = index.batch_dims(4)
    assert dims["x:0"] == {0} and all(dims[t] == {0} for t in dims)
    model = ProblemBuilder(index, (), 4, H100_NVLINK.intra_node, role=AxisRole.MODEL).build()
    free = ProblemBuilder(index, (), 4, H100_NVLINK.intra_node, role=AxisRole.ANY).build()
    def strategies(problem):
        node = {node.name: node for node in problem.nodes}["dense_0/matmul"]
        return {o.strategies[0].name for o in node.options}
    assert strategies(model) == {"replicate", "j", "k(reduce)"}
    assert strategies(free) == {"replicate", "i", "j", "k(reduce)"}


@pytest.mark.parametrize("hardware", ["cpu-virtual", "h100-nvlink"])
def test_a_small_cnn_is_planned_data_parallel(hardware):
    """Before: every plan of this CNN kept its input whole on every axis (and priced its
    convolutions split anyway), so it ran fully replicated."""
    from tofu_tf.strategies import keras_hooks
    from tofu_tf import models
    from tofu_tf.tf.capture import capture_training_step
    model = models.cnn(image_size=32, channels=32)
    keras_hooks.prepare_for_dtensor(model)      # BatchNorm unfused, as TofuStrategy trains it
    graph = capture_training_step(model, batch_size=256, loss="sparse_categorical_crossentropy", optimizer="sgd")
    plan = plan_graph(graph, num_devices=8, hardware=hardware)
    assert "batch" in dict(plan.mesh_axes), plan.mesh_axes
    assert all(layout[0] == "batch" for layout in plan.input_layouts.values()), plan.input_layouts


def test_a_keras_hub_resnet_is_planned_data_parallel_on_virtual_cpus():
    """keras-hub's ResNet classifier planned 0 of its 32 weights sharded and no batch split:
    all 8 virtual CPUs computed the whole step (8x the host's work on shared cores)."""
    import keras
    import keras_hub
    import tensorflow as tf
    from tofu_tf.tf.capture import capture_training_step
    backbone = keras_hub.models.ResNetBackbone(
        input_conv_filters=[64], input_conv_kernel_sizes=[3], stackwise_num_filters=[64, 32],
        stackwise_num_blocks=[1, 1], stackwise_num_strides=[1, 2], block_type="basic_block",
        use_pre_activation=False, image_shape=(32, 32, 3))
    model = keras_hub.models.ResNetImageClassifier(backbone=backbone, num_classes=10, preprocessor=None)
    graph = capture_training_step(model, batch_size=8, optimizer="adam",
                                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                                  features=tf.TensorSpec((8, 32, 32, 3)), labels=tf.TensorSpec((8,), tf.int32))
    plan = plan_graph(graph, num_devices=8, hardware="cpu-virtual")
    assert dict(plan.mesh_axes) == {"batch": 8}, plan.mesh_axes
    assert all(layout[0] == "batch" for layout in plan.input_layouts.values()), plan.input_layouts


def test_the_roles_of_an_axis_sharing_its_options_build_the_problems_each_builds_alone():
    """The search builds an axis's problem once per role from one ``AxisOptions``; each
    problem equals the one a builder of its own makes, on a first and a second axis."""
    from tofu_tf.search.problem import AxisDecision, AxisOptions
    from tofu_tf.search import tofu_dp
    index = GraphIndex(mlp_graph(batch=8), stub_strategies)
    first = ProblemBuilder(index, (), 2, H100_NVLINK.intra_node, role=AxisRole.MODEL).build()
    decided = (AxisDecision.of(first, tofu_dp.solve_axis(first, 0.0).choice, 2),)
    for prior in ((), decided):
        shared = AxisOptions(index, prior, 2)
        for role in (AxisRole.BATCH, AxisRole.MODEL, AxisRole.ANY):
            alone = ProblemBuilder(index, prior, 2, H100_NVLINK.intra_node, role=role).build()
            together = ProblemBuilder(index, prior, 2, H100_NVLINK.intra_node, role=role, options=shared).build()
            assert together.nodes == alone.nodes
            assert all((a == b).all() for a, b in zip(together.unary, alone.unary))
            assert all((a == b).all() for a, b in zip(together.memory, alone.memory))
            assert [(e.u, e.v) for e in together.edges] == [(e.u, e.v) for e in alone.edges]
            assert all((a.cost == b.cost).all() for a, b in zip(together.edges, alone.edges))
    with pytest.raises(ValueError, match="another axis"):
        ProblemBuilder(index, decided, 2, H100_NVLINK.intra_node, options=AxisOptions(index, (), 2))
