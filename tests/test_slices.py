"""New-axis slices in a model's layers (``tofu_tf.tf.compat.slices``): spelled out while the
strategy's model is called, so a layer's ``t[:, None]`` trains instead of being refused.

Before, such a slice on the step's data (keras-hub XLNet's segment matrix) was refused before
the first step (``UnsupportedOpError``): DTensor's StridedSlice expander crashes on it in
every layout (``tests/test_dtensor_expanders.py``).
"""

import threading

import keras as keras3
import numpy as np
import pytest
import tensorflow as tf
import tf_keras

from tests import strategy_helpers as helpers
from tofu_tf.tf.compat import slices

BATCH, STEPS = 8, 3


def _slice_spec_lengths(fn, spec):
    graph = tf.function(fn).get_concrete_function(spec).graph
    return [op.inputs[1].shape[0] for op in graph.get_operations() if op.type == "StridedSlice"]


def test_a_new_axis_slice_names_every_axis_inside_and_only_inside():
    spec = tf.TensorSpec((4, 5))
    original = tf.Tensor.__getitem__

    def outer(t):
        return t[:, None] - t[None]
    assert _slice_spec_lengths(outer, spec) == [2, 1]
    with slices.new_axes_spelled_out():
        assert _slice_spec_lengths(outer, spec) == [3, 3]
        assert _slice_spec_lengths(lambda t: t[1:, 0], spec) == [2]      # no new axis: as written
        seen = []
        other = threading.Thread(target=lambda: seen.append(_slice_spec_lengths(outer, spec)))
        other.start()
        other.join()
        assert seen == [[2, 1]]                                         # another thread slices as TF does
    assert tf.Tensor.__getitem__ is original
    value = tf.reshape(tf.range(20.0), (4, 5))
    with slices.new_axes_spelled_out():
        spelled = outer(value)
    np.testing.assert_array_equal(spelled.numpy(), outer(value).numpy())


def _outer_layer(keras):
    class Outer(keras.layers.Layer):
        """Pairwise differences of features: ``x[:, None] - x[:, :, None]`` (the first leaves an
        axis implicit after the new one)."""

        def call(self, x):
            return x[:, None] - x[:, :, None]
    return Outer(name="outer")


def _model(keras):
    keras.utils.set_random_seed(7)
    inputs = keras.Input((6,))
    x = keras.layers.Dense(6, name="d1")(inputs)
    x = keras.layers.Flatten()(_outer_layer(keras)(x))
    return keras.Model(inputs, keras.layers.Dense(4, name="head")(x))


@pytest.mark.parametrize("keras", [tf_keras, keras3], ids=["tf_keras", "keras3"])
def test_a_layer_slicing_a_new_axis_trains_as_one_device(keras):
    compile_ = lambda m: m.compile(optimizer=keras.optimizers.SGD(0.05),  # noqa: E731
                                   loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(0)
    x = rng.normal(size=(BATCH * STEPS, 6)).astype("float32")
    y = rng.integers(0, 4, BATCH * STEPS).astype("int32")
    strategy, model, _ = helpers.fit_beside_one_device(lambda: _model(keras), compile_, x, y)
    assert [a.target for a in strategy.changes if a.change.name == "new_axis_slices_spelled_out"] == [model.name]


def _xlnet():
    import keras_hub
    keras3.utils.set_random_seed(3)
    backbone = keras_hub.models.XLNetBackbone(vocabulary_size=64, num_layers=2, num_heads=4, hidden_dim=32,
                                              intermediate_dim=64, dropout=0.0)
    return keras3.Model(backbone.input, keras3.layers.Dense(64, name="lm_head")(backbone.output))


@pytest.mark.slow
def test_keras_hub_xlnet_trains_as_one_device():
    """XLNetSegmentMatrixLayer compares ``segment_ids[:, None]`` with ``cat_ids[None, :]``."""
    rng = np.random.default_rng(0)
    n = BATCH * STEPS
    x = {"token_ids": rng.integers(0, 64, (n, 8)).astype("int32"), "padding_mask": np.ones((n, 8), "int32"),
         "segment_ids": (np.arange(8) >= 5).astype("int32")[None].repeat(n, 0)}
    y = rng.integers(0, 64, (n, 8)).astype("int32")
    compile_ = lambda m: m.compile(optimizer=keras3.optimizers.SGD(0.05, momentum=0.9),  # noqa: E731
                                   loss=keras3.losses.SparseCategoricalCrossentropy(from_logits=True))
    strategy, _, _ = helpers.fit_beside_one_device(_xlnet, compile_, x, y, rtol=1e-5, atol=1e-5)
    assert any(a.change.name == "new_axis_slices_spelled_out" for a in strategy.changes)
