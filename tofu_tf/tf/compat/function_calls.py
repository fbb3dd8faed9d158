"""A ``tf.function`` called eagerly with host tensors that reads the strategy's variables.

After training under TofuStrategy a user calls functions of their own on the model: a serving
function (``tf.function(lambda x: model(x))``), an evaluation function of a training library,
a ``tf.function`` a library compiles for itself. Their arguments are host tensors and the
variables they read are the plan's DTensor variables; DTensor refuses the mix at the call
("The op/function ... got a regular tensor for input 0 ... but was expecting a DTensor"),
and MirroredStrategy would have run them. MirroredStrategy's variables read as one device's
values anywhere, which a sharded variable cannot.

The change ``functions_called_on_the_mesh`` (process-wide, while a TofuStrategy is alive):
TensorFlow's ``Function.__call__`` calls the function as TensorFlow does; when DTensor refuses
it for that reason and a planned TofuStrategy is alive, the call is made again with every host
tensor argument (a ``tf.Tensor`` or numpy array; Python values stay trace-time constants) laid
out on that strategy's mesh as a batch is (``place``), and its tensor results come back
assembled on the host (``gather``), as one device returns them. The function is remembered, so
later calls place their arguments first. Each function is logged once. A layout does not change
what a DTensor program computes, so a function computes what it computes on one device.

The strategy holds the change from its creation (``hold``): a function whose first call traces
the strategy's first ``strategy.run`` plans during that call, and the call made again uses that
plan. It gives the two callables when it adopts a plan (``offer``); the most recent live one is
used. The module never imports the strategies package: dependencies go one way.
"""

from __future__ import annotations

import threading
import weakref
from typing import Callable

import numpy as np
import tensorflow as tf
from absl import logging
from tensorflow.experimental import dtensor

from tofu_tf.tf.compat import patching
from tofu_tf.tf.compat.registry import change

CHANGE = change("functions_called_on_the_mesh")
# DTensor's message for a function given a host tensor where its program expects a DTensor
# (tensorflow/dtensor/cc/dtensor_device.cc).
_REFUSAL = "but was expecting a DTensor"

_lock = threading.Lock()
_offers: list = []                    # weak references to the strategies' (place, gather) holders
_placed_functions: "weakref.WeakSet" = weakref.WeakSet()


class _Offer:
    """What a planned strategy offers: how to lay an argument out and bring a result back."""

    def __init__(self, place: Callable, gather: Callable):
        self.place, self.gather = place, gather


def offer(holder, place: Callable, gather: Callable) -> None:
    """Let functions refused for host arguments be called again on ``holder``'s mesh, while
    ``holder`` (a strategy's internals) is alive: ``place(value)`` lays an argument out,
    ``gather(value)`` brings a result to the host."""
    with _lock:
        holder._tofu_function_offer = _Offer(place, gather)  # pylint: disable=protected-access
        _offers.append(weakref.ref(holder))
    _PATCH.hold(holder)


def hold(holder) -> None:
    """Keep the change in force while ``holder`` (a strategy's internals) is alive, before it has
    a plan to offer: a function whose call traces the strategy's first ``strategy.run`` (which
    plans) is called through the change, and is called again on the mesh the plan made."""
    _PATCH.hold(holder)


def _current_offer() -> "_Offer | None":
    with _lock:
        _offers[:] = [ref for ref in _offers if ref() is not None]
        return _offers[-1]()._tofu_function_offer if _offers else None  # pylint: disable=protected-access


def _is_host_tensor(value) -> bool:
    if isinstance(value, np.ndarray):
        return True
    return tf.is_tensor(value) and not isinstance(value, tf.Variable) and not isinstance(
        value, (tf.RaggedTensor, tf.SparseTensor)) and not dtensor.is_dtensor(value)


def _call_on_mesh(original, function, chosen: _Offer, args, kwargs):
    place = lambda value: chosen.place(value) if _is_host_tensor(value) else value  # noqa: E731
    args, kwargs = tf.nest.map_structure(place, (args, kwargs))
    result = original(function, *args, **kwargs)
    return tf.nest.map_structure(lambda value: chosen.gather(value) if tf.is_tensor(value) else value, result)


def _calling_on_the_mesh(original: Callable) -> Callable:
    def __call__(self, *args, **kwargs):
        if not tf.executing_eagerly():
            return original(self, *args, **kwargs)
        chosen = _current_offer()
        if chosen is not None and self in _placed_functions:
            return _call_on_mesh(original, self, chosen, args, kwargs)
        try:
            return original(self, *args, **kwargs)
        except (tf.errors.UnimplementedError, tf.errors.InvalidArgumentError) as error:
            # The strategy may have planned while this call traced the function (its first
            # strategy.run): the offer is the one made then.
            chosen = chosen or _current_offer()
            if chosen is None or _REFUSAL not in str(error) or not any(
                    _is_host_tensor(value) for value in tf.nest.flatten((args, kwargs))):
                raise
        _placed_functions.add(self)
        logging.info("TofuStrategy: %s: %s reads the strategy's variables and was called with host tensors: its "
                     "tensor arguments are laid out on the mesh and its results assembled on the host (%s)",
                     CHANGE.name, getattr(self, "__name__", "a tf.function"), CHANGE.why)
        return _call_on_mesh(original, self, chosen, args, kwargs)
    return __call__


def _tf_function_class():
    from tensorflow.python.eager.polymorphic_function import polymorphic_function
    return polymorphic_function.Function, "__call__"


_PATCH = patching.HeldPatch(CHANGE, _tf_function_class, _calling_on_the_mesh)
