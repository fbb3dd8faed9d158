"""Depthwise and separable convolution layers computed as grouped convolutions.

This module owns the change "depthwise_as_grouped_conv": the ``call`` of Keras'
``DepthwiseConv1D``/``DepthwiseConv2D`` and ``SeparableConv1D``/``SeparableConv2D``
layers (tf-keras and Keras 3), replaced on the layer by one computing the same with
a grouped ``Conv2D``. It touches nothing else: other convolutions, and depthwise
convolutions a layer calls itself (``keras.ops.depthwise_conv``), are left as they
are (the plan refuses the latter before the first step, ``tofu_tf.search.targets``).

Why: TF 2.21's DTensor has no layout propagation for ``DepthwiseConv2dNativeBackpropFilter``
nor ``DepthwiseConv2dNativeBackpropInput`` (a depthwise convolution's gradients), not
even replicated, and none for the ``SpaceToBatchND`` a dilated one is built with: every
EfficientNet-, MobileNet-, Xception- or ConvNeXt-style net failed in its first step,
under any plan. A depthwise convolution with multiplier ``m`` over ``C`` channels is the
convolution with ``C`` groups whose filter is the depthwise filter reshaped from
``(kh, kw, C, m)`` to ``(kh, kw, 1, C*m)``: output channel ``c*m + j`` of both reads input
channel ``c`` through filter ``[:, :, c, j]``. ``Conv2D`` with groups and its two
gradients are expanded by DTensor replicated and batch-split (``tests/test_depthwise.py``
probes both); on one CPU its outputs and gradients are bit-identical to the depthwise
kernels' (dilated: the filter gradient within 1e-6 relative). keras-hub's MobileNet
writes its depthwise convolutions that way itself (``Conv2D(groups=...)``).

It also owns the change "depthwise_op_as_grouped_conv": while a model the strategy prepared is
called (traced for planning or into a step program; on the calling thread, with the other
changes of ``new_axis_slices_spelled_out``), Keras 3's TensorFlow ``depthwise_conv`` (the module
function behind ``keras.ops.depthwise_conv``) computes the same grouped convolution, so a layer's
own depthwise convolution trains too (keras-hub Qwen3.5's gated delta net convolves its
projections causally so, ``_causal_conv1d``).

Only ``channels_last`` layers are rewritten, and not one with both a stride and a
dilation above 1 (Keras 3 decomposes that case itself); the rest keep their call.
The layer's weights, config and saved form are unchanged.

TensorFlow's CPU kernels for a grouped convolution's gradients are oneDNN's (on by default on
x86), in float32 (and bfloat16) only; TensorFlow's own raise "Gradients for grouped convolutions
are not supported on CPU" (float64, or ``TF_ENABLE_ONEDNN_OPTS=0``): the float64 check of
``tofu_tf.strategies.hub_sweep`` failed inside TensorFlow on EfficientNet and MobileNetV3, and a
CPU without oneDNN refused every depthwise layer. Where no GPU is visible and the CPU cannot
compute them in the input's dtype (``grouped_gradients_run``, probed once per dtype on two tiny
tensors), the rewritten call computes the depthwise convolution as one ordinary convolution whose
filter is block-diagonal (``depthwise_as_block_diagonal_conv``: each input channel feeds only its
own ``m`` outputs), whose gradients TensorFlow's CPU has in every float dtype. It costs ``C`` times
the arithmetic and filter memory of the depthwise kernel, so past ``BLOCK_DIAGONAL_MAX_CHANNELS``
channels, and for a dilated one where the CPU has no dilated gradients (float64), the call sums
the window's strided slices instead (``tofu_tf.tf.compat.windows.depthwise_by_taps``): as much
arithmetic as the depthwise kernel, but ``kh * kw`` slices and products, each with its gradient,
which made NASNetMobile's float64 step (5x5 and 7x7 separable convolutions) 145,726 ops that did
not compile in 45 minutes.
"""

from __future__ import annotations

import contextlib
import functools
import types
from typing import Iterator

import numpy as np
import tensorflow as tf

from tofu_tf.tf.compat import patching, windows
from tofu_tf.tf.compat.registry import Applied, change

DEPTHWISE_LAYERS = frozenset({"DepthwiseConv1D", "DepthwiseConv2D", "SeparableConv1D", "SeparableConv2D"})

# The block-diagonal form does ``C`` times the depthwise arithmetic and holds a ``C``-times larger
# filter; past this many channels the slice sum (as much arithmetic, more ops) is kept.
BLOCK_DIAGONAL_MAX_CHANNELS = 256


def rewrite_depthwise(path: str, layer) -> Applied | None:
    """Replace ``layer.call`` by its grouped-convolution form when ``layer`` is a depthwise
    or separable convolution this module can rewrite; the record of the change, or None."""
    if not _rewritable(layer):
        return None
    layer.call = types.MethodType(_grouped_call, layer)
    layer._tofu_grouped = True  # pylint: disable=protected-access
    return Applied(change("depthwise_as_grouped_conv"), path, "depthwise convolution as a grouped Conv2D")


def grouped_gradients_run(dtype=tf.float32) -> bool:
    """Whether this process can compute a grouped convolution's input gradient in ``dtype``: on a
    GPU (cuDNN), or on a CPU whose kernels are oneDNN's (float32, bfloat16)."""
    return windows.conv_gradients_run(dtype, grouped=True)


def _rewritable(layer) -> bool:
    kinds = {cls.__name__ for cls in type(layer).__mro__}
    if not kinds & DEPTHWISE_LAYERS or getattr(layer, "_tofu_grouped", False):
        return False
    if getattr(layer, "data_format", "channels_last") != "channels_last":
        return False
    strides, dilation = tuple(layer.strides), tuple(layer.dilation_rate)
    return not (max(strides) > 1 and max(dilation) > 1)


def depthwise_as_grouped_conv(inputs, kernel, *, strides, padding: str, dilation_rate):
    """``tf.nn.depthwise_conv2d`` (NHWC) computed by a grouped ``tf.nn.conv2d``.

    ``inputs``: ``(batch, height, width, C)``; ``kernel``: ``(kh, kw, C, m)``; ``strides``
    and ``dilation_rate``: two ints each; ``padding``: ``"same"`` or ``"valid"``."""
    kh, kw, channels, multiplier = kernel.shape
    filters = tf.reshape(kernel, (kh, kw, 1, channels * multiplier))
    return tf.nn.conv2d(inputs, filters, strides=(1, *strides, 1), padding=padding.upper(),
                        dilations=(1, *dilation_rate, 1))


def depthwise_as_block_diagonal_conv(inputs, kernel, *, strides, padding: str, dilation_rate):
    """``tf.nn.depthwise_conv2d`` (NHWC) computed by one ordinary ``tf.nn.conv2d`` whose
    ``(kh, kw, C, C*m)`` filter holds ``kernel[:, :, c, j]`` at input channel ``c``, output channel
    ``c*m + j``, and zeros elsewhere: the kernel times a constant identity mask, reshaped."""
    kh, kw, channels, multiplier = kernel.shape
    mask = tf.constant(np.eye(channels).reshape(1, 1, channels, channels, 1), kernel.dtype)
    filters = tf.reshape(tf.expand_dims(kernel, 3) * mask, (kh, kw, channels, channels * multiplier))
    return tf.nn.conv2d(inputs, filters, strides=(1, *strides, 1), padding=padding.upper(),
                        dilations=(1, *dilation_rate, 1))


def depthwise_conv(inputs, kernel, *, strides, padding: str, dilation_rate):
    """The depthwise convolution the rewritten calls compute: ``depthwise_as_grouped_conv`` where
    grouped gradients run in the input's dtype; else ``depthwise_as_block_diagonal_conv`` where an
    ordinary convolution's gradients run and the kernel has at most ``BLOCK_DIAGONAL_MAX_CHANNELS``
    channels; else ``windows.depthwise_by_taps``."""
    if grouped_gradients_run(inputs.dtype):
        conv = depthwise_as_grouped_conv
    elif (kernel.shape[2] <= BLOCK_DIAGONAL_MAX_CHANNELS
          and windows.conv_gradients_run(inputs.dtype, dilated=max(dilation_rate) > 1)):
        conv = depthwise_as_block_diagonal_conv
    else:
        conv = windows.depthwise_by_taps
    return conv(inputs, kernel, strides=strides, padding=padding, dilation_rate=dilation_rate)


_DEPTHWISE_OP = patching.ThreadScopedPatch(change("depthwise_op_as_grouped_conv"),
                                           functools.partial(windows.keras3_tf_nn, "depthwise_conv"))


def grouped_depthwise_op(original, inputs, kernel, strides=1, padding="valid", data_format=None, dilation_rate=1):
    """Keras 3's TensorFlow ``depthwise_conv`` as ``depthwise_conv`` computes it (``channels_last``, 1-D
    or 2-D, not both a stride and a dilation above 1, static filter); ``original(...)`` otherwise."""
    import keras
    inputs, kernel = tf.convert_to_tensor(inputs), tf.convert_to_tensor(kernel)
    n = (inputs.shape.rank or 0) - 2
    strides_n, dilation_n = windows.as_tuple(strides, n), windows.as_tuple(dilation_rate, n)
    layout = data_format or keras.config.image_data_format()
    if (n not in (1, 2) or strides_n is None or dilation_n is None or layout != "channels_last"
            or (max(strides_n) > 1 and max(dilation_n) > 1) or None in kernel.shape):
        return original(inputs, kernel, strides=strides, padding=padding, data_format=data_format,
                        dilation_rate=dilation_rate)
    if n == 1:
        outputs = depthwise_conv(tf.expand_dims(inputs, 1), tf.expand_dims(kernel, 0),
                                 strides=(1, *strides_n), padding=padding, dilation_rate=(1, *dilation_n))
        return tf.squeeze(outputs, 1)
    return depthwise_conv(inputs, kernel, strides=strides_n, padding=padding, dilation_rate=dilation_n)


@contextlib.contextmanager
def depthwise_ops_as_grouped() -> Iterator[None]:
    """While active, this thread's Keras 3 ``ops.depthwise_conv`` computes a grouped convolution
    (``grouped_depthwise_op``). Without Keras 3 imported, nothing changes."""
    if windows.keras3_tf_nn("depthwise_conv") is None:
        yield
        return
    with _DEPTHWISE_OP.active(grouped_depthwise_op):
        yield


def _grouped_call(layer, inputs):
    """The layer's call (depthwise, then the pointwise kernel of a separable layer, bias,
    activation) with the depthwise convolution as a grouped one. A 1-D layer runs as a
    2-D one over a height of 1, as Keras runs it."""
    one_d = inputs.shape.rank == 3
    depthwise = getattr(layer, "depthwise_kernel", None)
    depthwise = tf.convert_to_tensor(layer.kernel if depthwise is None else depthwise)
    strides, dilation = tuple(layer.strides), tuple(layer.dilation_rate)
    if one_d:
        inputs, depthwise = tf.expand_dims(inputs, 1), tf.expand_dims(depthwise, 0)
        strides, dilation = (1, *strides), (1, *dilation)
    outputs = depthwise_conv(inputs, depthwise, strides=strides, padding=layer.padding, dilation_rate=dilation)
    pointwise = getattr(layer, "pointwise_kernel", None)
    if pointwise is not None:
        pointwise = tf.convert_to_tensor(pointwise)
        if one_d:
            pointwise = tf.expand_dims(pointwise, 0)
        outputs = tf.nn.conv2d(outputs, pointwise, strides=(1, 1, 1, 1), padding="VALID")
    if one_d:
        outputs = tf.squeeze(outputs, 1)
    if layer.use_bias:
        outputs = tf.nn.bias_add(outputs, tf.convert_to_tensor(layer.bias))
    return outputs if layer.activation is None else layer.activation(outputs)
