"""The planner's intermediate representation of one training step.

This module owns the data the planner reasons about: operators, the tensors
they produce and consume, the role each tensor plays in training (input,
weight, gradient, optimizer slot, activation, scalar), and the model variables
those roles refer back to. It holds plain Python data only -- no TensorFlow
objects -- so the semantics, cost and search layers run fast, are testable
without TF, and a captured graph can be cached or shipped as JSON.

Capture (``tofu_tf.tf.capture``) is the only producer of a ``Graph`` from a
real model; everything above it treats the graph as read-only.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
import types
from collections import Counter
from typing import Mapping

IR_VERSION = 1

# Bytes per element of the dtypes that can appear in a training step. Dtypes
# without a fixed element size (resource handles, variants, strings) count 0:
# they name state, they are not state.
_DTYPE_BYTES = {
    "bool": 1, "int8": 1, "uint8": 1, "qint8": 1, "quint8": 1,
    "int16": 2, "uint16": 2, "float16": 2, "bfloat16": 2, "half": 2,
    "int32": 4, "uint32": 4, "float32": 4, "qint32": 4,
    "int64": 8, "uint64": 8, "float64": 8, "double": 8, "complex64": 8,
    "complex128": 16,
}


def dtype_size(dtype: str) -> int:
    """Bytes per element of ``dtype`` (a TF dtype name); 0 for handles."""
    return _DTYPE_BYTES.get(dtype, 0)


# The same table, read-only, for loops over every tensor of a graph (``.get(dtype, 0)``
# without a function call per tensor).
DTYPE_BYTES: Mapping[str, int] = types.MappingProxyType(_DTYPE_BYTES)


class Role(enum.Enum):
    """What a tensor is to the training step; the planner prices roles differently."""

    INPUT = "input"                    # a batch input (features or labels)
    WEIGHT = "weight"                  # the value of a model variable
    GRADIENT = "gradient"              # d(loss)/d(weight), one per trainable weight
    OPTIMIZER_SLOT = "optimizer_slot"  # the value of an optimizer slot (Adam's m, v)
    ACTIVATION = "activation"          # any other intermediate with elements
    SCALAR = "scalar"                  # rank-0 values: loss, step counters, learning rate
    RESOURCE = "resource"              # a handle naming a variable (no bytes of its own)


class VariableKind(enum.Enum):
    WEIGHT = "weight"
    OPTIMIZER_SLOT = "optimizer_slot"
    OPTIMIZER_STATE = "optimizer_state"  # scalar optimizer bookkeeping, e.g. the iteration count


@dataclasses.dataclass(frozen=True)
class Variable:
    """A variable of the model or its optimizer, by its Keras path.

    ``slot_of`` links an optimizer slot to the weight it tracks; ``gradient``
    names the gradient tensor of a trainable weight. Together they let the
    planner tie a weight, its gradient and its slots to one layout.
    """

    path: str
    shape: tuple[int, ...]
    dtype: str
    kind: VariableKind
    trainable: bool = False
    gradient: str | None = None
    slot_of: str | None = None
    slot_name: str | None = None

    @property
    def num_bytes(self) -> int:
        return math.prod(self.shape) * dtype_size(self.dtype)


@dataclasses.dataclass(frozen=True)
class Tensor:
    """One value of the step: ``name`` is ``"<producer op>:<output index>"``.

    ``const_value`` holds the value of small tensors that are known before the
    step runs (reduction axes, reshape targets, transpose permutations): op
    semantics need them and they are cheap to carry.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    role: Role
    producer: str
    consumers: tuple[str, ...] = ()
    variable_path: str | None = None
    const_value: tuple | int | float | bool | None = None

    @property
    def num_bytes(self) -> int:
        return math.prod(self.shape) * dtype_size(self.dtype)

    @property
    def rank(self) -> int:
        return len(self.shape)


@dataclasses.dataclass(frozen=True)
class Op:
    """One operator: its TF op type, the attributes its semantics need, and its
    tensors by name. ``layer`` is the Keras layer the op belongs to (forward or
    backward), or None for loss and optimizer bookkeeping. A loop (``While``)
    keeps its body as ``body``, an IR graph of its own."""

    name: str
    type: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    attrs: Mapping[str, object] = dataclasses.field(default_factory=dict)
    layer: str | None = None
    body: "Graph | None" = None


@dataclasses.dataclass(frozen=True)
class Graph:
    """A training step as the planner sees it: ops in topological order,
    tensors by name, and the variables the step reads and updates."""

    ops: tuple[Op, ...]
    tensors: Mapping[str, Tensor]
    variables: Mapping[str, Variable] = dataclasses.field(default_factory=dict)
    batch_size: int | None = None
    framework: str = ""

    # -- queries -----------------------------------------------------------
    def op(self, name: str) -> Op:
        for op in self.ops:
            if op.name == name:
                return op
        raise KeyError(f"no op named {name!r} in the graph")

    def tensors_with_role(self, role: Role) -> list[Tensor]:
        return [t for t in self.tensors.values() if t.role is role]

    def weights(self) -> list[Variable]:
        return [v for v in self.variables.values() if v.kind is VariableKind.WEIGHT]

    def slots_of(self, weight_path: str) -> list[Variable]:
        return [v for v in self.variables.values() if v.slot_of == weight_path]

    def bytes_by_role(self) -> dict[str, int]:
        """Bytes of state and values per role, each counted once.

        Weights and slots are counted per variable (a weight read by three ops
        is still one weight); gradients per trainable weight; inputs and
        activations per tensor, as if every one of them were alive at once (an
        upper bound: the cost model applies liveness).
        """
        totals = {role: 0 for role in ("weight", "gradient", "optimizer_slot", "activation", "input")}
        for var in self.variables.values():
            if var.kind is VariableKind.WEIGHT:
                totals["weight"] += var.num_bytes
            elif var.kind is VariableKind.OPTIMIZER_SLOT:
                totals["optimizer_slot"] += var.num_bytes
            if var.gradient is not None:
                totals["gradient"] += self.tensors[var.gradient].num_bytes
        for tensor in self.tensors.values():
            if tensor.role is Role.ACTIVATION:
                totals["activation"] += tensor.num_bytes
            elif tensor.role is Role.INPUT:
                totals["input"] += tensor.num_bytes
        return totals

    def op_type_counts(self, *, recursive: bool = True) -> Counter:
        counts: Counter = Counter()
        for op in self.ops:
            counts[op.type] += 1
            if recursive and op.body is not None:
                counts.update(op.body.op_type_counts())
        return counts

    def summary(self, *, top: int = 12) -> str:
        """A short report a person reads: sizes by role and the commonest ops."""
        counts = self.op_type_counts()
        lines = [
            f"Training-step graph ({self.framework or 'keras'}, batch {self.batch_size}): "
            f"{sum(counts.values())} ops of {len(counts)} types, "
            f"{len(self.tensors)} tensors, {len(self.variables)} variables",
            f"{'role':<16}{'bytes':>16}{'MiB':>12}",
        ]
        for role, size in self.bytes_by_role().items():
            lines.append(f"{role:<16}{size:>16,}{size / 2**20:>12.2f}")
        lines.append(f"{'op type':<32}{'count':>8}")
        for op_type, n in counts.most_common(top):
            lines.append(f"{op_type:<32}{n:>8}")
        if len(counts) > top:
            lines.append(f"... and {len(counts) - top} more op types")
        return "\n".join(lines)

    # -- serialization -----------------------------------------------------
    def to_dict(self) -> dict:
        return {
            "version": IR_VERSION,
            "batch_size": self.batch_size,
            "framework": self.framework,
            "ops": [_op_to_dict(op) for op in self.ops],
            "tensors": [_tensor_to_dict(t) for t in self.tensors.values()],
            "variables": [_variable_to_dict(v) for v in self.variables.values()],
        }

    def to_json(self, **json_kwargs) -> str:
        return json.dumps(self.to_dict(), **json_kwargs)

    @classmethod
    def from_dict(cls, data: Mapping) -> "Graph":
        version = data.get("version")
        if version != IR_VERSION:
            raise ValueError(
                f"IR JSON has version {version!r}; this tofu_tf reads version {IR_VERSION}. "
                "Capture the model again with this version of tofu_tf.")
        tensors = [_tensor_from_dict(t) for t in data["tensors"]]
        variables = [_variable_from_dict(v) for v in data["variables"]]
        return cls(
            ops=tuple(_op_from_dict(o) for o in data["ops"]),
            tensors={t.name: t for t in tensors},
            variables={v.path: v for v in variables},
            batch_size=data.get("batch_size"),
            framework=data.get("framework", ""),
        )

    @classmethod
    def from_json(cls, text: str) -> "Graph":
        return cls.from_dict(json.loads(text))


# -- JSON helpers: enums by value, tuples as lists, nested bodies as dicts ----

def _op_to_dict(op: Op) -> dict:
    out = {"name": op.name, "type": op.type, "inputs": list(op.inputs),
           "outputs": list(op.outputs), "attrs": dict(op.attrs), "layer": op.layer}
    if op.body is not None:
        out["body"] = op.body.to_dict()
    return out


def _op_from_dict(d: Mapping) -> Op:
    body = Graph.from_dict(d["body"]) if d.get("body") is not None else None
    return Op(name=d["name"], type=d["type"], inputs=tuple(d["inputs"]),
              outputs=tuple(d["outputs"]), attrs=_tuplify(d.get("attrs", {})),
              layer=d.get("layer"), body=body)


def _tensor_to_dict(t: Tensor) -> dict:
    d = dataclasses.asdict(t)
    d["role"] = t.role.value
    return d


def _tensor_from_dict(d: Mapping) -> Tensor:
    return Tensor(name=d["name"], shape=tuple(d["shape"]), dtype=d["dtype"],
                  role=Role(d["role"]), producer=d["producer"],
                  consumers=tuple(d.get("consumers", ())),
                  variable_path=d.get("variable_path"),
                  const_value=_tuplify(d.get("const_value")))


def _variable_to_dict(v: Variable) -> dict:
    d = dataclasses.asdict(v)
    d["kind"] = v.kind.value
    return d


def _variable_from_dict(d: Mapping) -> Variable:
    fields = dict(d)
    fields["kind"] = VariableKind(d["kind"])
    fields["shape"] = tuple(d["shape"])
    return Variable(**fields)


def _tuplify(value):
    """JSON turns tuples into lists; the IR stores tuples so values stay hashable."""
    if isinstance(value, list):
        return tuple(_tuplify(v) for v in value)
    if isinstance(value, dict):
        return {k: _tuplify(v) for k, v in value.items()}
    return value
