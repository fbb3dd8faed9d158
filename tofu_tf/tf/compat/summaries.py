"""Summaries of values on the mesh, written as one device writes them.

TensorBoard's summaries compute on the value they are given, eagerly: a histogram reshapes
it, takes its minimum and maximum and counts it into buckets whose edges are made by
``tf.linspace``, an image summary casts and encodes it. Given a weight of a TofuStrategy (a
DTensor variable, split or replicated), each op on it ran on the mesh while the edges, the
writer and the step are regular tensors, and DTensor refuses that mix: the first epoch of a
``fit`` with ``TensorBoard(histogram_freq=1)`` ended in ``UnimplementedError: The op/function
Reshape got a regular tensor for input 0 ... but was expecting a DTensor``, losing the run.

The change "summaries_gathered" replaces TensorBoard's ``scalar``, ``histogram``, ``image``,
``audio`` and ``text`` (``tensorboard.summary.v2``, which ``tf.summary``'s functions of those names
call, whichever API module Keras 3's and tf-keras' TensorBoard callbacks and users reach them by),
and ``tf.summary.write`` (``tf.summary`` and ``tf.compat.v2.summary``), while a TofuStrategy is alive: called
eagerly with a value on the mesh (a DTensor, a ``TofuVariable``, a Keras variable backed by
one), the value is first assembled in host memory from its shards (one variable at a time,
``tofu_tf.tf.variables.gather_to_host``), and the summary computes on that, as on one device:
the same histogram, scalar or image. Other values, and calls in a ``tf.function``, go to
TensorFlow's own functions unchanged. The originals are back once no TofuStrategy is alive.

Keras 3's callback turns a weight into its image with Keras ops and then a numpy array
(``keras.src.backend.convert_to_numpy``), and numpy cannot copy a split DTensor off the mesh
(``Trying to copy a non-single-device and non-replicated DTensor is not supported``): the change
"keras3_numpy_gathered" assembles a tensor on the mesh on the host there too, so
``keras.ops.convert_to_numpy`` of a mesh value gives one device's array.
"""

from __future__ import annotations

import functools
import importlib.util
import sys
from typing import Callable

import tensorflow as tf
from tensorflow.dtensor.python import d_variable
from tensorflow.experimental import dtensor

from tofu_tf.tf import keras_adapter
from tofu_tf.tf import variables as variables_lib
from tofu_tf.tf.compat import patching
from tofu_tf.tf.compat.registry import change

# tf.summary's functions, by the name of the argument holding the summarized value.
_DATA_ARGUMENT = {"scalar": "data", "histogram": "data", "image": "data", "audio": "data", "text": "data",
                  "write": "tensor"}


def on_host(value):
    """``value`` as one device holds it: a value on the mesh assembled in host memory, others as
    they are. Only eagerly: in a graph the value is symbolic."""
    if not tf.executing_eagerly():
        return value
    variable = keras_adapter.backing_variable(value)          # Keras 3 wraps the tf.Variable
    if not isinstance(variable, d_variable.DVariable):
        variable = getattr(variable, "_variable", variable)   # tf-keras mixed precision's AutoCastVariable
    if isinstance(variable, d_variable.DVariable):
        value = variable.read_value()
    if tf.is_tensor(value) and not isinstance(value, tf.Variable) and dtensor.is_dtensor(value):
        return tf.constant(variables_lib.gather_to_host(value, dtensor.fetch_layout(value)))
    return value        # a host value, or tf.summary.write's lazy tensor (a callable), which computes itself


def _gathering(argument: str, original: Callable) -> Callable:
    position = 1                    # (name, data, ...) / (tag, tensor, ...)

    @functools.wraps(original)
    def summary(*args, **kwargs):
        if argument in kwargs:
            kwargs[argument] = on_host(kwargs[argument])
        elif len(args) > position:
            args = args[:position] + (on_host(args[position]),) + args[position + 1:]
        return original(*args, **kwargs)
    return summary


def _tensorboard_summaries():
    """TensorBoard's summary functions module, which ``tf.summary.scalar`` and the others import
    at each call; None without TensorBoard (``tf.summary`` then raises for those itself)."""
    if importlib.util.find_spec("tensorboard") is None:
        return None
    import tensorboard.summary.v2 as tensorboard_summaries
    return tensorboard_summaries


def _patch(owner: Callable[[], object], name: str) -> patching.HeldPatch:
    def locate():
        module = owner()
        if module is None or getattr(getattr(module, name, None), "_tofu_change", None) == "summaries_gathered":
            return None                  # no such module, or the same module reached by another name
        return module, name
    return patching.HeldPatch(change("summaries_gathered"), locate, functools.partial(_gathering, _DATA_ARGUMENT[name]))


def _api_module(name: str):
    """TensorFlow's API module ``name``. ``import tensorflow.summary`` (Keras 3's callback does)
    loads ``tf.summary``'s file again as a module of that name and rebinds ``tf.summary`` to it: it
    is imported here, so that later imports find the one changed."""
    return importlib.import_module(name) if name.startswith("tensorflow.") else sys.modules.get(name)


# ``tf.summary.histogram`` and the others are one function bound in several API modules
# (``tf.summary``, ``tf.compat.v2.summary`` for tf-keras and TensorBoard, ``tensorflow.summary``
# once imported so, for Keras 3's callback), each importing TensorBoard's implementation at its
# call: that one module is changed. ``write`` is TensorFlow's own, changed in each API module.
_WRITE_MODULES = ("tensorflow.summary", "tensorflow._api.v2.summary", "tensorflow._api.v2.compat.v2.summary")
_PATCHES = tuple([_patch(_tensorboard_summaries, name) for name in _DATA_ARGUMENT if name != "write"]
                 + [_patch(functools.partial(_api_module, module), "write") for module in _WRITE_MODULES])


def _keras3_backend():
    if "keras" not in sys.modules:
        return None
    from keras.src import backend
    return backend if backend.backend() == "tensorflow" else None


def _numpy_gathered(original: Callable) -> Callable:
    @functools.wraps(original)
    def convert_to_numpy(x):
        return original(on_host(x) if tf.is_tensor(x) else x)
    return convert_to_numpy


# Keras 3's callbacks (TensorBoard's images) and ``keras.ops.convert_to_numpy`` reach the backend's
# function through ``keras.src.backend``.
_NUMPY = patching.HeldPatch(change("keras3_numpy_gathered"),
                            lambda: None if _keras3_backend() is None else (_keras3_backend(), "convert_to_numpy"),
                            _numpy_gathered)


def hold_summaries(strategy) -> None:
    """Gather values on the mesh to the host in ``tf.summary``'s functions, and in Keras 3's
    ``convert_to_numpy``, while ``strategy`` is alive (the module docstring says why)."""
    for patch in _PATCHES + (_NUMPY,):
        patch.hold(strategy)
