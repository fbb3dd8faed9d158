"""Element-wise ops: ``out[i..] = f(x[i..], y[i..], ...)`` under numpy
broadcasting (a size-1 operand dim is read at 0, a missing one not at all).

One builder serves every such op; the op lists below are the whole family.
Identity-like ops (Identity, StopGradient, Cast ...) are element-wise too.
"""

from __future__ import annotations

from tofu_tf.semantics.family import Family
from tofu_tf.semantics.ops._util import broadcast, names, suffixed
from tofu_tf.semantics.tdl import Apply, Out, Program
from tofu_tf.semantics.view import OpView

UNARY = (
    "Abs", "Acos", "Asin", "Atan", "Cast", "Ceil", "CheckNumerics", "Cos", "Cosh", "Elu",
    "Erf", "Erfc", "Exp", "Expm1", "Floor", "Identity", "Inv", "IsFinite", "IsInf", "IsNan",
    "LeakyRelu", "Log", "Log1p", "LogicalNot", "Neg", "OnesLike", "PreventGradient", "Reciprocal",
    "Relu", "Relu6", "Rint", "Round", "Rsqrt", "Selu", "Sigmoid", "Sign", "Sin", "Sinh", "Snapshot",
    "Softplus", "Softsign", "Sqrt", "Square", "StopGradient", "Tan", "Tanh", "ZerosLike",
)
BINARY = (
    "Add", "AddV2", "Atan2", "BitwiseAnd", "BitwiseOr", "Div", "DivNoNan", "Equal", "FloorDiv", "FloorMod",
    "Greater", "GreaterEqual", "Less", "LessEqual", "LogicalAnd", "LogicalOr", "Maximum", "Minimum",
    "Mod", "Mul", "MulNoNan", "NotEqual", "Pow", "RealDiv", "SquaredDifference", "Sub", "TruncateDiv",
    "Xdivy", "Xlog1py", "Xlogy",
    # gradients of activations: f'(x) * dy, element-wise
    "EluGrad", "LeakyReluGrad", "ReciprocalGrad", "Relu6Grad", "ReluGrad", "RsqrtGrad", "SeluGrad",
    "SigmoidGrad", "SoftplusGrad", "SoftsignGrad", "SqrtGrad", "TanhGrad",
)
NARY = ("AddN", "ClipByValue", "SelectV2")


def elementwise(op: OpView):
    """out[i..] = f(x[i..], ...) with numpy broadcasting"""
    out_shape = op.output_shapes[0]
    op_name = op.type

    def program(*xs):
        return Out(lambda *idx: Apply(op_name, *(x[broadcast(idx, x.shape, out_shape)] for x in xs)),
                   names(len(out_shape)))
    return program


def ensure_shape(op: OpView):
    """out[i..] = x[i..], checked against the shape attribute (local shape per part)"""
    return Program(elementwise(op), shape_attrs={"shape": 0})


def select(op: OpView):
    """out[i..] = cond[i..] ? t[i..] : e[i..]; a vector cond picks whole rows"""
    out_shape = op.output_shapes[0]
    cond_shape = op.input_shapes[0]

    def program(cond, t, e):
        def out(*idx):
            c = cond[idx[:1]] if len(cond_shape) == 1 and len(out_shape) > 1 else cond[idx]
            return Apply("select", c, t[idx], e[idx])
        return Out(out, names(len(out_shape)))
    return program


def bias_add(op: OpView):
    """out[n.., c] = x[n.., c] + bias[c] (c: the channel dim of data_format)"""
    out_shape = op.output_shapes[0]
    channel = _bias_channel(op, len(out_shape))

    def program(x, bias):
        return Out(lambda *idx: x[idx] + bias[idx[channel]], names(len(out_shape)))
    return program


def _bias_channel(op: OpView, rank: int) -> int:
    fmt = op.attr("data_format", "NHWC") or "NHWC"
    return 1 if fmt.startswith("NC") and rank >= 2 else rank - 1


def identity_n(op: OpView):
    """out_k[i..] = x_k[i..] for each of N tensors"""
    shapes = op.output_shapes

    def program(*xs):
        return tuple(Out((lambda x: lambda *idx: x[idx])(x), suffixed(len(s), k)) for k, (x, s) in enumerate(zip(xs, shapes)))
    return program


def register(registry) -> None:
    for op_type in UNARY + BINARY + NARY:
        registry.register(op_type, family=Family.ELEMENTWISE)(elementwise)
    registry.register("Select", family=Family.ELEMENTWISE)(select)
    registry.register("EnsureShape", family=Family.ELEMENTWISE)(ensure_shape)
    registry.register("BiasAdd", family=Family.ELEMENTWISE)(bias_add)
    registry.register("BiasAddV1", family=Family.ELEMENTWISE)(bias_add)
    registry.register("IdentityN", family=Family.ELEMENTWISE)(identity_n)
