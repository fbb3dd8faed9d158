"""Lowering targets: which of Tofu's strategies the backend that runs the plan can express.

``Target.IDEAL`` keeps every strategy the operator semantics derive (Tofu's
full space; the benches use it). ``Target.DTENSOR`` (the default) drops what
TF 2.21's DTensor SPMD expanders cannot lower, as checked on this project's
machines:

* convolutions (``Conv2D``, ``Conv2DBackpropInput``, ``Conv2DBackpropFilter``,
  ``DepthwiseConv2dNative`` and its backprops) run batch-split or replicated only:
  the filter stays whole and no other dim of the data tensors is split; so do the
  other ops of a convolution's layer (a Conv1D's bias add on 3-D tensors), and the
  weights they read stay replicated. In a
  graph with convolutions, 4-D activations are split on the batch dim only and
  weights read by ops on 4-D tensors (BatchNorm's scale and offset) stay
  replicated: DTensor propagates a channel split back into the convolution;
* ``Split``/``SplitV`` never split the dim they cut along;
* ``Pack``/``Unpack`` never split the dim they stack along;
* variables read by an LSTM/GRU cell (ops whose Keras layer is an LSTM or GRU
  layer or cell) stay replicated: a split kernel propagates into the unrolled
  input and DTensor's Unpack expander mis-shapes it.

The search applies a target as a wrapper around the strategy provider plus a
set of variables pinned to replication; it imports no TensorFlow.
"""

from __future__ import annotations

import enum
import re
from typing import Sequence

from tofu_tf import ir
from tofu_tf.semantics.strategy import OpStrategy

CONV_OPS = frozenset({
    "Conv2D", "Conv2DBackpropInput", "Conv2DBackpropFilter", "Conv3D", "DepthwiseConv2dNative",
    "DepthwiseConv2dNativeBackpropInput", "DepthwiseConv2dNativeBackpropFilter"})
# Where the filter sits: ("in", index) or ("out", index).
_FILTER = {"Conv2D": ("in", 1), "Conv3D": ("in", 1), "DepthwiseConv2dNative": ("in", 1),
           "Conv2DBackpropInput": ("in", 1), "DepthwiseConv2dNativeBackpropInput": ("in", 1),
           "Conv2DBackpropFilter": ("out", 0), "DepthwiseConv2dNativeBackpropFilter": ("out", 0)}
_RECURRENT_LAYER = re.compile(r"(^|[^a-z])(lstm|gru)", re.IGNORECASE)


class Target(enum.Enum):
    DTENSOR = "dtensor"
    IDEAL = "ideal"


def restrict_provider(provider, target: Target, graph: ir.Graph):
    """``provider`` without the strategies ``target`` cannot lower."""
    if target is Target.IDEAL:
        return provider
    has_conv = any(op.type in CONV_OPS for op in graph.ops)
    conv_layers = convolution_layers(graph)

    def lowerable(op: ir.Op, graph_: ir.Graph, n: int) -> list[OpStrategy]:
        return [s for s in provider(op, graph_, n)
                if dtensor_lowerable(op, graph_, s, has_conv=has_conv, conv_layers=conv_layers)]
    return lowerable


def convolution_layers(graph: ir.Graph) -> frozenset[str]:
    """The Keras layers that run a convolution (their ops' ``layer``)."""
    return frozenset(op.layer for op in graph.ops if op.type in CONV_OPS and op.layer)


def dtensor_lowerable(op: ir.Op, graph: ir.Graph, strategy: OpStrategy, *, has_conv: bool = False,
                      conv_layers: frozenset[str] = frozenset()) -> bool:
    """Whether DTensor (TF 2.21) can run ``op`` under ``strategy`` on one mesh axis.

    Every op of a convolution's layer runs batch-split or replicated, like the
    convolution: a Conv1D adds its bias and applies its activation to 3-D tensors
    after squeezing the convolution's output, and DTensor propagates a channel split
    there back into the convolution."""
    ins, outs = strategy.inputs, strategy.outputs
    if op.layer in conv_layers and op.type not in CONV_OPS:
        return all(s.dim in (None, 0) for s in (*ins, *outs))
    if op.type in CONV_OPS:
        side, index = _FILTER.get(op.type, ("in", 1))
        filt = (ins if side == "in" else outs)[index] if index < len(ins if side == "in" else outs) else None
        if filt is not None and filt.dim is not None:
            return False
        return all(s.dim in (None, 0) for s in (*ins, *outs))
    if has_conv:
        for names, splits in ((op.inputs, ins), (op.outputs, outs)):
            for name, split in zip(names, splits):
                tensor = graph.tensors.get(name)
                if split.dim not in (None, 0) and tensor is not None and tensor.rank == 4:
                    return False
    if op.type in ("Split", "SplitV"):
        axis_pos, x_pos = (0, 1) if op.type == "Split" else (2, 0)
        axis = _const_axis(graph, op, axis_pos, x_pos)
        if axis is None:
            return all(s.dim is None for s in (*ins, *outs))
        if x_pos < len(ins) and ins[x_pos].dim == axis:
            return False
        return all(s.dim != axis for s in outs)
    if op.type in ("Pack", "Unpack"):
        rank = _rank(graph, op.outputs[0] if op.type == "Pack" else op.inputs[0])
        if rank is None:
            return all(s.replicated for s in (*ins, *outs))
        axis = int(op.attrs.get("axis", 0)) % rank
        stacked = outs[:1] if op.type == "Pack" else ins[:1]
        if any(s.dim == axis for s in stacked):
            return False
    return True


def pinned_variables(graph: ir.Graph, target: Target) -> frozenset[str]:
    """Variables ``target`` needs replicated (weight paths; their slots follow)."""
    if target is Target.IDEAL:
        return frozenset()
    has_conv = any(op.type in CONV_OPS for op in graph.ops)
    conv_layers = convolution_layers(graph)
    pinned: set[str] = set()
    readers: dict[str, list[ir.Op]] = {}
    for op in graph.ops:
        for name in op.inputs:
            readers.setdefault(name, []).append(op)
    for op in graph.ops:
        if op.type != "ReadVariableOp" or not op.outputs:
            continue
        tensor = graph.tensors.get(op.outputs[0])
        if tensor is None or tensor.variable_path is None:
            continue
        users = _users_through_aliases(op.outputs[0], readers)
        if _is_recurrent(op) or any(_is_recurrent(u) for u in users):
            pinned.add(tensor.variable_path)
        elif has_conv and any(u.type in CONV_OPS or u.layer in conv_layers or _touches_rank4(u, graph)
                              for u in users):
            pinned.add(tensor.variable_path)
    return frozenset(pinned)


def _is_recurrent(op: ir.Op) -> bool:
    return op.layer is not None and bool(_RECURRENT_LAYER.search(op.layer)) or op.type in ("While", "StatelessWhile")


def _touches_rank4(op: ir.Op, graph: ir.Graph) -> bool:
    return any(graph.tensors[t].rank == 4 for t in (*op.inputs, *op.outputs) if t in graph.tensors)


def _users_through_aliases(name: str, readers: dict[str, list[ir.Op]]) -> list[ir.Op]:
    out, work, seen = [], [name], set()
    while work:
        current = work.pop()
        for user in readers.get(current, ()):
            if user.name in seen:
                continue
            seen.add(user.name)
            if user.type in ("Identity", "IdentityN", "Reshape", "ExpandDims", "Cast"):
                work.extend(user.outputs)
            out.append(user)
    return out


def _const_axis(graph: ir.Graph, op: ir.Op, axis_pos: int, x_pos: int) -> int | None:
    if axis_pos >= len(op.inputs) or x_pos >= len(op.inputs):
        return None
    value = graph.tensors[op.inputs[axis_pos]].const_value if op.inputs[axis_pos] in graph.tensors else None
    rank = _rank(graph, op.inputs[x_pos])
    if isinstance(value, (tuple, list)):
        value = value[0] if len(value) == 1 else None
    if not isinstance(value, int) or rank is None:
        return None
    return value % rank


def _rank(graph: ir.Graph, name: str) -> int | None:
    tensor = graph.tensors.get(name)
    return None if tensor is None else tensor.rank


def as_target(value: "Target | str") -> Target:
    try:
        return Target(value)
    except ValueError:
        raise ValueError(f"unknown target {value!r}; use 'dtensor' (what TF's DTensor can lower) "
                         "or 'ideal' (every strategy Tofu derives)") from None


__all__: Sequence[str] = ("Target", "restrict_provider", "dtensor_lowerable", "pinned_variables", "as_target")
