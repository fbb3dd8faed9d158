"""Ops with data-dependent coordinates: lookups and segment reductions.

``out[b, s, d] = table[ids[b, s], d]``: the looked-up dim of the table is
read at coordinates only the data knows, so the table stays whole on it
(a vocabulary-parallel lookup needs masking, which is another op); every
other dim splits. A segment sum writes at data-dependent rows, so it splits
over its input rows into partial sums, never over the segments.
"""

from __future__ import annotations

from tofu_tf.semantics.language import MetaKind
from tofu_tf.semantics.ops._util import conservative, names, normalize_axis
from tofu_tf.semantics.tdl import Max, Min, Out, Program, Sum, Where
from tofu_tf.semantics.view import OpView


def _gather_program(op: OpView, axis: int, batch_dims: int):
    i_shape = op.input_shapes[1]
    out_rank = len(op.output_shapes[0])
    mid = len(i_shape) - batch_dims

    def program(params, indices, *meta):
        def out(*idx):
            pre, looked, post = idx[:axis], idx[axis:axis + mid], idx[axis + mid:]
            ids = indices[pre[:batch_dims] + looked]
            return params[pre + (ids,) + post]
        return Out(out, names(out_rank))
    return program


def gather(op: OpView):
    """out[a.., i.., b..] = params[a.., indices[i..], b..] (axis in input 2)"""
    axis = op.value(2)
    if axis is None:
        return conservative(op, "gather axis not static")
    p_rank, i_rank = len(op.input_shapes[0]), len(op.input_shapes[1])
    axis = normalize_axis(axis, p_rank, op)
    batch_dims = op.attr("batch_dims", 0) or 0
    batch_dims = batch_dims % (i_rank + 1) if batch_dims < 0 else batch_dims
    return _gather_program(op, axis, batch_dims)


def resource_gather(op: OpView):
    """out[i.., d..] = var[indices[i..], d..]: an embedding lookup"""
    batch_dims = op.attr("batch_dims", 0) or 0
    return _gather_program(op, batch_dims, batch_dims)


def segment_reduce(op: OpView):
    """out[s, d..] = sum/max/min_{n..} data[n.., d..] where s = segment_ids[n..]"""
    s_shape = op.input_shapes[1]
    out_rank = len(op.output_shapes[0])
    reducer = {"UnsortedSegmentSum": Sum, "UnsortedSegmentMax": Max, "UnsortedSegmentMin": Min}[op.type]
    rows = tuple(f"n{d}" if len(s_shape) > 1 else "n" for d in range(len(s_shape)))

    def program(data, segment_ids, num_segments):
        def out(s, *rest):
            return reducer(lambda *n: Where(data[n + rest], (s, segment_ids[n])), names=rows)
        return Out(out, ("s",) + names(out_rank - 1, taken="sn"))
    return Program(program, meta={2: MetaKind.STATIC})


def register(registry) -> None:
    from tofu_tf.semantics.registry import Family
    registry.register("GatherV2", family=Family.GATHER)(gather)
    registry.register("ResourceGather", family=Family.GATHER)(resource_gather)
    for op_type in ("UnsortedSegmentSum", "UnsortedSegmentMax", "UnsortedSegmentMin"):
        registry.register(op_type, family=Family.GATHER)(segment_reduce)
