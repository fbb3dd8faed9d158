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

import numpy as np

from tofu_tf import ir
from tofu_tf.cost.collectives import Transfer, transfer
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
    return _producer_splits(alias_map(graph), _made_by(graph), op_strategies, num_axes, graph.tensors)


def step_cost(graph: ir.Graph, mesh: MeshSpec, hardware: HardwareProfile,
              op_strategies: Mapping[str, Sequence[OpStrategy]],
              var_splits: Mapping[str, Sequence[TensorSplit]], *, liveness: Liveness | None = None,
              work_seconds: Mapping[str, float] | None = None) -> StepCost:
    """Price ``op_strategies`` (op -> strategy per mesh axis) on ``mesh``.

    ``work_seconds`` (op -> unsplit compute seconds) may be passed to skip recomputing it.
    To price many plans of one graph, build a ``StepPricer`` once and call its ``price``."""
    return StepPricer(graph, liveness).price(mesh, hardware, op_strategies, var_splits, work_seconds=work_seconds)


class StepPricer:
    """What pricing a plan needs of a graph that no plan changes (aliases, who produces
    each tensor, every (op, input) that moves bytes, liveness), computed once.

    ``price`` walks every op input in schedule order and every mesh axis; a conversion
    is looked up by (producer splits, consumer splits, bytes), so the repeated layers of
    a model cost one pricing each, not one per layer."""

    def __init__(self, graph: ir.Graph, liveness: Liveness | None = None):
        self.graph = graph
        self.liveness = liveness or Liveness(graph)
        self.aliases = alias_map(graph)
        self._made_by = _made_by(graph)
        layer_of = {op.name: op.layer for op in graph.ops}
        self._uses: list[tuple[str, tuple[tuple[int, str, float, str], ...]]] = []
        for op in graph.ops:
            uses = []
            for j, name in enumerate(op.inputs):
                source = self.aliases.get(name, name)
                tensor = graph.tensors.get(source)
                if tensor is None or tensor.role is ir.Role.RESOURCE or ir.dtype_size(tensor.dtype) == 0:
                    continue
                layer = op.layer or layer_of.get(tensor.producer) or "(outside layers)"
                uses.append((j, source, float(tensor.num_bytes), layer))
            if uses:
                self._uses.append((op.name, tuple(uses)))
        self._live_bytes = np.asarray([graph.tensors[n].num_bytes for n in self.liveness.names], dtype=np.float64)
        priced = dict.fromkeys([source for _, uses in self._uses for _, source, _, _ in uses]
                               + list(self.liveness.names))
        self._priced = tuple((name, *self._made_by.get(self.aliases.get(name, name), (None, 0))) for name in priced)

    def producer_splits(self, op_strategies, num_axes: int, names) -> dict[str, tuple[TensorSplit, ...]]:
        """Per tensor in ``names``, the split it is produced in on each axis."""
        return _producer_splits(self.aliases, self._made_by, op_strategies, num_axes, names)

    def price(self, mesh: MeshSpec, hardware: HardwareProfile, op_strategies: Mapping[str, Sequence[OpStrategy]],
              var_splits: Mapping[str, Sequence[TensorSplit]], *,
              work_seconds: Mapping[str, float] | None = None) -> StepCost:
        """The ``StepCost`` of one plan (see the module docstring)."""
        sizes = mesh.sizes
        links = [hardware.axis_link(mesh, k) for k in range(len(sizes))]
        produced = _splits_of(self._priced, op_strategies, len(sizes))
        by_kind: dict[str, list[float]] = {}
        by_layer: dict[str, list[float]] = {}
        moves: dict[tuple, tuple[Transfer, ...]] = {}
        for op_name, uses in self._uses:
            strategies = op_strategies.get(op_name)
            if strategies is None:
                continue
            for j, source, nbytes, layer in uses:
                src = produced[source]
                dst = tuple(s.inputs[j] for s in strategies)
                key = (src, dst, nbytes)
                moved = moves.get(key)
                if moved is None:
                    moved = moves[key] = _conversions(src, dst, nbytes, sizes, links)
                for transfer_ in moved:
                    _add(by_kind, transfer_.kind.value, transfer_.bytes, transfer_.seconds)
                    _add(by_layer, layer, transfer_.bytes, transfer_.seconds)
        memory = self._memory(sizes, produced, var_splits)
        total_bytes = sum(v[0] for v in by_kind.values())
        total_seconds = sum(v[1] for v in by_kind.values())
        if work_seconds is None:
            work_seconds = op_work_seconds(self.graph, hardware)
        compute = _compute_seconds(work_seconds, op_strategies, sizes)
        return StepCost(total_bytes, total_seconds, {k: tuple(v) for k, v in by_kind.items()},
                        {k: tuple(v) for k, v in by_layer.items()}, memory, compute)

    def _memory(self, sizes, produced, var_splits) -> MemoryReport:
        names = self.liveness.names
        factors: dict[tuple, int] = {}
        divisor = np.empty(len(names))
        for i, name in enumerate(names):
            splits = produced[name]
            factor = factors.get(splits)
            if factor is None:
                factor = factors[splits] = _split_factor(splits, sizes)
            divisor[i] = factor
        variable_bytes = {}
        for path, var in self.graph.variables.items():
            splits = var_splits.get(path, (REPLICATED,) * len(sizes))
            variable_bytes[path] = var.num_bytes / _split_factor(splits, sizes)
        return self.liveness.report_array(self._live_bytes / divisor, variable_bytes)


def _made_by(graph: ir.Graph) -> dict[str, tuple[str, int]]:
    """Tensor -> (op producing it, output index)."""
    return {name: (op.name, i) for op in graph.ops for i, name in enumerate(op.outputs)}


def _producer_splits(aliases, made_by, op_strategies, num_axes: int, names) -> dict[str, tuple[TensorSplit, ...]]:
    made = [(name, *made_by.get(aliases.get(name, name), (None, 0))) for name in names]
    return _splits_of(made, op_strategies, num_axes)


def _splits_of(made, op_strategies, num_axes: int) -> dict[str, tuple[TensorSplit, ...]]:
    """``made``: (tensor, producing op, output index) triples."""
    whole = (REPLICATED,) * num_axes
    out: dict[str, tuple[TensorSplit, ...]] = {}
    for name, op_name, index in made:
        strategies = op_strategies.get(op_name)
        out[name] = whole if strategies is None else tuple(
            s.outputs[index] if index < len(s.outputs) else REPLICATED for s in strategies)
    return out


def _conversions(src, dst, nbytes: float, sizes, links) -> tuple[Transfer, ...]:
    """The collectives converting ``src`` to ``dst`` axis by axis: on axis ``k`` after the
    consumer's splits on axes ``< k`` and while the producer's hold on axes ``> k``."""
    out = []
    for k in range(len(sizes)):
        moved = transfer(src[k], dst[k], nbytes / _split_factor(dst[:k], sizes[:k]) /
                         _split_factor(src[k + 1:], sizes[k + 1:]), sizes[k], links[k])
        if moved is not None:
            out.append(moved)
    return tuple(out)


def _compute_seconds(work_seconds: Mapping[str, float], op_strategies, sizes) -> float:
    """Sum over ops of work / devices splitting it (``split_factor``), memoized per strategy tuple."""
    factors: dict[tuple[int, ...], int] = {}
    total = 0.0
    for name, strategies in op_strategies.items():
        work = work_seconds.get(name, 0.0)
        if not work:
            continue
        key = tuple(map(id, strategies))
        factor = factors.get(key)
        if factor is None:
            factor = factors[key] = split_factor(strategies, sizes)
        total += work / factor
    return total


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


