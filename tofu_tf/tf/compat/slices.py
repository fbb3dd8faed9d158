"""New-axis slices of the strategy's models spelled out, so DTensor lays them out correctly.

This module owns the changes "new_axis_slices_spelled_out" (a prepared model's ``call``
wrapped, for the model's life) and "tensor_getitem_spelled_out": while that model is
called (traced for planning, or traced into a step program), on the calling thread only,
``tf.Tensor.__getitem__`` turns a slice spec with a new axis into the same slice with
every axis named (``t[:, None]`` on a matrix becomes ``t[:, None, :]``,
``tofu_tf.tf.variables.spelled_out``). Other threads, and slices taken outside the
model's call, see TensorFlow's own ``__getitem__``. It changes nothing else.

Why: TF 2.21's DTensor infers a ``StridedSlice``'s output layout from the input's layout
at the output position for the axes a spec leaves implicit after a new axis: an
out-of-bounds read, a segfault or an error of garbage bytes, in every layout, replicated
included (``tofu_tf.search.targets``; reproducer in ``tests/test_dtensor_expanders.py``).
keras-hub's XLNet builds its segment matrix so (``segment_ids[:, None] == cat_ids[None, :]``
in ``XLNetSegmentMatrixLayer``), and the plan refused it. The spelled-out slice is the same
op on the same values, with a spec DTensor reads axis by axis; the strategy's own variables
already slice so (``TofuVariable.__getitem__``).
"""

from __future__ import annotations

import contextlib
import functools
import types
from typing import Iterator

from tofu_tf.tf import variables as variables_lib
from tofu_tf.tf.compat import depthwise, patching, scans, tensor_arrays, windows
from tofu_tf.tf.compat.registry import Applied, change


def _tensor_getitem():
    from tensorflow.python.framework import tensor
    return tensor.Tensor, "__getitem__"


_GETITEM = patching.ThreadScopedPatch(change("tensor_getitem_spelled_out"), _tensor_getitem)


def _spelling_out(original, value, spec):
    rank = value.shape.rank if value.shape is not None else None
    return original(value, variables_lib.spelled_out(spec, rank))


@contextlib.contextmanager
def new_axes_spelled_out() -> Iterator[None]:
    """While active, ``t[spec]`` on a ``tf.Tensor`` on this thread names every axis of a spec
    with a new axis (``variables.spelled_out``); other threads slice as TensorFlow does."""
    with _GETITEM.active(_spelling_out):
        yield


def spell_out_new_axes(model) -> Applied | None:
    """Make ``model``'s call run under ``new_axes_spelled_out`` (and, for the same reason, under
    ``tensor_arrays.tensor_arrays_as_lists``, ``scans.scans_unrolled``,
    ``depthwise.depthwise_ops_as_grouped`` and ``windows.dilated_convs_in_conv2d``); the record, or None
    when it already does. Every layer the model calls is inside its call, so one wrap covers them."""
    if getattr(model, "_tofu_slices_spelled", False):
        return None
    model.call = types.MethodType(_spelled_call(model.call), model)
    model._tofu_slices_spelled = True  # pylint: disable=protected-access
    return Applied(change("new_axis_slices_spelled_out"), model.name, "t[:, None] sliced as t[:, None, :]")


def _spelled_call(call):
    """``call`` (the model's bound call) run under the contexts; unbound, so that a copy of the
    model (``copy.deepcopy`` rebinds the method) runs its own call, not the original's."""
    func = getattr(call, "__func__", None)

    @functools.wraps(call)
    def spelled_call(self, *args, **kwargs):
        with new_axes_spelled_out(), tensor_arrays.tensor_arrays_as_lists(), scans.scans_unrolled(), \
                depthwise.depthwise_ops_as_grouped(), windows.dilated_convs_in_conv2d():
            return func(self, *args, **kwargs) if func is not None else call(*args, **kwargs)
    return spelled_call
