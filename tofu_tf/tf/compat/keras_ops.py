"""Keras 3 ops whose TensorFlow kernel DTensor cannot lay out, written with ops it can, while a
step on the mesh is traced.

* ``slice_update_as_select``: Keras 3's TensorFlow backend writes ``keras.ops.slice_update`` as
  XLA's ``dynamic_update_slice`` (the op ``XlaDynamicUpdateSlice``). DTensor has no layout
  propagation for it, not even on replicated inputs, and it has no CPU kernel, so neither
  DTensor's nor grappler's constant folding removes it where its inputs are constants:
  keras-hub's Swin Transformer builds its shifted windows' attention mask so, from zeros and
  ones, in every step, and the step failed (``'tf.XlaDynamicUpdateSlice' op does not implement
  layout propagation``); keras-hub's decoding loop updates its key/value cache and its prompt
  so, at a start that is a tensor. The replacement pads the update to the input's shape at the
  start indices and selects it where it lands (``Pad`` and ``SelectV2``, which DTensor lays out
  like the input, so a cache split over the batch or the heads stays split), with the starts
  clamped into the input as XLA clamps them: the value is the same for every start.
  (``TensorStridedSliceUpdate`` was tried first: under DTensor it silently left the input
  unchanged when the start was a tensor, replicated or split, on TF 2.21.)
* ``roll_as_slices``: ``keras.ops.roll`` is ``tf.roll`` (the op ``Roll``), for which DTensor has
  no layout propagation either (Swin's shifted windows roll the activations in every block). A
  roll by a static shift along a dim of static size is the concatenation of two slices of that
  dim, which DTensor lays out as it lays out any slice (the batch split stays where it is); the
  values are the same. A shift or axis given as a tensor, or a roll of the flattened tensor
  (``axis=None``), keeps ``tf.roll``.
* ``one_hot_as_equal``: ``keras.ops.one_hot`` is ``tf.one_hot`` (the op ``OneHot``). DTensor's
  OneHot expander mis-shapes its output where layout propagation carries a split onto the
  one-hot (depth) axis from the ops after it: a mixture-of-experts router (keras-hub Qwen3-MoE)
  one-hot encodes the experts it picked and weights the experts' outputs, whose expert axis the
  plan splits, by the result, and the first step failed ("SPMD expansion resulted in op output
  inconsistent with the provided layout. Expected shape: <64,2,16> got shape: <64,2,4>", after
  "non-broadcastable operands"); the planner keeps the depth axis whole, but DTensor propagates
  its consumers' layout into the op. The replacement compares the indices with ``range(depth)``
  (``Equal`` of the indices, a new trailing axis, and a ``Range``; then a ``Cast``), which DTensor
  lays out element-wise in any layout; the values are the same bits (1 where the index is the
  class, else 0; an index out of range gives a row of zeros, as ``tf.one_hot``). A sparse one-hot,
  or one along another axis than the last, keeps ``tf.one_hot``.
* ``top_k_gradient_by_comparison``: ``keras.ops.top_k`` is ``tf.math.top_k`` (``TopKV2``), whose
  gradient scatters the values' gradient into the input's flattened shape at global flat positions
  (``ScatterNd``). Where the input is split over the batch (a router's tokens, data parallel),
  DTensor's propagation splits the scatter's output like the rest of the batch, and its ScatterNd
  expander indexes each shard with the global positions: keras-hub Qwen3.5-MoE's first step failed
  ("indices[127] = [253] does not index into shape [32]"). The replacement keeps ``TopKV2`` forward
  and computes its gradient as ``sum_k dvalues[..., k] * (indices[..., k] == range(n))``, an
  element-wise product and a sum over ``k`` DTensor lays out in any layout; the top-k indices of a
  row are distinct, so each input position receives its one gradient plus zeros: the same bits. An
  integer input keeps ``tf.math.top_k``.
* ``split_as_slices``: ``keras.ops.split`` is ``tf.split`` (``Split``/``SplitV``), whose DTensor
  expander refuses an input split along the axis it cuts ("Spliting over sharded dimension is not
  supported"). The planner never gives a Split such an input (``tofu_tf.search.targets``) and
  prices the relayout before it, but DTensor's propagation carries the layout of the op before
  (an expert bank's ``einsum`` whose kernel the plan splits on that axis) into the Split: keras-hub
  Qwen-MoE's experts (``ops.split(gate_up, 2, axis=-1)``) failed in their first step on a
  batch x model mesh. The replacement takes each section as a slice of that axis, which DTensor's
  slice expander lays out by gathering the axis first: the relayout the plan priced, the same values.
  Sections or indices given as tensors, or an axis of unknown size, keep ``tf.split``.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import tensorflow as tf

from tofu_tf.tf.compat import patching
from tofu_tf.tf.compat.registry import change


def _keras3_slice_update():
    import sys
    if "keras" not in sys.modules:
        return None
    from keras.src.backend.tensorflow import core
    return core, "slice_update"


def slice_update_as_select(inputs, start_indices, updates):
    """``inputs`` with ``updates`` written at ``start_indices``, as XLA's
    ``dynamic_update_slice`` writes it: each start clamped to ``[0, input dim - update dim]``;
    the update padded to the input's shape there and selected where it lands."""
    inputs = tf.convert_to_tensor(inputs)
    updates = tf.cast(tf.convert_to_tensor(updates), inputs.dtype)
    if isinstance(start_indices, (list, tuple)):
        starts = tf.stack([tf.cast(tf.convert_to_tensor(start), tf.int32) for start in start_indices])
    else:
        starts = tf.cast(tf.convert_to_tensor(start_indices), tf.int32)
    size = tf.shape(inputs, out_type=tf.int32)
    update_size = tf.shape(updates, out_type=tf.int32)
    starts = tf.clip_by_value(starts, 0, tf.maximum(size - update_size, 0))
    paddings = tf.stack([starts, size - starts - update_size], axis=1)
    landed = tf.pad(tf.ones(update_size, tf.int8), paddings) > 0
    return tf.where(landed, tf.pad(updates, paddings), inputs)


def _keras3_roll():
    import sys
    if "keras" not in sys.modules:
        return None
    from keras.src.backend.tensorflow import numpy as keras_numpy
    return keras_numpy, "roll"


def _static_ints(value):
    """``value`` as a tuple of Python ints, or None when it holds a tensor."""
    items = value if isinstance(value, (tuple, list)) else (value,)
    if not all(isinstance(item, int) or (hasattr(item, "__index__") and not tf.is_tensor(item)) for item in items):
        return None
    return tuple(int(item) for item in items)


def roll_as_slices(original, x, shift, axis=None):
    """``tf.roll(x, shift, axis)`` as concatenated slices where shift, axis and the rolled dims'
    sizes are static; ``original(x, shift, axis)`` otherwise."""
    shifts, axes = _static_ints(shift), None if axis is None else _static_ints(axis)
    x = tf.convert_to_tensor(x)
    if shifts is None or axes is None or x.shape.rank is None:
        return original(x, shift, axis=axis)
    if len(shifts) != len(axes) or any(x.shape[a] is None for a in axes):
        return original(x, shift, axis=axis)
    for step, dim in zip(shifts, axes):
        size = x.shape[dim]
        step %= size
        if step:
            head = [slice(None)] * x.shape.rank
            tail = list(head)
            head[dim], tail[dim] = slice(size - step, size), slice(0, size - step)
            x = tf.concat([x[tuple(head)], x[tuple(tail)]], axis=dim)
    return x


def _keras3_one_hot():
    import sys
    if "keras" not in sys.modules:
        return None
    from keras.src.backend.tensorflow import nn as keras_nn
    return keras_nn, "one_hot"


def one_hot_as_equal(original, x, num_classes, axis=-1, dtype=None, sparse=False):
    """``keras.ops.one_hot(x, num_classes, dtype=dtype)`` as ``Equal(x[..., None], range(num_classes))``
    cast to ``dtype`` (float32 by default); ``original(...)`` for a sparse one-hot or another axis."""
    x = tf.convert_to_tensor(x)
    if sparse or axis not in (-1, x.shape.rank) or not x.dtype.is_integer:
        return original(x, num_classes, axis=axis, dtype=dtype, sparse=sparse)
    classes = tf.range(num_classes, dtype=x.dtype)
    hit = tf.equal(tf.expand_dims(x, -1), classes)
    return hit if dtype == "bool" else tf.cast(hit, dtype or "float32")


def _keras3_top_k():
    import sys
    if "keras" not in sys.modules:
        return None
    from keras.src.backend.tensorflow import math as keras_math
    return keras_math, "top_k"


def top_k_gradient_by_comparison(original, x, k, sorted=True):  # pylint: disable=redefined-builtin
    """``tf.math.top_k(x, k, sorted)``, its gradient with respect to ``x`` computed by comparing the
    indices with ``range(n)`` instead of scattering (see the module docstring); ``original(...)``
    for an integer ``x``."""
    x = tf.convert_to_tensor(x)
    if not x.dtype.is_floating:
        return original(x, k, sorted=sorted)

    @tf.custom_gradient
    def top_k(x):
        values, indices = tf.math.top_k(x, k, sorted=sorted)

        def gradient(dvalues, *unused):
            if dvalues is None:
                return tf.zeros_like(x)
            hit = tf.equal(tf.expand_dims(indices, -1), tf.range(tf.shape(x, out_type=indices.dtype)[-1]))
            return tf.reduce_sum(tf.cast(hit, dvalues.dtype) * tf.expand_dims(dvalues, -1), axis=-2)
        return (values, indices), gradient
    return top_k(x)


def _keras3_split():
    import sys
    if "keras" not in sys.modules:
        return None
    from keras.src.backend.tensorflow import numpy as keras_numpy
    return keras_numpy, "split"


def split_as_slices(original, x, indices_or_sections, axis=0):
    """``keras.ops.split(x, indices_or_sections, axis)`` as slices of ``x`` along ``axis`` where the
    dim's size and the sections or indices are static; ``original(...)`` otherwise."""
    x = tf.convert_to_tensor(x)
    rank = x.shape.rank
    size = x.shape[axis] if rank else None
    if size is None:
        return original(x, indices_or_sections, axis=axis)
    if isinstance(indices_or_sections, int):
        if indices_or_sections <= 0 or size % indices_or_sections:
            return original(x, indices_or_sections, axis=axis)
        bounds = [size * i // indices_or_sections for i in range(indices_or_sections + 1)]
    else:
        indices = _static_ints(tuple(indices_or_sections)) if isinstance(indices_or_sections, (list, tuple)) else None
        if indices is None or any(not 0 <= i <= size for i in indices) or list(indices) != sorted(indices):
            return original(x, indices_or_sections, axis=axis)
        bounds = [0, *indices, size]
    dim = axis % rank
    pieces = []
    for start, stop in zip(bounds, bounds[1:]):
        spec = [slice(None)] * rank
        spec[dim] = slice(start, stop)
        pieces.append(x[tuple(spec)])
    return pieces


_SPLIT = patching.ThreadScopedPatch(change("split_as_slices"), _keras3_split)
_TOP_K = patching.ThreadScopedPatch(change("top_k_gradient_by_comparison"), _keras3_top_k)
_ONE_HOT = patching.ThreadScopedPatch(change("one_hot_as_equal"), _keras3_one_hot)
_ROLL = patching.ThreadScopedPatch(change("roll_as_slices"), _keras3_roll)
_SLICE_UPDATE = patching.ThreadScopedPatch(change("slice_update_as_select"), _keras3_slice_update)


@contextlib.contextmanager
def dtensor_expandable_ops() -> Iterator[None]:
    """While active, this thread's Keras 3 ``ops.slice_update``, ``ops.roll``, ``ops.one_hot``, ``ops.top_k`` and ``ops.split`` calls build ops
    DTensor can lay out (the module docstring says why). Without Keras 3 imported, nothing changes."""
    if _keras3_slice_update() is None:
        yield
        return
    with _SLICE_UPDATE.active(lambda original, inputs, start_indices, updates:
                              slice_update_as_select(inputs, start_indices, updates)), _ROLL.active(roll_as_slices), \
            _ONE_HOT.active(one_hot_as_equal), _TOP_K.active(top_k_gradient_by_comparison), \
            _SPLIT.active(split_as_slices):
        yield
