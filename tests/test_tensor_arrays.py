"""TensorArrays of static size as lists while the strategy's model is called
(``tofu_tf.tf.compat.tensor_arrays``): a layer that writes an unrolled loop's steps into a
TensorArray trains as one device (keras-hub RWKV-7), and one indexed by a tensor is refused
before the first step.

Before, any TensorArray in a layer failed inside the first step with DTensor's own
"'tf.TensorListStack' op does not implement layout propagation" (as a TensorList it has none).
"""

import keras as keras3
import numpy as np
import pytest
import tensorflow as tf
import tf_keras

from tests import strategy_helpers as helpers
from tofu_tf.tf.compat import tensor_arrays

BATCH, STEPS = 8, 3


def _steps(x):
    """A running product-sum over dim 1, one TensorArray write per (static) step, then stacked."""
    ta = tf.TensorArray(x.dtype, size=x.shape[1])
    state = tf.zeros_like(x[:, 0])
    for t in range(x.shape[1]):
        state = state * 0.5 + x[:, t]
        ta = ta.write(t, state)
    return tf.transpose(ta.stack(), (1, 0, 2)) + ta.read(0)[:, None, :]


def _op_types(fn, spec):
    return {op.type for op in tf.function(fn).get_concrete_function(spec).graph.get_operations()}


def test_a_static_tensor_array_is_a_list_inside_and_only_inside():
    spec = tf.TensorSpec((2, 3, 4))
    assert "TensorListStack" in _op_types(_steps, spec)
    with tensor_arrays.tensor_arrays_as_lists():
        types = _op_types(_steps, spec)
        assert not any(t.startswith("TensorList") for t in types) and "Pack" in types
        value = tf.reshape(tf.range(24.0), (2, 3, 4))
        listed = _steps(value)
    np.testing.assert_array_equal(listed.numpy(), tf.function(_steps)(value).numpy())
    assert "TensorListStack" in _op_types(_steps, spec)


def test_a_tensor_array_in_a_loop_becomes_a_graph_one_with_what_was_written():
    """tf.scan unstacks its elements into a TensorArray (a list, static indices), then reads it
    at the loop's counter: from there it is TensorFlow's TensorArray, holding the elements."""
    def scanned(x):
        return tf.scan(lambda acc, row: acc * 0.5 + row, x)
    spec, value = tf.TensorSpec((3, 4)), tf.reshape(tf.range(12.0), (3, 4))
    with tensor_arrays.tensor_arrays_as_lists():
        assert "TensorListStack" in _op_types(scanned, spec)
        listed = tf.function(scanned)(value)
    np.testing.assert_allclose(listed.numpy(), tf.function(scanned)(value).numpy())


def _layer(keras):
    class Steps(keras.layers.Layer):
        def call(self, x):
            return _steps(x)
    return Steps(name="steps")


def _model(keras):
    return helpers.model_around_a_sequence_layer(keras, _layer(keras))


_compile = helpers.compile_with_momentum


@pytest.mark.parametrize("keras", [tf_keras, keras3], ids=["tf_keras", "keras3"])
def test_a_layer_writing_a_tensor_array_trains_as_one_device(keras):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(BATCH * STEPS, 5, 4)).astype("float32")
    y = rng.integers(0, 4, BATCH * STEPS).astype("int32")
    helpers.fit_beside_one_device(lambda: _model(keras), lambda m: _compile(keras, m), x, y)


def _rwkv():
    import keras_hub
    keras3.utils.set_random_seed(3)
    backbone = keras_hub.models.RWKV7Backbone(hidden_size=32, head_size=8, num_layers=2, vocabulary_size=64,
                                              intermediate_dim=64, gate_lora=8, mv_lora=8, aaa_lora=8, decay_lora=8)
    return keras3.Model(backbone.input, keras3.layers.Dense(64, name="lm_head")(backbone.output))


@pytest.mark.slow
def test_keras_hub_rwkv7_trains_as_one_device():
    """RWKV-7's time mixing loops in Python over the sequence, writing a TensorArray per step."""
    rng = np.random.default_rng(0)
    n = BATCH * STEPS
    x = {"token_ids": rng.integers(1, 64, (n, 8)).astype("int32"), "padding_mask": np.ones((n, 8), "int32")}
    y = rng.integers(0, 64, (n, 8)).astype("int32")
    helpers.fit_beside_one_device(_rwkv, lambda m: _compile(keras3, m), x, y, rtol=1e-5, atol=1e-5)
