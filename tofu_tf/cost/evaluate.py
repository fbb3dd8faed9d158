"""The cost of a complete assignment, recomputed from scratch.

Given a graph, a mesh and, for every op, the strategy it runs on each mesh
axis (plus each variable's split per axis), this module prices the whole
step: every conversion a tensor's readers ask for on every axis (once per
tensor and layout, however many ops read it in that layout; the all-reduces DTensor
runs as one sharing one latency where ``Link.combines_gradient_all_reduces``, each paying the
copy into the combined buffer, unless running them one by one is cheaper:
``tofu_tf.cost.combining``),
and the peak memory per device by liveness. It is the single definition of "what a plan
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
import math
from typing import Mapping, Sequence

import numpy as np

from tofu_tf import ir
from tofu_tf.cost import combining
from tofu_tf.cost.collectives import Collective, collective_cost
from tofu_tf.cost.compute import FLOP_OPS, FREE_OPS, is_split, op_work
from tofu_tf.cost.hardware import HardwareProfile
from tofu_tf.cost.memory import Liveness, MemoryReport, alias_map
from tofu_tf.mesh import MeshSpec
from tofu_tf.semantics.strategy import REPLICATED, OpStrategy, Reduction, TensorSplit


@dataclasses.dataclass(frozen=True)
class StepCost:
    """Communication per step (bytes, seconds; by collective and by layer), compute
    seconds per device, and memory. ``all_reduces_combined``: whether the step is priced with
    DTensor combining its all-reduces (True) or running them one by one (False), the cheaper
    (``tofu_tf.cost.combining``); None where the links price no combining or nothing combines.
    ``packing_seconds``: of the all-reduces' seconds, those of copying the combined ones into
    and out of their buffers."""

    comm_bytes: float
    comm_seconds: float
    by_collective: Mapping[str, tuple[float, float]]
    by_layer: Mapping[str, tuple[float, float]]
    memory: MemoryReport
    compute_seconds: float = 0.0
    all_reduces_combined: bool | None = None
    packing_seconds: float = 0.0

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
    """Prices many plans of one graph: what no plan changes (every op input that moves
    bytes, who produces each tensor, liveness) is laid out once as arrays.

    A plan's strategies become small integer codes per (op, axis) -- a split dim ``d``
    is ``d``, whole is -1, partial is -2 and below -- so every conversion of every op
    input on every axis is found and priced with array arithmetic. The arithmetic is
    the module docstring's, term by term and in the same order (ops in schedule order,
    inputs, axes), so the result is the one a loop over the ops gives."""

    def __init__(self, graph: ir.Graph, liveness: Liveness | None = None):
        self.graph = graph
        self.liveness = liveness or Liveness(graph)
        self.aliases = self.liveness.aliases
        made_by = _made_by(graph)
        self._op_index = {op.name: i for i, op in enumerate(graph.ops)}
        self._absent = len(graph.ops)                 # a row of "no strategy": every tensor whole
        self._max_in = max((len(op.inputs) for op in graph.ops), default=0) + 1
        self._max_out = max((len(op.outputs) for op in graph.ops), default=0) + 1
        layer_of = {op.name: op.layer for op in graph.ops}
        layers: dict[str, int] = {}
        uses = []                                  # (consumer, slot, producer, output, bytes, layer, source) per use
        sources: dict[str, tuple | None] = {}      # per source tensor: what every use of it shares
        aliases, tensors, op_index, absent = self.aliases, graph.tensors, self._op_index, self._absent
        resource, dtype_bytes = ir.Role.RESOURCE, ir.DTYPE_BYTES
        for i, op in enumerate(graph.ops):
            for j, name in enumerate(op.inputs):
                source = aliases.get(name, name)
                known = sources.get(source, False)
                if known is False:
                    tensor = tensors.get(source)
                    if tensor is None or tensor.role is resource or dtype_bytes.get(tensor.dtype, 0) == 0:
                        known = None
                    else:
                        made, index = made_by.get(source, (None, 0))
                        known = (op_index.get(made, absent), index, float(tensor.num_bytes),
                                 layer_of.get(tensor.producer), len(sources))
                    sources[source] = known
                if known is None:
                    continue
                label = op.layer or known[3] or "(outside layers)"
                uses.append((i, j, known[0], known[1], known[2], layers.setdefault(label, len(layers)), known[4]))
        consumer, slot, producer, out, nbytes, layer, source = zip(*uses) if uses else ((),) * 7
        self._layers = tuple(layers)
        self._use_consumer, self._use_slot = np.asarray(consumer, dtype=np.int64), np.asarray(slot, dtype=np.int64)
        self._use_producer, self._use_out = np.asarray(producer, dtype=np.int64), np.asarray(out, dtype=np.int64)
        self._use_bytes, self._use_layer = np.asarray(nbytes, dtype=np.float64), np.asarray(layer, dtype=np.int64)
        self._use_source = np.asarray(source, dtype=np.int64)
        source_ids = {name: known[4] for name, known in sources.items() if known is not None}
        dtypes: dict[str, int] = {}
        self._source_dtype = np.zeros(len(sources), dtype=np.int64)
        for name, sid in source_ids.items():
            self._source_dtype[sid] = dtypes.setdefault(tensors[name].dtype, len(dtypes))
        self._levels = combining.AllReduceLevels(graph, source_ids)
        live_producer, live_out = [], []
        for name in self.liveness.names:
            made, index = made_by.get(self.aliases.get(name, name), (None, 0))
            live_producer.append(self._op_index.get(made, self._absent))
            live_out.append(index)
        self._live_producer = np.asarray(live_producer, dtype=np.int64)
        self._live_out = np.asarray(live_out, dtype=np.int64)
        self._live_bytes = self.liveness.full_bytes
        self.made_by = made_by        # tensor -> (producing op, output index); the Plan reads it too

    def producer_splits(self, op_strategies, num_axes: int, names) -> dict[str, tuple[TensorSplit, ...]]:
        """Per tensor in ``names``, the split it is produced in on each axis."""
        made = [(name, *self.made_by.get(self.aliases.get(name, name), (None, 0))) for name in names]
        return _splits_of(made, op_strategies, num_axes)

    def price(self, mesh: MeshSpec, hardware: HardwareProfile, op_strategies: Mapping[str, Sequence[OpStrategy]],
              var_splits: Mapping[str, Sequence[TensorSplit]], *,
              work_seconds: Mapping[str, float] | None = None) -> StepCost:
        """The ``StepCost`` of one plan (see the module docstring)."""
        names = list(op_strategies)
        columns = [[strategies[k] for strategies in op_strategies.values()] for k in range(len(mesh.sizes))]
        return self._price(mesh, hardware, _Codes(self, names, columns), var_splits, work_seconds)

    def price_axes(self, mesh: MeshSpec, hardware: HardwareProfile, axes: Sequence[Mapping[str, OpStrategy]],
                   var_splits: Mapping[str, Sequence[TensorSplit]], *,
                   work_seconds: Mapping[str, float] | None = None) -> StepCost:
        """``price`` for a plan given as one table per mesh axis (op -> strategy): the search's
        form, priced without first merging the tables."""
        names = list(axes[0]) if axes else []
        if any(list(table) != names for table in axes[1:]):
            merged = {name: tuple(table[name] for table in axes) for name in names}
            return self.price(mesh, hardware, merged, var_splits, work_seconds=work_seconds)
        return self._price(mesh, hardware, _Codes(self, names, [list(t.values()) for t in axes]), var_splits,
                           work_seconds)

    def _price(self, mesh, hardware, codes: "_Codes", var_splits, work_seconds) -> StepCost:
        sizes = np.asarray(mesh.sizes, dtype=np.int64)
        links = [hardware.axis_link(mesh, k) for k in range(len(sizes))]
        by_kind, by_layer, (combined, packing) = self._comm(codes, sizes, links)
        memory = self._memory(codes, sizes, var_splits)
        total_bytes = sum(v[0] for v in by_kind.values())
        total_seconds = sum(v[1] for v in by_kind.values())
        if work_seconds is None:
            work_seconds = op_work_seconds(self.graph, hardware)
        compute = codes.compute_seconds(work_seconds, sizes)
        return StepCost(total_bytes, total_seconds, by_kind, by_layer, memory, compute, combined, packing)

    def _comm(self, codes: "_Codes", sizes: np.ndarray, links) -> tuple[dict, dict, tuple[bool | None, float]]:
        decided = codes.has[self._use_consumer]
        consumer, slot = self._use_consumer[decided], self._use_slot[decided]
        producer, out = self._use_producer[decided], self._use_out[decided]
        nbytes, layer = self._use_bytes[decided], self._use_layer[decided]
        dst = codes.inputs[codes.rows[consumer], slot[:, None]]          # [use, axis]
        src = codes.outputs[codes.rows[producer], out[:, None]]
        # A tensor is converted once per layout its readers ask for, however many read it
        # (DTensor relayouts the value, not the use): keep each (tensor, layout) at its first use.
        once = np.unique(np.column_stack([self._use_source[decided], dst]), axis=0, return_index=True)[1]
        once.sort()
        producer, out, nbytes, layer, dst, src = producer[once], out[once], nbytes[once], layer[once], dst[once], src[once]
        num_axes = len(sizes)
        dst_split = np.where(dst >= 0, sizes, 1)
        src_split = np.where(src >= 0, sizes, 1)
        kinds, moved_bytes, latencies, buffers = [], [], [], []
        for k in range(num_axes):
            before = np.prod(dst_split[:, :k], axis=1) if k else np.ones(len(dst), dtype=np.int64)
            after = np.prod(src_split[:, k + 1:], axis=1) if k + 1 < num_axes else np.ones(len(dst), dtype=np.int64)
            size = nbytes / before / after
            kind = _collective_codes(src[:, k], dst[:, k])
            if sizes[k] <= 1:
                kind[:] = -1
            kind[size <= 0] = -1
            factor, fixed = _collective_tables(int(sizes[k]), links[k])
            kinds.append(kind), moved_bytes.append(factor[kind] * size), latencies.append(fixed[kind])
            buffers.append(size)
        combined = (None, 0.0)
        if kinds:
            kind, latency = np.stack(kinds, axis=1), np.stack(latencies, axis=1)
            combined = self._combine(kind, latency, np.stack(buffers, axis=1), src,
                                     self._use_source[decided][once], links)
            bandwidth = np.asarray([link.bandwidth for link in links])
            seconds = (latency + np.stack(moved_bytes, axis=1) / bandwidth).ravel()
            kind, moved_bytes = kind.ravel(), np.stack(moved_bytes, axis=1).ravel()
        else:
            kind, moved_bytes, seconds = np.zeros(0, dtype=np.int64), np.zeros(0), np.zeros(0)
        layer = np.repeat(layer, num_axes)
        real = kind >= 0
        return (_totals(kind[real], moved_bytes[real], seconds[real], [c.value for c in _COLLECTIVES]),
                _totals(layer[real], moved_bytes[real], seconds[real], self._layers), combined)

    def _combine(self, kind: np.ndarray, latency: np.ndarray, buffer: np.ndarray, src: np.ndarray,
                 source: np.ndarray, links) -> tuple[bool | None, float]:
        """Price DTensor's all-reduce combining into ``latency`` (``[conversion, axis]``: the fixed
        seconds each collective pays) where it is cheaper (``tofu_tf.cost.combining``), on axes whose
        link pays its latency once per collective: of the all-reduces (and the all-gathers it runs as
        all-reduces) of one run the first pays the latency, and each member of a run of two or more
        pays the copy of its ``buffer`` bytes into and out of the combined buffer. Returns whether
        it combined (``combining.combining_pays``) and the packing seconds it added."""
        combined = np.zeros(kind.shape, dtype=bool)
        for k, link in enumerate(links):
            if link.combines_gradient_all_reduces:
                combined[:, k] = (kind[:, k] == _ALL_REDUCE) | (link.gathers_by_all_reduce & (kind[:, k] == _ALL_GATHER))
        rows, axes = np.nonzero(combined)                 # conversion-major, as the totals are summed
        if len(rows) <= 1:
            return None, 0.0
        level_of = self._levels.levels(np.unique(source[rows]).tolist())
        levels = np.asarray([level_of[s] for s in source[rows].tolist()], dtype=np.int64)
        reduction = np.where(kind[rows, axes] == _ALL_REDUCE, src[rows, axes], _SUM_CODE)
        runs = combining.run_groups(levels, axes, reduction, self._source_dtype[source[rows]])
        copy_rate = np.asarray([link.combine_copy_bandwidth or np.inf for link in links])
        packing = buffer[rows, axes] / copy_rate[axes]
        first, shared = combining.run_roles(runs)
        pays = combining.combining_pays(first, shared, latency[rows, axes], packing)
        if not pays:
            return pays, 0.0
        latency[rows[~first], axes[~first]] = 0.0
        latency[rows[shared], axes[shared]] += packing[shared]
        return True, float(packing[shared].sum())

    def _memory(self, codes: "_Codes", sizes: np.ndarray, var_splits) -> MemoryReport:
        made = codes.outputs[codes.rows[self._live_producer], self._live_out[:, None]]
        divisor = np.prod(np.where(made >= 0, sizes, 1), axis=1) if len(made) else np.ones(0, dtype=np.int64)
        variable_bytes = {}
        for path, var in self.graph.variables.items():
            splits = var_splits.get(path, (REPLICATED,) * len(sizes))
            variable_bytes[path] = var.num_bytes / _split_factor(splits, [int(s) for s in sizes])
        return self.liveness.report_array(self._live_bytes / divisor, variable_bytes)


_COLLECTIVES = tuple(Collective)
_ALL_REDUCE = _COLLECTIVES.index(Collective.ALL_REDUCE)
_ALL_GATHER = _COLLECTIVES.index(Collective.ALL_GATHER)
_REDUCTIONS = tuple(Reduction)
_SUM_CODE = -2 - _REDUCTIONS.index(Reduction.SUM)       # an all-gather runs as a summing all-reduce


def _code(split: TensorSplit) -> int:
    if split.partial is not None:
        return -2 - _REDUCTIONS.index(split.partial)
    return -1 if split.dim is None else split.dim


class _Codes:
    """A plan as integer codes: per op a row of strategy ids (one per axis), per strategy
    the code of each input and output (missing ones whole), and whether it splits the op."""

    def __init__(self, pricer: StepPricer, names: list[str], columns: list[list[OpStrategy]]):
        """``columns[k][i]``: the strategy of op ``names[i]`` on axis ``k``."""
        num_axes = len(columns)
        ids = np.stack([np.fromiter(map(id, column), dtype=np.int64, count=len(names)) for column in columns],
                       axis=1) if num_axes else np.zeros((len(names), 0), dtype=np.int64)
        _, first, inverse = np.unique(ids.ravel(), return_index=True, return_inverse=True)
        table: list[OpStrategy | None] = [None] + [columns[i % num_axes][i // num_axes] for i in first.tolist()]
        rows = np.asarray(inverse, dtype=np.int64).reshape(len(names), num_axes) + 1      # 0: no strategy
        op_index = pricer._op_index
        order = [op_index.get(name, -1) for name in names]
        self.names = names
        self.table_rows = rows
        self.rows = np.zeros((pricer._absent + 1, num_axes), dtype=np.int64)
        self.has = np.zeros(pricer._absent + 1, dtype=bool)
        where = np.asarray(order, dtype=np.int64)
        inside = where >= 0
        self.rows[where[inside]] = self.table_rows[inside]
        self.has[where[inside]] = True
        self.inputs = np.full((len(table), pricer._max_in), -1, dtype=np.int64)
        self.outputs = np.full((len(table), pricer._max_out), -1, dtype=np.int64)
        self.splits = np.zeros(len(table), dtype=bool)
        for sid, strategy in enumerate(table[1:], start=1):
            self.inputs[sid, :len(strategy.inputs)] = [_code(s) for s in strategy.inputs]
            self.outputs[sid, :len(strategy.outputs)] = [_code(s) for s in strategy.outputs]
            self.splits[sid] = is_split(strategy)

    def compute_seconds(self, work_seconds: Mapping[str, float], sizes: np.ndarray) -> float:
        """Sum over ops, in plan order, of work / product of the axis sizes splitting it."""
        if not self.names:
            return 0.0
        work = np.asarray([work_seconds.get(name, 0.0) for name in self.names], dtype=np.float64)
        factor = np.prod(np.where(self.splits[self.table_rows], sizes, 1), axis=1)
        return sum((work / factor).tolist())


def _collective_codes(src: np.ndarray, dst: np.ndarray) -> np.ndarray:
    """``collectives.collective_for`` on codes: index into ``Collective`` order, -1 if local."""
    kind = np.full(src.shape, -1, dtype=np.int64)
    partial = src <= -2
    kind[partial & (dst >= 0)] = _COLLECTIVES.index(Collective.REDUCE_SCATTER)
    kind[partial & (dst < 0) & (dst != src)] = _COLLECTIVES.index(Collective.ALL_REDUCE)
    gather = ~partial & (dst >= -1) & (src >= 0) & (src != dst)
    kind[gather & (dst == -1)] = _COLLECTIVES.index(Collective.ALL_GATHER)
    kind[gather & (dst >= 0)] = _COLLECTIVES.index(Collective.ALL_TO_ALL)
    return kind


def _collective_tables(n: int, link) -> tuple[np.ndarray, np.ndarray]:
    """Per collective (and a trailing zero row for "none", index -1): bytes factor and
    the latency term, from ``collectives.collective_cost`` itself."""
    factor = [collective_cost(c, 1.0, n, link).bytes for c in _COLLECTIVES] + [0.0]
    fixed = [collective_cost(c, 0.0, n, link).seconds for c in _COLLECTIVES] + [0.0]
    return np.asarray(factor), np.asarray(fixed)


def _totals(keys: np.ndarray, nbytes: np.ndarray, seconds: np.ndarray, labels) -> dict[str, tuple[float, float]]:
    """Sums per key in order of first appearance (sequential sums, as a loop adds)."""
    if not len(keys):
        return {}
    sum_bytes = np.bincount(keys, weights=nbytes, minlength=len(labels))
    sum_seconds = np.bincount(keys, weights=seconds, minlength=len(labels))
    first = np.unique(keys, return_index=True)[1]
    return {labels[keys[i]]: (float(sum_bytes[keys[i]]), float(sum_seconds[keys[i]])) for i in sorted(first)}


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


def op_work_seconds(graph: ir.Graph, hardware: HardwareProfile) -> dict[str, float]:
    """Per op with any work, its compute seconds on one device when not split: ``op_work``'s
    seconds, with the bytes-touched case (most ops) summed here from per-tensor bytes
    (the same sum, in the same order), so a 10k-op graph is priced in one pass."""
    out = {}
    tensors, dtype_bytes, resource = graph.tensors, ir.DTYPE_BYTES, ir.Role.RESOURCE
    bandwidth = hardware.memory_bandwidth
    for op in graph.ops:
        kind = op.type
        if kind in FREE_OPS:
            continue
        if kind in FLOP_OPS:
            seconds = op_work(op, graph).seconds(hardware)
        else:
            touched = 0.0
            for name in (*op.inputs, *op.outputs):
                tensor = tensors.get(name)
                if tensor is not None and tensor.role is not resource:
                    touched += math.prod(tensor.shape) * dtype_bytes.get(tensor.dtype, 0)
            seconds = 0.0 / hardware.flops + touched / bandwidth
        if seconds:
            out[op.name] = seconds
    return out


def _split_factor(splits: Sequence[TensorSplit], sizes: Sequence[int]) -> int:
    factor = 1
    for split, size in zip(splits, sizes):
        if split.dim is not None:
            factor *= size
    return factor
