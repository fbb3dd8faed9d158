"""Window ops as sums of strided slices (``tofu_tf.tf.compat.windows``): average pooling with
overlapping windows or "same" padding, and depthwise convolutions in a dtype without grouped
gradients, compute what one device computes and train under TofuStrategy.

Before, InceptionV3 and NASNet (3x3 stride-1 "same" average pooling) were refused before their
first step (DTensor has no layout propagation for ``AvgPoolGrad``), and a float64 depthwise
convolution failed inside TensorFlow ("Gradients for grouped convolutions are not supported on CPU").
A float64 depthwise convolution is one convolution with a block-diagonal filter where it can be
(``tofu_tf.tf.compat.depthwise``): the slice sum made NASNetMobile's float64 step too large to compile.
"""

import keras as keras3
import numpy as np
import pytest
import tensorflow as tf
import tf_keras

from tests import strategy_helpers as helpers
from tofu_tf.tf.compat import depthwise, windows

BATCH, STEPS = 8, 2


def _value_and_gradients(fn, *tensors):
    with tf.GradientTape() as tape:
        tape.watch(tensors)
        y = fn()
        loss = tf.reduce_sum(y * y)
    return (y, *tape.gradient(loss, list(tensors)))


def _assert_equal_to_rounding(got, want, dtype):
    """Each tensor of ``got`` equal to ``want``'s, same shape and dtype, to ``dtype``'s rounding."""
    tol = 1e-5 if dtype == "float32" else 1e-12
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        np.testing.assert_allclose(g.numpy(), w.numpy(), rtol=tol, atol=tol * np.abs(w.numpy()).max())


@pytest.mark.parametrize("pool, strides, padding", [
    ((3, 3), (1, 1), "same"), ((3, 3), (2, 2), "valid"), ((3, 3), (2, 2), "same"), ((2, 3), (1, 2), "same"),
    ((1, 1), (2, 2), "valid")])
def test_a_window_sum_computes_tf_average_pooling(pool, strides, padding):
    """Output and input gradient against ``tf.nn.avg_pool2d`` ("same": each border window divided by
    the input positions it covers, as TensorFlow does), to float32 rounding."""
    x = tf.constant(np.random.default_rng(0).normal(size=(2, 9, 10, 3)).astype("float32"))
    want = _value_and_gradients(lambda: tf.nn.avg_pool2d(x, pool, strides, padding.upper()), x)
    got = _value_and_gradients(lambda: windows.average_pool_2d(x, pool, strides, padding), x)
    for g, w in zip(got, want):
        assert g.shape == w.shape
        np.testing.assert_allclose(g.numpy(), w.numpy(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("strides, dilation, padding, multiplier", [
    ((1, 1), (1, 1), "same", 1), ((2, 2), (1, 1), "same", 2), ((2, 2), (1, 1), "valid", 1),
    ((1, 1), (2, 2), "same", 2)])
def test_a_window_sum_computes_the_depthwise_convolution(dtype, strides, dilation, padding, multiplier):
    """Output and both gradients against ``tf.nn.depthwise_conv2d``, in float64 too (TensorFlow's CPU
    depthwise kernels have float64; its grouped-convolution gradients do not)."""
    rng = np.random.default_rng(0)
    x = tf.constant(rng.normal(size=(2, 9, 10, 3)).astype(dtype))
    kernel = tf.constant(rng.normal(size=(3, 3, 3, multiplier)).astype(dtype))
    want = _value_and_gradients(lambda: tf.nn.depthwise_conv2d(x, kernel, (1, *strides, 1), padding.upper(),
                                                               dilations=dilation), x, kernel)
    got = _value_and_gradients(lambda: windows.depthwise_by_taps(x, kernel, strides=strides, padding=padding,
                                                                 dilation_rate=dilation), x, kernel)
    _assert_equal_to_rounding(got, want, dtype)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("strides, padding, multiplier", [
    ((1, 1), "same", 1), ((2, 2), "same", 2), ((2, 2), "valid", 1), ((1, 1), "valid", 3)])
def test_a_block_diagonal_convolution_computes_the_depthwise_convolution(dtype, strides, padding, multiplier):
    """Output and both gradients of the ordinary convolution with a block-diagonal filter against
    ``tf.nn.depthwise_conv2d``, to ``dtype``'s rounding."""
    rng = np.random.default_rng(0)
    x = tf.constant(rng.normal(size=(2, 9, 10, 3)).astype(dtype))
    kernel = tf.constant(rng.normal(size=(3, 3, 3, multiplier)).astype(dtype))
    want = _value_and_gradients(lambda: tf.nn.depthwise_conv2d(x, kernel, (1, *strides, 1), padding.upper()), x, kernel)
    got = _value_and_gradients(lambda: depthwise.depthwise_as_block_diagonal_conv(
        x, kernel, strides=strides, padding=padding, dilation_rate=(1, 1)), x, kernel)
    _assert_equal_to_rounding(got, want, dtype)


def _depthwise_op_types(channels: int, dilation=(1, 1)) -> list:
    """The op types of a float64 7x7 depthwise convolution over ``channels`` channels as the
    rewritten layers compute it, traced into a graph."""
    conv = tf.function(lambda x, k: depthwise.depthwise_conv(x, k, strides=(1, 1), padding="same",
                                                             dilation_rate=dilation))
    graph = conv.get_concrete_function(tf.TensorSpec((2, 9, 9, channels), tf.float64),
                                       tf.TensorSpec((7, 7, channels, 1), tf.float64)).graph
    return [op.type for op in graph.get_operations()]


@pytest.mark.skipif(bool(tf.config.list_logical_devices("GPU")), reason="a GPU has grouped gradients")
def test_a_float64_depthwise_convolution_is_one_convolution_not_a_slice_per_tap():
    """NASNetMobile's float64 check did not finish: each 7x7 depthwise convolution was 49 slices and
    49 products (and their gradients), 145,726 ops a step. Now one ``Conv2D`` with a block-diagonal
    filter; the slice sum stays past ``BLOCK_DIAGONAL_MAX_CHANNELS`` channels and where dilated."""
    op_types = _depthwise_op_types(176)
    assert op_types.count("Conv2D") == 1 and "StridedSlice" not in op_types and len(op_types) < 15
    wide = _depthwise_op_types(depthwise.BLOCK_DIAGONAL_MAX_CHANNELS + 1)
    assert "Conv2D" not in wide and wide.count("StridedSlice") >= 49
    assert "Conv2D" not in _depthwise_op_types(8, dilation=(2, 2))


def _pooling_model(keras):
    """InceptionV3's branch pooling (3x3, stride 1, "same") and a strided overlapping one."""
    keras.utils.set_random_seed(7)
    inputs = keras.Input((9, 9, 4))
    x = keras.layers.Conv2D(8, 3, padding="same", name="c1")(inputs)
    x = keras.layers.AveragePooling2D((3, 3), strides=(1, 1), padding="same", name="branch_pool")(x)
    x = keras.layers.AveragePooling2D((3, 3), strides=(2, 2), name="strided_pool")(keras.layers.ReLU()(x))
    x = keras.layers.GlobalAveragePooling2D()(x)
    return keras.Model(inputs, keras.layers.Dense(4, name="head")(x))


def _data(shape, dtype="float32"):
    rng = np.random.default_rng(0)
    return rng.normal(size=(BATCH * STEPS, *shape)).astype(dtype), rng.integers(0, 4, BATCH * STEPS).astype("int32")


def _compile(keras, model):
    model.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))


@pytest.mark.parametrize("keras", [tf_keras, keras3], ids=["tf_keras", "keras3"])
def test_overlapping_average_pooling_trains_as_one_device(keras):
    x, y = _data((9, 9, 4))
    strategy, model, reference = helpers.fit_beside_one_device(
        lambda: _pooling_model(keras), lambda m: _compile(keras, m), x, y)
    rewritten = sorted(a.target.rsplit("/", 1)[-1] for a in strategy.changes
                       if a.change.name == "average_pool_as_window_sum")
    assert rewritten == ["branch_pool", "strided_pool"]
    np.testing.assert_allclose(model.predict(x[:13], batch_size=BATCH, verbose=0),
                               reference.predict(x[:13], batch_size=BATCH, verbose=0), rtol=1e-5, atol=1e-5)


def _depthwise_model(dilation=1):
    tf_keras.utils.set_random_seed(7)
    inputs = tf_keras.Input((8, 8, 4))
    x = tf_keras.layers.DepthwiseConv2D(3, padding="same", depth_multiplier=2, dilation_rate=dilation,
                                        name="dw")(inputs)
    x = tf_keras.layers.SeparableConv2D(8, 3, strides=2, name="sep")(tf_keras.layers.ReLU()(x))
    x = tf_keras.layers.GlobalAveragePooling2D()(x)
    return tf_keras.Model(inputs, tf_keras.layers.Dense(4, name="head")(x))


@pytest.mark.parametrize("dilation", [1, 2], ids=["block_diagonal", "dilated_by_taps"])
def test_a_float64_depthwise_model_trains_as_one_device(dilation):
    """The sweep's float64 check of EfficientNet and MobileNetV3: the grouped form's gradients have
    no float64 CPU kernel, so the rewritten layers compute a block-diagonal convolution (the dilated
    ``dw`` layer: sum strided slices); one device runs TensorFlow's own float64 depthwise kernels.
    Equal to float64 rounding."""
    assert not depthwise.grouped_gradients_run(tf.float64) or tf.config.list_logical_devices("GPU")
    tf_keras.backend.set_floatx("float64")
    try:
        x, y = _data((8, 8, 4), "float64")
        strategy, _, _ = helpers.fit_beside_one_device(lambda: _depthwise_model(dilation),
                                                       lambda m: _compile(tf_keras, m), x, y,
                                                       rtol=1e-10, atol=1e-12)
    finally:
        tf_keras.backend.set_floatx("float32")
    assert sorted(a.target.rsplit("/", 1)[-1] for a in strategy.changes
                  if a.change.name == "depthwise_as_grouped_conv") == ["dw", "sep"]


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("dilation, padding", [(2, "same"), ((2, 3), "valid"), (1, "same")])
def test_a_dilated_keras_conv_in_one_conv2d_is_keras_own(dtype, dilation, padding):
    """Keras 3's ``ops.conv`` under ``dilated_convs_in_conv2d`` (one ``Conv2D`` with ``dilations``; in
    float64, which has no dilated gradient kernels on CPU, ``conv_by_taps``) against its own
    (``SpaceToBatchND`` around a convolution): output and both gradients."""
    rng = np.random.default_rng(0)
    x = tf.constant(rng.normal(size=(2, 11, 10, 3)).astype(dtype))
    kernel = tf.constant(rng.normal(size=(3, 3, 3, 4)).astype(dtype))

    def conv():
        return keras3.ops.conv(x, kernel, padding=padding, dilation_rate=dilation)
    want = _value_and_gradients(conv, x, kernel)
    with windows.dilated_convs_in_conv2d():
        got = _value_and_gradients(conv, x, kernel)
    _assert_equal_to_rounding(got, want, dtype)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("keras", [tf_keras, keras3], ids=["tf_keras", "keras3"])
@pytest.mark.parametrize("rank, dilation, padding", [
    (2, 2, "same"), (2, (2, 3), "valid"), (1, 2, "causal"), (1, 3, "same"), (1, 2, "valid")])
def test_a_dilated_conv_layer_in_one_conv2d_is_its_own(dtype, keras, rank, dilation, padding):
    """A ``Conv1D``/``Conv2D`` layer under ``dilated_convs_in_conv2d`` (tf-keras: its ``convolution_op``;
    Keras 3: ``ops.conv``; as one ``Conv2D`` with ``dilations``, a 1-D one of height 1, or
    ``conv_by_taps`` in float64) against its own (``tf.nn.convolution``: ``SpaceToBatchND`` around a
    convolution): output and both gradients."""
    rng = np.random.default_rng(0)
    x = tf.constant(rng.normal(size=(2, 11, 10, 3)[:rank + 1] + (3,)).astype(dtype))
    conv = keras.layers.Conv2D if rank == 2 else keras.layers.Conv1D
    layer = conv(4, 3, padding=padding, dilation_rate=dilation, use_bias=False, dtype=dtype)
    layer.build(x.shape)
    kernel = layer.kernel.value if keras is keras3 else layer.kernel     # Keras 3 wraps the tf.Variable
    want = _value_and_gradients(lambda: layer(x), x, kernel)
    with windows.dilated_convs_in_conv2d():
        got = _value_and_gradients(lambda: layer(x), x, kernel)
    _assert_equal_to_rounding(got, want, dtype)


def _causal_dilated_model(keras):
    """A temporal convolution network in small (WaveNet's stack): causal Conv1Ds dilated 1, 2, 4."""
    keras.utils.set_random_seed(7)
    inputs = keras.Input((16, 4))
    x = inputs
    for rate in (1, 2, 4):
        x = keras.layers.Conv1D(8, 3, padding="causal", dilation_rate=rate, activation="relu", name=f"tcn_{rate}")(x)
    return keras.Model(inputs, keras.layers.Dense(4, name="head")(keras.layers.GlobalAveragePooling1D()(x)))


def _atrous_model(keras):
    """DeepLabV3's atrous spatial pyramid pooling in small: parallel 3x3 convolutions dilated 2 and 3."""
    keras.utils.set_random_seed(7)
    inputs = keras.Input((12, 12, 4))
    x = keras.layers.Conv2D(8, 3, padding="same", name="c1")(inputs)
    branches = [keras.layers.Conv2D(8, 3, padding="same", dilation_rate=rate, name=f"aspp_{rate}")(x)
                for rate in (2, 3)]
    x = keras.layers.GlobalAveragePooling2D()(keras.layers.Concatenate()(branches))
    return keras.Model(inputs, keras.layers.Dense(4, name="head")(x))


@pytest.mark.parametrize("keras", [tf_keras, keras3], ids=["tf_keras", "keras3"])
@pytest.mark.parametrize("build, shape", [(_atrous_model, (12, 12, 4)), (_causal_dilated_model, (16, 4))],
                         ids=["atrous_2d", "causal_1d"])
def test_dilated_convolutions_train_as_one_device(keras, build, shape):
    """Before, the strategy refused the dilated convolutions' SpaceToBatchND before the first step
    (Keras 3: keras-hub DeepLabV3; tf-keras: any Conv2D(dilation_rate=2); both: a causal dilated
    Conv1D)."""
    from keras.src.backend.tensorflow import nn as keras_nn
    from tf_keras.src.layers.convolutional import base_conv
    own, own_op = keras_nn.conv, base_conv.Conv.convolution_op
    x, y = _data(shape)
    _, model, reference = helpers.fit_beside_one_device(lambda: build(keras), lambda m: _compile(keras, m),
                                                        x, y, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(model.predict(x[:13], batch_size=BATCH, verbose=0),
                               reference.predict(x[:13], batch_size=BATCH, verbose=0), rtol=1e-5, atol=1e-5)
    assert keras_nn.conv is own and base_conv.Conv.convolution_op is own_op   # the frameworks' own outside the call
