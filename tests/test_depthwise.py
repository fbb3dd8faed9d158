"""Depthwise and separable convolutions (``tofu_tf.tf.compat.depthwise``): computed as grouped
convolutions, they compute what one device computes and train under TofuStrategy.

Before, every model with a ``DepthwiseConv2D`` or ``SeparableConv2D`` (EfficientNet, MobileNet,
Xception, ConvNeXt) failed in its first step, under any plan, with DTensor's own
"'tf.DepthwiseConv2dNativeBackpropFilter' op does not implement layout propagation".
"""

import keras as keras3
import numpy as np
import pytest
import tensorflow as tf
import tf_keras

from tests import strategy_helpers as helpers
from tofu_tf.tf.compat import depthwise

BATCH, STEPS = 8, 3
# TensorFlow's CPU kernels for a grouped convolution's gradients, and for a depthwise convolution
# with unequal strides, are oneDNN's, which TensorFlow leaves off on some x86 CPUs (an AMD EPYC):
# there TensorFlow itself cannot compute them, on one device or any ("Gradients for grouped
# convolutions are not supported on CPU"), and the strategy computes depthwise layers by taps
# instead (tested below in a subprocess with oneDNN off).
needs_onednn = pytest.mark.skipif(not depthwise.grouped_gradients_run(),
                                  reason="this CPU's TensorFlow kernels have no grouped-convolution gradients "
                                         "(oneDNN off: TF_ENABLE_ONEDNN_OPTS=1 turns it on)")


@pytest.mark.parametrize("strides, dilation, padding", [
    ((1, 1), (1, 1), "same"), ((2, 2), (1, 1), "same"), ((2, 1), (1, 1), "valid"), ((1, 1), (2, 2), "same"),
    ((1, 1), (1, 3), "valid")])
@needs_onednn
def test_a_grouped_convolution_computes_the_depthwise_one(strides, dilation, padding):
    """Output and both gradients, on one device, against ``tf.nn.depthwise_conv2d``: the same
    bits (the dilated filter gradient sums in another order: 1e-6 relative)."""
    rng = np.random.default_rng(0)
    x = tf.constant(rng.normal(size=(4, 9, 10, 3)).astype("float32"))
    kernel = tf.constant(rng.normal(size=(3, 3, 3, 2)).astype("float32"))

    def run(conv):
        with tf.GradientTape() as tape:
            tape.watch([x, kernel])
            y = conv()
            loss = tf.reduce_sum(y * y)
        return (y, *tape.gradient(loss, [x, kernel]))
    want = run(lambda: tf.nn.depthwise_conv2d(x, kernel, (1, *strides, 1), padding.upper(), dilations=dilation))
    got = run(lambda: depthwise.depthwise_as_grouped_conv(x, kernel, strides=strides, padding=padding,
                                                          dilation_rate=dilation))
    for g, w in zip(got, want):
        assert g.shape == w.shape
        np.testing.assert_allclose(g.numpy(), w.numpy(), rtol=1e-6, atol=1e-6 * np.abs(w.numpy()).max())


def _model(keras, one_d=False):
    keras.utils.set_random_seed(7)
    if one_d:
        inputs = keras.Input((12, 4))
        x = keras.layers.Conv1D(8, 3, padding="same", name="c1")(inputs)
        x = keras.layers.DepthwiseConv1D(3, padding="same", depth_multiplier=2, name="dw")(x)
        x = keras.layers.SeparableConv1D(8, 3, strides=2, padding="valid", activation="relu", name="sep")(x)
        x = keras.layers.GlobalAveragePooling1D()(x)
    else:
        inputs = keras.Input((8, 8, 4))
        x = keras.layers.Conv2D(8, 3, padding="same", name="c1")(inputs)
        x = keras.layers.DepthwiseConv2D(3, padding="same", depth_multiplier=2, activation="relu", name="dw")(x)
        x = keras.layers.DepthwiseConv2D(3, strides=2, padding="valid", use_bias=False, name="dw_strided")(x)
        x = keras.layers.SeparableConv2D(8, 3, dilation_rate=2, padding="same", name="sep")(x)
        x = keras.layers.GlobalAveragePooling2D()(x)
    return keras.Model(inputs, keras.layers.Dense(4, name="head")(x))


def _data(model):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(BATCH * STEPS, *model.input_shape[1:])).astype("float32")
    return x, rng.integers(0, 4, BATCH * STEPS).astype("int32")


def _compile(keras, model):
    model.compile(optimizer=keras.optimizers.SGD(0.05),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))


@pytest.mark.parametrize("one_d", [False, True], ids=["2d", "1d"])
@pytest.mark.parametrize("keras", [tf_keras, keras3], ids=["tf_keras", "keras3"])
def test_depthwise_and_separable_layers_train_as_one_device(keras, one_d):
    x, y = _data(_model(keras, one_d))
    strategy, model, reference = helpers.fit_beside_one_device(
        lambda: _model(keras, one_d), lambda m: _compile(keras, m), x, y)
    rewritten = sorted(a.target.rsplit("/", 1)[-1] for a in strategy.changes
                       if a.change.name == "depthwise_as_grouped_conv")
    assert rewritten == (["dw", "sep"] if one_d else ["dw", "dw_strided", "sep"])
    np.testing.assert_allclose(model.predict(x, batch_size=BATCH, verbose=0),
                               reference.predict(x, batch_size=BATCH, verbose=0), rtol=1e-5, atol=1e-5)


class _OwnDepthwise(keras3.layers.Layer):
    """A layer calling ``keras.ops.depthwise_conv`` itself, as keras-hub Qwen3.5's gated delta net
    convolves its projections causally (``_causal_conv1d``: pad, then a 1-D depthwise convolution)."""

    def build(self, shape):
        self.kernel = self.add_weight(shape=(3,) * (len(shape) - 2) + (shape[-1], 1), initializer="glorot_uniform")

    def call(self, x):
        if x.shape.rank == 3:
            x = keras3.ops.pad(x, [[0, 0], [2, 0], [0, 0]])
        return keras3.ops.depthwise_conv(x, self.kernel, padding="valid")


def _own_depthwise_model(one_d):
    keras3.utils.set_random_seed(7)
    inputs = keras3.Input((12, 4) if one_d else (8, 8, 4))
    x = _OwnDepthwise(name="own_dw")(keras3.layers.Dense(8, name="d1")(inputs))
    pooled = (keras3.layers.GlobalAveragePooling1D() if one_d else keras3.layers.GlobalAveragePooling2D())(x)
    return keras3.Model(inputs, keras3.layers.Dense(4, name="head")(pooled))


@pytest.mark.parametrize("one_d", [False, True], ids=["2d", "1d"])
def test_a_layers_own_keras_depthwise_conv_trains_as_one_device(one_d):
    """Before, the strategy refused the layer's DepthwiseConv2dNativeBackpropFilter before the first
    step (keras-hub Qwen3.5-MoE's linear attention); its call now computes the grouped convolution
    (``depthwise_op_as_grouped_conv``), and only while the model is called."""
    from keras.src.backend.tensorflow import nn as keras_nn
    own = keras_nn.depthwise_conv
    x, y = _data(_own_depthwise_model(one_d))
    strategy, model, reference = helpers.fit_beside_one_device(
        lambda: _own_depthwise_model(one_d), lambda m: _compile(keras3, m), x, y)
    np.testing.assert_allclose(model.predict(x, batch_size=BATCH, verbose=0),
                               reference.predict(x, batch_size=BATCH, verbose=0), rtol=1e-5, atol=1e-5)
    assert keras_nn.depthwise_conv is own          # Keras' own outside the model's call


@pytest.mark.parametrize("strides, dilation, one_d", [(1, 1, True), (2, 1, True), (1, 2, False),
                                                    pytest.param((2, 1), 1, False, marks=needs_onednn)])
def test_a_keras_depthwise_conv_by_groups_is_keras_own(strides, dilation, one_d):
    rng = np.random.default_rng(0)
    x = tf.constant(rng.normal(size=(2, 9, 4) if one_d else (2, 9, 10, 4)).astype("float32"))
    kernel = tf.constant(rng.normal(size=(3, 4, 2) if one_d else (3, 3, 4, 2)).astype("float32"))
    want = keras3.ops.depthwise_conv(x, kernel, strides=strides, padding="same", dilation_rate=dilation)
    with depthwise.depthwise_ops_as_grouped():
        got = keras3.ops.depthwise_conv(x, kernel, strides=strides, padding="same", dilation_rate=dilation)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_the_rewrite_keeps_what_it_cannot_express():
    """channels_first, and a stride with a dilation, keep the layer's own call."""
    first = keras3.layers.DepthwiseConv2D(3, data_format="channels_first")
    both = keras3.layers.SeparableConv1D(4, 3, strides=2, dilation_rate=2)
    plain = keras3.layers.Conv2D(4, 3)
    assert [depthwise.rewrite_depthwise("x", layer) for layer in (first, both, plain)] == [None] * 3
    assert "call" not in vars(first) and "call" not in vars(both)


def _efficientnet():
    import keras_hub
    keras3.utils.set_random_seed(3)
    backbone = keras_hub.models.EfficientNetBackbone(
        stackwise_width_coefficients=[1.0] * 2, stackwise_depth_coefficients=[1.0] * 2,
        stackwise_kernel_sizes=[3, 3], stackwise_num_repeats=[1, 1], stackwise_input_filters=[8, 8],
        stackwise_output_filters=[8, 16], stackwise_expansion_ratios=[1, 2],
        stackwise_squeeze_and_excite_ratios=[0.25, 0.25], stackwise_strides=[1, 2],
        stackwise_block_types=["v1", "v1"], stackwise_force_input_filters=[0, 0],
        stackwise_nores_option=[False, False], input_shape=(16, 16, 3), dropout=0.0, num_features=32)
    return keras_hub.models.EfficientNetImageClassifier(backbone=backbone, num_classes=4, preprocessor=None,
                                                        dropout=0.0)


def _xception():
    import keras_hub
    keras3.utils.set_random_seed(3)
    backbone = keras_hub.models.XceptionBackbone(stackwise_conv_filters=[[8, 8], [16, 16], [16, 16]],
                                                 stackwise_pooling=[True, True, False], image_shape=(16, 16, 3))
    pooled = keras3.layers.GlobalAveragePooling2D()(backbone.output)
    return keras3.Model(backbone.input, keras3.layers.Dense(4, name="head")(pooled))


@pytest.mark.slow
@pytest.mark.parametrize("build", [_efficientnet, _xception], ids=["efficientnet", "xception"])
def test_keras_hub_depthwise_backbones_train_as_one_device(build):
    """Tiny keras-hub nets (random weights, no download): EfficientNet (a DepthwiseConv2D in every
    MBConv block, BatchNormalization, squeeze-and-excite) and Xception (SeparableConv2D).
    SGD with momentum, 3 steps."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(BATCH * STEPS, 16, 16, 3)).astype("float32")
    y = rng.integers(0, 4, BATCH * STEPS).astype("int32")
    strategy, _, _ = helpers.fit_beside_one_device(build, lambda m: _compile(keras3, m), x, y, rtol=1e-5, atol=1e-5)
    assert any(a.change.name == "depthwise_as_grouped_conv" for a in strategy.changes)


_WITHOUT_ONEDNN = """
from tofu_tf.tf import devices
devices.configure_virtual_cpus(8)
import numpy as np
import keras
from tofu_tf.strategies import TofuStrategy
from tofu_tf.tf.compat import depthwise
assert not depthwise.grouped_gradients_run()

def build():
    keras.utils.set_random_seed(7)
    inputs = keras.Input((6, 6, 4))
    x = keras.layers.GlobalAveragePooling2D()(keras.layers.DepthwiseConv2D(3, name="dw")(inputs))
    model = keras.Model(inputs, keras.layers.Dense(2)(x))
    model.compile(optimizer="sgd", loss="mse")
    return model
x, y = np.random.default_rng(0).normal(size=(2, 8, 6, 6, 4)).astype("float32"), np.ones((8, 2), "float32")
reference = build()
want = [reference.train_on_batch(x[i], y) for i in range(2)]
strategy = TofuStrategy(8)
with strategy.scope():
    model = build()
    model.set_weights(build().get_weights())
got = [float(model.fit(x[i], y, batch_size=8, verbose=0).history["loss"][0]) for i in range(2)]
np.testing.assert_allclose(got, want, rtol=1e-6)
print("REWRITTEN", [a.target for a in strategy.changes if a.change.name == "depthwise_as_grouped_conv"])
"""


def test_without_grouped_gradient_kernels_the_depthwise_layer_sums_strided_slices():
    """TensorFlow's own CPU kernels (oneDNN off) have no grouped-convolution gradients: the
    rewritten layer computes its depthwise convolution as a sum of strided slices
    (``tofu_tf.tf.compat.windows``) and trains as one device. (Before, the layer kept its
    depthwise call and the strategy refused its gradient before the first step.)"""
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", _WITHOUT_ONEDNN], cwd=root, capture_output=True, text=True,
                         timeout=300, env={**os.environ, "PYTHONPATH": root, "TF_ENABLE_ONEDNN_OPTS": "0"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert "REWRITTEN" in out.stdout and "dw" in out.stdout.split("REWRITTEN", 1)[1], out.stdout[-2000:]



def _mobilenet():
    """keras-hub's MobileNet (V3 blocks: grouped depthwise convolutions, squeeze-and-excite,
    hard-swish) from a tiny config, a pooled classifier head."""
    import keras_hub
    keras3.utils.set_random_seed(3)
    backbone = keras_hub.models.MobileNetBackbone(
        stackwise_expansion=[[16, 24], [32]], stackwise_num_blocks=[2, 1], stackwise_num_filters=[[8, 8], [16]],
        stackwise_kernel_size=[[3, 3], [3]], stackwise_num_strides=[[2, 1], [2]],
        stackwise_se_ratio=[[None, None], [0.25]], stackwise_activation=[["relu", "relu"], ["hard_swish"]],
        stackwise_padding=[[1, 1], [1]], output_num_filters=32, depthwise_filters=8, depthwise_stride=2,
        depthwise_residual=False, last_layer_filter=32, squeeze_and_excite=0.5, image_shape=(32, 32, 3),
        input_num_filters=8)
    pooled = keras3.layers.GlobalAveragePooling2D()(backbone.output)
    return keras3.Model(backbone.input, keras3.layers.Dense(4, name="head")(pooled))


# The betas of _mobilenet() whose gradient is zero in exact arithmetic. Each is the beta of a block's
# last BatchNormalization (block_0_0's bn2, the inverted residual blocks' bn3), whose output reaches the
# loss only through the next block's bias-free 1x1 convolution and its BatchNormalization (through the
# residual Add of block_1_1 too): the beta adds a constant per channel, the 1x1 convolution maps it to
# a constant per channel, and the next BatchNormalization subtracts its batch mean, so the loss does
# not depend on it. Its computed gradient is rounding noise (checked below on one device), which
# differs between one device's sums and the sharded ones; Adam divides a gradient by its own
# magnitude and turns that noise into steps of about the learning rate, on each side.
ZERO_GRADIENT_BETAS = ("block_0_0/block_0_0_bn2/beta", "block_1_0/block_1_0_bn3/beta",
                       "block_1_1/block_1_1_bn3/beta", "block_2_0/block_2_0_bn3/beta")
LEARNING_RATE = 1e-3


@pytest.mark.slow
@needs_onednn           # keras-hub MobileNet writes grouped Conv2Ds itself: one device cannot train it either
def test_mobilenet_trains_with_adam_as_one_device_but_for_betas_without_gradient():
    """keras-hub MobileNet, 3 steps of Adam: the losses and every weight (moving statistics included)
    as on one device, at 1e-5, but for the betas of ``ZERO_GRADIENT_BETAS``, exempt for the reason
    given there and only held to Adam's bound (a learning rate per step). The exemption is checked:
    on one device those betas' gradients are a millionth of the largest."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(BATCH * STEPS, 32, 32, 3)).astype("float32")
    y = rng.integers(0, 4, BATCH * STEPS).astype("int32")
    probe = _mobilenet()
    loss = keras3.losses.SparseCategoricalCrossentropy(from_logits=True)
    with tf.GradientTape() as tape:
        value = loss(y[:BATCH], probe(x[:BATCH], training=True))
    gradients = {w.path: g for w, g in zip(probe.trainable_weights, tape.gradient(value, probe.trainable_weights))}
    largest = max(float(tf.reduce_max(tf.abs(g))) for g in gradients.values())
    for path, gradient in gradients.items():
        no_gradient = float(tf.reduce_max(tf.abs(gradient))) <= 1e-6 * largest
        assert no_gradient == (path in ZERO_GRADIENT_BETAS), (path, float(tf.reduce_max(tf.abs(gradient))), largest)

    def compile_adam(model):
        model.compile(optimizer=keras3.optimizers.Adam(LEARNING_RATE), loss=loss)
    reference = _mobilenet()
    initial = reference.get_weights()
    compile_adam(reference)
    want = reference.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0).history["loss"]
    from tofu_tf.strategies import TofuStrategy
    strategy = TofuStrategy(8)
    with strategy.scope():
        model = _mobilenet()
        model.set_weights(initial)
        compile_adam(model)
    got = model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0).history["loss"]
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for weight, g, w in zip(model.weights, model.get_weights(), reference.get_weights()):
        if weight.path in ZERO_GRADIENT_BETAS:
            np.testing.assert_array_less(np.abs(g - w), STEPS * LEARNING_RATE * 1.01, err_msg=weight.path)
        else:
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5, err_msg=weight.path)
