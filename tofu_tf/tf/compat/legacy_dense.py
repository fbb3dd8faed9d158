"""A legacy tf-keras optimizer's dense update, in ops DTensor runs, for the fused kernels it has none for.

This module owns the change "legacy_fused_updates_unfused". A legacy optimizer
(``tf_keras.optimizers.legacy``) updates each weight with one fused kernel on the variable's
handle, and DTensor lays out only some of them (SGD's, Adam's, Adagrad's, centered RMSprop's; see
``tofu_tf.search.targets``). Adadelta's (``ResourceApplyAdadelta``), Adamax's
(``ResourceApplyAdaMax``), Ftrl's (``ResourceApplyFtrl``, ``ResourceApplyFtrlV2``) and RMSprop's with
momentum (``ResourceApplyRMSProp``) it cannot, in any layout: a model compiled with one was refused
before its first step, where MirroredStrategy trains it (tf-keras's own distribute tests do). So
each such optimizer's ``_resource_apply_dense`` (on the instance: the user's, and capture's copy)
computes its kernel's formula with elementwise ops (TensorFlow's ``training_ops.cc``, in the same
order) from the weight and slots as read before the update, and writes each once: the same numbers,
in ops DTensor runs in the weight's layout. Sparse updates go through the dense one
(``tofu_tf.tf.compat.legacy_sparse``); Adam's ``amsgrad`` and the proximal optimizers keep their
kernels and stay refused.
"""

from __future__ import annotations

import tensorflow as tf

from tofu_tf.tf import keras_adapter
from tofu_tf.tf.compat.registry import Applied, change

_MARK = "_tofu_fused_updates_unfused"


def _coefficients(optimizer, var):
    device, dtype = var.device, var.dtype.base_dtype
    return optimizer._fallback_apply_state(device, dtype)  # pylint: disable=protected-access


def _read(slot):
    return tf.identity(slot.value())


def _adadelta(optimizer, grad, var, c):
    accum, accum_update = optimizer.get_slot(var, "accum_grad"), optimizer.get_slot(var, "accum_var")
    old_accum, old_update = _read(accum), _read(accum_update)
    rho, epsilon, one = c["rho"], c["epsilon"], tf.ones([], var.dtype.base_dtype)
    new_accum = old_accum * rho + tf.square(grad) * (one - rho)
    update = tf.sqrt(old_update + epsilon) * tf.math.rsqrt(new_accum + epsilon) * grad
    return [accum.assign(new_accum, read_value=False),
            accum_update.assign(old_update * rho + tf.square(update) * (one - rho), read_value=False),
            var.assign_sub(update * c["lr_t"], read_value=False)]


def _adamax(optimizer, grad, var, c):
    m, v = optimizer.get_slot(var, "m"), optimizer.get_slot(var, "v")
    old_m, old_v = _read(m), _read(v)
    one = tf.ones([], var.dtype.base_dtype)
    new_m = old_m + (grad - old_m) * (one - c["beta_1_t"])
    new_v = tf.maximum(c["beta_2_t"] * old_v, tf.abs(grad))
    step = c["lr_t"] / (one - c["beta_1_power"]) * (new_m / (new_v + c["epsilon"]))
    return [m.assign(new_m, read_value=False), v.assign(new_v, read_value=False),
            var.assign_sub(step, read_value=False)]


def _ftrl(optimizer, grad, var, c):
    accum, linear = optimizer.get_slot(var, "accumulator"), optimizer.get_slot(var, "linear")
    old_accum, old_linear, weight = _read(accum), _read(linear), _read(var)
    lr, l1, lr_power = c["lr_t"], c["l1_regularization_strength"], c["learning_rate_power"]
    l2 = c["l2_regularization_strength"] + c["beta"] / (2.0 * lr)
    shrinkage = optimizer._l2_shrinkage_regularization_strength  # pylint: disable=protected-access
    toward = grad + 2.0 * c["l2_shrinkage_regularization_strength"] * weight if shrinkage > 0.0 else grad
    new_accum = old_accum + tf.square(grad)
    new_linear = old_linear + toward - (tf.pow(new_accum, -lr_power) - tf.pow(old_accum, -lr_power)) / lr * weight
    clamped = tf.maximum(tf.minimum(new_linear, l1), -l1)
    new_weight = (clamped - new_linear) / (tf.pow(new_accum, -lr_power) / lr + 2.0 * l2)
    return [accum.assign(new_accum, read_value=False), linear.assign(new_linear, read_value=False),
            var.assign(new_weight, read_value=False)]


def _rmsprop_momentum(optimizer, grad, var, c):
    rms, mom = optimizer.get_slot(var, "rms"), optimizer.get_slot(var, "momentum")
    old_rms, old_mom = _read(rms), _read(mom)
    one = tf.ones([], var.dtype.base_dtype)
    new_rms = old_rms + (tf.square(grad) - old_rms) * (one - c["rho"])
    new_mom = old_mom * c["momentum"] + (grad * c["lr_t"]) / tf.sqrt(new_rms + c["epsilon"])
    return [rms.assign(new_rms, read_value=False), mom.assign(new_mom, read_value=False),
            var.assign_sub(new_mom, read_value=False)]


def _formula(optimizer):
    """The unfused update of ``optimizer``'s class, or None where its kernel runs (or is kept)."""
    import tf_keras
    legacy = tf_keras.optimizers.legacy
    if isinstance(optimizer, legacy.Adadelta):
        return _adadelta
    if isinstance(optimizer, legacy.Adamax):
        return _adamax
    if isinstance(optimizer, legacy.Ftrl):
        return _ftrl
    if isinstance(optimizer, legacy.RMSprop) and optimizer._momentum and not optimizer.centered:  # pylint: disable=protected-access
        return _rmsprop_momentum
    return None


def unfuse_dense_updates(optimizer) -> Applied | None:
    """Give a legacy tf-keras optimizer whose fused dense kernel DTensor cannot run the same
    update in elementwise ops (the module docstring says which), on the instance; None where it
    needs none. At most once per optimizer."""
    if optimizer is None or not keras_adapter.is_legacy_optimizer(optimizer) or getattr(optimizer, _MARK, False):
        return None
    formula = _formula(optimizer)
    if formula is None:
        return None

    def _resource_apply_dense(grad, var, apply_state=None):
        coefficients = (apply_state or {}).get((var.device, var.dtype.base_dtype)) or _coefficients(optimizer, var)
        return tf.group(*formula(optimizer, grad, var, coefficients))

    optimizer._resource_apply_dense = _resource_apply_dense  # pylint: disable=protected-access
    setattr(optimizer, _MARK, True)
    return Applied(change("legacy_fused_updates_unfused"), getattr(optimizer, "_name", type(optimizer).__name__),
                   "dense update in elementwise ops")
