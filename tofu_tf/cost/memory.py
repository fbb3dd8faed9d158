"""Memory per device under a plan, with activation liveness over the step's schedule.

Persistent state (weights and optimizer slots) is counted at its sharded size
for the whole step. Every other value with bytes (inputs, activations,
gradients) lives from the op that produces it to its last consumer, in the
order capture recorded the ops (a topological order, i.e. the schedule TF runs
on one device). Reads of variables and ``Identity``-like ops alias their
source: they extend its life and cost nothing themselves. The peak is the
largest sum of live values plus persistent state; the report keeps the
categories and the largest contributors, so an infeasible budget can be
explained. A ``While`` loop is opaque: its outputs are priced, its body is not.

This module knows shapes and bytes per device, never layouts: callers pass
the per-device bytes they computed from a plan.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Mapping

import numpy as np

from tofu_tf import ir

ALIAS_OPS = frozenset({"Identity", "IdentityN", "Snapshot", "StopGradient", "PreventGradient"})
_TRANSIENT_ROLES = frozenset({ir.Role.ACTIVATION, ir.Role.INPUT, ir.Role.GRADIENT, ir.Role.SCALAR})
_TRANSIENT_ROLE_TUPLE = tuple(_TRANSIENT_ROLES)   # membership by identity: an Enum hashes in Python


def alias_map(graph: ir.Graph) -> dict[str, str]:
    """Tensor name -> the tensor it is an alias of (Identity outputs, resolved transitively)."""
    aliases: dict[str, str] = {}
    for op in graph.ops:
        if op.type not in ALIAS_OPS:
            continue
        for src, dst in zip(op.inputs, op.outputs):
            if src in graph.tensors and dst in graph.tensors and graph.tensors[src].shape == graph.tensors[dst].shape:
                aliases[dst] = aliases.get(src, src)
    return aliases


@dataclasses.dataclass(frozen=True)
class MemoryReport:
    """Peak bytes on one device and what makes it up (all per device)."""

    peak_bytes: int
    weight_bytes: int
    optimizer_slot_bytes: int
    gradient_bytes_at_peak: int
    activation_bytes_at_peak: int
    peak_op: str
    top_contributors: tuple[tuple[str, int], ...]

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["top_contributors"] = [list(item) for item in self.top_contributors]
        return out

    @classmethod
    def from_dict(cls, data: Mapping) -> "MemoryReport":
        fields = dict(data)
        fields["top_contributors"] = tuple((str(n), int(b)) for n, b in data["top_contributors"])
        return cls(**fields)


class Liveness:
    """Lifetimes of the transient values of a graph (computed once, priced many times)."""

    def __init__(self, graph: ir.Graph):
        self.graph = graph
        self.aliases = aliases = alias_map(graph)       # shared with the pricer and the search index
        position = {op.name: i for i, op in enumerate(graph.ops)}
        last_use: dict[str, int] = {}
        for i, op in enumerate(graph.ops):               # schedule order: the last write is the last use
            for name in op.inputs:
                last_use[aliases.get(name, name)] = i
        names, starts, ends, sizes = [], [], [], []
        transient, dtype_bytes = _TRANSIENT_ROLE_TUPLE, ir.DTYPE_BYTES
        for name, tensor in graph.tensors.items():
            if name in aliases or tensor.role not in transient:
                continue
            itemsize = dtype_bytes.get(tensor.dtype, 0)
            if itemsize == 0:
                continue
            start = position.get(tensor.producer, 0)
            names.append(name)
            starts.append(start)
            ends.append(max(last_use.get(name, start), start))
            sizes.append(math.prod(tensor.shape) * itemsize)
        self.names = tuple(names)
        self.index = {name: i for i, name in enumerate(names)}
        self.start = np.asarray(starts, dtype=np.int64)
        self.end = np.asarray(ends, dtype=np.int64)
        self.full_bytes = np.asarray(sizes, dtype=np.float64)   # per name, unpartitioned
        self.num_steps = max(len(graph.ops), 1)
        self._gradient_mask: np.ndarray | None = None

    def live_curve(self, nbytes: np.ndarray) -> np.ndarray:
        """Bytes alive at each op of the schedule, for per-tensor bytes in ``self.names`` order."""
        diff = np.zeros(self.num_steps + 1)
        np.add.at(diff, self.start, nbytes)
        np.add.at(diff, self.end + 1, -nbytes)
        return np.cumsum(diff[:-1])

    def bytes_array(self, tensor_bytes: Mapping[str, float]) -> np.ndarray:
        return np.asarray([tensor_bytes[name] for name in self.names], dtype=np.float64)

    def live_at(self, step: int) -> np.ndarray:
        """Boolean mask over ``self.names``: alive at ``step``."""
        return (self.start <= step) & (self.end >= step)

    def report(self, tensor_bytes: Mapping[str, float], variable_bytes: Mapping[str, float], *,
               top: int = 8) -> MemoryReport:
        """The peak under per-device tensor and variable bytes."""
        return self.report_array(self.bytes_array(tensor_bytes), variable_bytes, top=top)

    def report_array(self, nbytes: np.ndarray, variable_bytes: Mapping[str, float], *,
                     top: int = 8) -> MemoryReport:
        """``report`` with the tensor bytes as an array in ``self.names`` order."""
        curve = self.live_curve(nbytes) if len(nbytes) else np.zeros(1)
        step = int(np.argmax(curve))
        alive = self.live_at(step) if len(nbytes) else np.zeros(0, dtype=bool)
        if self._gradient_mask is None:
            self._gradient_mask = np.asarray([self.graph.tensors[n].role is ir.Role.GRADIENT for n in self.names],
                                             dtype=bool)
        grads = self._gradient_mask
        weights = slots = 0.0
        for path, size in variable_bytes.items():
            if self.graph.variables[path].kind is ir.VariableKind.OPTIMIZER_SLOT:
                slots += size
            else:
                weights += size
        live_items = [(self.names[i], nbytes[i]) for i in np.nonzero(alive)[0]]
        contributors = sorted(list(variable_bytes.items()) + live_items, key=lambda kv: -kv[1])[:top]
        grad_bytes = float(nbytes[alive & grads].sum()) if len(nbytes) else 0.0
        act_bytes = float(nbytes[alive & ~grads].sum()) if len(nbytes) else 0.0
        return MemoryReport(
            peak_bytes=int(round(weights + slots + grad_bytes + act_bytes)),
            weight_bytes=int(round(weights)), optimizer_slot_bytes=int(round(slots)),
            gradient_bytes_at_peak=int(round(grad_bytes)), activation_bytes_at_peak=int(round(act_bytes)),
            peak_op=self.graph.ops[step].name if self.graph.ops else "",
            top_contributors=tuple((name, int(round(b))) for name, b in contributors))
