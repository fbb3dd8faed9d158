"""Capture of tf-keras training steps into the IR."""

import os
import subprocess
import sys

import pytest
import tensorflow as tf
import tf_keras as keras

import tofu_tf
from tofu_tf import ir, models

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


def test_dynamic_dimension_names_the_tensor_and_the_fix():
    inputs = keras.Input((None, 4))
    model = keras.Model(inputs, keras.layers.Dense(3)(inputs))
    with pytest.raises(tofu_tf.DynamicShapeError, match=r"unknown dimension.*keras.Input\(shape=...\)"):
        tofu_tf.capture_training_step(model, batch_size=2, loss="mse", optimizer="sgd")


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
