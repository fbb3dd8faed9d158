"""Layout ops: they move elements without computing, so their descriptions
relate output dims to input dims. Reshape writes each input dim as a digit of
the flat output position (``x[i // 64, i % 64, d]``), so a dim splits exactly
where the split commutes with the reshape; transpose permutes indices;
concat, stack and split select among tensors along one index, which therefore
stays whole; slices and pads shift coordinates, so only untouched dims split.
"""

from __future__ import annotations

import math

from tofu_tf.semantics.family import Family
from tofu_tf.semantics.language import DescriptionError, MetaKind
from tofu_tf.semantics.ops._util import as_tuple, broadcast, conservative, names, normalize_axis
from tofu_tf.semantics.tdl import Out, Position, Program, Select, Sum, Where
from tofu_tf.semantics.view import OpView


def _strides(shape) -> tuple[int, ...]:
    out, acc = [], 1
    for size in reversed(shape):
        out.append(acc)
        acc *= size
    return tuple(reversed(out))


def reshape(op: OpView):
    """out[o..] = x[digits of the flat position of o..]: x[(i*256+j)//16384, ...]"""
    x_shape, out_shape = op.input_shapes[0], op.output_shapes[0]
    if math.prod(x_shape) != math.prod(out_shape):
        raise DescriptionError(f"{op.type}: {x_shape} and {out_shape} differ in size")
    out_strides, in_strides = _strides(out_shape), _strides(x_shape)

    def program(x, *meta):
        def out(*idx):
            flat = sum((i * s for i, s in zip(idx, out_strides)), 0)
            coords = []
            for d, (size, stride) in enumerate(zip(x_shape, in_strides)):
                digit = flat // stride
                coords.append(digit if d == 0 else digit % size)
            return x[tuple(coords)]
        return Out(out, names(len(out_shape)))
    meta = {1: MetaKind.OUTPUT_SHAPE} if op.type == "Reshape" else {}
    return Program(program, meta=meta)


def transpose(op: OpView):
    """out[i..] = x[i permuted back] (perm in input 1)"""
    perm = as_tuple(op.value(1))
    rank = len(op.output_shapes[0])
    if perm is None:
        return conservative(op, "permutation not static")
    perm = tuple(normalize_axis(p, rank, op) for p in perm)

    def program(x, perm_tensor):
        def out(*idx):
            coords = [None] * rank
            for k, p in enumerate(perm):
                coords[p] = idx[k]
            return x[tuple(coords)]
        return Out(out, names(rank))
    return program


def concat(op: OpView):
    """out[.., j, ..] = x_t[.., j - offset_t, ..] for the t whose range holds j: j is whole"""
    axis_pos = 0 if op.type == "Concat" else op.num_inputs - 1
    axis = op.value(axis_pos)
    rank = len(op.output_shapes[0])
    if axis is None:
        return conservative(op, "concat axis not static")
    axis = normalize_axis(axis, rank, op)
    shapes = [s for p, s in enumerate(op.input_shapes) if p != axis_pos]
    offsets = [sum(s[axis] for s in shapes[:t]) for t in range(len(shapes))]

    def program(*args):
        xs = [a for p, a in enumerate(args) if p != axis_pos]

        def out(*idx):
            j = idx[axis]
            return Select(j, [x[idx[:axis] + (j - off,) + idx[axis + 1:]] for x, off in zip(xs, offsets)])
        return Out(out, names(rank))
    return program


def pack(op: OpView):
    """out[.., t, ..] = x_t[..]: the stacked index t is whole"""
    rank = len(op.output_shapes[0])
    axis = normalize_axis(op.attr("axis", 0), rank, op)

    def program(*xs):
        def out(*idx):
            rest = idx[:axis] + idx[axis + 1:]
            return Select(idx[axis], [x[rest] for x in xs])
        return Out(out, names(rank))
    return program


def unpack(op: OpView):
    """out_t[..] = x[.., t, ..]"""
    rank = len(op.input_shapes[0])
    axis = normalize_axis(op.attr("axis", 0), rank, op)
    out_rank = rank - 1

    def program(x):
        return tuple(Out((lambda t: lambda *idx: x[idx[:axis] + (t,) + idx[axis:]])(t), names(out_rank))
                     for t in range(op.num_outputs))
    return program


def split(op: OpView):
    """out_t[.., j, ..] = x[.., j + offset_t, ..] (Split: equal parts; SplitV: sizes in input 1)"""
    if op.type == "Split":
        axis_pos, x_pos = 0, 1
    else:
        axis_pos, x_pos = 2, 0
    axis = op.value(axis_pos)
    x_shape = op.input_shapes[x_pos]
    if axis is None:
        return conservative(op, "split axis not static")
    axis = normalize_axis(axis, len(x_shape), op)
    sizes = [s[axis] for s in op.output_shapes]
    offsets = [sum(sizes[:t]) for t in range(len(sizes))]
    rank = len(x_shape)

    def program(*args):
        x = args[x_pos]

        def piece(t):
            def out(*idx):
                value = x[idx[:axis] + (idx[axis] + offsets[t],) + idx[axis + 1:]]
                # SplitV's size_splits state the global sizes: its split dim stays whole
                return Position(idx[axis], args=(value,)) if op.type == "SplitV" else value
            return out
        base = names(rank)
        return tuple(Out(piece(t), base[:axis] + (f"{base[axis]}{t}",) + base[axis + 1:]) for t in range(len(sizes)))
    return program


def slice_(op: OpView):
    """out[i..] = x[i + begin..] (begin in input 1, size in input 2)"""
    begin = as_tuple(op.value(1))
    x_shape = op.input_shapes[0]
    if begin is None:
        return _slice_at_unknown_begin(op)
    begin = tuple(b + s if b < 0 else b for b, s in zip(begin, x_shape))

    def program(x, begin_tensor, size_tensor):
        return Out(lambda *idx: x[tuple(i + b for i, b in zip(idx, begin))], names(len(x_shape)))
    return Program(program, meta={2: MetaKind.OUTPUT_SHAPE})


def _slice_at_unknown_begin(op: OpView):
    """out[i..] = x[i.., :]: a begin computed in the step (ConcatOffset's, in a
    concatenation's gradient) is unknown, but a dim the slice keeps whole must
    begin at 0; the cut dims stay whole."""
    x_shape, out_shape = op.input_shapes[0], op.output_shapes[0]
    cut = [d for d, (n, m) in enumerate(zip(x_shape, out_shape)) if n != m]

    def program(x, begin_tensor, size_tensor):
        def out(*idx):
            value = x[tuple(slice(None) if d in cut else i for d, i in enumerate(idx))]
            return Position(*(idx[d] for d in cut), args=(value,)) if cut else value
        return Out(out, names(len(x_shape)))
    return Program(program, meta={2: MetaKind.OUTPUT_SHAPE})


def _strided_spec(op: OpView, x_shape):
    """TF's strided-slice semantics as one entry per output dim: ``("new",)``
    for an inserted size-1 dim or ``("x", dim, start, stride)``; plus the
    input dims shrunk to a single coordinate ``{dim: index}``."""
    begin, end, strides = (as_tuple(op.value(p)) for p in (1, 2, 3))
    if begin is None or end is None or strides is None:
        return None
    bm, em, elm, nam, sam = (int(op.attr(k, 0) or 0) for k in
                             ("begin_mask", "end_mask", "ellipsis_mask", "new_axis_mask", "shrink_axis_mask"))
    entries, shrink, d = [], {}, 0
    n = len(begin)
    for i in range(n):
        if (elm >> i) & 1:
            after = sum(1 for k in range(i + 1, n) if not (nam >> k) & 1)
            while d < len(x_shape) - after:
                entries.append(("x", d, 0, 1))
                d += 1
            continue
        if (nam >> i) & 1:
            entries.append(("new",))
            continue
        if d >= len(x_shape):
            return None
        size, stride = x_shape[d], strides[i]
        if (sam >> i) & 1:
            b = begin[i] + size if begin[i] < 0 else begin[i]
            shrink[d] = b
        else:
            if (bm >> i) & 1:
                start = 0 if stride > 0 else size - 1
            else:
                b = begin[i] + size if begin[i] < 0 else begin[i]
                start = min(max(b, 0), size) if stride > 0 else min(max(b, -1), size - 1)
            entries.append(("x", d, start, stride))
        d += 1
    while d < len(x_shape):
        entries.append(("x", d, 0, 1))
        d += 1
    return entries, shrink


def strided_slice(op: OpView):
    """out[i..] = x[begin + i * stride..] (shrunk dims at their index, new dims of size 1)"""
    x_shape, out_shape = op.input_shapes[0], op.output_shapes[0]
    spec = _strided_spec(op, x_shape)
    if spec is None or len(spec[0]) != len(out_shape):
        return conservative(op, "strided slice bounds not static")
    entries, shrink = spec

    def program(x, b, e, s):
        def out(*idx):
            coords = [None] * len(x_shape)
            for d, k in shrink.items():
                coords[d] = k
            for i, entry in zip(idx, entries):
                if entry[0] == "x":
                    _, d, start, stride = entry
                    coords[d] = start + i * stride
            return x[tuple(coords)]
        return Out(out, names(len(out_shape)))
    return program


def strided_slice_grad(op: OpView):
    """dx[begin + i * stride..] = dy[i..]: the scatter form of a strided slice"""
    dx_shape, dy_shape = op.output_shapes[0], op.input_shapes[4]
    spec = _strided_spec(op, dx_shape)
    if spec is None or len(spec[0]) != len(dy_shape):
        return conservative(op, "strided slice bounds not static")
    entries, shrink = spec
    dy_names = names(len(dy_shape))
    dx_names = tuple(f"x{d}" for d in range(len(dx_shape)))

    def program(shape, b, e, s, dy):
        def out(*dx_idx):
            def body(*i):
                placements = [(dx_idx[d], k) for d, k in shrink.items()]
                coords = []
                for ik, entry in zip(i, entries):
                    coords.append(ik)
                    if entry[0] == "x":
                        _, d, start, stride = entry
                        placements.append((dx_idx[d], start + ik * stride))
                return Where(dy[tuple(coords)], *placements)
            return Sum(body, names=dy_names)
        return Out(out, dx_names)
    return Program(program, meta={0: MetaKind.OUTPUT_SHAPE})


def pad(op: OpView):
    """out[i..] = x[i - before..] (zero / constant / mirrored outside): padded dims are whole"""
    paddings = as_tuple(op.value(1))
    x_shape = op.input_shapes[0]
    if paddings is None or len(paddings) != 2 * len(x_shape):
        return conservative(op, "paddings not static")
    before = paddings[0::2]
    padded = [d for d in range(len(x_shape)) if paddings[2 * d] or paddings[2 * d + 1]]

    def program(x, paddings_tensor, *constant):
        def out(*idx):
            value = x[tuple(i - b for i, b in zip(idx, before))]
            extra = tuple(c[()] for c in constant)
            return Position(*(idx[d] for d in padded), args=(value,) + extra) if padded else value
        return Out(out, names(len(x_shape)))
    return program


def tile(op: OpView):
    """out[i..] = x[i % size..] (multiples in input 1)"""
    x_shape, out_shape = op.input_shapes[0], op.output_shapes[0]

    def program(x, multiples):
        def out(*idx):
            return x[tuple(i if n == m else (0 if n == 1 else i % n) for i, n, m in zip(idx, x_shape, out_shape))]
        return Out(out, names(len(out_shape)))
    return Program(program, meta={1: MetaKind.TILE_MULTIPLES})


def broadcast_to(op: OpView):
    """out[i..] = x[i..] under numpy broadcasting (shape in input 1)"""
    out_shape = op.output_shapes[0]

    def program(x, shape):
        return Out(lambda *idx: x[broadcast(idx, x.shape, out_shape)], names(len(out_shape)))
    return Program(program, meta={1: MetaKind.OUTPUT_SHAPE})


def matrix_band_part(op: OpView):
    """out[.., i, j] = x[.., i, j] if j - i <= upper and i - j <= lower else 0: i, j whole unless the band is everything"""
    lower, upper = op.value(1), op.value(2)
    rank = len(op.output_shapes[0])
    everything = lower is not None and upper is not None and lower < 0 and upper < 0

    def program(x, lo, up):
        def out(*idx):
            return x[idx] if everything else Position(idx[-2], idx[-1], args=(x[idx],))
        return Out(out, names(rank))
    return program


def invert_permutation(op: OpView):
    """out[x[i]] = i: needs the whole permutation"""
    return lambda x: lambda i: Position(i, args=(x[:],))


def register(registry) -> None:
    table = {
        "Reshape": reshape, "ExpandDims": reshape, "Squeeze": reshape, "Transpose": transpose,
        "ConcatV2": concat, "Concat": concat, "Pack": pack, "Unpack": unpack, "Split": split, "SplitV": split,
        "Slice": slice_, "StridedSlice": strided_slice, "StridedSliceGrad": strided_slice_grad,
        "Pad": pad, "PadV2": pad, "MirrorPad": pad, "Tile": tile, "BroadcastTo": broadcast_to,
        "MatrixBandPart": matrix_band_part, "InvertPermutation": invert_permutation,
    }
    for op_type, build in table.items():
        registry.register(op_type, family=Family.LAYOUT)(build)
