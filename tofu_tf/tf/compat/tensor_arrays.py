"""TensorArrays of static size held as Python lists while the strategy's model is called.

This module owns the change "tensor_arrays_as_lists": while a model the strategy prepared is
called (traced for planning or into a step program; ``tofu_tf.tf.compat.slices`` wraps the
call and enters ``tensor_arrays_as_lists``), on the calling thread only, a ``tf.TensorArray``
made with a static size and no handle or flow keeps its elements in a Python list, as
TensorFlow's own eager TensorArray does: ``write(t, x)`` at a Python int stores ``x``,
``stack()`` is one ``Pack``, ``read``/``gather``/``unstack``/``concat`` are slices and packs.
TensorArrays made elsewhere, or on other threads, are TensorFlow's.

Why: in a graph a TensorArray is a TensorList (``TensorListReserve``, ``TensorListSetItem``,
``TensorListStack``), and TF 2.21's DTensor has no layout propagation for TensorLists, not even
replicated (``tofu_tf.search.dtensor_support``). keras-hub's RWKV-7 runs its recurrence as a
Python loop over the static sequence length that writes each step's output into a TensorArray
and stacks it: the loop is already unrolled, only the container is a TensorList. As a list,
the same values reach the same ``Pack``, and every op is one DTensor lays out.

A TensorArray used in a loop (``tf.while_loop``, ``tf.map_fn``; a ``tf.scan`` of static length is
unrolled first, ``tofu_tf.tf.compat.scans``: its flow taken, or an index the graph computes) cannot be a list: it becomes TensorFlow's graph TensorArray there, with
what was written, and the plan refuses its ``TensorListStack`` before the first step, naming the
layer and the fix (a Python loop over the static length) instead of failing inside DTensor.
"""

from __future__ import annotations

import contextlib
import functools
import numbers
import weakref
from typing import Iterator

import tensorflow as tf

from tofu_tf.tf.compat import patching
from tofu_tf.tf.compat.registry import change


def _tensor_array_init():
    from tensorflow.python.ops import tensor_array_ops
    return tensor_array_ops.TensorArray, "__init__"


_INIT = patching.ThreadScopedPatch(change("tensor_arrays_as_lists"), _tensor_array_init)


@contextlib.contextmanager
def tensor_arrays_as_lists() -> Iterator[None]:
    """While active, a ``tf.TensorArray`` of static size made on this thread is list-backed."""
    with _INIT.active(_list_backed_init):
        yield


def _list_backed_init(original, self, dtype, size=None, dynamic_size=None, clear_after_read=None,
                      tensor_array_name=None, handle=None, flow=None, infer_shape=True, element_shape=None,
                      colocate_with_first_write_call=True, name=None):
    static_size = None if size is None else _static_index(size)
    if handle is not None or flow is not None or static_size is None or dynamic_size:
        return original(self, dtype, size=size, dynamic_size=dynamic_size, clear_after_read=clear_after_read,
                        tensor_array_name=tensor_array_name, handle=handle, flow=flow, infer_shape=infer_shape,
                        element_shape=element_shape, colocate_with_first_write_call=colocate_with_first_write_call,
                        name=name)
    self._implementation = _list_class()(  # pylint: disable=protected-access
        dtype, size=int(static_size), dynamic_size=False, clear_after_read=clear_after_read, infer_shape=infer_shape,
        element_shape=element_shape)
    self._implementation.parent = weakref.ref(self)  # pylint: disable=protected-access
    return None


def _static_index(index):
    """``index`` as a Python int, or None when the graph computes it."""
    if isinstance(index, numbers.Integral):
        return int(index)
    static = tf.get_static_value(index)
    return None if static is None else static


@functools.lru_cache(maxsize=None)
def _list_class():
    from tensorflow.python.ops import tensor_array_ops

    class ListTensorArray(tensor_array_ops._EagerTensorArray):  # pylint: disable=protected-access
        """TensorFlow's eager TensorArray (a list of tensors) in a graph, while indices are static.

        Used in a loop (its flow taken, as ``tf.while_loop`` takes a loop variable's) or at an
        index the graph computes, it becomes TensorFlow's graph TensorArray holding what was
        written, and runs as TensorFlow runs it: a TensorList, which the plan then refuses by
        name (``TensorListStack``, ``tofu_tf.search.targets``). Raising here instead would
        unwind through ``tf.scan``, which leaves the default variable scope's caching device
        set, and every later ``strategy.scope()`` would fail."""

        def __init__(self, dtype, size, dynamic_size, clear_after_read, infer_shape, element_shape):
            self._handle = None
            self._infer_shape = infer_shape
            self._element_shape = tf.TensorShape(element_shape)
            self._colocate_with_first_write_call = False
            self._dtype = tf.as_dtype(dtype).base_dtype
            self._dynamic_size = dynamic_size or False
            self._clear_after_read = True if clear_after_read is None else clear_after_read
            self._previously_read_indices = []
            self._tensor_array = [None] * size

        def _as_graph(self):
            """Make the parent TensorArray a graph one holding this one's elements; its new implementation."""
            parent = self.parent()
            graph = tensor_array_ops._GraphTensorArrayV2(  # pylint: disable=protected-access
                self._dtype, size=len(self._tensor_array), dynamic_size=self._dynamic_size,
                clear_after_read=self._clear_after_read, infer_shape=self._infer_shape,
                element_shape=self._element_shape if self._element_shape.rank is not None else None)
            graph.parent = weakref.ref(parent)
            parent._implementation = graph  # pylint: disable=protected-access
            for index, value in enumerate(self._tensor_array):
                if value is not None:
                    written = graph.write(index, value)
                    graph = written._implementation  # pylint: disable=protected-access
                    graph.parent = weakref.ref(parent)
                    parent._implementation = graph  # pylint: disable=protected-access
            return graph

        @property
        def _flow(self):
            return self._as_graph()._flow  # pylint: disable=protected-access

        def read(self, index, name=None):
            static = _static_index(index)
            return self._as_graph().read(index, name) if static is None else super().read(static, name)

        def write(self, index, value, name=None):
            static = _static_index(index)
            if static is None:
                return self._as_graph().write(index, value, name)
            return super().write(static, value, name)

        def gather(self, indices, name=None):
            static = tf.get_static_value(indices)
            return self._as_graph().gather(indices, name) if static is None else super().gather(static, name)

        def scatter(self, indices, value, name=None):
            static = tf.get_static_value(indices)
            return self._as_graph().scatter(indices, value, name) if static is None \
                else super().scatter(static, value, name)

        def size(self, name=None):
            return tf.constant(len(self._tensor_array), tf.int32)

    return ListTensorArray
