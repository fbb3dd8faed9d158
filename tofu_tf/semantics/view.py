"""The static facts about one op that its description may depend on.

This module owns ``OpView``: an op's type, attributes, and per input and
output its shape, dtype and (for small constants) value, read once from an
``ir.Op`` in an ``ir.Graph``. It is the only input of a description builder
and, being hashable, the cache key of descriptions and strategies: two ops
with equal views have equal semantics. A resource input's shape is the shape
of the variable it names, so variable reads and updates are described on the
variable's value.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

from tofu_tf import ir

RESOURCE = "resource"


@dataclasses.dataclass(frozen=True)
class OpView:
    """An op as its description sees it. ``None`` in a shape means unknown
    (a tensor missing from the graph, or a handle to an unknown variable)."""

    type: str
    attrs: tuple[tuple[str, object], ...] = ()
    input_shapes: tuple[tuple[int, ...] | None, ...] = ()
    input_dtypes: tuple[str, ...] = ()
    input_values: tuple[object, ...] = ()
    output_shapes: tuple[tuple[int, ...] | None, ...] = ()
    output_dtypes: tuple[str, ...] = ()

    @classmethod
    def of(cls, op: ir.Op, graph: ir.Graph) -> "OpView":
        return cls(*view_key(op, graph))

    @classmethod
    def build(cls, op_type: str, *, attrs: Mapping[str, object] | None = None, input_shapes=(),
              output_shapes=(), input_dtypes=None, output_dtypes=None, input_values=None) -> "OpView":
        """A view from plain values (custom ops, tests)."""
        n_in, n_out = len(input_shapes), len(output_shapes)
        return cls(op_type, freeze_attrs(attrs or {}),
                   tuple(_shape(s) for s in input_shapes),
                   tuple(input_dtypes or ("float32",) * n_in),
                   tuple(input_values or (None,) * n_in),
                   tuple(_shape(s) for s in output_shapes),
                   tuple(output_dtypes or ("float32",) * n_out))

    # -- queries used by description builders ---------------------------------
    def attr(self, name: str, default=None):
        for key, value in self.attrs:
            if key == name:
                return value
        return default

    @property
    def num_inputs(self) -> int:
        return len(self.input_shapes)

    @property
    def num_outputs(self) -> int:
        return len(self.output_shapes)

    def value(self, position: int):
        """The constant value of an input (a tuple for vectors), None if unknown."""
        return self.input_values[position] if position < len(self.input_values) else None

    def is_variable(self, position: int) -> bool:
        return self.input_dtypes[position] == RESOURCE


def _shape(shape) -> tuple[int, ...] | None:
    return None if shape is None else tuple(int(d) for d in shape)


def freeze_attrs(attrs: Mapping[str, object]) -> tuple[tuple[str, object], ...]:
    return tuple(sorted((k, _freeze(v)) for k, v in attrs.items()))


def _freeze(value):
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, _freeze(v)) for k, v in value.items()))
    return value


def view_key(op: ir.Op, graph: ir.Graph) -> tuple:
    """The fields of ``OpView.of(op, graph)`` as a plain tuple: cheap to build
    and hash, so per-op lookups in a 20k-op graph stay fast."""
    tensors = graph.tensors
    in_shapes, in_dtypes, in_values = [], [], []
    for name in op.inputs:
        t = tensors.get(name)
        if t is None:
            in_shapes.append(None)
            in_dtypes.append("unknown")
            in_values.append(None)
        elif t.dtype == RESOURCE:
            var = graph.variables.get(t.variable_path) if t.variable_path else None
            in_shapes.append(var.shape if var is not None else None)
            in_dtypes.append(RESOURCE)
            in_values.append(None)
        else:
            in_shapes.append(t.shape)
            in_dtypes.append(t.dtype)
            in_values.append(t.const_value)
    out_shapes, out_dtypes = [], []
    for name in op.outputs:
        t = tensors.get(name)
        if t is None:
            out_shapes.append(None)
            out_dtypes.append("unknown")
        elif t.dtype == RESOURCE:
            var = graph.variables.get(t.variable_path) if t.variable_path else None
            out_shapes.append(var.shape if var is not None else _shape(op.attrs.get("shape")))
            out_dtypes.append(RESOURCE)
        else:
            out_shapes.append(t.shape)
            out_dtypes.append(t.dtype)
    try:
        attrs = tuple(sorted(op.attrs.items()))
        hash(attrs)
    except TypeError:
        attrs = freeze_attrs(op.attrs)
    return (op.type, attrs, tuple(in_shapes), tuple(in_dtypes), tuple(in_values),
            tuple(out_shapes), tuple(out_dtypes))
