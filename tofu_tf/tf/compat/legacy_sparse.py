"""A legacy tf-keras optimizer's sparse (Embedding) update, in ops DTensor runs, row for row the same.

This module owns the change "legacy_sparse_updates_dense". A legacy optimizer
(``tf_keras.optimizers.legacy``) updates a weight from a sparse gradient (an ``IndexedSlices``: an
Embedding's) on the variable's handle: ``ResourceScatterAdd``/``ResourceScatterUpdate`` through its
``_resource_scatter_add``/``_resource_scatter_update``, or one fused op
(``ResourceSparseApplyKerasMomentum``, ``ResourceSparseApplyRMSProp``,
``ResourceSparseApplyCenteredRMSProp``). DTensor runs none of them. Densifying the gradient is no
way out in general: where the sparse update leaves the rows it was not given alone (momentum, RMS
averages), the dense update of a gradient with zero rows would move them.

So the sparse update keeps its meaning with other ops, on the optimizer instance:

* a scatter through ``_resource_scatter_add``/``_resource_scatter_update`` (Adam, Adamax, Nadam,
  RMSprop without momentum) becomes an ``assign_add`` of the rows summed into a dense tensor, or an
  ``assign`` that takes the given rows and keeps the others (the indices are unique there: the
  optimizer sums duplicates first);
* a fused sparse op (SGD and RMSprop with momentum) becomes the optimizer's own dense update of the
  densified gradient, after which every row the gradient did not touch is put back, in the weight
  and in each of its slots: the fused sparse op computes, on the rows it is given, what the dense
  op computes on every row.

Plain SGD and Adagrad need none of this: their dense update of the densified gradient is the sparse
update (a zero row moves nothing and adds nothing to an accumulator); the gradient is densified
(``sparse_gradient_for_update``). Ftrl's and Adadelta's sparse updates are refused: DTensor runs
neither fused sparse kernel, and their dense update (in elementwise ops,
``tofu_tf.tf.compat.legacy_dense``) would move the rows the sparse one leaves alone.
"""

from __future__ import annotations

import tensorflow as tf

from tofu_tf.tf import keras_adapter
from tofu_tf.tf.compat.registry import Applied, change

_MARK = "_tofu_sparse_updates_dense"


def _legacy():
    import tf_keras
    return tf_keras.optimizers.legacy


def _innermost(optimizer):
    """(the optimizer that applies the updates, the legacy LossScaleOptimizer around it or None)."""
    import tf_keras
    wrapper = None
    while isinstance(optimizer, tf_keras.mixed_precision.LossScaleOptimizer) and keras_adapter.is_legacy_optimizer(
            optimizer.inner_optimizer):
        wrapper, optimizer = optimizer, optimizer.inner_optimizer
    return optimizer, wrapper


def _densified_exactly(optimizer) -> bool:
    """Whether ``optimizer``'s dense update of the densified gradient is its sparse update."""
    legacy = _legacy()
    return (isinstance(optimizer, legacy.SGD) and not optimizer._momentum   # pylint: disable=protected-access
            or isinstance(optimizer, legacy.Adagrad))


def _rewritten(optimizer) -> bool:
    """Whether this module rewrites ``optimizer``'s sparse update (see the module docstring)."""
    legacy = _legacy()
    return isinstance(optimizer, (legacy.SGD, legacy.RMSprop, legacy.Adam, legacy.Adamax, legacy.Nadam))


def _dense_rows(values, indices, rows: int):
    """The rows ``values`` gives at ``indices`` summed into a dense tensor of ``rows`` rows."""
    return tf.math.unsorted_segment_sum(values, indices, rows)


def _touched(indices, rows: int, like):
    """A bool mask broadcastable to ``like``: the rows ``indices`` names."""
    hits = tf.math.unsorted_segment_sum(tf.ones_like(indices, dtype=tf.int32), indices, rows) > 0
    return tf.reshape(hits, [rows] + [1] * (like.shape.rank - 1))


def _scatter_add(variable, indices, values):
    """``_resource_scatter_add``: add ``values`` to ``variable``'s rows ``indices``; its new value."""
    update = variable.assign_add(_dense_rows(values, indices, variable.shape[0]), read_value=False)
    with tf.control_dependencies([update]):
        return variable.value()


def _scatter_update(variable, indices, values):
    """``_resource_scatter_update``: set ``variable``'s rows ``indices`` (unique) to ``values``; its new value."""
    rows = variable.shape[0]
    old = variable.value()
    update = variable.assign(tf.where(_touched(indices, rows, old), _dense_rows(values, indices, rows), old),
                             read_value=False)
    with tf.control_dependencies([update]):
        return variable.value()


def _apply_sparse_as_masked_dense(optimizer, original):
    """``_resource_apply_sparse`` for an optimizer whose sparse update is one fused op on the rows
    given: the dense update of the densified gradient, then the untouched rows of the weight and
    of each slot put back; ``original`` where the update is written with scatters."""

    def apply_sparse(grad, var, indices, apply_state=None):
        if not optimizer._momentum:                      # pylint: disable=protected-access
            return original(grad, var, indices, apply_state=apply_state)
        rows = var.shape[0]
        held = [var] + [optimizer.get_slot(var, name) for name in optimizer.get_slot_names()]
        before = [h.value() for h in held]
        with tf.control_dependencies(before):
            update = optimizer._resource_apply_dense(   # pylint: disable=protected-access
                _dense_rows(grad, indices, rows), var, apply_state=apply_state)
        with tf.control_dependencies([update]):
            touched = _touched(indices, rows, before[0])
            kept = [h.assign(tf.where(touched, h.value(), old), read_value=False) for h, old in zip(held, before)]
        return tf.group(*kept)
    return apply_sparse


def sparse_updates_dense(optimizer) -> Applied | None:
    """Rewrite a legacy tf-keras optimizer's sparse updates as the module docstring says, on the
    instance (the innermost one under legacy LossScaleOptimizers); None where there is none to
    rewrite. At most once per optimizer."""
    if optimizer is None or not keras_adapter.is_legacy_optimizer(optimizer):
        return None
    inner, _ = _innermost(optimizer)
    if not _rewritten(inner) or getattr(inner, _MARK, False):
        return None
    # pylint: disable=protected-access
    inner._resource_scatter_add = _scatter_add
    inner._resource_scatter_update = _scatter_update
    if isinstance(inner, (_legacy().SGD, _legacy().RMSprop)):
        inner._resource_apply_sparse = _apply_sparse_as_masked_dense(inner, inner._resource_apply_sparse)
    setattr(inner, _MARK, True)
    return Applied(change("legacy_sparse_updates_dense"), getattr(inner, "_name", type(inner).__name__),
                   "sparse (Embedding) updates in assigns of dense rows")


def sparse_gradient_for_update(optimizer, gradient, variable):
    """A legacy optimizer's sparse gradient as its update takes it here: densified where the dense
    update is the sparse one, as it is where ``sparse_updates_dense`` rewrote the update, else refused
    naming the weight and the optimizer to use. Other gradients and optimizers: unchanged."""
    if not isinstance(gradient, tf.IndexedSlices) or not keras_adapter.is_legacy_optimizer(optimizer):
        return gradient
    inner, wrapper = _innermost(optimizer)
    if _densified_exactly(inner):
        return tf.convert_to_tensor(gradient)
    if getattr(inner, _MARK, False):
        return gradient
    name = type(inner).__name__
    through = "" if wrapper is None else f" (wrapped in a {type(wrapper).__name__})"
    instead = f"tf_keras.optimizers.{name}" + ("" if wrapper is None else
                                               " (wrapped in tf_keras.mixed_precision.LossScaleOptimizer)")
    raise NotImplementedError(
        f"TofuStrategy: {name} (tf_keras.optimizers.legacy){through} updates "
        f"{keras_adapter.variable_path(variable)!r} from a sparse (Embedding) gradient with an op DTensor cannot "
        f"run, and its dense update would move the rows the sparse one leaves alone. Use the new optimizer, "
        f"{instead}, which DTensor runs.")
