"""Eager tensors a traced step captures, put on the mesh replicated.

A layer may make a tensor of its own when it is built and use it in ``call``: keras-hub's
Swin Transformer keeps its windows' relative-position index (a ``[w*w, w*w]`` int32 table
made with ``ops.convert_to_tensor`` in ``build``); other layers keep masks, frequency tables
or lookup indices so. A ``tf.function`` tracing ``call`` captures such an eager tensor as an input
of the program, which TensorFlow passes at each call (on TF 2.21 small ones too). That
input is a regular tensor, and DTensor refuses a program on the mesh whose input is not on
the mesh (``got a regular tensor for input 10 (shape [16,16]) but was expecting a DTensor``):
the first step failed. MirroredStrategy runs the same program once per device, on a copy
that device reads.

Here, while the function passed to ``strategy.run`` is traced, the graph it is traced into
puts each eager tensor it would capture as an input on the mesh first, replicated (every
device holds the whole tensor, as each MirroredStrategy replica does), once per graph and
tensor. The capture then holds that copy, and every call of the program passes it. This is
one mechanism for every such tensor: the layer, the library or the user's code that made it
is not known and need not be. Variables (resource handles) are not touched: those of the
strategy are on the mesh, and a variable made elsewhere is the strategy's concern
(``TofuStrategy.run`` runs a function reading one per device).

The change is "captured_tensors_on_mesh" (``tofu_tf.tf.compat.registry``): the ``capture``
method of the one ``FuncGraph`` being traced, on that instance, while the function is traced;
restored when it returns, also on error. TensorFlow routes every capture of an outer tensor
(an op's input, ``convert_to_tensor``, a nested ``tf.cond``/``while`` or ``tf.function``
passing its own captures on) through that method.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import tensorflow as tf
from absl import logging
from tensorflow.experimental import dtensor

CHANGE_NAME = "captured_tensors_on_mesh"

# Dtypes DTensor cannot hold as a replicated value, or that are no value at all (handles).
_KEPT_DTYPES = frozenset({tf.resource, tf.variant, tf.string})


def _eager_tensor_type():
    from tensorflow.python.framework import ops   # the change "captured_tensors_on_mesh" (its EagerTensor)
    return ops.EagerTensor


def _func_graph_type():
    from tensorflow.python.framework import func_graph
    return func_graph.FuncGraph


def needs_mesh_copy(value) -> bool:
    """Whether ``value`` is an eager tensor off the mesh, of a dtype DTensor can replicate. (A
    traced function takes every captured eager tensor as an input on TF 2.21, small ones too,
    though its capture code would embed those of up to 128 elements as constants.)"""
    if not isinstance(value, _eager_tensor_type()) or value.dtype in _KEPT_DTYPES:
        return False
    with tf.init_scope():
        return not dtensor.is_dtensor(value)


def replicated_copy(value, mesh: dtensor.Mesh):
    """``value`` (an eager tensor) on every device of ``mesh``, replicated."""
    with tf.init_scope():
        return dtensor.copy_to_mesh(value, dtensor.Layout.replicated(mesh, rank=value.shape.rank))


@contextlib.contextmanager
def on_mesh(mesh: dtensor.Mesh, what: str = "the function passed to strategy.run") -> Iterator[None]:
    """While active, the graph being traced now (if it is a ``tf.function``'s) captures each
    eager tensor it would take as an input as a replicated copy on ``mesh``. Eagerly, or in a
    graph of TF 1's kind, nothing changes. ``what``: the function traced, for the log."""
    graph = tf.compat.v1.get_default_graph()
    if tf.executing_eagerly() or not isinstance(graph, _func_graph_type()):
        yield
        return
    if getattr(graph.capture, "_tofu_change", None) == CHANGE_NAME:     # an outer on_mesh of this graph
        yield
        return
    original = graph.capture
    # id(tensor) -> (tensor, its copy): TensorFlow keys a graph's captures by the id of the
    # tensor it is given, so one tensor captured twice must give the same copy; the tensor
    # is kept so that its id is not reused meanwhile.
    copies: dict = {}

    def capture(tensor, name=None, shape=None):
        if needs_mesh_copy(tensor):
            entry = copies.get(id(tensor))
            if entry is None:
                entry = copies[id(tensor)] = (tensor, replicated_copy(tensor, mesh))
                logging.info("TofuStrategy: %s captures an eager tensor %s %s made outside it (a layer's "
                             "constant): put on the mesh replicated", what, tensor.dtype.name,
                             tensor.shape.as_list())
            tensor = entry[1]
        return original(tensor, name=name, shape=shape)

    capture._tofu_change = CHANGE_NAME  # pylint: disable=protected-access
    graph.capture = capture
    try:
        yield
    finally:
        if graph.capture is capture:
            del graph.capture                    # the class's method again
