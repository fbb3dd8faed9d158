"""Capture of tf-keras training steps into the IR."""

import os
import subprocess
import sys

import pytest
import tensorflow as tf
import tf_keras as keras

import tofu_tf
from tofu_tf import ir, models
from tofu_tf.tf import update_stamps

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _transformer_block():
    """MultiHeadAttention + LayerNormalization + Embedding + softmax + dropout."""
    tokens = keras.Input((8,), dtype="int32")
    x = keras.layers.Embedding(50, 16, name="embed")(tokens)
    attention = keras.layers.MultiHeadAttention(2, 8, dropout=0.1, name="mha")(x, x)
    x = keras.layers.LayerNormalization(name="ln1")(x + attention)
    h = keras.layers.Dense(32, activation="relu", name="ffn_in")(x)
    x = keras.layers.LayerNormalization(name="ln2")(x + keras.layers.Dense(16, name="ffn_out")(h))
    x = keras.layers.Dropout(0.1)(x)
    return keras.Model(tokens, keras.layers.Dense(50, name="head")(x))


BUILDERS = {
    "mlp": lambda: models.mlp(width=32),
    "cnn": lambda: models.cnn(),
    "lstm": lambda: models.rnn(cell="lstm", hidden=16, seq_len=5),
    "transformer": _transformer_block,
}


@pytest.fixture(scope="module", params=sorted(BUILDERS))
def captured(request):
    model = BUILDERS[request.param]()
    graph = tofu_tf.capture_training_step(model, batch_size=8, loss="sparse_categorical_crossentropy",
                                          optimizer="adam")
    return request.param, model, graph


def test_every_tensor_has_a_static_shape(captured):
    _, _, graph = captured
    for tensor in graph.tensors.values():
        assert all(isinstance(d, int) and d >= 0 for d in tensor.shape), tensor


def test_bytes_by_role_match_keras(captured):
    _, model, graph = captured
    totals = graph.bytes_by_role()
    trainable_bytes = sum(int(tf.size(v)) * v.dtype.size for v in model.trainable_variables)
    assert totals["weight"] == model.count_params() * 4
    assert totals["gradient"] == trainable_bytes
    assert totals["optimizer_slot"] == 2 * trainable_bytes  # Adam: m and v
    assert totals["input"] > 0 and totals["activation"] > 0


def test_every_trainable_weight_links_gradient_and_slots(captured):
    _, model, graph = captured
    for variable in model.trainable_variables:
        path = variable.name[:-2]
        weight = graph.variables[path]
        assert weight.trainable and weight.kind is ir.VariableKind.WEIGHT
        gradient = graph.tensors[weight.gradient]
        assert gradient.role is ir.Role.GRADIENT and gradient.variable_path == path
        assert gradient.shape == weight.shape
        slots = graph.slots_of(path)
        assert sorted(s.slot_name for s in slots) == ["m", "v"]
        assert all(s.shape == weight.shape for s in slots)


def test_weights_are_read_through_weight_or_handle_tensors(captured):
    """Most weights are read by ReadVariableOp; an Embedding gathers from the handle."""
    _, model, graph = captured
    read_paths = {t.variable_path for t in graph.tensors.values()
                  if t.role in (ir.Role.WEIGHT, ir.Role.RESOURCE) and t.consumers}
    assert {v.name[:-2] for v in model.trainable_variables} <= read_paths


def test_json_round_trip(captured):
    _, _, graph = captured
    assert ir.Graph.from_json(graph.to_json()) == graph


def test_ops_are_attributed_to_layers(captured):
    name, model, graph = captured
    layers = {op.layer for op in graph.ops if op.layer}
    dense_like = {l.name for l in model.layers if l.weights}
    assert dense_like <= layers, f"{name}: layers without ops {dense_like - layers}"


def test_calls_are_inlined_and_loops_kept_with_bodies():
    model = BUILDERS["lstm"]()
    graph = tofu_tf.capture_training_step(model, batch_size=4, loss="sparse_categorical_crossentropy",
                                          optimizer="sgd")
    types = graph.op_type_counts(recursive=False)
    assert not {"PartitionedCall", "StatefulPartitionedCall"} & set(types)
    loops = [op for op in graph.ops if op.type in ("While", "StatelessWhile")]
    assert len(loops) >= 2  # the forward recurrence and its gradient
    assert all(op.body is not None and op.body.ops for op in loops)
    assert "MatMul" in loops[0].body.op_type_counts()


def test_capture_does_not_build_the_users_optimizer():
    model = BUILDERS["mlp"]()
    optimizer = keras.optimizers.Adam()
    before = len(optimizer.variables)
    tofu_tf.capture_training_step(model, batch_size=8, loss="sparse_categorical_crossentropy",
                                  optimizer=optimizer)
    assert len(optimizer.variables) == before
    model.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy")
    model.fit(tf.zeros((8, 16)), tf.zeros((8,), tf.int32), epochs=1, verbose=0)  # still trains


_ALLOCATION_PROBE = """
import tensorflow as tf
import tofu_tf
from tofu_tf import models
model = models.mlp(input_dim=512, width=1024, depth=2)
tf.config.experimental.reset_memory_stats("CPU:0")
start = tf.config.experimental.get_memory_info("CPU:0")["current"]
tofu_tf.capture_training_step(model, batch_size=4, loss="sparse_categorical_crossentropy", optimizer="adam")
print(model.count_params() * 4, tf.config.experimental.get_memory_info("CPU:0")["peak"] - start)
"""


@pytest.mark.slow   # captures in a fresh Python, measuring its allocations
def test_capture_allocates_nothing_model_sized():
    """Optimizer slots are traced as uninitialized handles: no buffer is allocated.

    Runs in a subprocess: the allocator statistics need TF_CPU_ALLOCATOR_USE_BFC
    set before TF starts, and that allocator is not used by the rest of the suite.
    """
    env = dict(os.environ, TF_CPU_ALLOCATOR_USE_BFC="true", PYTHONPATH=ROOT)
    out = subprocess.run([sys.executable, "-c", _ALLOCATION_PROBE], env=env, capture_output=True,
                         text=True, check=True, timeout=300)
    weight_bytes, allocated = (int(v) for v in out.stdout.split()[-2:])
    assert allocated < weight_bytes / 100, (allocated, weight_bytes)


def _inputs(graph):
    return [t.name for t in graph.tensors.values() if t.role is ir.Role.INPUT]


def test_an_open_input_dimension_names_the_input_and_the_fix():
    inputs = keras.Input((None, 4), name="frames")
    model = keras.Model(inputs, keras.layers.Dense(3)(inputs))
    with pytest.raises(tofu_tf.DynamicShapeError,
                       match=r"model input 'frames' has shape \(None, None, 4\).*features="):
        tofu_tf.capture_training_step(model, batch_size=2, loss="mse", optimizer="sgd")


def test_an_open_input_dimension_is_planned_from_the_batch():
    """``keras.Input(shape=(None, 4))``, as every keras-hub backbone declares its tokens:
    the batch's own static shape is what is traced (was: DynamicShapeError)."""
    inputs = keras.Input((None, 4), name="frames")
    model = keras.Model(inputs, keras.layers.Dense(3)(inputs))
    graph = tofu_tf.capture_training_step(model, batch_size=2, loss="mse", optimizer="sgd",
                                          features=tf.TensorSpec((2, 5, 4), tf.float32))
    assert [graph.tensors[name].shape for name in _inputs(graph)] == [(2, 5, 4), (2, 5, 3)]


def test_a_model_revived_from_a_savedmodel_is_captured_at_the_batch_shapes(tmp_path):
    """A subclassed model loaded from a SavedModel calls the functions saved with it, traced for
    any batch size (None): each is imported again for the shapes the step calls it with, its
    variable reads given their variables' shapes (was: DynamicShapeError, (None, 5))."""
    class Net(keras.Model):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(5)

        def call(self, x):
            return self.dense(x)

    net = Net()
    net(tf.zeros((2, 3)))
    net.save(str(tmp_path / "net"), save_format="tf")
    revived = keras.models.load_model(str(tmp_path / "net"))
    graph = tofu_tf.capture_training_step(revived, batch_size=16, loss="mse", optimizer="sgd",
                                          features=tf.TensorSpec((16, 3), tf.float32))
    assert all(None not in t.shape for t in graph.tensors.values())
    assert sorted(v.shape for v in graph.weights()) == [(3, 5), (5,)]
    assert any(op.type == "MatMul" and graph.tensors[op.outputs[0]].shape == (16, 5) for op in graph.ops)


@pytest.mark.parametrize("framework", ["tf_keras", "keras3"])
def test_dict_inputs_keep_their_structure_and_names(framework):
    """Every keras-hub model takes a dict of inputs; capture called models with a flat
    list (ValueError: the structure of inputs doesn't match)."""
    import keras as keras3
    k = keras if framework == "tf_keras" else keras3
    tokens, mask = k.Input((6,), name="token_ids", dtype="int32"), k.Input((6,), name="padding_mask", dtype="int32")
    hidden = k.layers.Embedding(16, 8)(tokens) * k.ops.expand_dims(k.ops.cast(mask, "float32"), -1) \
        if framework == "keras3" else k.layers.Embedding(16, 8)(tokens)
    model = k.Model({"token_ids": tokens, "padding_mask": mask}, k.layers.Dense(16)(hidden))
    graph = tofu_tf.capture_training_step(model, batch_size=4, optimizer="sgd",
                                          loss=k.losses.SparseCategoricalCrossentropy(from_logits=True))
    assert sorted(name.split(":")[0] for name in _inputs(graph)) == ["labels", "padding_mask", "token_ids"]
    assert graph.tensors["token_ids:0"].shape == (4, 6)


def test_unbuilt_model_is_rejected_with_a_remedy():
    model = keras.Sequential([keras.layers.Dense(3)])
    with pytest.raises(TypeError, match="build it first"):
        tofu_tf.capture_training_step(model, batch_size=2, loss="mse", optimizer="sgd")


def test_conflicting_fixed_batch_size_is_rejected():
    model = models.mlp(batch_size=4)
    with pytest.raises(ValueError, match="fixes the batch size to 4"):
        tofu_tf.capture_training_step(model, batch_size=8, loss="mse", optimizer="sgd")


def test_bad_batch_size_is_rejected():
    with pytest.raises(ValueError, match="positive int"):
        tofu_tf.capture_training_step(models.mlp(), batch_size=0, loss="mse", optimizer="sgd")


def test_every_op_input_is_a_known_tensor(captured):
    """Handles of variables outside model/optimizer lists (a learning-rate variable) are tensors too."""
    _, _, graph = captured
    for op in graph.ops:
        for name in op.inputs:
            assert name in graph.tensors, (op.name, name)


class _SignGate(keras.layers.Layer):
    """Branches in Python on a tensor: needs AutoGraph to trace."""

    def call(self, x):
        if tf.reduce_sum(x) > 0:
            return x * 2.0
        return -x


class _TensorLoop(keras.layers.Layer):
    """Loops over a tensor in Python: needs AutoGraph to trace."""

    def call(self, x):
        for _ in tf.range(tf.shape(x)[1] // 2):
            x = x * 0.5
        return x


@pytest.mark.parametrize("layer,converted", [(_SignGate, {"If", "StatelessIf"}), (_TensorLoop, {"While", "StatelessWhile"})])
def test_python_control_flow_on_tensors_is_traced_with_autograph(layer, converted):
    inputs = keras.Input((4,))
    model = keras.Model(inputs, keras.layers.Dense(3, name="out")(layer()(keras.layers.Dense(4, name="d")(inputs))))
    graph = tofu_tf.capture_training_step(model, batch_size=2, loss="mse", optimizer="sgd")
    assert converted & {op.type for op in graph.ops}  # the Python control flow became a graph op
    assert {v.path for v in graph.variables.values() if v.kind is ir.VariableKind.WEIGHT} == {
        "d/kernel", "d/bias", "out/kernel", "out/bias"}
    assert all(v.gradient for v in graph.variables.values() if v.kind is ir.VariableKind.WEIGHT)


def test_an_error_that_autograph_cannot_fix_still_surfaces():
    class Broken(keras.layers.Layer):
        def call(self, x, training=None):
            if training:  # a Python bool: builds fine, fails in the training step
                raise ValueError("broken layer")
            return x

    inputs = keras.Input((4,))
    model = keras.Model(inputs, Broken()(keras.layers.Dense(4)(inputs)))
    with pytest.raises(ValueError, match="broken layer"):
        tofu_tf.capture_training_step(model, batch_size=2, loss="mse", optimizer="sgd")


# -- optimizer updates traced once per weight shape ----------------------------

_TRACE_SPECIFIC_ATTRS = frozenset({"_gradient_op_type", "body", "cond", "f"})  # counters and function names


def _assert_same_step(traced, stamped):
    """``stamped`` is ``traced`` up to the names of ops, tensors and the optimizer's
    variables: op for op the same type, attributes, layer, inputs and outputs."""
    paths = dict(zip(traced.variables, stamped.variables, strict=True))
    names: dict[str, str] = {}

    def same_tensor(a, b):
        ta, tb = traced.tensors[a], stamped.tensors[b]
        if (ta.variable_path or "").startswith("captured/"):  # a handle named per trace: map it consistently
            paths.setdefault(ta.variable_path, tb.variable_path)
        assert (ta.shape, ta.dtype, ta.role, paths.get(ta.variable_path, ta.variable_path), ta.const_value,
                len(ta.consumers)) == (tb.shape, tb.dtype, tb.role, tb.variable_path, tb.const_value,
                                       len(tb.consumers)), (ta, tb)
        names[a] = b

    def attrs(op):
        return {k: v for k, v in op.attrs.items() if k not in _TRACE_SPECIFIC_ATTRS}

    for a, b in zip(traced.ops, stamped.ops, strict=True):
        assert (a.type, attrs(a), a.layer, len(a.inputs)) == (b.type, attrs(b), b.layer, len(b.inputs)), (a, b)
        for x, y in zip(a.inputs, b.inputs):
            if x in names:
                assert names[x] == y, (a.name, b.name, x, y)
            else:
                same_tensor(x, y)
        for x, y in zip(a.outputs, b.outputs, strict=True):
            same_tensor(x, y)
    assert len(traced.tensors) == len(stamped.tensors)
    for path, variable in traced.variables.items():
        other = stamped.variables[paths[path]]
        assert variable.gradient is None or names[variable.gradient] == other.gradient
        assert (variable.shape, variable.kind, variable.slot_name, paths.get(variable.slot_of)) == (
            other.shape, other.kind, other.slot_name, other.slot_of)


def _stamped_ops(graph):
    return [op for op in graph.ops if f"/{update_stamps.STAMP_SCOPE}/" in op.name]


def test_updates_stamped_per_weight_shape_give_the_traced_step_and_plan(captured):
    name, model, stamped = captured
    traced = tofu_tf.capture_training_step(model, batch_size=8, loss="sparse_categorical_crossentropy",
                                           optimizer="adam", trace_each_update=True)
    assert _stamped_ops(stamped) and not _stamped_ops(traced)  # every test model repeats a weight shape
    _assert_same_step(traced, stamped)
    if name != "lstm":  # (its plan takes long; its IR is compared above)
        a, b = tofu_tf.plan_graph(traced, num_devices=4), tofu_tf.plan_graph(stamped, num_devices=4)
        assert (a.mesh_shape, a.variable_layouts, a.comm_bytes, a.peak_memory_bytes) == (
            b.mesh_shape, b.variable_layouts, b.comm_bytes, b.peak_memory_bytes)


def test_keras3_updates_are_stamped_too():
    import keras as keras3
    model = keras3.Sequential([keras3.Input((16,)), keras3.layers.Dense(16), keras3.layers.Dense(16),
                               keras3.layers.Dense(4)])
    kwargs = dict(batch_size=8, loss="sparse_categorical_crossentropy", optimizer="adam")
    stamped = tofu_tf.capture_training_step(model, **kwargs)
    assert _stamped_ops(stamped)
    _assert_same_step(tofu_tf.capture_training_step(model, trace_each_update=True, **kwargs), stamped)


class _OwnUpdate(keras.optimizers.SGD):
    """A user's update_step: tofu_tf cannot know it depends on the weight only by shape."""

    def update_step(self, gradient, variable):
        variable.assign_sub(gradient * self.learning_rate * 2.0)


class _ReadsAnotherWeight(keras.optimizers.SGD):
    """An update that reads a weight other than its own (``probe``)."""

    probe = None

    def update_step(self, gradient, variable):
        variable.assign_sub(gradient * self.learning_rate + 0.0 * tf.reduce_mean(self.probe))


def test_a_users_update_step_is_traced_for_every_weight():
    model = models.mlp(width=32)
    graph = tofu_tf.capture_training_step(model, batch_size=8, loss="sparse_categorical_crossentropy",
                                          optimizer=_OwnUpdate())
    assert not _stamped_ops(graph)
    assert sum(op.type == "AssignSubVariableOp" for op in graph.ops) == len(model.trainable_variables)


def test_an_update_that_reads_another_weight_is_not_stamped(monkeypatch):
    """Even where stamping is allowed, an update reading anything weight-specific
    besides its own weight, slots and gradient is traced for every weight."""
    monkeypatch.setattr(update_stamps, "_stamps_safely", lambda optimizer: True)
    model = models.mlp(width=32)
    monkeypatch.setattr(_ReadsAnotherWeight, "probe", model.trainable_variables[0])
    kwargs = dict(batch_size=8, loss="sparse_categorical_crossentropy", optimizer=_ReadsAnotherWeight())
    graph = tofu_tf.capture_training_step(model, **kwargs)
    assert not _stamped_ops(graph)
    _assert_same_step(tofu_tf.capture_training_step(model, trace_each_update=True, **kwargs), graph)


def _jit_compiled(fresh_optimizer):
    """tf-keras' optimizer as on a GPU: each weight's update an XLA function of its own."""
    def fresh(framework, optimizer):
        opt = fresh_optimizer(framework, optimizer)
        opt.jit_compile = True
        return opt
    return fresh


def test_xla_compiled_updates_are_traced_inline_and_stamped(monkeypatch):
    from tofu_tf.tf import keras_adapter
    model = models.mlp(width=32)
    kwargs = dict(batch_size=8, loss="sparse_categorical_crossentropy", optimizer="adam")
    plain = tofu_tf.capture_training_step(model, **kwargs)
    monkeypatch.setattr(keras_adapter, "fresh_optimizer", _jit_compiled(keras_adapter.fresh_optimizer))
    compiled = tofu_tf.capture_training_step(model, **kwargs)
    assert _stamped_ops(compiled)
    _assert_same_step(plain, compiled)


def test_updates_traced_inside_functions_of_their_own_are_not_stamped(monkeypatch):
    from tofu_tf.tf import keras_adapter
    monkeypatch.setattr(keras_adapter, "fresh_optimizer", _jit_compiled(keras_adapter.fresh_optimizer))
    monkeypatch.setattr(keras_adapter, "trace_updates_inline", lambda optimizer: optimizer)
    model = models.mlp(width=32)
    kwargs = dict(batch_size=8, loss="sparse_categorical_crossentropy", optimizer="adam")
    graph = tofu_tf.capture_training_step(model, **kwargs)
    assert not _stamped_ops(graph)
    _assert_same_step(tofu_tf.capture_training_step(model, trace_each_update=True, **kwargs), graph)


def test_per_output_losses_are_refused_with_what_to_do_instead():
    inputs = keras.Input((8,))
    hidden = keras.layers.Dense(8)(inputs)
    model = keras.Model(inputs, [keras.layers.Dense(4, name="a")(hidden), keras.layers.Dense(1, name="b")(hidden)])
    with pytest.raises(ValueError, match="one loss per output.*Compile it with a single loss"):
        tofu_tf.capture_training_step(model, batch_size=4, loss={"a": "mse", "b": "mse"}, optimizer="sgd")


def test_a_broadcast_gradients_axes_and_an_inverse_permutation_are_known_and_data_parallel_moves_only_gradients():
    """A batched einsum against a kernel (Keras 3's EinsumDense: BatchMatMulV2 broadcasting the
    kernel) reduces its kernel's gradient over axes ``BroadcastGradientArgs`` computes from two
    static shapes, and a transpose's gradient transposes by ``InvertPermutation(perm)``.
    ``tf.get_static_value`` knows neither; unknown, the Sum and the Transpose could only run
    whole, and the data-parallel plan all-gathered their batch (keras-hub Llama: 3.7 MiB a
    step that DTensor does not move). Now both are folded at capture."""
    import keras as keras3
    inputs = keras3.Input((8, 16))
    x = keras3.layers.EinsumDense("abc,cd->abd", (8, 32), name="einsum")(inputs)
    x = keras3.layers.Permute((2, 1), name="permute")(x)
    outputs = keras3.layers.Dense(4, name="head")(keras3.layers.Flatten()(x))
    graph = tofu_tf.capture_training_step(keras3.Model(inputs, outputs), batch_size=16, optimizer="sgd", loss="mse")
    ops = {op.name: op for op in graph.ops}
    folded = [op for op in graph.ops if op.type in ("BroadcastGradientArgs", "InvertPermutation")]
    assert {op.type for op in folded} == {"BroadcastGradientArgs", "InvertPermutation"}
    for op in folded:
        assert all(graph.tensors[name].const_value is not None for name in op.outputs), op.name
    reduce_axes = [graph.tensors[op.inputs[1]].const_value for op in graph.ops
                   if op.type == "Sum" and ops.get(graph.tensors[op.inputs[1]].producer, op).type == "BroadcastGradientArgs"]
    assert (0,) in reduce_axes             # the kernel's gradient: summed over the batch
    plan = tofu_tf.plan_graph(graph, num_devices=8, method="data_parallel")
    assert set(plan.comm_by_collective) <= {"all-reduce"}, plan.comm_by_collective


@pytest.mark.parametrize("framework, optimizer, deduplicated", [
    ("tf_keras", "adam", True), ("tf_keras", "legacy_adam", True), ("tf_keras", "legacy_sgd", False),
    ("keras3", "adam", False)])
def test_a_sparse_gradient_an_optimizer_deduplicates_keeps_its_rows_whole(framework, optimizer, deduplicated):
    """tf-keras' optimizers sum an Embedding gradient's duplicate rows after ``tf.unique`` of its
    indices, which DTensor runs on the whole index vector: the gradient's rows split over the batch
    are gathered (bench/executed.py: the tf-keras GPT's 227.5 KiB of all-gathers, which the plan
    priced as an all-reduce of the dense gradient). Capture names that sum so the planner keeps its
    rows whole and prices their gather. Keras 3's optimizers and tf-keras' legacy SGD scatter the
    rows as they come: their sum stays free to take partial sums over the batch."""
    import keras as keras3
    kit = keras if framework == "tf_keras" else keras3
    tokens = kit.Input((8,), dtype="int32")
    outputs = kit.layers.Dense(4, name="head")(kit.layers.Flatten()(kit.layers.Embedding(64, 16, name="embed")(tokens)))
    chosen = {"adam": lambda: kit.optimizers.Adam(), "legacy_adam": lambda: keras.optimizers.legacy.Adam(),
              "legacy_sgd": lambda: keras.optimizers.legacy.SGD()}[optimizer]()
    graph = tofu_tf.capture_training_step(kit.Model(tokens, outputs), batch_size=16, optimizer=chosen, loss="mse")
    sums = [op for op in graph.ops if op.type == "UnsortedSegmentSum"]
    assert len(sums) == 1
    assert sums[0].name.endswith("deduplicated_sparse_gradient") == deduplicated, sums[0].name
    plan = tofu_tf.plan_graph(graph, num_devices=8, method="data_parallel")
    strategy = plan.op_strategies[sums[0].name]
    assert (strategy == ("replicate",)) == deduplicated, strategy     # the rows whole only where they are gathered
    assert ("all-gather" in plan.comm_by_collective) == deduplicated, plan.comm_by_collective
