"""A model revived from a SavedModel reads its variables as TofuStrategy lays them out.

This module owns the change "saved_function_captures_deferred". tf-keras revives a model or layer
it cannot rebuild from its config (a subclassed model, a custom layer: ``load_model`` of a
SavedModel) as a ``RevivedLayer`` whose call runs the functions saved with it. TensorFlow's loader
binds each restored function to the handles of the variables as they were loaded
(``restore_captures``: the handle tensors themselves). Under ``strategy.scope()`` those are the
handles of variables waiting for the plan; TofuStrategy then gives each variable its sharded buffer
in place (``tofu_tf.tf.variables.materialize``), a new handle, and the restored functions would
still read the stale ones (DTensor failed inside the step: ``In[1] is not a matrix``).

So each restored concrete function of the model's revived layers has every captured variable
handle replaced by a deferred capture (``ConcreteFunction.set_external_captures`` with a callable,
as TF's own distributed variables restore theirs): the function reads the variable's handle when
it is called, the planned one. The functions' graphs are not changed; the step traces them with
the variables' global shapes as before.
"""

from __future__ import annotations

from tofu_tf.tf import keras_adapter
from tofu_tf.tf.compat.registry import Applied, change

_REVIVED = ("tf_keras.src.saving.legacy.saved_model.load", "RevivedLayer")


def is_revived(layer) -> bool:
    """Whether tf-keras revived ``layer`` from a SavedModel's functions (no class to rebuild it from)."""
    return any((kind.__module__, kind.__name__) == _REVIVED for kind in type(layer).__mro__)


def _concrete_functions(layers) -> list:
    """The restored concrete functions the ``layers`` hold in their SavedModel attributes (tf-keras's
    ``_serialized_attributes``, its ``keras_api`` object among them), each once."""
    from tensorflow.python.eager.polymorphic_function import concrete_function as concrete_lib
    from tensorflow.python.saved_model import function_deserialization

    found, seen = [], set()

    def add(value) -> None:
        if isinstance(value, function_deserialization.RestoredFunction):
            for concrete in value.concrete_functions:
                add(concrete)
        elif isinstance(value, concrete_lib.ConcreteFunction) and id(value) not in seen:
            seen.add(id(value))
            found.append(value)

    for layer in layers:
        for value in getattr(layer, "_serialized_attributes", {}).values():  # pylint: disable=protected-access
            add(value)
            for attribute in vars(value).values() if hasattr(value, "__dict__") else ():
                add(attribute)
    return found


def defer_saved_function_captures(model) -> Applied | None:
    """Make the restored functions of ``model``'s revived layers read each variable's handle at call
    time (see the module docstring); None where no restored function captures one of its variables
    (a model with no revived layer, or one done before)."""
    layers = [model] + [layer for _, layer in keras_adapter.layer_paths(model)]
    revived = [layer for layer in layers if is_revived(layer)]
    if not revived:
        return None
    variables = {id(keras_adapter.backing_variable(v).handle): keras_adapter.backing_variable(v)
                 for v in model.variables}
    deferred = 0
    for concrete in _concrete_functions(layers):
        captures = list(concrete._captured_inputs)  # pylint: disable=protected-access  (the bound values, unevaluated)
        rebound = [(lambda variable=variables[id(c)]: variable.handle)
                   if not callable(c) and id(c) in variables else c for c in captures]
        if any(new is not old for new, old in zip(rebound, captures)):
            concrete.set_external_captures(rebound)
            deferred += 1
    if not deferred:                   # none captures a variable, or done already
        return None
    return Applied(change("saved_function_captures_deferred"), model.name,
                   f"{deferred} restored functions read their variables' planned handles")
