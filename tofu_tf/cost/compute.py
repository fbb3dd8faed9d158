r"""The compute term of the modeled step time: how long each op runs on one device.

Per op, a work estimate from static shapes:

* contractions (``MatMul``, ``BatchMatMul*``, ``Einsum``, ``Conv2D``, depthwise
  convolutions and the backprops of both) count floating-point operations,
  :math:`2 \prod(\text{output}) \cdot K` with :math:`K` the contracted extent,
  and run at the device's FLOP rate;
* every other op counts the bytes it touches (its inputs and outputs) and runs
  at the device's memory bandwidth;
* ops that move no data (variable reads, aliases, constants, placeholders) cost 0.

Under a strategy an op's work is divided by the number of devices it is split
over: on each mesh axis where its strategy is anything but "replicate", the
axis's devices share the op; a replicated op does its full work on every device:

.. math:: t_{\text{compute}}(o) = \frac{W(o)}{R_o} \Big/ \prod_{k:\ s_k(o) \ne \text{replicate}} n_k

with :math:`R_o` the FLOP rate or the memory bandwidth of the hardware profile.
Imports no TensorFlow.
"""

from __future__ import annotations

import dataclasses
import math

from tofu_tf import ir
from tofu_tf.cost.hardware import HardwareProfile
from tofu_tf.semantics.strategy import OpStrategy

FLOP_OPS = frozenset({
    "MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3", "Einsum",
    "Conv2D", "Conv2DBackpropInput", "Conv2DBackpropFilter", "Conv3D",
    "DepthwiseConv2dNative", "DepthwiseConv2dNativeBackpropInput", "DepthwiseConv2dNativeBackpropFilter"})
FREE_OPS = frozenset({"ReadVariableOp", "Identity", "IdentityN", "Snapshot", "StopGradient", "PreventGradient",
                      "Const", "Placeholder", "NoOp", "Shape", "ShapeN", "Size", "Rank", "VarHandleOp"})


@dataclasses.dataclass(frozen=True)
class Work:
    """An op's work on one device when it is not split: FLOPs and bytes touched."""

    flops: float
    bytes: float

    def seconds(self, hardware: HardwareProfile) -> float:
        return self.flops / hardware.flops + self.bytes / hardware.memory_bandwidth


def op_work(op: ir.Op, graph: ir.Graph) -> Work:
    """The work estimate of ``op`` (see the module docstring)."""
    if op.type in FREE_OPS:
        return Work(0.0, 0.0)
    if op.type in FLOP_OPS:
        flops = _flops(op, graph)
        if flops is not None:
            return Work(flops, 0.0)
    touched = 0.0
    for name in (*op.inputs, *op.outputs):
        tensor = graph.tensors.get(name)
        if tensor is not None and tensor.role is not ir.Role.RESOURCE:
            touched += tensor.num_bytes
    return Work(0.0, touched)


def split_factor(strategies, sizes) -> int:
    """How many devices share an op: the product of axis sizes its strategies split it on."""
    factor = 1
    for strategy, size in zip(strategies, sizes):
        if is_split(strategy):
            factor *= size
    return factor


def is_split(strategy: OpStrategy) -> bool:
    """Whether a strategy divides the op's work (anything but every tensor whole)."""
    return strategy.divides_work


def _shape(graph: ir.Graph, name: str) -> tuple[int, ...] | None:
    tensor = graph.tensors.get(name)
    return None if tensor is None else tensor.shape


def _flops(op: ir.Op, graph: ir.Graph) -> float | None:
    shapes = [_shape(graph, t) for t in op.inputs]
    out = _shape(graph, op.outputs[0]) if op.outputs else None
    if out is None or any(s is None for s in shapes[:2]) or len(shapes) < 2:
        return None
    t = op.type
    if t == "MatMul":
        a = shapes[0]
        k = a[0] if op.attrs.get("transpose_a", False) else a[-1]
        return 2.0 * math.prod(out) * k
    if t.startswith("BatchMatMul"):
        a = shapes[0]
        k = a[-2] if op.attrs.get("adj_x", False) else a[-1]
        return 2.0 * math.prod(out) * k
    if t == "Einsum":
        return _einsum_flops(str(op.attrs.get("equation", "")), shapes)
    if t in ("Conv2D", "Conv3D", "DepthwiseConv2dNative"):
        f = shapes[1]
        per_out = math.prod(f[:-1]) if t != "DepthwiseConv2dNative" else math.prod(f[:-2])
        return 2.0 * math.prod(out) * per_out
    if t in ("Conv2DBackpropInput", "DepthwiseConv2dNativeBackpropInput"):
        f, dy = shapes[1], _shape(graph, op.inputs[2]) if len(op.inputs) > 2 else None
        if dy is None:
            return None
        per = math.prod(f[:-1]) if t == "Conv2DBackpropInput" else math.prod(f[:-2])
        return 2.0 * math.prod(dy) * per
    if t in ("Conv2DBackpropFilter", "DepthwiseConv2dNativeBackpropFilter"):
        dy = _shape(graph, op.inputs[2]) if len(op.inputs) > 2 else None
        if dy is None:
            return None
        per = math.prod(out[:-1]) if t == "Conv2DBackpropFilter" else math.prod(out[:-2])
        return 2.0 * math.prod(dy) * per
    return None


def _einsum_flops(equation: str, shapes) -> float | None:
    if "->" not in equation or "." in equation:
        return None
    lhs = equation.split("->")[0].split(",")
    extent: dict[str, int] = {}
    for letters, shape in zip(lhs, shapes):
        if shape is None or len(letters) != len(shape):
            return None
        extent.update(zip(letters, shape))
    return 2.0 * math.prod(extent.values())
