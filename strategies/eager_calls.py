"""A Keras model called eagerly, outside ``strategy.run``: an eager training loop.

keras.io's "Writing a training loop from scratch" first trains with no ``tf.function`` and no
``strategy.run``::

    with strategy.scope():
        model = build_model()
        optimizer = keras.optimizers.SGD(0.1)
        for x, y in batches:
            with tf.GradientTape() as tape:
                loss = loss_fn(y, model(x, training=True))
            grads = tape.gradient(loss, model.trainable_weights)
            optimizer.apply_gradients(zip(grads, model.trainable_weights))

MirroredStrategy runs that loop as one device. Under TofuStrategy the model's variables were
still deferred (no plan: nothing had called ``fit`` or ``strategy.run``), so the call computed on
host copies no tape could watch: ``ValueError: No gradients provided for any variable``. After a
plan, the call mixed the host batch with weights on the mesh, which DTensor refuses.

So a Keras model of a TofuStrategy, called eagerly outside any replica function with concrete
values (tensors, arrays), is called on the mesh (the change "eager_model_calls",
``tofu_tf.tf.compat.registry``):

1. At its first such call without a plan, the strategy plans the model from that call's
   inputs, as ``strategy.plan_model(model, batch_size=<their batch>, features=<their specs>)``
   does (the model's compiled loss and optimizer, else mean squared error and SGD: the loop's
   own are not reachable from a call; plan the model first for them), and makes its variables.
2. The inputs are laid out on the mesh as the strategy lays out a batch (split over the
   plan's batch axis when it divides them, else replicated), and the model's call runs as a
   ``tf.function`` traced once per input signature (``_program`` says why), as a step does.
3. The outputs come back to the host as one device returns them (assembled from their
   shards), so the loop's own loss, metrics and prints compute on host values. The gradient
   a tape sends back into an output is laid out as the output was on the mesh, and flows
   through the model's ops on the mesh to its variables: ``tape.gradient`` gives each weight's
   gradient on the mesh, in a layout the optimizer's update (``apply_gradients`` in the scope)
   applies shard by shard.

Nothing changes for a model whose weights are not a TofuStrategy's (a one-device copy called in
the scope; an unbuilt model counts as the strategy's when called in its scope), for calls inside ``strategy.run``, Keras'
steps or any ``tf.function``, or for symbolic calls (a functional model built from
``keras.Input``). A pipelined strategy (``pipeline=``) refuses the call, naming ``fit``.
Gradients with respect to the inputs themselves do not cross the boundary (the tape sees the
laid-out inputs as constants).
"""

from __future__ import annotations

import functools
import sys
import threading
import weakref
from typing import Callable

import numpy as np
import tensorflow as tf
from absl import logging
from tensorflow.experimental import dtensor

from tofu_tf.errors import TofuError
from tofu_tf.tf import keras_adapter, mesh_captures
from tofu_tf.tf import variables as variables_lib
from tofu_tf.tf.compat import keras_ops as compat_keras_ops
from tofu_tf.tf.compat import patching
from tofu_tf.tf.compat.registry import change


class EagerCallError(TofuError, RuntimeError):
    """A model was called eagerly outside ``strategy.run`` in a way TofuStrategy cannot run on its mesh."""


_INSIDE = threading.local()         # a routed call in progress on this thread: inner models run as they are


def _calling(model, call: Callable, args, kwargs):
    """``model(*args, **kwargs)``: on its strategy's mesh when it is such a call (module docstring)."""
    strategy = getattr(model, "distribute_strategy", None)
    extended = getattr(strategy, "extended", None)
    if (not hasattr(extended, "call_model_eagerly") or getattr(_INSIDE, "active", False)
            or not tf.executing_eagerly() or _in_replica_function() or not _holds_values((args, kwargs))
            or not _of_strategy(model, strategy)):
        return call(model, *args, **kwargs)
    _INSIDE.active = True
    try:
        return extended.call_model_eagerly(model, call, args, kwargs)
    finally:
        _INSIDE.active = False


def _of_strategy(model, strategy) -> bool:
    """Whether ``model``'s weights are ``strategy``'s, or, for a model with none yet (built at its
    first call), whether it is called in ``strategy``'s scope. A model reporting the strategy only
    because it is called in its scope (a one-device copy made for an export) is not."""
    weights = model.weights
    if not weights:
        return tf.distribute.has_strategy() and tf.distribute.get_strategy() is strategy
    variable = keras_adapter.backing_variable(weights[0])
    variable = getattr(variable, "_variable", variable) if not hasattr(variable, "_tofu_path") else variable  # AutoCast
    return getattr(variable, "_distribute_strategy", None) is strategy and strategy.extended.variable_created_in_scope(
        variable)


def _in_replica_function() -> bool:
    """Inside ``strategy.run`` (a replica context of a strategy in scope)."""
    return tf.distribute.has_strategy() and tf.distribute.get_replica_context() is not None


def _holds_values(structure) -> bool:
    """Whether the call's arguments hold a concrete value (a symbolic Keras tensor does not)."""
    return any(isinstance(leaf, (np.ndarray, np.generic)) or (tf.is_tensor(leaf) and hasattr(leaf, "numpy"))
               for leaf in tf.nest.flatten(structure))


def _routed(original: Callable) -> Callable:
    @functools.wraps(original)
    def __call__(self, *args, **kwargs):
        return _calling(self, original, args, kwargs)
    return __call__


def _model_class(module: str, attribute: str):
    def locate():
        if module.split(".")[0] not in sys.modules:     # a Keras 3 user does not pay tf-keras's import
            return None
        import importlib
        return importlib.import_module(module), attribute
    return locate


def _model_class_call(module: str, name: str):
    def locate():
        found = _model_class(module, name)()
        return None if found is None else (getattr(*found), "__call__")
    return locate


_PATCHES = (patching.HeldPatch(change("eager_model_calls"), _model_class_call("tf_keras", "Model"), _routed),
            patching.HeldPatch(change("eager_model_calls"), _model_class_call("keras", "Model"), _routed))


def hold_eager_calls(strategy) -> None:
    """Route eager calls of ``strategy``'s models onto its mesh while it is alive (installed as
    each Keras is imported: ``refresh_eager_calls``)."""
    for patch in _PATCHES:
        patch.hold(strategy)


def refresh_eager_calls() -> None:
    """Install the change for a Keras imported after the strategy was made."""
    for patch in _PATCHES:
        patch.refresh()


def call_on_mesh(extended, model, call: Callable, args, kwargs):
    """``call(model, *args, **kwargs)`` (the class's ``__call__``) on ``extended``'s mesh, planning first when no plan
    exists; outputs on the host, with gradients back to the mesh (the module docstring)."""
    if extended.pipelined:
        raise EagerCallError(
            f"{model.name} was called eagerly outside strategy.run, and a pipelined TofuStrategy runs a model only "
            "through fit, evaluate and predict: train it with model.fit, or drop pipeline= to run the loop")
    if not extended.planned:
        features = args[0] if args else kwargs.get("inputs", kwargs.get("x"))
        specs = tf.nest.map_structure(_spec_of, features)
        batch = _batch_of(specs, model)
        logging.info("TofuStrategy: %s called eagerly before any plan (an eager training loop): planning it for "
                     "this call's batch of %d", model.name, batch)
        extended.plan_for(model, batch_size=batch, loss=None, optimizer=None, labels=None, features=specs)
    else:
        extended.prepare_model(model)
    placer = extended.batch_placer()
    args, kwargs = tf.nest.map_structure(lambda value: placer.place(value) if _is_value(value) else value,
                                         (tuple(args), dict(kwargs)))
    with extended._container_strategy().scope():  # pylint: disable=protected-access
        outputs = _program(model, call, extended.mesh)(*args, **kwargs)
    return tf.nest.map_structure(to_host_with_gradient, outputs)


# model -> its eager calls' tf.function (which holds the model weakly: a value here holding its
# key strongly would keep every model alive).
_PROGRAMS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _program(model, original: Callable, mesh: dtensor.Mesh):
    """The ``tf.function`` a model's eager calls run as, one trace per input signature. Run op by op,
    each op of the call would meet the layers' own eager tensors (a mask or an index a layer made
    at build) as regular tensors beside the weights on the mesh, which DTensor refuses; traced, the
    step's mechanism puts them on the mesh (``tofu_tf.tf.mesh_captures``), and Keras 3 ops DTensor
    cannot lay out are written as ones it can (``tofu_tf.tf.compat.keras_ops``). A tape around the
    call records the function, whose gradient runs on the mesh too."""
    program = _PROGRAMS.get(model)
    if program is None or program[0] != mesh:
        held = weakref.ref(model)

        def call(*args, **kwargs):
            with mesh_captures.on_mesh(mesh, f"{held().name} called eagerly"), \
                    compat_keras_ops.dtensor_expandable_ops():
                return original(held(), *args, **kwargs)
        program = _PROGRAMS[model] = (mesh, tf.function(call))
    return program[1]


def _is_value(value) -> bool:
    return isinstance(value, (np.ndarray, np.generic)) or (tf.is_tensor(value) and not isinstance(value, tf.Variable))


def _spec_of(value):
    if tf.is_tensor(value) or isinstance(value, (np.ndarray, np.generic)):
        return tf.TensorSpec(value.shape, tf.as_dtype(value.dtype))
    return value


def _batch_of(specs, model) -> int:
    leaves = [s for s in tf.nest.flatten(specs) if isinstance(s, tf.TensorSpec)]
    if not leaves or leaves[0].shape.rank in (None, 0) or leaves[0].shape[0] is None:
        raise EagerCallError(
            f"{model.name} was called eagerly before TofuStrategy planned it, with no batch of static shape to plan "
            "from: plan it first with strategy.plan_model(model, batch_size=<global batch size>, "
            "features=<a batch>), or train it through strategy.run or model.fit")
    return int(leaves[0].shape[0])


def to_host_with_gradient(value):
    """``value`` (an output on the mesh) assembled on the host, as one device returns it; the
    gradient a tape sends back into it is laid out on the mesh as ``value`` was."""
    if not (tf.is_tensor(value) and dtensor.is_dtensor(value)):
        return value
    layout = dtensor.fetch_layout(value)
    if not value.dtype.is_floating:
        return tf.constant(variables_lib.gather_to_host(value, layout))

    @tf.custom_gradient
    def gathered(x):
        def gradient(dy):
            return variables_lib.scatter_from_host(np.asarray(tf.convert_to_tensor(dy)), layout)
        return tf.constant(variables_lib.gather_to_host(x, layout)), gradient
    return gathered(value)
