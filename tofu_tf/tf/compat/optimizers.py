"""The changes the strategy makes to its model's (or a custom loop's) optimizer.

Each function changes the optimizer it is given, at most once (it marks the instance), and
returns the ``Applied`` record of the registered change (``tofu_tf.tf.compat.registry``), or
None where the optimizer needs none:

* ``adopt_optimizer``: ``optimizer_adopted``, a tf-keras optimizer made before ``strategy.scope()``;
* ``defer_slot_zeros``: ``slot_zeros_deferred``, tf-keras slots made as shards;
* ``relayout_gradients``: ``gradients_relaid``, each dense gradient in its variable's layout;
* ``update_moving_averages``: ``ema_after_update``, tf-keras ``use_ema`` averages kept;
* ``sparse_updates_dense``: ``legacy_sparse_updates_dense``, a legacy optimizer's sparse updates in
  ops DTensor runs (``tofu_tf.tf.compat.legacy_sparse``);
* ``unfuse_dense_updates``: ``legacy_fused_updates_unfused``, a legacy optimizer's fused dense update
  DTensor cannot run, in elementwise ops (``tofu_tf.tf.compat.legacy_dense``).
"""

from __future__ import annotations

import tensorflow as tf

from tofu_tf.tf import keras_adapter
from tofu_tf.tf.compat import legacy_sparse
from tofu_tf.tf.compat.legacy_dense import unfuse_dense_updates  # noqa: F401  (one of this module's changes)
from tofu_tf.tf.compat.legacy_sparse import sparse_updates_dense  # noqa: F401  (one of this module's changes)
from tofu_tf.tf.compat.registry import Applied, change


def defer_slot_zeros(optimizer) -> Applied | None:
    """Make a tf-keras optimizer hand its zero-initialized slots a ``DeferredZeros``.

    Its ``add_variable_from_reference`` otherwise builds ``tf.zeros(weight.shape)``
    eagerly, a full-size slot on one device, before any variable creator can
    choose a layout. Idempotent; Keras 3 optimizers are left alone.
    """
    if optimizer is None or getattr(optimizer, "_tofu_defers_zeros", False):
        return None
    if not type(optimizer).__module__.startswith("tf_keras") or keras_adapter.is_legacy_optimizer(optimizer):
        return None             # a legacy optimizer's slot initial values are shape-carrying partials
    if not hasattr(optimizer, "add_variable_from_reference"):
        return None             # a TF1 optimizer (tf.compat.v1.train) wrapped in TFOptimizer: its own slots
    original = optimizer.add_variable_from_reference

    def wrapper(*args, **kwargs):
        reference, _ = keras_adapter.slot_reference_and_name(args, kwargs)
        keras_adapter.defer_default_zeros(reference, args, kwargs)
        return original(*args, **kwargs)

    optimizer.add_variable_from_reference = wrapper
    optimizer._tofu_defers_zeros = True  # pylint: disable=protected-access
    return Applied(change("slot_zeros_deferred"), getattr(optimizer, "name", type(optimizer).__name__))


def adopt_optimizer(optimizer, strategy) -> Applied | None:
    """Make a tf-keras optimizer built before ``strategy.scope()`` act as one built inside it.

    A tf-keras optimizer records the strategy current when it is constructed, and makes
    its step counter and learning-rate variables then. One made before the scope
    (``opt = Adam(1e-3)`` at the top of a script, then ``model.compile(optimizer=opt)``
    inside it: fine under MirroredStrategy) would send its updates through the default
    strategy's ``merge_call``, which nests strategy scopes inside TofuStrategy's global
    DTensor step and fails, and its counter would be a plain variable, outside the
    strategy's care (its in-step increment was lost: Adam's bias correction drifted).
    So the optimizer records ``strategy`` and takes the DTensor path, as it would have
    inside the scope, and its counter and learning rate are made again under the
    scope with their current values.
    """
    if optimizer is None or not type(optimizer).__module__.startswith("tf_keras"):
        return None
    if not hasattr(optimizer, "_run_with_dtensor") or optimizer._distribution_strategy is strategy:
        return None
    optimizer._distribution_strategy = strategy  # pylint: disable=protected-access
    optimizer._run_with_dtensor = True  # pylint: disable=protected-access
    with strategy.scope():
        _remake(optimizer, "_iterations", optimizer._create_iteration_variable)  # pylint: disable=protected-access
        learning_rate = optimizer._learning_rate  # pylint: disable=protected-access
        if isinstance(learning_rate, tf.Variable):
            _remake(optimizer, "_learning_rate",
                    lambda: setattr(optimizer, "_learning_rate",
                                    optimizer._build_learning_rate(float(learning_rate.numpy()))))
        elif hasattr(optimizer, "_current_learning_rate"):  # a LearningRateSchedule
            _remake(optimizer, "_current_learning_rate", lambda: optimizer._build_learning_rate(learning_rate))
    return Applied(change("optimizer_adopted"), getattr(optimizer, "name", type(optimizer).__name__), "updates through TofuStrategy, as if created in its scope")


def _remake(optimizer, attribute: str, make) -> None:
    """Make ``optimizer.<attribute>`` (a variable) again, with its value, where the old one was
    in the optimizer's variable list (checkpoints and ``get_weights`` keep their order)."""
    old = getattr(optimizer, attribute)
    value = old.numpy()
    make()
    new = getattr(optimizer, attribute)
    new.assign(value)
    variables = [v for v in optimizer._variables if v is not new]  # pylint: disable=protected-access
    optimizer._variables = [new if v is old else v for v in variables]  # pylint: disable=protected-access


def update_moving_averages(optimizer) -> Applied | None:
    """Make a tf-keras optimizer with ``use_ema=True`` keep its moving averages under DTensor.

    tf-keras applies gradients on its DTensor path (the one a strategy's optimizer
    takes) through the base class, which never updates the averages; ``fit`` still
    ends by overwriting every weight with its average, so the whole run was lost:
    the model returned to its initial weights (tested). After the base update this
    runs what tf-keras' distributed path runs after it: each average moves toward its
    weight, and every ``ema_overwrite_frequency`` steps the weights take the averages.
    """
    if (not getattr(optimizer, "use_ema", False) or not type(optimizer).__module__.startswith("tf_keras")
            or getattr(optimizer, "_tofu_updates_averages", False)):
        return None
    apply = optimizer._internal_apply_gradients  # pylint: disable=protected-access

    def apply_then_average(grads_and_vars):
        if not optimizer._run_with_dtensor:                # pylint: disable=protected-access
            return apply(grads_and_vars)                   # the distributed path averages itself
        grads_and_vars = list(grads_and_vars)
        step = optimizer.iterations + 1                    # read before this step's increment, as tf-keras does
        iteration = apply(grads_and_vars)
        weights = [variable for _, variable in grads_and_vars]
        optimizer._update_model_variables_moving_average(weights)  # pylint: disable=protected-access
        if optimizer.ema_overwrite_frequency:
            # The averages are read here, not inside the cond's branch: a read in the
            # branch's graph does not see this step's write (DTensor orders it first).
            averages = [tf.identity(_moving_average(optimizer, weight)) for weight in weights]

            def overwrite():
                for weight, average in zip(weights, averages):
                    weight.assign(average)
            tf.cond(tf.equal(step % optimizer.ema_overwrite_frequency, 0), overwrite, lambda: None)
        return iteration

    optimizer._internal_apply_gradients = apply_then_average  # pylint: disable=protected-access
    optimizer._tofu_updates_averages = True  # pylint: disable=protected-access
    return Applied(change("ema_after_update"), getattr(optimizer, "name", type(optimizer).__name__), "moving averages updated after each step")


def relayout_gradients(optimizer) -> Applied | None:
    """Make ``optimizer`` take each dense gradient in its variable's layout.

    DTensor's layout propagation is a fixed point over producers and consumers; where
    it does not converge it locks what it has, and a kernel gradient's ``Sum`` over
    the batch can be asked for an output split on another dim than its input (Gemma's
    MLP kernels under a Megatron plan: input split on the kernel's rows, the optimizer's
    update asking for its columns). DTensor's reduce expander only splits further
    (``EmitAllScatter ... was not more sharded than the original_layout``), so the first
    step fails. An explicit relayout to the variable's layout between the gradient and
    the update ends the chain of requests there: the ``Sum`` keeps the layout its input
    gives, and the relayout converts it (an identity where the layouts already agree).
    Installed on the optimizer instance, so custom training loops that call
    ``apply_gradients`` themselves get it too.
    """
    if optimizer is None or getattr(optimizer, "_tofu_relayouts_gradients", False):
        return None
    from tensorflow.experimental import dtensor

    def relaid(gradient, variable):
        layout = getattr(keras_adapter.backing_variable(variable), "layout", None)
        if layout is None or not isinstance(gradient, tf.Tensor):   # None, IndexedSlices, before the plan
            return gradient
        return dtensor.relayout(gradient, layout)

    module = type(optimizer).__module__
    if module.startswith("keras") and hasattr(optimizer, "apply"):        # Keras 3: apply_gradients calls apply
        apply = optimizer.apply

        def apply_in_variable_layouts(grads, trainable_variables=None):
            grads = list(grads)
            # apply(grads) on a built optimizer updates the variables it was built for, in order.
            variables = trainable_variables if trainable_variables is not None \
                else optimizer._trainable_variables  # pylint: disable=protected-access
            if variables is not None and len(variables) == len(grads):
                grads = [relaid(g, v) for g, v in zip(grads, variables)]
            return apply(grads, trainable_variables)
        optimizer.apply = apply_in_variable_layouts
    elif module.startswith("tf_keras") and hasattr(optimizer, "apply_gradients"):
        apply_gradients = optimizer.apply_gradients

        def apply_gradients_in_variable_layouts(grads_and_vars, *args, **kwargs):
            pairs = [(relaid(legacy_sparse.sparse_gradient_for_update(optimizer, g, v), v), v) for g, v in grads_and_vars]
            return apply_gradients(pairs, *args, **kwargs)
        optimizer.apply_gradients = apply_gradients_in_variable_layouts
    else:
        return None
    optimizer._tofu_relayouts_gradients = True  # pylint: disable=protected-access
    return Applied(change("gradients_relaid"), getattr(optimizer, "name", type(optimizer).__name__), "each dense gradient in its variable's layout")


def _moving_average(optimizer, weight):
    # pylint: disable=protected-access
    return optimizer._model_variables_moving_average[optimizer._index_dict[optimizer._var_key(weight)]]
