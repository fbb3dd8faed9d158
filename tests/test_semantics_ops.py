"""Property tests of every registered op description, against TensorFlow's own kernels.

For every op type in the default registry there is a case builder below
(grouped by description family, so the tables stay short). Hypothesis draws
shapes, attributes and values; for every strategy derived for the op, the
test runs the real TF op (``tf.raw_ops``, CPU) on each device's part of the
inputs -- blocks along split dims, whole tensors where replicated, metadata
rewritten as the description says -- and recombines the parts (concatenation
along split dims; sum / mean / max / min of partial results). The result
must equal the op run unsplit.

Stateful ops run for real on ``tf.Variable`` parts (an update is checked on
the variables' new values). Random ops are checked in distribution (shapes
and range of every part); ops that cannot run eagerly (Placeholder,
VarHandleOp) are checked for the shapes their parts would have; ops described
as replicated must have replicate-all as their only strategy.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import inspect
import math

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tensorflow.python.framework import op_def_registry

from tofu_tf import ir, semantics
from tofu_tf.semantics import MetaKind, Reduction, Use
from tofu_tf.semantics.ops import elementwise as ew_ops
from tofu_tf.semantics.ops import state as state_ops

F32 = np.float32


class Check(enum.Enum):
    EXACT = "exact"                # recombined parts equal the unsplit result
    DISTRIBUTION = "distribution"  # random values: every part has its block's shape (and range)
    SHAPES = "shapes"              # no eager kernel: split dims divide the shapes
    REPLICATED = "replicated"      # described as replicated: replicate-all is the only strategy


@dataclasses.dataclass(frozen=True)
class Case:
    """One op to check: its type, attributes, input values (``variables``:
    positions fed as resource handles; ``unknown``: positions whose small
    integer values the IR does not hold, as when capture cannot fold them)
    and how to check it."""

    op_type: str
    inputs: tuple
    attrs: dict = dataclasses.field(default_factory=dict)
    variables: frozenset = frozenset()
    check: Check = Check.EXACT
    num_parts: int = 2
    output_shapes: tuple = ()  # for ops that are not run (SHAPES, REPLICATED)
    unknown: frozenset = frozenset()


# -- running TF ops ------------------------------------------------------------------

_RENAMED = {("Squeeze", "squeeze_dims"): "axis"}  # graph attr -> tf.raw_ops parameter


@functools.lru_cache(maxsize=None)
def _raw_op(op_type: str):
    fn = getattr(tf.raw_ops, op_type)
    return fn, tuple(inspect.signature(fn).parameters), op_def_registry.get(op_type)


def run_op(op_type: str, attrs: dict, inputs, variables=frozenset()):
    """Run one TF op eagerly; returns (outputs, new values of the variables fed)."""
    fn, params, op_def = _raw_op(op_type)
    handles = {k: tf.Variable(x) for k, x in enumerate(inputs) if k in variables}
    values = [handles[k].handle if k in handles else tf.constant(x) for k, x in enumerate(inputs)]
    args = list(op_def.input_arg)
    names = params[:len(args)]  # raw_ops take the inputs first, in order (names may differ from the op def)
    n_list = len(values) - (len(args) - 1)
    kwargs, pos = {}, 0
    for arg, name in zip(args, names):
        if arg.number_attr or arg.type_list_attr:
            kwargs[name] = values[pos:pos + n_list]
            pos += n_list
        else:
            kwargs[name] = values[pos]
            pos += 1
    attrs = {_RENAMED.get((op_type, k), k): v for k, v in attrs.items()}
    kwargs.update({k: v for k, v in attrs.items() if k in params and k not in kwargs})
    out = fn(**kwargs)
    if out is None or isinstance(out, tf.Operation):
        outs = []
    elif isinstance(out, (list, tuple)):
        outs = list(out)
    else:
        outs = [out]
    return [np.asarray(o) for o in outs], {k: v.numpy() for k, v in handles.items()}


# -- the IR of one op ------------------------------------------------------------------

def _small_value(x: np.ndarray):
    if x.dtype.kind not in "iu" or x.size > 64:
        return None
    return x.item() if x.ndim == 0 else tuple(x.reshape(-1).tolist())


def build_ir(case: Case, outputs) -> tuple[ir.Op, ir.Graph]:
    tensors, variables, in_names, out_names = {}, {}, [], []
    for k, x in enumerate(case.inputs):
        name = f"in{k}:0"
        in_names.append(name)
        if k in case.variables:
            path = f"var{k}"
            variables[path] = ir.Variable(path, tuple(x.shape), x.dtype.name, ir.VariableKind.WEIGHT)
            tensors[name] = ir.Tensor(name, (), "resource", ir.Role.RESOURCE, f"in{k}", ("op",), variable_path=path)
        else:
            tensors[name] = ir.Tensor(name, tuple(x.shape), x.dtype.name, ir.Role.ACTIVATION, f"in{k}", ("op",),
                                      const_value=None if k in case.unknown else _small_value(x))
    for k, (shape, dtype) in enumerate(outputs):
        name = f"op:{k}"
        out_names.append(name)
        if dtype == "resource":
            variables["new"] = ir.Variable("new", tuple(shape), "float32", ir.VariableKind.WEIGHT)
            tensors[name] = ir.Tensor(name, (), "resource", ir.Role.RESOURCE, "op", variable_path="new")
        else:
            tensors[name] = ir.Tensor(name, tuple(shape), dtype, ir.Role.ACTIVATION, "op")
    op = ir.Op("op", case.op_type, tuple(in_names), tuple(out_names), attrs=dict(case.attrs))
    return op, ir.Graph(ops=(op,), tensors=tensors, variables=variables)


# -- the property --------------------------------------------------------------------

def _local_shape(shape, split: semantics.TensorSplit, parts: int):
    shape = list(shape)
    if split.dim is not None:
        assert shape[split.dim] % parts == 0, f"split of dim {split.dim} of {tuple(shape)} into {parts}"
        shape[split.dim] //= parts
    return tuple(shape)


def _part(x: np.ndarray, split: semantics.TensorSplit, p: int, parts: int) -> np.ndarray:
    return x if split.dim is None else np.split(x, parts, axis=split.dim)[p]


def _combine(pieces, split: semantics.TensorSplit, where: str):
    if split.dim is not None:
        return np.concatenate(pieces, axis=split.dim)
    if split.partial is not None:
        stacked = np.stack(pieces)
        return {Reduction.SUM: np.sum, Reduction.MEAN: np.mean, Reduction.MAX: np.max,
                Reduction.MIN: np.min}[split.partial](stacked, axis=0).astype(pieces[0].dtype)
    for piece in pieces[1:]:
        _assert_same(piece, pieces[0], f"{where}: replicated parts differ")
    return pieces[0]


def _assert_same(got, want, message):
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape, f"{message}: shape {got.shape} != {want.shape}"
    if want.dtype.kind == "f":
        scale = max(1.0, float(np.nanmax(np.abs(want), initial=0.0, where=np.isfinite(want))))
        np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4 * scale, equal_nan=True, err_msg=message)
    else:
        np.testing.assert_array_equal(got, want, err_msg=message)


def check_case(case: Case, registry=None):
    """The property: every derived strategy of the op computes the unsplit result."""
    if case.check in (Check.SHAPES, Check.REPLICATED):
        ref, ref_vars = None, {}
        outputs = case.output_shapes
    else:
        ref, ref_vars = run_op(case.op_type, case.attrs, case.inputs, case.variables)
        outputs = tuple((r.shape, r.dtype.name) for r in ref)
    op, graph = build_ir(case, outputs)
    registry = registry or semantics.default_registry()
    status, problem = registry.status(op, graph)
    assert status == "described", f"{case.op_type}: {status} {problem}"
    desc = registry.describe(op, graph)
    parts = case.num_parts
    found = registry.strategies(op, graph, parts)
    assert found[0] == semantics.replicate_all(len(case.inputs), len(outputs))
    if case.check is Check.REPLICATED:
        assert found == [found[0]], f"{case.op_type} must only replicate: {[s.text() for s in found]}"
        return found
    for strategy in found:
        assert len(strategy.inputs) == len(case.inputs) and len(strategy.outputs) == len(outputs)
        where = f"{case.op_type} {desc.text()} strategy {strategy.text()} over {parts}"
        if case.check is Check.SHAPES:
            for (shape, _), split in zip(outputs, strategy.outputs):
                _local_shape(shape, split, parts)
            continue
        _check_strategy(case, strategy, desc, ref, ref_vars, parts, where)
    return found


def _check_strategy(case, strategy, desc, ref, ref_vars, parts, where):
    out0 = _local_shape(ref[0].shape, strategy.outputs[0], parts) if ref else None
    attrs = dict(case.attrs)
    for attr, k in desc.shape_attrs:
        attrs[attr] = _local_shape(ref[k].shape, strategy.outputs[k], parts)
    op_type = case.op_type
    if op_type == "Squeeze" and not attrs.get("squeeze_dims"):
        # "every unit dim" means the global ones: a part's dim may become 1 (the lowering reshapes)
        attrs["squeeze_dims"] = tuple(d for d, n in enumerate(case.inputs[0].shape) if n == 1)
        op_type = op_type if attrs["squeeze_dims"] else "Identity"
    pieces = []
    for p in range(parts):
        local = []
        for k, (x, split, use) in enumerate(zip(case.inputs, strategy.inputs, desc.inputs)):
            if use.use is Use.META and use.meta is MetaKind.OUTPUT_SHAPE:
                local.append(np.array(out0, dtype=x.dtype))
            elif use.use is Use.META and use.meta is MetaKind.TILE_MULTIPLES:
                in0 = _local_shape(case.inputs[0].shape, strategy.inputs[0], parts)
                local.append(np.array([o // i for o, i in zip(out0, in0)], dtype=x.dtype))
            elif use.use is Use.SHAPE_ONLY:
                local.append(x)  # shape ops read the global static shape
            else:
                local.append(_part(x, split, p, parts))
        pieces.append(run_op(op_type, attrs, local, case.variables))
    for k, want in enumerate(ref):
        if desc.outputs[k].use is Use.WORKSPACE:
            continue
        split = strategy.outputs[k]
        if case.check is Check.DISTRIBUTION:
            for p in range(parts):
                got = pieces[p][0][k]
                assert got.shape == _local_shape(want.shape, split, parts), where
                if case.op_type == "RandomUniform":
                    assert np.all((got >= 0) & (got < 1)), where
            continue
        got = _combine([piece[0][k] for piece in pieces], split, f"{where} output {k}")
        _assert_same(got, want, f"{where} output {k}")
    for k, _ in desc.updates:
        want = ref_vars[k]
        got = _combine([piece[1][k] for piece in pieces], strategy.inputs[k], f"{where} variable {k}")
        _assert_same(got, want, f"{where} variable {k}")


# -- case builders, by family -----------------------------------------------------------

DIMS = (4, 2, 6, 1, 8, 3)  # hypothesis starts from the first: make early examples splittable


class Draw:
    """Hypothesis draws plus a numpy generator seeded by hypothesis."""

    def __init__(self, draw):
        self.draw = draw
        self.rng = np.random.default_rng(draw(st.integers(0, 2**31 - 1)))

    def pick(self, options):
        return self.draw(st.sampled_from(list(options)))

    def int(self, lo, hi):
        return self.draw(st.integers(lo, hi))

    def bool(self):
        return self.draw(st.booleans())

    def shape(self, lo=1, hi=4, dims=DIMS):
        return tuple(self.pick(dims) for _ in range(self.int(lo, hi)))

    def floats(self, shape, lo=-0.9, hi=0.9, dtype=F32):
        return self.rng.uniform(lo, hi, size=shape).astype(dtype)

    def ints(self, shape, lo, hi, dtype=np.int32):
        return self.rng.integers(lo, hi, size=shape).astype(dtype)

    def bools(self, shape):
        return self.rng.random(shape) < 0.5

    def broadcast_variant(self, shape):
        lead = self.int(0, len(shape))
        return tuple(1 if self.bool() and self.bool() else d for d in shape[lead:])

    def parts(self):
        return self.pick((2, 4, 3))


_POSITIVE = {"Log", "Sqrt", "Rsqrt", "Reciprocal", "Inv"}
_INT_BINARY = {"FloorDiv", "FloorMod", "TruncateDiv", "Mod", "BitwiseAnd", "BitwiseOr"}
_BOOL_BINARY = {"LogicalAnd", "LogicalOr"}
_GRADS = {t for t in ew_ops.BINARY if t.endswith("Grad")}


def unary(d: Draw, op_type: str) -> Case:
    shape = d.shape()
    x = d.floats(shape, 0.1, 0.9) if op_type in _POSITIVE else d.floats(shape)
    attrs = {}
    if op_type == "LogicalNot":
        x = d.bools(shape)
    elif op_type == "Cast":
        attrs = {"DstT": d.pick(("int32", "float64", "float16", "bool")), "Truncate": False}
    elif op_type == "LeakyRelu":
        attrs = {"alpha": 0.2}
    elif op_type == "EnsureShape":
        attrs = {"shape": shape}
    elif op_type in ("CheckNumerics", "PreventGradient"):
        attrs = {"message": "checked"}
    return Case(op_type, (x,), attrs, num_parts=d.parts())


def binary(d: Draw, op_type: str) -> Case:
    out = d.shape()
    a_shape, b_shape = (out, out) if op_type in _GRADS else (d.broadcast_variant(out), d.broadcast_variant(out))
    if d.bool():
        a_shape, b_shape = b_shape, a_shape
    if op_type in _INT_BINARY:
        a, b = d.ints(a_shape, -6, 7), d.ints(b_shape, 1, 5)
    elif op_type in _BOOL_BINARY:
        a, b = d.bools(a_shape), d.bools(b_shape)
    else:
        a, b = d.floats(a_shape, 0.1, 0.9), d.floats(b_shape)
    return Case(op_type, (a, b), num_parts=d.parts())


def nary(d: Draw, op_type: str) -> Case:
    shape = d.shape()
    if op_type == "AddN":
        return Case(op_type, tuple(d.floats(shape) for _ in range(d.int(2, 4))), num_parts=d.parts())
    if op_type == "IdentityN":
        return Case(op_type, tuple(d.floats(d.shape()) for _ in range(d.int(1, 3))), num_parts=d.parts())
    if op_type == "SelectV2":
        return Case(op_type, (d.bools(d.broadcast_variant(shape)), d.floats(d.broadcast_variant(shape)),
                              d.floats(shape)), num_parts=d.parts())
    if op_type == "Select":
        cond_shape = shape[:1] if shape and d.bool() else shape
        return Case(op_type, (d.bools(cond_shape), d.floats(shape), d.floats(shape)), num_parts=d.parts())
    bounds = (np.array(-0.3, F32), np.array(0.4, F32)) if d.bool() else \
        (d.floats(shape, -0.5, -0.1), d.floats(shape, 0.1, 0.5))
    return Case(op_type, (d.floats(shape),) + bounds, num_parts=d.parts())


def bias(d: Draw, op_type: str) -> Case:
    shape = d.shape(2, 4)
    fmt = "NHWC" if op_type == "BiasAddV1" else d.pick(("NHWC", "NCHW"))
    channels = shape[1] if fmt == "NCHW" else shape[-1]
    attrs = {} if op_type == "BiasAddV1" else {"data_format": fmt}
    if op_type == "BiasAddGrad":
        return Case(op_type, (d.floats(shape),), attrs, num_parts=d.parts())
    return Case(op_type, (d.floats(shape), d.floats((channels,))), attrs, num_parts=d.parts())


def reduce(d: Draw, op_type: str) -> Case:
    shape = d.shape(0, 4)
    x = d.bools(shape) if op_type in ("Any", "All") else d.floats(shape, 0.8, 1.2)
    if op_type == "L2Loss":
        return Case(op_type, (x,), num_parts=d.parts())
    if op_type == "Cumsum":
        shape = shape or (4,)
        return Case(op_type, (d.floats(shape), np.array(_random_axis(d, len(shape)), np.int32)),
                    {"exclusive": d.bool(), "reverse": d.bool()}, num_parts=d.parts())
    if op_type == "TopKV2":
        shape = shape or (4,)
        return Case(op_type, (d.floats(shape), np.array(d.int(1, shape[-1]), np.int32)), {"sorted": d.bool()},
                    num_parts=d.parts())
    if op_type in ("ArgMax", "ArgMin"):
        shape = shape or (4,)
        axis = d.int(-len(shape), len(shape) - 1)
        return Case(op_type, (d.floats(shape), np.array(axis, np.int32)), {"output_type": "int64"},
                    num_parts=d.parts())
    axes = [a for a in range(len(shape)) if d.bool()]
    axes = [a - len(shape) if d.bool() else a for a in axes]
    return Case(op_type, (x, np.array(axes, np.int32)), {"keep_dims": d.bool()}, num_parts=d.parts())


def matmul(d: Draw, op_type: str) -> Case:
    m, k, n = (d.pick(DIMS) for _ in range(3))
    if op_type == "MatMul":
        ta, tb = d.bool(), d.bool()
        a = d.floats((k, m) if ta else (m, k))
        b = d.floats((n, k) if tb else (k, n))
        return Case(op_type, (a, b), {"transpose_a": ta, "transpose_b": tb}, num_parts=d.parts())
    batch = d.shape(1, 2)
    ax, ay = d.bool(), d.bool()
    bx, by = (batch, batch) if op_type == "BatchMatMul" else (d.broadcast_variant(batch), d.broadcast_variant(batch))
    x = d.floats(bx + ((k, m) if ax else (m, k)))
    y = d.floats(by + ((n, k) if ay else (k, n)))
    attrs = {"adj_x": ax, "adj_y": ay}
    if op_type == "BatchMatMulV3":
        attrs["Tout"] = "float32"
    return Case(op_type, (x, y), attrs, num_parts=d.parts())


_EQUATIONS = ("abc,cde->abde", "abcd,aecd->acbe", "acbe,aecd->abcd", "abcd,cde->abe", "abe,cde->abcd",
              "abe,abcd->cde", "abcd,acbe->aecd", "ij,jk->ik", "bij,bjk->bik", "ij->ji", "ij->", "bi,bi->b",
              "...ij,...jk->...ik", "ii->i")


def einsum(d: Draw, op_type: str) -> Case:
    equation = d.pick(_EQUATIONS)
    lhs = equation.split("->")[0].split(",")
    sizes = {c: d.pick(DIMS) for c in set("".join(lhs)) if c != "."}
    ellipsis = d.shape(0, 2)
    inputs = tuple(d.floats((ellipsis if "..." in s else ()) + tuple(sizes[c] for c in s.replace("...", "")))
                   for s in lhs)
    return Case(op_type, inputs, {"equation": equation}, num_parts=d.parts())


def _conv_attrs(d: Draw, rank: int, allow_dilation=True):
    stride = d.pick((1, 2))
    dilation = d.pick((1, 2)) if stride == 1 and allow_dilation else 1
    padding = d.pick(("SAME", "VALID", "EXPLICIT"))
    attrs = {"strides": (1,) + (stride,) * rank + (1,), "dilations": (1,) + (dilation,) * rank + (1,),
             "padding": padding, "data_format": "NHWC" if rank == 2 else "NDHWC"}
    if padding == "EXPLICIT":
        attrs["explicit_paddings"] = (0, 0) + tuple(d.int(0, 1) for _ in range(2 * rank)) + (0, 0)
    return attrs


def _grouped_gradients_run() -> bool:
    from tofu_tf.tf.compat import depthwise
    return depthwise.grouped_gradients_run()


def conv(d: Draw, op_type: str) -> Case:
    depthwise = op_type.startswith("Depthwise")
    rank = 3 if op_type == "Conv3D" else 2
    attrs = _conv_attrs(d, rank, allow_dilation=op_type == "Conv2D")  # CPU kernels: forward only
    if depthwise or op_type == "Conv3D":
        attrs.pop("explicit_paddings", None)
        if attrs["padding"] == "EXPLICIT":
            attrs["padding"] = "VALID"
    if op_type == "Conv3D":
        attrs.pop("dilations")
    n = d.pick((1, 2, 4))
    spatial = tuple(d.pick((2, 4, 6, 8)) for _ in range(rank))
    cin = d.pick((1, 2, 4))
    kernel = tuple(d.int(1, min(3, s)) for s in spatial)
    dil = attrs.get("dilations", (1, 1, 1, 1))[1]
    if attrs["padding"] == "VALID" and any((k - 1) * dil + 1 > s for k, s in zip(kernel, spatial)):
        kernel = (1,) * rank
    cout = d.pick((1, 2)) if depthwise else d.pick((1, 2, 4))
    # A grouped convolution (a depthwise one as Conv2D, tofu_tf.tf.compat.depthwise): the filter
    # holds cin/groups input channels, and cout is a multiple of groups.
    # CPU gradient kernels for groups are oneDNN's, which take no EXPLICIT padding (Keras uses none),
    # and exist only where oneDNN is on (TensorFlow leaves it off on some x86 CPUs, an AMD EPYC).
    grouped_kernels = not op_type.startswith("Conv2DBackprop") or _grouped_gradients_run()
    groups = d.pick((1, 2, cin)) if op_type.startswith("Conv2D") and cin > 1 and attrs["padding"] != "EXPLICIT" \
        and grouped_kernels else 1
    if groups > 1:
        cout = groups * d.pick((1, 2))
    x = d.floats((n,) + spatial + (cin,))
    f = d.floats(kernel + (cin // groups, cout))
    forward = "DepthwiseConv2dNative" if depthwise else ("Conv3D" if rank == 3 else "Conv2D")
    if op_type == forward:
        return Case(op_type, (x, f), attrs, num_parts=d.parts())
    dy = d.floats(run_op(forward, attrs, (x, f))[0][0].shape)
    if op_type.endswith("BackpropInput"):
        return Case(op_type, (np.array(x.shape, np.int32), f, dy), attrs, num_parts=d.parts())
    return Case(op_type, (x, np.array(f.shape, np.int32), dy), attrs, num_parts=d.parts())


def pool(d: Draw, op_type: str) -> Case:
    n, h, w, c = d.pick((1, 2, 4)), d.pick((2, 4, 6, 8)), d.pick((2, 4, 6, 8)), d.pick((1, 2, 4))
    kh, kw = d.int(1, min(3, h)), d.int(1, min(3, w))
    sh, sw = d.int(1, 3), d.int(1, 3)
    attrs = {"ksize": (1, kh, kw, 1), "strides": (1, sh, sw, 1), "padding": d.pick(("SAME", "VALID")),
             "data_format": "NHWC"}
    x = d.floats((n, h, w, c))
    forward = "MaxPool" if op_type.startswith("Max") else "AvgPool"
    if op_type == forward:
        return Case(op_type, (x,), attrs, num_parts=d.parts())
    y = run_op(forward, attrs, (x,))[0][0]
    dy = d.floats(y.shape)
    if op_type == "MaxPoolGrad":
        return Case(op_type, (x, y, dy), attrs, num_parts=d.parts())
    return Case(op_type, (np.array(x.shape, np.int32), dy), attrs, num_parts=d.parts())


def batch_norm(d: Draw, op_type: str) -> Case:
    training = d.bool()
    nchw_ok = op_type not in ("FusedBatchNorm", "FusedBatchNormGrad") and (training or "Grad" not in op_type)
    fmt = d.pick(("NHWC", "NCHW")) if nchw_ok else "NHWC"  # what the CPU kernels support
    shape = tuple(d.pick((1, 2, 4, 6)) for _ in range(4))
    channels = shape[fmt.index("C")]
    factor = d.pick((1.0, 0.5)) if training and op_type != "FusedBatchNorm" else 1.0
    attrs = {"is_training": training, "data_format": fmt, "epsilon": 0.001}
    if op_type != "FusedBatchNorm" and not op_type.startswith("FusedBatchNormGrad"):
        attrs["exponential_avg_factor"] = factor
    x = d.floats(shape)
    scale, offset = d.floats((channels,), 0.5, 1.5), d.floats((channels,))
    stats_shape = (0,) if training and factor == 1.0 else (channels,)
    mean, var = d.floats(stats_shape), d.floats(stats_shape, 0.5, 1.5)
    if not op_type.startswith("FusedBatchNormGrad"):
        return Case(op_type, (x, scale, offset, mean, var), attrs, num_parts=d.parts())
    forward = op_type.replace("Grad", "")
    if not training:
        mean, var = d.floats((channels,)), d.floats((channels,), 0.5, 1.5)
    fwd_attrs = dict(attrs, exponential_avg_factor=1.0) if forward != "FusedBatchNorm" else attrs
    reserves = run_op(forward, fwd_attrs, (x, scale, offset, mean, var))[0][3:]
    if not training:
        reserves = [mean, var] + reserves[2:]
    return Case(op_type, (d.floats(shape), x, scale) + tuple(reserves), attrs, num_parts=d.parts())


def softmax(d: Draw, op_type: str) -> Case:
    if op_type == "SparseSoftmaxCrossEntropyWithLogits":
        b, c = d.pick(DIMS), d.pick(DIMS)
        return Case(op_type, (d.floats((b, c)), d.ints((b,), 0, c)), num_parts=d.parts())
    if op_type == "SoftmaxCrossEntropyWithLogits":
        b, c = d.pick(DIMS), d.pick(DIMS)
        labels = d.floats((b, c), 0.1, 1.0)
        return Case(op_type, (d.floats((b, c)), labels / labels.sum(-1, keepdims=True)), num_parts=d.parts())
    return Case(op_type, (d.floats(d.shape(1, 4)),), num_parts=d.parts())


def gather(d: Draw, op_type: str) -> Case:
    if op_type == "ResourceGather":
        table = d.floats((d.pick((4, 8, 16)), d.pick(DIMS)))
        ids = d.ints(d.shape(0, 2), 0, table.shape[0])
        return Case(op_type, (table, ids), {"dtype": "float32"}, variables=frozenset({0}), num_parts=d.parts())
    if op_type == "GatherV2":
        params = d.floats(d.shape(1, 3))
        batch_dims = d.int(0, 1) if len(params.shape) > 1 else 0
        axis = d.int(batch_dims, len(params.shape) - 1)
        ids_shape = params.shape[:batch_dims] + d.shape(0, 2)
        ids = d.ints(ids_shape, 0, params.shape[axis])
        return Case(op_type, (params, ids, np.array(axis, np.int32)), {"batch_dims": batch_dims},
                    num_parts=d.parts())
    seg_shape = d.shape(1, 2)
    data = d.floats(seg_shape + d.shape(0, 2))
    num = d.pick((2, 4, 6))
    return Case(op_type, (data, d.ints(seg_shape, 0, num), np.array(num, np.int32)), num_parts=d.parts())


def _coordinates(d: Draw, rows, dims) -> np.ndarray:
    """Per row of ``rows`` a coordinate vector into leading dims ``dims`` (in range)."""
    return np.stack([d.ints(rows, 0, n) for n in dims], axis=-1).astype(np.int32)


def scatter(d: Draw, op_type: str) -> Case:
    if op_type == "OneHot":
        ids_shape, depth = d.shape(0, 3), d.pick(DIMS)
        on_off = (np.array(1.5, F32), np.array(-0.5, F32))
        return Case(op_type, (d.ints(ids_shape, -1, depth + 1), np.array(depth, np.int32)) + on_off,
                    {"axis": d.int(-1, len(ids_shape))}, num_parts=d.parts())
    shape = d.shape(1, 4)
    depth = d.int(1, len(shape))
    rows = d.shape(0 if op_type == "GatherNd" else 1, 2)  # TF's scatters refuse a single coordinate vector
    indices = _coordinates(d, rows, shape[:depth])
    if op_type == "GatherNd":
        return Case(op_type, (d.floats(shape), indices), num_parts=d.parts())
    updates = d.floats(rows + shape[depth:])
    if op_type == "ScatterNd":
        return Case(op_type, (indices, updates, np.array(shape, np.int32)), num_parts=d.parts())
    return Case(op_type, (d.floats(shape), indices, updates), num_parts=d.parts())


def _factors(n: int) -> list[int]:
    out, p = [], 2
    while n > 1:
        while n % p == 0:
            out.append(p)
            n //= p
        p += 1
    return out


def reshape(d: Draw, op_type: str) -> Case:
    shape = d.shape(0, 4)
    x = d.floats(shape)
    if op_type == "ExpandDims":
        return Case(op_type, (x, np.array(d.int(-len(shape) - 1, len(shape)), np.int32)), num_parts=d.parts())
    if op_type == "Squeeze":
        dims = [i for i, s in enumerate(shape) if s == 1 and d.bool()]
        return Case(op_type, (x,), {"squeeze_dims": tuple(dims)}, num_parts=d.parts())
    factors = [f for s in shape for f in _factors(s)]
    if d.bool():
        d.rng.shuffle(factors)
    out, i = [], 0
    while i < len(factors):
        k = d.int(1, 3)
        out.append(math.prod(factors[i:i + k]))
        i += k
    for _ in range(d.int(0, 2)):
        out.insert(d.int(0, len(out)), 1)
    if out and d.bool():
        out[d.int(0, len(out) - 1)] = -1
    return Case(op_type, (x, np.array(out, np.int32)), num_parts=d.parts())


def _random_axis(d: Draw, rank: int) -> int:
    return d.int(-rank, rank - 1) if rank else 0


def layout(d: Draw, op_type: str) -> Case:
    parts = d.parts()
    shape = d.shape(1, 4)
    rank = len(shape)
    if op_type == "Transpose":
        perm = list(range(rank))
        d.rng.shuffle(perm)
        return Case(op_type, (d.floats(shape), np.array(perm, np.int32)), num_parts=parts)
    if op_type in ("ConcatV2", "Concat"):
        axis = _random_axis(d, rank)
        xs = tuple(d.floats(shape[:axis % rank] + (d.pick(DIMS),) + shape[axis % rank + 1:]) for _ in range(d.int(2, 3)))
        ax = np.array(axis, np.int32)
        return Case(op_type, (ax,) + xs if op_type == "Concat" else xs + (ax,), num_parts=parts)
    if op_type == "Pack":
        return Case(op_type, tuple(d.floats(shape) for _ in range(d.int(1, 3))), {"axis": d.int(-rank - 1, rank)},
                    num_parts=parts)
    if op_type == "Unpack":
        axis = _random_axis(d, rank)
        return Case(op_type, (d.floats(shape),), {"axis": axis, "num": shape[axis]}, num_parts=parts)
    if op_type == "Split":
        axis = _random_axis(d, rank)
        num = d.pick([n for n in (1, 2, 3) if shape[axis] % n == 0])
        return Case(op_type, (np.array(axis, np.int32), d.floats(shape)), {"num_split": num}, num_parts=parts)
    if op_type == "SplitV":
        axis = _random_axis(d, rank)
        size = shape[axis]
        cut = sorted({0, size, *(d.int(0, size) for _ in range(2))})
        sizes = [b - a for a, b in zip(cut, cut[1:])]
        return Case(op_type, (d.floats(shape), np.array(sizes, np.int32), np.array(axis, np.int32)),
                    {"num_split": len(sizes)}, num_parts=parts)
    if op_type == "Slice":
        begin = [d.int(0, s - 1) if d.bool() else 0 for s in shape]
        size = [(-1 if d.bool() else s - b) if d.bool() else d.int(1, s - b) for s, b in zip(shape, begin)]
        # a begin computed in the step (a concatenation's gradient slices at ConcatOffset's offsets)
        unknown = frozenset({1}) if d.bool() else frozenset()
        return Case(op_type, (d.floats(shape), np.array(begin, np.int32), np.array(size, np.int32)),
                    num_parts=parts, unknown=unknown)
    if op_type in ("Pad", "PadV2", "MirrorPad"):
        limit = {"MirrorPad": 0}.get(op_type, 2)
        pads = [(d.int(0, min(limit, s - 1) if op_type == "MirrorPad" else 2),
                 d.int(0, min(limit, s - 1) if op_type == "MirrorPad" else 2)) for s in shape]
        if op_type == "MirrorPad":
            pads = [(d.int(0, s - 1), d.int(0, s - 1)) if s > 1 and d.bool() else (0, 0) for s in shape]
        inputs = (d.floats(shape), np.array(pads, np.int32))
        attrs = {"mode": "REFLECT"} if op_type == "MirrorPad" else {}
        if op_type == "PadV2":
            inputs += (np.array(0.5, F32),)
        return Case(op_type, inputs, attrs, num_parts=parts)
    if op_type == "Tile":
        return Case(op_type, (d.floats(shape), np.array([d.int(1, 3) for _ in shape], np.int32)), num_parts=parts)
    if op_type == "BroadcastTo":
        return Case(op_type, (d.floats(d.broadcast_variant(shape)), np.array(shape, np.int32)), num_parts=parts)
    if op_type == "MatrixBandPart":
        shape = d.shape(2, 4)
        return Case(op_type, (d.floats(shape), np.array(d.pick((-1, 0, 1)), np.int64),
                              np.array(d.pick((-1, 0, 1)), np.int64)), num_parts=parts)
    if op_type == "InvertPermutation":
        perm = np.arange(d.pick(DIMS), dtype=np.int32)
        d.rng.shuffle(perm)
        return Case(op_type, (perm,), num_parts=parts)
    raise AssertionError(op_type)


def strided_slice(d: Draw, op_type: str) -> Case:
    shape = d.shape(1, 4)
    begin, end, strides = [], [], []
    masks = dict.fromkeys(("begin_mask", "end_mask", "ellipsis_mask", "new_axis_mask", "shrink_axis_mask"), 0)
    entries = list(range(len(shape)))
    if d.bool():
        entries.insert(d.int(0, len(entries)), "new")
    if len(shape) > 1 and d.bool():
        start = d.int(0, len(shape) - 1)
        entries = entries[:start] + ["..."] + [e for e in entries[start:] if e == "new" or e > start]
    for i, entry in enumerate(entries):
        if entry == "new":
            masks["new_axis_mask"] |= 1 << i
            begin.append(0), end.append(0), strides.append(1)
        elif entry == "...":
            masks["ellipsis_mask"] |= 1 << i
            begin.append(0), end.append(0), strides.append(1)
        else:
            size = shape[entry]
            kind = d.pick(("full", "mask", "range", "shrink", "reverse"))
            if kind == "shrink":
                masks["shrink_axis_mask"] |= 1 << i
                b = d.int(-size, size - 1)
                begin.append(b), end.append(b + 1 if b != -1 else 0), strides.append(1)
            elif kind == "mask":
                masks["begin_mask"] |= 1 << i
                masks["end_mask"] |= 1 << i
                begin.append(0), end.append(0), strides.append(d.pick((1, 2)))
            elif kind == "range":
                b = d.int(0, size - 1)
                begin.append(b), end.append(d.int(b + 1, size + 2)), strides.append(d.pick((1, 2)))
            elif kind == "reverse":
                begin.append(size - 1), end.append(-size - 1), strides.append(-1)
            else:
                begin.append(0), end.append(size), strides.append(1)
    meta = tuple(np.array(v, np.int32) for v in (begin, end, strides))
    x = d.floats(shape)
    if op_type == "StridedSlice":
        return Case(op_type, (x,) + meta, masks, num_parts=d.parts())
    dy = d.floats(run_op("StridedSlice", masks, (x,) + meta)[0][0].shape)
    return Case(op_type, (np.array(shape, np.int32),) + meta + (dy,), masks, num_parts=d.parts())


def variable(d: Draw, op_type: str) -> Case:
    shape = d.shape(0, 3)
    var = d.floats(shape)
    if op_type == "VarHandleOp":
        return Case(op_type, (), {"dtype": "float32", "shape": shape}, check=Check.SHAPES,
                    output_shapes=((shape, "resource"),), num_parts=d.parts())
    if op_type in ("ReadVariableOp", "VarIsInitializedOp", "VariableShape"):
        return Case(op_type, (var,), {"dtype": "float32"}, variables=frozenset({0}), num_parts=d.parts())
    return Case(op_type, (var, d.floats(shape)), {"dtype": "float32"}, variables=frozenset({0}),
                num_parts=d.parts())


# Fused optimizer updates (tf-keras's legacy optimizers): the input count and the gradient's position.
_FUSED = {"ResourceApplyGradientDescent": (3, 2), "ResourceApplyProximalGradientDescent": (5, 4),
          "ResourceApplyKerasMomentum": (5, 3), "ResourceApplyMomentum": (5, 3), "ResourceApplyAdagrad": (4, 3),
          "ResourceApplyAdagradV2": (5, 4), "ResourceApplyProximalAdagrad": (6, 5), "ResourceApplyAdam": (10, 9),
          "ResourceApplyAdaMax": (9, 8), "ResourceApplyAdadelta": (7, 6), "ResourceApplyRMSProp": (8, 7),
          "ResourceApplyFtrl": (8, 3), "ResourceApplyFtrlV2": (9, 3), "ResourceApplyCenteredRMSProp": (9, 8),
          "ResourceApplyAdamWithAmsgrad": (11, 10)}


def fused_update(d: Draw, op_type: str) -> Case:
    """The weight and slots as variables (slots positive: square roots of accumulators, and a centered
    RMSProp's mean square above its squared mean), hyperparameters in (0.1, 0.9), Ftrl's power -0.5."""
    count, grad_at = _FUSED[op_type]
    written = state_ops.FUSED_UPDATES[op_type]
    shape = d.shape(0, 3)
    inputs = [d.floats(shape)] + [d.floats(shape, 0.5, 1.5) for _ in range(written - 1)]
    if op_type == "ResourceApplyCenteredRMSProp":
        inputs[1], inputs[2] = d.floats(shape, -0.2, 0.2), d.floats(shape, 1.0, 2.0)
    for position in range(written, count):
        inputs.append(d.floats(shape) if position == grad_at else np.array(d.pick((0.1, 0.3, 0.5, 0.9)), F32))
    if op_type.startswith("ResourceApplyFtrl"):
        inputs[-1] = np.array(-0.5, F32)
    return Case(op_type, tuple(inputs), variables=frozenset(range(written)), num_parts=d.parts())


def shape_op(d: Draw, op_type: str) -> Case:
    if op_type == "StatelessRandomGetKeyCounter":
        return Case(op_type, (np.array([d.int(0, 9), d.int(0, 9)], np.int32),), num_parts=d.parts())
    if op_type == "BroadcastGradientArgs":
        out = d.shape(0, 4)
        return Case(op_type, (np.array(d.broadcast_variant(out), np.int32),
                              np.array(d.broadcast_variant(out), np.int32)), num_parts=d.parts())
    if op_type == "ConcatOffset":
        shape = d.shape(1, 4)
        axis = d.int(0, len(shape) - 1)
        shapes = tuple(np.array(shape[:axis] + (d.pick(DIMS),) + shape[axis + 1:], np.int32)
                       for _ in range(d.int(2, 3)))
        return Case(op_type, (np.array(axis, np.int32),) + shapes, {"N": len(shapes)}, num_parts=d.parts())
    xs = tuple(d.floats(d.shape()) for _ in range(d.int(1, 3) if op_type == "ShapeN" else 1))
    attrs = {} if op_type == "Rank" else {"out_type": "int32"}
    return Case(op_type, xs, attrs, num_parts=d.parts())


def generator(d: Draw, op_type: str) -> Case:
    shape = d.shape(0, 4)
    dims = np.array(shape, np.int32)
    if op_type == "Placeholder":
        return Case(op_type, (), {"dtype": "float32", "shape": shape}, check=Check.SHAPES,
                    output_shapes=((shape, "float32"),), num_parts=d.parts())
    if op_type == "Fill":
        return Case(op_type, (dims, np.array(0.25, F32)), num_parts=d.parts())
    if op_type == "Range":
        start, delta = d.int(-3, 3), d.int(1, 3)
        limit = start + delta * d.pick(DIMS)
        return Case(op_type, tuple(np.array(v, np.int32) for v in (start, limit, delta)), num_parts=d.parts())
    if op_type.startswith("Stateless"):
        key, counter = run_op("StatelessRandomGetKeyCounter", {}, (np.array([1, 2], np.int32),))[0]
        return Case(op_type, (dims, key, counter, np.array(1, np.int32)), {"dtype": "float32"},
                    check=Check.DISTRIBUTION, num_parts=d.parts())
    if op_type == "RandomUniformInt":
        return Case(op_type, (dims, np.array(0, np.int32), np.array(5, np.int32)), check=Check.DISTRIBUTION,
                    num_parts=d.parts())
    return Case(op_type, (dims,), {"dtype": "float32"}, check=Check.DISTRIBUTION, num_parts=d.parts())


def replicated(d: Draw, op_type: str) -> Case:
    n_in, n_out = (0, 1) if op_type == "Const" else (d.int(0, 3), d.int(0, 3))
    inputs = tuple(d.floats(d.shape()) for _ in range(n_in))
    return Case(op_type, inputs, check=Check.REPLICATED, num_parts=d.parts(),
                output_shapes=tuple((d.shape(), "float32") for _ in range(n_out)))


def _table() -> dict:
    table = {}
    table.update(dict.fromkeys(ew_ops.UNARY + ("EnsureShape",), unary))
    table.update(dict.fromkeys(ew_ops.BINARY, binary))
    table.update(dict.fromkeys(ew_ops.NARY + ("Select", "IdentityN"), nary))
    table.update(dict.fromkeys(("BiasAdd", "BiasAddV1", "BiasAddGrad"), bias))
    table.update(dict.fromkeys(("Sum", "Mean", "Max", "Min", "Prod", "Any", "All", "EuclideanNorm", "ArgMax",
                                "ArgMin", "L2Loss", "Cumsum", "TopKV2"), reduce))
    table.update(dict.fromkeys(("MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3"), matmul))
    table["Einsum"] = einsum
    table.update(dict.fromkeys(("Conv2D", "Conv3D", "Conv2DBackpropInput", "Conv2DBackpropFilter",
                                "DepthwiseConv2dNative", "DepthwiseConv2dNativeBackpropInput",
                                "DepthwiseConv2dNativeBackpropFilter"), conv))
    table.update(dict.fromkeys(("MaxPool", "AvgPool", "MaxPoolGrad", "AvgPoolGrad"), pool))
    table.update(dict.fromkeys(("FusedBatchNorm", "FusedBatchNormV2", "FusedBatchNormV3", "FusedBatchNormGrad",
                                "FusedBatchNormGradV2", "FusedBatchNormGradV3"), batch_norm))
    table.update(dict.fromkeys(("Softmax", "LogSoftmax", "SparseSoftmaxCrossEntropyWithLogits",
                                "SoftmaxCrossEntropyWithLogits"), softmax))
    table.update(dict.fromkeys(("GatherV2", "ResourceGather", "UnsortedSegmentSum", "UnsortedSegmentMax",
                                "UnsortedSegmentMin"), gather))
    table.update(dict.fromkeys(("GatherNd", "ScatterNd", "OneHot", "TensorScatterUpdate", "TensorScatterAdd",
                                "TensorScatterSub", "TensorScatterMax", "TensorScatterMin"), scatter))
    table.update(dict.fromkeys(("Reshape", "ExpandDims", "Squeeze"), reshape))
    table.update(dict.fromkeys(("Transpose", "ConcatV2", "Concat", "Pack", "Unpack", "Split", "SplitV", "Slice",
                                "Pad", "PadV2", "MirrorPad", "Tile", "BroadcastTo", "MatrixBandPart",
                                "InvertPermutation"), layout))
    table.update(dict.fromkeys(("StridedSlice", "StridedSliceGrad"), strided_slice))
    table.update(dict.fromkeys(("ReadVariableOp", "AssignVariableOp", "AssignAddVariableOp", "AssignSubVariableOp",
                                "VarHandleOp", "VarIsInitializedOp", "VariableShape"), variable))
    table.update(dict.fromkeys(state_ops.FUSED_UPDATES, fused_update))
    table.update(dict.fromkeys(("Shape", "ShapeN", "Size", "Rank", "BroadcastGradientArgs", "ConcatOffset",
                                "StatelessRandomGetKeyCounter"), shape_op))
    table.update(dict.fromkeys(("Placeholder", "Fill", "Range") + state_ops.GENERATORS, generator))
    table.update(dict.fromkeys(state_ops.REPLICATED, replicated))
    return table


CASES = _table()


def test_every_registered_op_type_has_a_property_test():
    registered = set(semantics.default_registry().op_types())
    assert registered - set(CASES) == set(), "registered op types without a property test"
    assert set(CASES) - registered == set(), "property tests for op types nobody registered"


# more examples where attributes vary more
_EXAMPLES = {conv: 14, pool: 14, einsum: 12, reshape: 12, layout: 10, strided_slice: 12, gather: 10,
             scatter: 10, batch_norm: 10, matmul: 8, binary: 6, reduce: 8}


@pytest.mark.parametrize("op_type", sorted(CASES))
def test_every_strategy_computes_the_unsplit_result(op_type):
    build = CASES[op_type]

    @settings(max_examples=_EXAMPLES.get(build, 5), deadline=None, database=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
    @given(data=st.data())
    def holds(data):
        check_case(data.draw(st.composite(lambda draw: build(Draw(draw), op_type))()))

    holds()
