"""Contractions, einsum-like: ``out[i, j] = sum_k a[i, k] * b[k, j]`` and its
batched and general (Einsum) forms. Output indices split the operands that
carry them; a contracted index splits both operands and leaves partial sums.
"""

from __future__ import annotations

from tofu_tf.semantics.family import Family
from tofu_tf.semantics.language import DescriptionError
from tofu_tf.semantics.ops._util import broadcast, conservative, names
from tofu_tf.semantics.tdl import Apply, Out, Sum
from tofu_tf.semantics.view import OpView


def matmul(op: OpView):
    """out[i, j] = sum_k a[i, k] * b[k, j] (transpose_a: a[k, i]; transpose_b: b[j, k])"""
    ta = bool(op.attr("transpose_a", False))
    tb = bool(op.attr("transpose_b", False))
    return lambda a, b: lambda i, j: Sum(lambda k: a[(k, i) if ta else (i, k)] * b[(j, k) if tb else (k, j)])


def batch_matmul(op: OpView):
    """out[..., i, j] = sum_k x[..., i, k] * y[..., k, j] (adj_x/adj_y transpose; batch dims broadcast)"""
    adj_x = bool(op.attr("adj_x", False))
    adj_y = bool(op.attr("adj_y", False))
    out_shape = op.output_shapes[0]
    x_shape, y_shape = op.input_shapes[0], op.input_shapes[1]
    batch_shape = out_shape[:-2]

    def program(x, y):
        def out(*idx):
            batch, i, j = idx[:-2], idx[-2], idx[-1]
            bx = broadcast(batch, x_shape[:-2], batch_shape)
            by = broadcast(batch, y_shape[:-2], batch_shape)
            return Sum(lambda k: x[bx + ((k, i) if adj_x else (i, k))] * y[by + ((j, k) if adj_y else (k, j))])
        return Out(out, names(len(batch_shape), taken="ijk") + ("i", "j"))
    return program


def einsum(op: OpView):
    """out[abde] = sum_c a[abc] * b[cde]: the equation's letters are the indices"""
    equation = op.attr("equation")
    if not isinstance(equation, str) or "->" not in equation:
        return conservative(op, "einsum without an explicit output")
    specs, out_spec = _expand_ellipsis(equation.replace(" ", ""), op)
    if specs is None:
        return conservative(op, "einsum equation not understood")
    if len(specs) != op.num_inputs:
        raise DescriptionError(f"Einsum: equation {equation!r} has {len(specs)} operands, the op {op.num_inputs}")
    out_shape = op.output_shapes[0]
    extents = {c: n for c, n in zip(out_spec, out_shape)}
    reduced = []
    for spec, shape in zip(specs, op.input_shapes):
        for c, n in zip(spec, shape):
            if c not in out_spec and c not in reduced:
                reduced.append(c)
            if n != 1:
                extents.setdefault(c, n)

    def program(*xs):
        def out(*idx):
            env = dict(zip(out_spec, idx))

            def body(*r):
                env.update(zip(reduced, r))
                return Apply("mul", *(x[tuple(0 if (n == 1 and extents.get(c, 1) != 1) else env[c]
                                              for c, n in zip(spec, x.shape))]
                                      for x, spec in zip(xs, specs)))
            return Sum(body, names=tuple(reduced)) if reduced else body()
        return Out(out, tuple(out_spec))
    return program


def _expand_ellipsis(equation: str, op: OpView):
    lhs, out = equation.split("->")
    specs = lhs.split(",")
    spare = [c for c in "ABCDEFGHIJKLMNOPQRSTUVWXYZ" if c not in equation]
    ell_rank = 0
    for spec, shape in zip(specs, op.input_shapes):
        if "..." in spec:
            ell_rank = max(ell_rank, len(shape) - (len(spec) - 3))
    fill = "".join(spare[:ell_rank])
    expanded = []
    for spec, shape in zip(specs, op.input_shapes):
        if "..." in spec:
            k = len(shape) - (len(spec) - 3)
            spec = spec.replace("...", fill[ell_rank - k:])
        expanded.append(spec)
    out = out.replace("...", fill)
    if any(not s.isalpha() for s in expanded + [out]):
        return None, None
    return expanded, out


def register(registry) -> None:
    registry.register("MatMul", family=Family.CONTRACTION)(matmul)
    for op_type in ("BatchMatMul", "BatchMatMulV2", "BatchMatMulV3"):
        registry.register(op_type, family=Family.CONTRACTION)(batch_matmul)
    registry.register("Einsum", family=Family.CONTRACTION)(einsum)
