"""Windowed ops: convolution and pooling. An output position ``h`` reads the
input range ``h*stride + r*dilation - pad`` for window offsets ``r``; the
gradients write that range (``Where``). Splitting ``h`` is legal only when
windows of different parts do not overlap and line up with the blocks (no
padding, window no longer than its stride): otherwise a halo would have to be
exchanged, which a strategy does not express, so the derivation leaves ``h``
whole. Batch and channels split freely; the filter's input channels, like any
contracted index, split into partial sums.
"""

from __future__ import annotations

from tofu_tf.semantics.family import Family
from tofu_tf.semantics.language import DescriptionError, MetaKind
from tofu_tf.semantics.ops._util import Format, data_format, windows
from tofu_tf.semantics.tdl import Apply, Max, Mean, Out, Program, Sum, Where
from tofu_tf.semantics.view import OpView

_NAMES = {  # spatial, kernel offset and output-coordinate index names per spatial rank
    1: (("w",), ("q",), ("x",)),
    2: (("h", "w"), ("r", "q"), ("y", "x")),
    3: (("d", "h", "w"), ("t", "r", "q"), ("z", "y", "x")),
}


def _names(rank: int):
    if rank not in _NAMES:
        raise DescriptionError(f"{rank} spatial dims are not supported")
    return _NAMES[rank]


def _spatial(fmt: Format, shape) -> tuple[int, ...]:
    return tuple(shape[d] for d in fmt.spatial)


def _conv_windows(op: OpView, fmt: Format, x_shape, y_shape, kernel):
    return windows(op, fmt, _spatial(fmt, x_shape), _spatial(fmt, y_shape), kernel)


def _groups(x_channels: int, f_shape) -> tuple[int, int, int]:
    """(groups, input channels per group, output channels per group) of a convolution whose
    input has ``x_channels`` channels and whose filter is ``f_shape`` (``[..., c/groups, o]``)."""
    per_group = f_shape[-2]
    if not per_group or x_channels % per_group or f_shape[-1] % (x_channels // per_group):
        raise DescriptionError(f"filter {tuple(f_shape)} does not group {x_channels} input channels")
    groups = x_channels // per_group
    return groups, per_group, f_shape[-1] // groups


def conv(op: OpView):
    """out[n, h, w, o] = sum_{r, q, c} x[n, h*s+r*d-p, w*s+q*d-p, c] * f[r, q, c, o]"""
    fmt = data_format(op)
    x_shape, f_shape = op.input_shapes[0], op.input_shapes[1]
    rank = len(fmt.spatial)
    win = _conv_windows(op, fmt, x_shape, op.output_shapes[0], f_shape[:rank])
    sp, kr, _ = _names(rank)
    groups, cg, og = _groups(x_shape[fmt.channel], f_shape)
    if groups > 1:
        return _grouped_conv(fmt, win, rank, groups, cg, og)

    def program(x, f):
        def out(*idx):
            n, hw, o = fmt.split(idx)

            def body(*rc):
                r, c = rc[:rank], rc[rank]
                return x[fmt.place(n, tuple(wi.at(h, k) for wi, h, k in zip(win, hw, r)), c)] * f[r + (c, o)]
            return Sum(body, names=kr + ("c",))
        return Out(out, fmt.place("n", sp, "o"))
    return program


def conv_backprop_input(op: OpView):
    """dx[n, h*s+r*d-p, w*s+q*d-p, c] += dy[n, h, w, o] * f[r, q, c, o] (a scatter over windows)"""
    fmt = data_format(op)
    f_shape, dy_shape, dx_shape = op.input_shapes[1], op.input_shapes[2], op.output_shapes[0]
    rank = len(fmt.spatial)
    win = _conv_windows(op, fmt, dx_shape, dy_shape, f_shape[:rank])
    sp, kr, outn = _names(rank)
    groups, cg, og = _groups(dx_shape[fmt.channel], f_shape)
    if groups > 1:
        return _grouped_conv_backprop_input(fmt, win, rank, groups, cg, og)

    def program(sizes, f, dy):
        def out(*idx):
            n, yx, c = fmt.split(idx)

            def body(*hwrqo):
                hw, r, o = hwrqo[:rank], hwrqo[rank:2 * rank], hwrqo[2 * rank]
                value = dy[fmt.place(n, hw, o)] * f[r + (c, o)]
                return Where(value, *((y, wi.at(h, k)) for y, wi, h, k in zip(yx, win, hw, r)))
            return Sum(body, names=sp + kr + ("o",))
        return Out(out, fmt.place("n", outn, "c"))
    return Program(program, meta={0: MetaKind.OUTPUT_SHAPE})


def conv_backprop_filter(op: OpView):
    """df[r, q, c, o] = sum_{n, h, w} x[n, h*s+r*d-p, w*s+q*d-p, c] * dy[n, h, w, o]"""
    fmt = data_format(op)
    x_shape, dy_shape, df_shape = op.input_shapes[0], op.input_shapes[2], op.output_shapes[0]
    rank = len(fmt.spatial)
    win = _conv_windows(op, fmt, x_shape, dy_shape, df_shape[:rank])
    sp, kr, _ = _names(rank)
    groups, cg, og = _groups(x_shape[fmt.channel], df_shape)
    if groups > 1:
        return _grouped_conv_backprop_filter(fmt, win, rank, groups, cg, og)

    def program(x, sizes, dy):
        def out(*rqco):
            r, c, o = rqco[:rank], rqco[rank], rqco[rank + 1]

            def body(n, *hw):
                return x[fmt.place(n, tuple(wi.at(h, k) for wi, h, k in zip(win, hw, r)), c)] * dy[fmt.place(n, hw, o)]
            return Sum(body, names=("n",) + sp)
        return Out(out, kr + ("c", "o"))
    return Program(program, meta={1: MetaKind.OUTPUT_SHAPE})


def _grouped_conv(fmt, win, rank, groups, cg, og):
    """A grouped convolution (``groups`` > 1: a depthwise one written as ``Conv2D``):
    out[n, h, w, g*og+j] = sum_{r, q, c} x[n, h*s+r*d-p, w*s+q*d-p, g*cg+c] * f[r, q, c, g*og+j]"""
    sp, kr, _ = _names(rank)

    def program(x, f):
        def out(*idx):
            n, hw, o = fmt.split(idx)

            def body(*rcgj):
                r, c, g, j = rcgj[:rank], rcgj[rank], rcgj[rank + 1], rcgj[rank + 2]
                value = x[fmt.place(n, tuple(wi.at(h, k) for wi, h, k in zip(win, hw, r)), g * cg + c)] \
                    * f[r + (c, g * og + j)]
                return Where(value, (o, g * og + j))
            return Sum(body, names=kr + ("c", "g", "j"), sizes={"g": groups, "j": og})
        return Out(out, fmt.place("n", sp, "o"))
    return program


def _grouped_conv_backprop_input(fmt, win, rank, groups, cg, og):
    """dx[n, h*s+r*d-p, w*s+q*d-p, g*cg+c] += dy[n, h, w, g*og+j] * f[r, q, c, g*og+j]"""
    sp, kr, outn = _names(rank)

    def program(sizes, f, dy):
        def out(*idx):
            n, yx, ci = fmt.split(idx)

            def body(*hwrcgj):
                hw, r = hwrcgj[:rank], hwrcgj[rank:2 * rank]
                c, g, j = hwrcgj[2 * rank], hwrcgj[2 * rank + 1], hwrcgj[2 * rank + 2]
                value = dy[fmt.place(n, hw, g * og + j)] * f[r + (c, g * og + j)]
                return Where(value, *((y, wi.at(h, k)) for y, wi, h, k in zip(yx, win, hw, r)), (ci, g * cg + c))
            return Sum(body, names=sp + kr + ("c", "g", "j"), sizes={"g": groups, "j": og})
        return Out(out, fmt.place("n", outn, "ci"))
    return Program(program, meta={0: MetaKind.OUTPUT_SHAPE})


def _grouped_conv_backprop_filter(fmt, win, rank, groups, cg, og):
    """df[r, q, c, g*og+j] = sum_{n, h, w} x[n, h*s+r*d-p, w*s+q*d-p, g*cg+c] * dy[n, h, w, g*og+j]"""
    sp, kr, _ = _names(rank)

    def program(x, sizes, dy):
        def out(*rqco):
            r, c, o = rqco[:rank], rqco[rank], rqco[rank + 1]

            def body(n, *hwgj):
                hw, g, j = hwgj[:rank], hwgj[rank], hwgj[rank + 1]
                value = x[fmt.place(n, tuple(wi.at(h, k) for wi, h, k in zip(win, hw, r)), g * cg + c)] \
                    * dy[fmt.place(n, hw, g * og + j)]
                return Where(value, (o, g * og + j))
            return Sum(body, names=("n",) + sp + ("g", "j"), sizes={"g": groups, "j": og})
        return Out(out, kr + ("c", "o"))
    return Program(program, meta={1: MetaKind.OUTPUT_SHAPE})


def depthwise(op: OpView):
    """out[n, h, w, c*M+m] = sum_{r, q} x[n, h*s+r*d-p, w*s+q*d-p, c] * f[r, q, c, m]"""
    fmt = data_format(op)
    x_shape, f_shape = op.input_shapes[0], op.input_shapes[1]
    mult = f_shape[3]
    win = _conv_windows(op, fmt, x_shape, op.output_shapes[0], f_shape[:2])

    def program(x, f):
        def out(*idx):
            n, (h, w), k = fmt.split(idx)

            def body(r, q, c, m):
                value = x[fmt.place(n, (win[0].at(h, r), win[1].at(w, q)), c)] * f[r, q, c, m]
                return Where(value, (k, c * mult + m))
            return Sum(body)
        return Out(out, fmt.place("n", ("h", "w"), "k"))
    return program


def depthwise_backprop_input(op: OpView):
    """dx[n, h*s+r*d-p, w*s+q*d-p, c] += dy[n, h, w, c*M+m] * f[r, q, c, m]"""
    fmt = data_format(op)
    f_shape, dy_shape, dx_shape = op.input_shapes[1], op.input_shapes[2], op.output_shapes[0]
    mult = f_shape[3]
    win = _conv_windows(op, fmt, dx_shape, dy_shape, f_shape[:2])

    def program(sizes, f, dy):
        def out(*idx):
            n, (y, x), c = fmt.split(idx)

            def body(h, w, r, q, m):
                value = dy[fmt.place(n, (h, w), c * mult + m)] * f[r, q, c, m]
                return Where(value, (y, win[0].at(h, r)), (x, win[1].at(w, q)))
            return Sum(body)
        return Out(out, fmt.place("n", ("y", "x"), "c"))
    return Program(program, meta={0: MetaKind.OUTPUT_SHAPE})


def depthwise_backprop_filter(op: OpView):
    """df[r, q, c, m] = sum_{n, h, w} x[n, h*s+r*d-p, w*s+q*d-p, c] * dy[n, h, w, c*M+m]"""
    fmt = data_format(op)
    x_shape, dy_shape, df_shape = op.input_shapes[0], op.input_shapes[2], op.output_shapes[0]
    mult = df_shape[3]
    win = _conv_windows(op, fmt, x_shape, dy_shape, df_shape[:2])

    def program(x, sizes, dy):
        def out(r, q, c, m):
            return Sum(lambda n, h, w: x[fmt.place(n, (win[0].at(h, r), win[1].at(w, q)), c)]
                       * dy[fmt.place(n, (h, w), c * mult + m)])
        return out
    return Program(program, meta={1: MetaKind.OUTPUT_SHAPE})


def _pool_kernel(op: OpView, fmt: Format):
    ksize = op.attr("ksize")
    if ksize is None or len(ksize) != len(fmt.text):
        raise DescriptionError(f"{op.type}: ksize attribute missing or of the wrong length")
    if ksize[fmt.text.index("N")] != 1 or ksize[fmt.channel] != 1:
        raise DescriptionError(f"{op.type}: pooling over batch or channels is not supported")
    return tuple(int(ksize[d]) for d in fmt.spatial)


def pool(op: OpView):
    """out[n, h, w, c] = max/mean_{r, q} x[n, h*s+r-p, w*s+q-p, c]"""
    fmt = data_format(op)
    kernel = _pool_kernel(op, fmt)
    win = _conv_windows(op, fmt, op.input_shapes[0], op.output_shapes[0], kernel)
    reducer = Max if op.type == "MaxPool" else Mean
    rank = len(kernel)
    sp, kr, _ = _names(rank)

    def program(x):
        def out(*idx):
            n, hw, c = fmt.split(idx)
            return reducer(lambda *r: x[fmt.place(n, tuple(wi.at(h, k) for wi, h, k in zip(win, hw, r)), c)],
                           names=kr, sizes=dict(zip(kr, kernel)))
        return Out(out, fmt.place("n", sp, "c"))
    return program


def max_pool_grad(op: OpView):
    """dx[n, h*s+r-p, w*s+q-p, c] += dy[n, h, w, c] where x there is the window's max y[n, h, w, c]"""
    fmt = data_format(op)
    kernel = _pool_kernel(op, fmt)
    dx_shape, dy_shape = op.input_shapes[0], op.input_shapes[2]
    win = _conv_windows(op, fmt, dx_shape, dy_shape, kernel)
    rank = len(kernel)
    sp, kr, outn = _names(rank)

    def program(x, y, dy):
        def out(*idx):
            n, yx, c = fmt.split(idx)

            def body(*hwr):
                hw, r = hwr[:rank], hwr[rank:]
                at = tuple(wi.at(h, k) for wi, h, k in zip(win, hw, r))
                value = Apply("argmax_mask", dy[fmt.place(n, hw, c)], x[fmt.place(n, at, c)], y[fmt.place(n, hw, c)])
                return Where(value, *zip(yx, at))
            return Sum(body, names=sp + kr, sizes=dict(zip(kr, kernel)))
        return Out(out, fmt.place("n", outn, "c"))
    return program


def avg_pool_grad(op: OpView):
    """dx[n, h*s+r-p, w*s+q-p, c] += dy[n, h, w, c] / window size"""
    fmt = data_format(op)
    kernel = _pool_kernel(op, fmt)
    dx_shape, dy_shape = op.output_shapes[0], op.input_shapes[1]
    win = _conv_windows(op, fmt, dx_shape, dy_shape, kernel)
    rank = len(kernel)
    sp, kr, outn = _names(rank)

    def program(sizes, dy):
        def out(*idx):
            n, yx, c = fmt.split(idx)

            def body(*hwr):
                hw, r = hwr[:rank], hwr[rank:]
                at = tuple(wi.at(h, k) for wi, h, k in zip(win, hw, r))
                return Where(Apply("div_count", dy[fmt.place(n, hw, c)]), *zip(yx, at))
            return Sum(body, names=sp + kr, sizes=dict(zip(kr, kernel)))
        return Out(out, fmt.place("n", outn, "c"))
    return Program(program, meta={0: MetaKind.OUTPUT_SHAPE})


def register(registry) -> None:
    table = {
        "Conv2D": conv, "Conv3D": conv,
        "Conv2DBackpropInput": conv_backprop_input, "Conv2DBackpropFilter": conv_backprop_filter,
        "DepthwiseConv2dNative": depthwise,
        "DepthwiseConv2dNativeBackpropInput": depthwise_backprop_input,
        "DepthwiseConv2dNativeBackpropFilter": depthwise_backprop_filter,
        "MaxPool": pool, "AvgPool": pool, "MaxPoolGrad": max_pool_grad, "AvgPoolGrad": avg_pool_grad,
    }
    for op_type, build in table.items():
        registry.register(op_type, family=Family.WINDOW)(build)
