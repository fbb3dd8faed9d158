"""tf-keras's normalization layers, run unfused with the fused kernel's numerics.

This module owns the changes "batch_norm_unfused" (with ``layer_norm_unfused`` in
``tofu_tf.tf.compat.layers``), "normalization_centered" and "batch_norm_global_moments".

Why unfused: tf-keras runs BatchNormalization (and LayerNormalization) through
``FusedBatchNormV3``, which DTensor has no layout propagation for, so the strategy switches
them to their unfused ops (``tf.nn.moments`` and ``tf.nn.batch_normalization``).

Why centered: the unfused ops do not compute what the fused kernel computes in float32.
``tf.nn.batch_normalization`` writes ``x * inv + (offset - mean * inv)`` with
``inv = scale / sqrt(variance + epsilon)``: where a channel's mean is large against its
standard deviation, ``x * inv`` and ``mean * inv`` are two large numbers whose difference is the
output, and float32 keeps few of its digits. The fused kernel subtracts the mean first. Measured
on tf-keras's NASNetMobile (32x32 inputs, batch 8: its last cells normalize 8 values a channel),
one SGD step's gradient against float64's: the fused kernel 4e-5 of each weight's largest
update, the unfused ops 53% (a BatchNormalization's beta in the last cell), the unfused ops with
the mean subtracted first (``centered_batch_normalization``) 6e-5 — so a strategy that ran
the unfused ops as tf-keras writes them trained another model than one device does.

While an unfused tf-keras normalization layer is called, ``tf.nn.batch_normalization`` (as the
layer's module reaches it, through ``tensorflow.compat.v2``) is ``centered_batch_normalization``
on the calling thread (a ``ThreadScopedPatch``); other threads and every other caller get
TensorFlow's own. Keras 3's BatchNormalization is not touched: it runs the same unfused ops on
one device, so the strategy computes what one device computes there.

Why global moments: tf-keras takes any strategy with a ``_mesh`` attribute for a DTensor strategy
(``tf_keras.src.dtensor.utils.running_with_dtensor_strategy``), and under one a BatchNormalization
that is not ``synchronized`` computes its statistics per replica group, as MirroredStrategy's
replicas do: the batch reshaped to ``[replicas, batch / replicas, ...]``, moments over each group,
repeated back over the batch, and a mean of the repeated statistics over the batch for the moving
averages. TofuStrategy has one replica, so the values are the global batch's, one device's; but
through ops one device does not run, which DTensor runs as more collectives, and more than the
plan priced: the moving averages' two means over the batch-split repeat are two all-reduces of
their own, which DTensor cannot combine with the gradients' (another reduction), and the repeat's
gradient two sums a layer (bench/executed.py's CNN: 14 all-reduces in 5 runs, its price 4 runs;
the capture held the same ops, and why the price combined one more was not traced, since the
ops are gone). While such a layer is called (``compute_global_moments``), the check reads False
on the calling thread, so it runs ``tf.nn.moments`` over the batch as one device does, when
captured and when stepped alike: 11 all-reduces in 4 runs, as priced.
"""

from __future__ import annotations

import functools

import tensorflow as tf

from tofu_tf.tf.compat import patching
from tofu_tf.tf.compat.registry import change


def centered_batch_normalization(x, mean, variance, offset, scale, variance_epsilon, name=None):
    """``tf.nn.batch_normalization`` with the mean subtracted before the scaling (see the module
    docstring): ``(x - mean) * scale / sqrt(variance + epsilon) + offset``."""
    with tf.name_scope(name or "batchnorm"):
        inv = tf.math.rsqrt(variance + variance_epsilon)
        if scale is not None:
            inv *= scale
        centered = (x - mean) * tf.cast(inv, x.dtype)
        return centered + tf.cast(offset, x.dtype) if offset is not None else centered


def _tf_v2_nn():
    import tensorflow.compat.v2 as tf_v2  # tf-keras's modules reach tf.nn through this one
    return tf_v2.nn, "batch_normalization"


_CENTERED = patching.ThreadScopedPatch(change("normalization_centered"), _tf_v2_nn)


def _centered_hook(original, *args, **kwargs):
    del original
    return centered_batch_normalization(*args, **kwargs)


def center_normalization(layer) -> None:
    """Make ``layer``'s call (an unfused tf-keras BatchNormalization or LayerNormalization) run
    ``tf.nn.batch_normalization`` as ``centered_batch_normalization``."""
    _call_under(layer, _CENTERED, _centered_hook)


def _call_under(layer, patch: patching.ThreadScopedPatch, hook) -> None:
    """Make ``layer``'s call (on the instance) run with ``patch`` active with ``hook``."""
    call = layer.call

    @functools.wraps(call)
    def patched_call(*args, **kwargs):
        with patch.active(hook):
            return call(*args, **kwargs)

    layer.call = patched_call


def _dtensor_strategy_check():
    from tf_keras.src.dtensor import utils  # the module tf-keras's BatchNormalization reads it from
    return utils, "running_with_dtensor_strategy"


_GLOBAL_MOMENTS = patching.ThreadScopedPatch(change("batch_norm_global_moments"), _dtensor_strategy_check)


def _not_per_replica(original):
    del original
    return False


def compute_global_moments(layer) -> bool:
    """Make ``layer``'s call (a tf-keras BatchNormalization) compute its statistics over the whole
    batch as one device does (see the module docstring); False, and nothing changed, for a
    ``synchronized`` layer, which tf-keras already computes so under DTensor, and for a layer
    already changed (one shared by two prepared models: a GAN's generator)."""
    if getattr(layer, "synchronized", False) or getattr(layer, "_tofu_global_moments", False):
        return False
    _call_under(layer, _GLOBAL_MOMENTS, _not_per_replica)
    layer._tofu_global_moments = True  # pylint: disable=protected-access
    return True


def unfuse_batch_norm(layer) -> None:
    """Switch a BatchNormalization to its unfused ops, keeping the fused kernel's
    moving-variance update: the fused op averages the *unbiased* batch
    variance (Bessel's n/(n-1)) into ``moving_variance``, the unfused path the
    biased one, which would drift by about 1/n per step."""
    layer.fused = False
    moments, assign = layer._moments, layer._assign_moving_average  # pylint: disable=protected-access
    counts = {}

    def counting_moments(inputs, reduction_axes, keep_dims, mask=None):
        counts["n"] = tf.cast(tf.reduce_prod(tf.gather(tf.shape(inputs), reduction_axes)), inputs.dtype)
        return moments(inputs, reduction_axes, keep_dims, mask=mask)

    def bessel_assign(variable, value, momentum, inputs_size):
        if variable is layer.moving_variance and "n" in counts:
            n = tf.cast(counts["n"], value.dtype)
            value = value * n / tf.maximum(n - 1.0, 1.0)
        return assign(variable, value, momentum, inputs_size)

    layer._moments = counting_moments  # pylint: disable=protected-access
    layer._assign_moving_average = bessel_assign  # pylint: disable=protected-access
