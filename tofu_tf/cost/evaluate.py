"""The cost of a complete assignment, recomputed from scratch.

Given a graph, a mesh and, for every op, the strategy it runs on each mesh
axis (plus each variable's split per axis), this module prices the whole
step: every (producer, consumer) conversion on every axis, and the peak
memory per device by liveness. It is the single definition of "what a plan
costs" -- the search reports these numbers, and tests recompute them.

A conversion on axis ``k`` is done after the consumer's layout is in place on
axes ``< k`` and while the producer's layout still holds on axes ``> k``, so
its bytes are the tensor's bytes divided by both sets of splits. (The
recursive search, which does not know later axes yet, prices the same
conversion without the second division: it can only overestimate.)

The compute term (``tofu_tf.cost.compute``) adds, per decided op, its work
divided by the devices its strategies split it over; the modeled step time is
communication seconds plus compute seconds.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence

from tofu_tf import ir
from tofu_tf.cost.collectives import transfer
from tofu_tf.cost.compute import op_work, split_factor
from tofu_tf.cost.hardware import HardwareProfile
from tofu_tf.cost.memory import Liveness, MemoryReport, alias_map
from tofu_tf.mesh import MeshSpec
from tofu_tf.semantics.strategy import REPLICATED, OpStrategy, TensorSplit


@dataclasses.dataclass(frozen=True)
class StepCost:
    """Communication per step (bytes, seconds; by collective and by layer), compute
    seconds per device, and memory."""

    comm_bytes: float
    comm_seconds: float
    by_collective: Mapping[str, tuple[float, float]]
    by_layer: Mapping[str, tuple[float, float]]
    memory: MemoryReport
    compute_seconds: float = 0.0

    @property
    def step_seconds(self) -> float:
        return self.comm_seconds + self.compute_seconds


def producer_splits(graph: ir.Graph, op_strategies: Mapping[str, Sequence[OpStrategy]],
                    num_axes: int) -> dict[str, tuple[TensorSplit, ...]]:
    """Per tensor, the split it is produced in on each axis (aliases follow their source)."""
    aliases = alias_map(graph)
    out: dict[str, tuple[TensorSplit, ...]] = {}
    position = {}
    for op in graph.ops:
        for i, name in enumerate(op.outputs):
            position[name] = (op.name, i)
    for name in graph.tensors:
        source = aliases.get(name, name)
        op_name, index = position.get(source, (None, 0))
        strategies = op_strategies.get(op_name)
        if strategies is None:
            out[name] = (REPLICATED,) * num_axes
        else:
            out[name] = tuple(s.outputs[index] if index < len(s.outputs) else REPLICATED for s in strategies)
    return out


def step_cost(graph: ir.Graph, mesh: MeshSpec, hardware: HardwareProfile,
              op_strategies: Mapping[str, Sequence[OpStrategy]],
              var_splits: Mapping[str, Sequence[TensorSplit]], *, liveness: Liveness | None = None,
              work_seconds: Mapping[str, float] | None = None) -> StepCost:
    """Price ``op_strategies`` (op -> strategy per mesh axis) on ``mesh``.

    ``work_seconds`` (op -> unsplit compute seconds) may be passed to skip recomputing it."""
    sizes = mesh.sizes
    links = [hardware.axis_link(mesh, k) for k in range(len(sizes))]
    aliases = alias_map(graph)
    produced = producer_splits(graph, op_strategies, len(sizes))
    by_kind: dict[str, list[float]] = {}
    by_layer: dict[str, list[float]] = {}
    layer_of = {op.name: op.layer for op in graph.ops}
    for op in graph.ops:
        strategies = op_strategies.get(op.name)
        if strategies is None:
            continue
        for j, name in enumerate(op.inputs):
            source = aliases.get(name, name)
            tensor = graph.tensors.get(source)
            if tensor is None or tensor.role is ir.Role.RESOURCE or ir.dtype_size(tensor.dtype) == 0:
                continue
            src = produced[source]
            dst = tuple(s.inputs[j] for s in strategies)
            for k in range(len(sizes)):
                nbytes = tensor.num_bytes / _split_factor(dst[:k], sizes[:k]) / _split_factor(src[k + 1:], sizes[k + 1:])
                moved = transfer(src[k], dst[k], nbytes, sizes[k], links[k])
                if moved is None:
                    continue
                layer = op.layer or layer_of.get(tensor.producer)
                _add(by_kind, moved.kind.value, moved.bytes, moved.seconds)
                _add(by_layer, layer or "(outside layers)", moved.bytes, moved.seconds)
    memory = _memory(graph, sizes, produced, var_splits, liveness or Liveness(graph))
    total_bytes = sum(v[0] for v in by_kind.values())
    total_seconds = sum(v[1] for v in by_kind.values())
    if work_seconds is None:
        work_seconds = op_work_seconds(graph, hardware)
    compute = sum(work_seconds.get(name, 0.0) / split_factor(strategies, sizes)
                  for name, strategies in op_strategies.items())
    return StepCost(total_bytes, total_seconds, {k: tuple(v) for k, v in by_kind.items()},
                    {k: tuple(v) for k, v in by_layer.items()}, memory, compute)


def op_work_seconds(graph: ir.Graph, hardware: HardwareProfile) -> dict[str, float]:
    """Per op with any work, its compute seconds on one device when not split."""
    out = {}
    for op in graph.ops:
        seconds = op_work(op, graph).seconds(hardware)
        if seconds:
            out[op.name] = seconds
    return out


def _split_factor(splits: Sequence[TensorSplit], sizes: Sequence[int]) -> int:
    factor = 1
    for split, size in zip(splits, sizes):
        if split.dim is not None:
            factor *= size
    return factor


def _add(table: dict[str, list[float]], key: str, nbytes: float, seconds: float) -> None:
    entry = table.setdefault(key, [0.0, 0.0])
    entry[0] += nbytes
    entry[1] += seconds


def _memory(graph, sizes, produced, var_splits, liveness: Liveness) -> MemoryReport:
    tensor_bytes = {name: graph.tensors[name].num_bytes / _split_factor(produced[name], sizes)
                    for name in liveness.names}
    variable_bytes = {}
    for path, var in graph.variables.items():
        splits = var_splits.get(path, (REPLICATED,) * len(sizes))
        variable_bytes[path] = var.num_bytes / _split_factor(splits, sizes)
    return liveness.report(tensor_bytes, variable_bytes)
