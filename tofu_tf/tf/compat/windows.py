"""Window ops (average pooling, depthwise convolution) written as sums of strided slices.

This module owns the changes "average_pool_as_window_sum" and "dilated_conv_in_conv2d"
(below). "average_pool_as_window_sum": the ``call`` of an
``AveragePooling2D`` layer (tf-keras and Keras 3, ``channels_last``) whose windows overlap or
whose padding is ``"same"`` (``average_pool_as_mean`` takes the non-overlapping ``"valid"`` ones),
replaced on the layer by ``average_pool_2d``.

Why: TF 2.21's DTensor has no layout propagation for ``AvgPoolGrad`` (the gradient of
``tf.nn.avg_pool``), not even replicated: InceptionV3's and NASNet's 3x3 stride-1 ``"same"``
poolings were refused before the first step, under any plan. A window op over a ``kh x kw``
window is the sum, over the ``kh * kw`` offsets ``(i, j)`` of the window, of the input slice
that offset reads for every output position (``window_taps``): a ``Pad`` and one
``StridedSlice`` per offset, whose gradients (``Pad``'s ``Slice``, ``StridedSliceGrad``) DTensor
lays out like any other op, batch-split or replicated. Average pooling divides that sum by the
number of input positions (not padding) each window covers, as ``tf.nn.avg_pool`` does; the
count is a constant of the shapes, computed once in numpy.

The same sum computes a depthwise convolution (``depthwise_by_taps``, each offset's slice times
that offset's filter row) with ops that exist in every dtype: ``tofu_tf.tf.compat.depthwise``
uses it where this process has no kernel for a grouped convolution's gradients in the input's
dtype (CPU float64, CPU without oneDNN) and its block-diagonal form does not serve (a dilated
convolution in float64, or more channels than that form is worth).

"dilated_conv_in_conv2d": while a model the strategy prepared is called (as
"depthwise_op_as_grouped_conv", ``tofu_tf.tf.compat.slices``), Keras 3's TensorFlow ``conv``
(``dilated_conv``) and tf-keras's convolution layers (``Conv.convolution_op``,
``dilated_tf_keras_conv``) compute a 1-D or 2-D ``channels_last`` stride-1 dilated convolution as
one ``Conv2D`` op with ``dilations`` (a 1-D one as the 2-D one of height 1). Why:
``tf.nn.convolution`` computes a dilated convolution off TPU as
``SpaceToBatchND``, a plain convolution and ``BatchToSpaceND``, and DTensor has no layout
propagation for ``SpaceToBatchND``: keras-hub's DeepLabV3 (atrous spatial pyramid pooling), a
tf-keras ``Conv2D(dilation_rate=2)`` and a causal dilated ``Conv1D`` (WaveNet, TCNs) were refused.
``Conv2D`` with ``dilations`` computes the same (forward bit for bit on one CPU) and DTensor lays it
out as any convolution. TensorFlow's CPU has its gradients in float32 only (oneDNN's:
"Current CPU implementations do not yet support dilation rates larger than 1" in float64); in
another dtype the convolution is the sum over the window's offsets of each offset's slice times
that offset's filter matrix (``conv_by_taps``).

The sums run in another order than TensorFlow's own kernels: equal to about 1e-7 relative in
float32 (``tests/test_windows.py``), not bit for bit.
"""

from __future__ import annotations

import contextlib
import functools
import math
import sys
import types
from typing import Iterator, Sequence

import numpy as np
import tensorflow as tf

from tofu_tf.tf.compat import patching
from tofu_tf.tf.compat.registry import Applied, change


def _extent(size: int, window: int, stride: int, dilation: int, padding: str) -> tuple[int, int, int]:
    """(output size, padding before, padding after) of one spatial axis, as TensorFlow computes them."""
    span = (window - 1) * dilation + 1
    if padding == "valid":
        return max(math.ceil((size - span + 1) / stride), 0), 0, 0
    out = math.ceil(size / stride)
    total = max((out - 1) * stride + span - size, 0)
    return out, total // 2, total - total // 2


def window_taps(inputs, window: Sequence[int], strides: Sequence[int], padding: str,
                dilation: Sequence[int] = (1, 1)) -> Iterator[tuple[tuple[int, int], tf.Tensor]]:
    """For each offset ``(i, j)`` of a ``window`` over ``inputs`` (NHWC, static height and width),
    the ``(batch, out_h, out_w, C)`` slice of the zero-padded input that offset reads for every
    output position."""
    padding = padding.lower()
    (out_h, top, bottom), (out_w, left, right) = (
        _extent(inputs.shape[axis], window[k], strides[k], dilation[k], padding) for k, axis in ((0, 1), (1, 2)))
    if top or bottom or left or right:
        inputs = tf.pad(inputs, [[0, 0], [top, bottom], [left, right], [0, 0]])
    (sh, sw), (dh, dw) = strides, dilation
    for i in range(window[0]):
        for j in range(window[1]):
            yield (i, j), inputs[:, i * dh: i * dh + (out_h - 1) * sh + 1: sh,
                                 j * dw: j * dw + (out_w - 1) * sw + 1: sw, :]


def _window_counts(height: int, width: int, window, strides, padding: str) -> np.ndarray:
    """How many input positions (not padding) each output position's window covers: (1, out_h, out_w, 1)."""
    (out_h, top, bottom), (out_w, left, right) = (
        _extent(size, window[k], strides[k], 1, padding) for k, size in enumerate((height, width)))
    inside = np.pad(np.ones((height, width)), [[top, bottom], [left, right]])
    (sh, sw) = strides
    counts = sum(inside[i: i + (out_h - 1) * sh + 1: sh, j: j + (out_w - 1) * sw + 1: sw]
                 for i in range(window[0]) for j in range(window[1]))
    return counts[None, :, :, None]


def average_pool_2d(inputs, pool_size: Sequence[int], strides: Sequence[int], padding: str):
    """``tf.nn.avg_pool2d`` (NHWC) as the sum of the window's slices over each window's count."""
    pool_size, strides = tuple(pool_size), tuple(strides)
    total = tf.add_n([tap for _, tap in window_taps(inputs, pool_size, strides, padding)])
    counts = _window_counts(inputs.shape[1], inputs.shape[2], pool_size, strides, padding.lower())
    return total / tf.constant(counts, total.dtype)


def depthwise_by_taps(inputs, kernel, *, strides, padding: str, dilation_rate):
    """``tf.nn.depthwise_conv2d`` (NHWC; ``kernel``: ``(kh, kw, C, m)``) as the sum over the window's
    offsets of each offset's slice times that offset's filter (output channel ``c*m + j``: input
    channel ``c`` through ``kernel[:, :, c, j]``, as the depthwise op orders them)."""
    kh, kw, channels, multiplier = kernel.shape
    terms = []
    for (i, j), tap in window_taps(inputs, (kh, kw), strides, padding, dilation_rate):
        if multiplier == 1:
            terms.append(tap * kernel[i, j, :, 0])
        else:
            terms.append(tap[..., None] * kernel[i, j])     # (batch, h, w, C, m)
    total = tf.add_n(terms)
    if multiplier == 1:
        return total
    shape = tf.shape(total)
    return tf.reshape(total, tf.concat([shape[:3], [channels * multiplier]], 0))


def rewrite_average_pool(path: str, layer) -> Applied | None:
    """Replace an overlapping or ``"same"`` ``AveragePooling2D`` layer's call by ``average_pool_2d``
    (``channels_last``); the record of the change, or None where the layer is not one."""
    if type(layer).__name__ not in ("AveragePooling2D", "AvgPool2D") or getattr(layer, "_tofu_window_sum", False):
        return None
    if getattr(layer, "data_format", "channels_last") != "channels_last":
        return None
    layer.call = types.MethodType(_pool_call, layer)
    layer._tofu_window_sum = True  # pylint: disable=protected-access
    return Applied(change("average_pool_as_window_sum"), path, "pooling as a sum of strided slices")


def _pool_call(layer, inputs):
    return average_pool_2d(inputs, layer.pool_size, layer.strides, layer.padding)


def as_tuple(value, n: int) -> tuple[int, ...] | None:
    """``value`` (an int or a sequence) as ``n`` ints, or None where it is not that."""
    items = (value,) * n if isinstance(value, int) else tuple(value)
    return items if len(items) == n and all(isinstance(i, int) for i in items) else None


def conv_by_taps(inputs, kernel, *, strides, padding: str, dilation_rate):
    """``tf.nn.conv2d`` (NHWC; ``kernel``: ``(kh, kw, C_in, C_out)``) as the sum over the window's offsets
    of each offset's slice times that offset's ``(C_in, C_out)`` filter matrix, in any dtype."""
    return tf.add_n([tf.einsum("bhwc,cd->bhwd", tap, kernel[i, j])
                     for (i, j), tap in window_taps(inputs, kernel.shape[:2], strides, padding, dilation_rate)])


def conv_gradients_run(dtype, *, grouped: bool = False, dilated: bool = False) -> bool:
    """Whether this process computes the input gradient of a ``Conv2D`` in ``dtype`` (grouped, or
    dilated): on a GPU; on a CPU where oneDNN's kernels have it (float32, bfloat16), since
    TensorFlow's own have neither grouped nor dilated gradients."""
    return _conv_gradients_run(tf.as_dtype(dtype).name, grouped, dilated)


@functools.lru_cache(maxsize=None)
def _conv_gradients_run(dtype: str, grouped: bool, dilated: bool) -> bool:
    """``conv_gradients_run``, probed once per case on tiny tensors, eagerly, outside any function."""
    if tf.config.list_logical_devices("GPU"):
        return True
    channels = 2 if grouped else 1          # 2 input channels through a filter of depth 1: two groups
    with tf.init_scope(), tf.device("/CPU:0"):
        try:
            tf.raw_ops.Conv2DBackpropInput(
                input_sizes=[1, 3, 3, channels], filter=tf.ones((2, 2, 1, channels), dtype),
                out_backprop=tf.ones((1, 3, 3, channels), dtype), strides=[1, 1, 1, 1], padding="SAME",
                dilations=[1, 2, 2, 1] if dilated else [1, 1, 1, 1])
        except (tf.errors.InvalidArgumentError, tf.errors.UnimplementedError, tf.errors.NotFoundError):
            return False
    return True


def keras3_tf_nn(name: str):
    """(Keras 3's TensorFlow backend ``nn`` module, ``name``): what a thread-scoped patch of one of its
    functions replaces; None where Keras 3 is not imported (nothing to patch)."""
    if "keras" not in sys.modules:
        return None
    from keras.src.backend.tensorflow import nn as keras_nn
    return keras_nn, name


def tf_keras_conv_op():
    """(tf-keras's base ``Conv`` class, ``"convolution_op"``): what a thread-scoped patch replaces;
    None where tf-keras is not imported (nothing to patch)."""
    if "tf_keras" not in sys.modules:
        return None
    from tf_keras.src.layers.convolutional import base_conv
    return base_conv.Conv, "convolution_op"


_DILATED_CONV = patching.ThreadScopedPatch(change("dilated_conv_in_conv2d"), functools.partial(keras3_tf_nn, "conv"))
_DILATED_TF_KERAS_CONV = patching.ThreadScopedPatch(change("dilated_conv_in_conv2d"), tf_keras_conv_op)


def _conv2d_dilated(inputs, kernel, padding: str, dilation_2: tuple[int, int]):
    """A 2-D ``channels_last`` stride-1 dilated convolution as one ``Conv2D`` with ``dilations``
    (``conv_by_taps`` where this process has no dilated gradients in the input's dtype); None where
    neither applies (a dynamic spatial size without dilated gradient kernels)."""
    if conv_gradients_run(inputs.dtype, dilated=True):
        return tf.nn.conv2d(inputs, kernel, strides=1, padding=padding.upper(), dilations=(1, *dilation_2, 1))
    if None in inputs.shape[1:3]:
        return None
    return conv_by_taps(inputs, kernel, strides=(1, 1), padding=padding.lower(), dilation_rate=dilation_2)


def _dilations(inputs, kernel, strides, dilation_rate, padding, channels_last: bool) -> tuple[int, ...] | None:
    """The dilation of a convolution ``_conv_dilated`` computes (1-D or 2-D, ``channels_last``, stride 1,
    dilated, one group, a static filter, ``"valid"``/``"same"`` padding), else None."""
    rank = inputs.shape.rank - 2 if inputs.shape.rank is not None else 0
    dilation = as_tuple(dilation_rate, rank) if rank in (1, 2) else None
    if (dilation is None or max(dilation) == 1 or as_tuple(strides, rank) != (1,) * rank or not channels_last
            or not isinstance(padding, str) or padding.lower() not in ("valid", "same")
            or kernel.shape.rank != rank + 2 or None in kernel.shape or inputs.shape[-1] != kernel.shape[-2]):
        return None
    return dilation


def _conv_dilated(inputs, kernel, padding: str, dilation: tuple[int, ...]):
    """``_conv2d_dilated``; a 1-D convolution as the 2-D one of height 1 (``expand_dims``, not a
    new-axis slice: see ``new_axis_slices_spelled_out``)."""
    if len(dilation) == 2:
        return _conv2d_dilated(inputs, kernel, padding, dilation)
    out = _conv2d_dilated(tf.expand_dims(inputs, 1), tf.expand_dims(kernel, 0), padding, (1, *dilation))
    return None if out is None else tf.squeeze(out, 1)


def dilated_conv(original, inputs, kernel, strides=1, padding="valid", data_format=None, dilation_rate=1):
    """Keras 3's TensorFlow ``conv``, for a 1-D or 2-D ``channels_last`` stride-1 dilated convolution
    (not grouped, static filter), as ``_conv_dilated``; ``original(...)`` for any other convolution."""
    import keras
    inputs, kernel = tf.convert_to_tensor(inputs), tf.convert_to_tensor(kernel)
    layout = data_format or keras.config.image_data_format()
    dilation = _dilations(inputs, kernel, strides, dilation_rate, padding, layout == "channels_last")
    computed = None if dilation is None else _conv_dilated(inputs, kernel, padding, dilation)
    if computed is None:
        return original(inputs, kernel, strides=strides, padding=padding, data_format=data_format,
                        dilation_rate=dilation_rate)
    return computed


def dilated_tf_keras_conv(original, layer, inputs, kernel):
    """tf-keras ``Conv.convolution_op`` (``Conv1D``/``Conv2D``, which compute a dilated convolution
    through ``tf.nn.convolution``'s ``SpaceToBatchND``), for a 1-D or 2-D ``channels_last`` stride-1
    dilated convolution of one group, as ``_conv_dilated`` (``"causal"``: the layer has padded its
    input, as for its own ``"VALID"`` convolution); ``original(layer, ...)`` for any other."""
    inputs, kernel = tf.convert_to_tensor(inputs), tf.convert_to_tensor(kernel)
    padding = "valid" if layer.padding == "causal" else layer.padding
    dilation = None if layer.groups != 1 else _dilations(
        inputs, kernel, tuple(layer.strides), tuple(layer.dilation_rate), padding,
        layer.data_format == "channels_last")
    computed = None if dilation is None else _conv_dilated(inputs, kernel, padding, dilation)
    return original(layer, inputs, kernel) if computed is None else computed


@contextlib.contextmanager
def dilated_convs_in_conv2d() -> Iterator[None]:
    """While active, this thread's Keras 3 ``ops.conv`` (``dilated_conv``) and tf-keras
    convolution layers (``dilated_tf_keras_conv``) compute a dilated 1-D or 2-D convolution as one
    ``Conv2D``. A framework not imported is left alone."""
    with contextlib.ExitStack() as stack:
        if keras3_tf_nn("conv") is not None:
            stack.enter_context(_DILATED_CONV.active(dilated_conv))
        if tf_keras_conv_op() is not None:
            stack.enter_context(_DILATED_TF_KERAS_CONV.active(dilated_tf_keras_conv))
        yield
