"""Ops with data-dependent coordinates: lookups, scatters, segment reductions
and one-hot encodings.

``out[b, s, d] = table[ids[b, s], d]``: the looked-up dim of the table is
read at coordinates only the data knows, so the table stays whole on it
(a vocabulary-parallel lookup needs masking, which is another op); every
other dim splits. GatherNd reads several such dims at once. A segment sum
and ScatterNd write at data-dependent rows into zeros, so they split over
their update rows into partial sums, never over the rows written. A
TensorScatter op writes into a copy of its tensor: a part holding a block of
the tensor cannot tell which coordinates are its own, and parts holding some
of the updates would each return the whole tensor, so the written dims and
the update rows stay whole (the dims below the coordinates split). A one-hot
compares each depth position with the index it encodes, so the depth dim
stays whole.
"""

from __future__ import annotations

from tofu_tf.semantics.family import Family
from tofu_tf.semantics.language import DescriptionError, MetaKind
from tofu_tf.semantics.ops._util import conservative, names, normalize_axis
from tofu_tf.semantics.tdl import Max, Min, Out, Position, Program, Sum, Where
from tofu_tf.semantics.view import OpView

TENSOR_SCATTERS = ("TensorScatterUpdate", "TensorScatterAdd", "TensorScatterSub", "TensorScatterMax",
                   "TensorScatterMin")


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


def _index_depth(op: OpView, position: int) -> int:
    """The length of the coordinate vectors in the indices input at ``position``
    (the last dim of an ``*Nd`` op's indices): how many leading dims it addresses."""
    shape = op.input_shapes[position]
    if not shape:
        raise DescriptionError(f"{op.type}: indices need a last dim holding the coordinates, got shape {shape}")
    return shape[-1]


def gather_nd(op: OpView):
    """out[n.., r..] = params[indices[n.., 0], .., indices[n.., K-1], r..]"""
    depth = _index_depth(op, 1)
    rows = len(op.input_shapes[1]) - 1

    def program(params, indices):
        def out(*idx):
            looked, rest = idx[:rows], idx[rows:]
            return params[tuple(indices[looked + (k,)] for k in range(depth)) + rest]
        return Out(out, names(len(op.output_shapes[0])))
    return program


def scatter_nd(op: OpView):
    """out[s.., r..] = sum_{n..} updates[n.., r..] where (s..) = indices[n.., :] (shape in input 2)"""
    depth = _index_depth(op, 0)
    out_rank = len(op.output_shapes[0])
    rows = tuple(f"n{d}" for d in range(len(op.input_shapes[0]) - 1))
    written = tuple(f"s{d}" for d in range(depth))

    def program(indices, updates, shape):
        def out(*idx):
            placed, rest = idx[:depth], idx[depth:]

            def body(*n):
                return Where(updates[n + rest], *((s, indices[n + (k,)]) for k, s in enumerate(placed)))
            return Sum(body, names=rows)
        return Out(out, written + names(out_rank - depth, taken="sn"))
    return Program(program, meta={2: MetaKind.OUTPUT_SHAPE})


def tensor_scatter(op: OpView):
    """out[s.., r..] = tensor[s.., r..] updated by updates[:, r..] at indices[:, :]: s and the update rows whole"""
    depth = _index_depth(op, 1)
    rank = len(op.output_shapes[0])
    whole = (slice(None),) * (len(op.input_shapes[1]) - 1)

    def program(tensor, indices, updates):
        def out(*idx):
            rest = idx[depth:]
            return Position(*idx[:depth], args=(tensor[idx], updates[whole + rest], indices[whole + (slice(None),)]))
        return Out(out, names(rank))
    return program


def one_hot(op: OpView):
    """out[i.., d, j..] = on if indices[i.., j..] == d else off (d at the axis attr): d is whole"""
    rank = len(op.output_shapes[0])
    axis = normalize_axis(op.attr("axis", -1), rank, op)

    def program(indices, depth, on_value, off_value):
        def out(*idx):
            d = idx[axis]
            return Position(d, args=(indices[idx[:axis] + idx[axis + 1:]], on_value[()], off_value[()]))
        return Out(out, names(rank))
    return program


def register(registry) -> None:
    registry.register("GatherV2", family=Family.GATHER)(gather)
    registry.register("ResourceGather", family=Family.GATHER)(resource_gather)
    for op_type in ("UnsortedSegmentSum", "UnsortedSegmentMax", "UnsortedSegmentMin"):
        registry.register(op_type, family=Family.GATHER)(segment_reduce)
    registry.register("GatherNd", family=Family.GATHER)(gather_nd)
    registry.register("ScatterNd", family=Family.GATHER)(scatter_nd)
    for op_type in TENSOR_SCATTERS:
        registry.register(op_type, family=Family.GATHER)(tensor_scatter)
    registry.register("OneHot", family=Family.GATHER)(one_hot)
