"""Reductions: ``out[i..] = sum/mean/max/min/prod_r x[i.., r..]`` over named
axes. Splitting a reduced axis leaves each device a partial result combined
by the same reduction ("partition-n-reduce"); a product is not split. Ops
that reduce under a non-linear function (EuclideanNorm, ArgMax) reduce
*inside* their expression, so their reduced axes are never split. TopKV2
selects along its last axis: each of its k results depends on the whole row
and on its own global rank, so neither that axis nor k splits.
"""

from __future__ import annotations

from tofu_tf.semantics.family import Family
from tofu_tf.semantics.ops._util import as_tuple, conservative, names, normalize_axis
from tofu_tf.semantics.tdl import Apply, Max, Mean, Min, Out, Position, Prod, Sum, Where
from tofu_tf.semantics.view import OpView

_REDUCERS = {"Sum": Sum, "Mean": Mean, "Max": Max, "Min": Min, "Prod": Prod, "Any": Max, "All": Min}


def _axes(op: OpView, rank: int) -> tuple[int, ...] | None:
    axes = as_tuple(op.value(1))
    if axes is None:
        return None
    return tuple(sorted({normalize_axis(a, rank, op) for a in axes})) if rank else ()


def _reduce_program(op: OpView, reducer, wrap=None):
    """out[kept..] = reducer_{r..} x[..]; keep_dims puts the reduced dims at 0."""
    x_shape = op.input_shapes[0]
    rank = len(x_shape)
    axes = _axes(op, rank)
    if axes is None:
        return conservative(op, "reduction axes not static")
    keep = bool(op.attr("keep_dims", False))
    kept = [d for d in range(rank) if d not in axes]
    out_rank = rank if keep else len(kept)
    out_names = names(out_rank, taken="rstu")
    red_names = tuple(f"r{a}" if len(axes) > 1 else "r" for a in range(len(axes)))

    def program(x, axes_tensor):
        def out(*idx):
            kept_idx = [idx[d] for d in kept] if keep else list(idx)

            def body(*r):
                coords, ki, ri = [], iter(kept_idx), iter(r)
                for d in range(rank):
                    coords.append(next(ri) if d in axes else next(ki))
                return x[tuple(coords)]
            value = reducer(body, names=red_names) if axes else body()
            if wrap is not None:
                value = Apply(wrap, value)
            if keep and axes:
                return Where(value, *((idx[d], 0) for d in axes))
            return value
        return Out(out, out_names)
    return program


def reduce(op: OpView):
    """out[i..] = reduce_r x[i.., r] over the axes in input 1 (keep_dims: reduced dims at 0)"""
    return _reduce_program(op, _REDUCERS[op.type])


def euclidean_norm(op: OpView):
    """out[i..] = sqrt(sum_r x[i.., r]^2): the sum is internal"""
    return _reduce_program(op, Sum, wrap="sqrt")


def arg_reduce(op: OpView):
    """out[i..] = argmax_r x[i.., r]: an index, not a value, so r is internal"""
    x_shape = op.input_shapes[0]
    rank = len(x_shape)
    axis = op.value(1)
    if axis is None:
        return conservative(op, "axis not static")
    axis = normalize_axis(axis, rank, op)
    reducer = Max if op.type == "ArgMax" else Min

    def program(x, axis_tensor):
        def out(*idx):
            return Apply(op.type, reducer(lambda r: x[idx[:axis] + (r,) + idx[axis:]]))
        return Out(out, names(rank - 1, taken="r"))
    return program


def bias_add_grad(op: OpView):
    """out[c] = sum_{n..} dy[n.., c] (c: the channel dim of data_format)"""
    x_shape = op.input_shapes[0]
    rank = len(x_shape)
    fmt = op.attr("data_format", "NHWC") or "NHWC"
    channel = 1 if fmt.startswith("NC") and rank >= 2 else rank - 1
    others = tuple(f"r{d}" for d in range(rank - 1))

    def program(dy):
        def out(c):
            def body(*r):
                coords = list(r)
                coords.insert(channel, c)
                return dy[tuple(coords)]
            return Sum(body, names=others)
        return out
    return program


def l2_loss(op: OpView):
    """out[] = sum_{i..} x[i..]^2 / 2"""
    rank = len(op.input_shapes[0])

    def program(x):
        return lambda: Sum(lambda *r: x[r] * x[r] / 2, names=names(rank))
    return program


def cumsum(op: OpView):
    """out[.., t, ..] = sum_{s <= t} x[.., s, ..] (exclusive / reverse attrs): the scanned axis depends on global positions"""
    rank = len(op.output_shapes[0])
    axis = op.value(1)
    if axis is None:
        return conservative(op, "scan axis not static")
    axis = normalize_axis(axis, rank, op)

    def program(x, axis_tensor):
        def out(*idx):
            return Sum(lambda s: Position(s, idx[axis], args=(x[idx[:axis] + (s,) + idx[axis + 1:]],)))
        return Out(out, names(rank, taken="s"))
    return program


def top_k(op: OpView):
    """values[i.., j], indices[i.., j] = the j-th largest of x[i.., :] and its position: the row is whole, j fixed"""
    rank = len(op.input_shapes[0])

    def program(x, k):
        def out(*idx):
            return Position(idx[-1], args=(x[idx[:-1] + (slice(None),)],))
        return Out(out, names(rank)), Out(out, names(rank))
    return program


def register(registry) -> None:
    for op_type in _REDUCERS:
        registry.register(op_type, family=Family.REDUCTION)(reduce)
    registry.register("EuclideanNorm", family=Family.REDUCTION)(euclidean_norm)
    registry.register("ArgMax", family=Family.REDUCTION)(arg_reduce)
    registry.register("ArgMin", family=Family.REDUCTION)(arg_reduce)
    registry.register("BiasAddGrad", family=Family.REDUCTION)(bias_add_grad)
    registry.register("L2Loss", family=Family.REDUCTION)(l2_loss)
    registry.register("Cumsum", family=Family.REDUCTION)(cumsum)
    registry.register("TopKV2", family=Family.REDUCTION)(top_k)
