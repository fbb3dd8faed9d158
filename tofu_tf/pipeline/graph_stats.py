"""Per-layer memory statistics read off a captured training step (analytic).

This module owns the translation of one ``tofu_tf.ir.Graph`` (the training
step of a Keras model at the micro-batch size, as ``tofu_tf.tf.capture``
produces it) into the chain of ``LayerStats`` the pipeline partitioner cuts.
It imports no TensorFlow: the Keras-facing part (capture, layer names,
variable owners) is ``tofu_tf.pipeline.keras_stats``.

What it decides:

* Which ops belong to which top-level Keras layer, and to which phase. Ops
  are named by Keras name scopes: ``<model>/<layer>/...`` in the forward pass,
  ``gradient_tape/<model>/<layer>/...`` in the backward pass. Keras 3
  uniquifies scopes (``dense_0_1``); when the model's own scope carries such a
  suffix, layer scopes are read with one ``_<n>`` suffix stripped. Ops outside
  the model scope before the first backward op are the loss (they go with the
  last unit: the last stage computes the loss); between backward ops they are
  gradient aggregation (``AddN``), billed to the preceding backward op's layer;
  after the backward pass they are the optimizer update.
* Where a pipeline may cut. A cut between two layers is allowed where exactly
  one tensor crosses it (a residual connection or a second input make two):
  the layers between allowed cuts form one unit (a Transformer block becomes
  one unit, a Dense layer stays one).
* What each unit costs, at one micro-batch:

  - ``state_bytes``: its weights, their gradients (kept for the whole step:
    a pipeline accumulates gradients over micro-batches) and optimizer slots;
  - ``activation_bytes``: forward values that backward ops read, each tensor
    billed once, to the earliest unit whose backward reads it (the model
    input to the first unit that reads it);
  - ``transient_bytes``: the live peak of the unit's other values (forward
    temporaries, activation gradients) over the unit's own forward and
    backward ops, by ``tofu_tf.cost.memory.Liveness``;
  - ``workspace_bytes``: the largest scratch buffer a kernel of the unit's
    backward pass allocates outside the graph's tensors: the im2col buffer of
    TensorFlow's CPU convolution-gradient kernels
    (``convolution_workspace_bytes``), 0 in units without 2-D convolutions;
  - ``param_count`` and ``compute_seconds`` (FLOPs and bytes touched, priced
    by a ``HardwareProfile``) for the parameter- and time-balanced baselines.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import os
import re
from collections import Counter
from typing import Mapping, Sequence

from tofu_tf import ir
from tofu_tf.cost import compute as compute_cost
from tofu_tf.cost import hardware as hardware_profiles
from tofu_tf.cost.memory import Liveness, alias_map
from tofu_tf.errors import TofuError
from tofu_tf.pipeline.stats import LayerStats

_BACKWARD_SCOPE = "gradient_tape"
_SUFFIX = re.compile(r"^(.*)_\d+$")
_VALUE_ROLES = frozenset({ir.Role.ACTIVATION, ir.Role.INPUT})


class Phase(enum.Enum):
    FORWARD = "forward"
    BACKWARD = "backward"
    UPDATE = "update"


@dataclasses.dataclass(frozen=True)
class OpPlace:
    """Where one op of the step belongs: its phase and its top-level layer (None: loss)."""

    phase: Phase
    layer: str | None


@dataclasses.dataclass(frozen=True)
class Unit:
    """Consecutive top-level layers between two allowed pipeline cuts."""

    name: str
    layers: tuple[str, ...]
    signature: str = ""  # equal for units with the same forward ops on the same shapes


class GraphStatsError(TofuError, ValueError):
    """The captured step does not map onto the model's layers."""


@dataclasses.dataclass(frozen=True)
class ChainAnalysis:
    """The pipeline units of a model and their statistics, index for index."""

    units: tuple[Unit, ...]
    stats: tuple[LayerStats, ...]
    boundary_bytes: tuple[int, ...]  # bytes unit l sends to unit l + 1 (0 for the last)


def chain_stats(graph: ir.Graph, *, layer_names: Sequence[str], model_name: str,
                variable_layers: Mapping[str, str] | None = None,
                hardware: "hardware_profiles.HardwareProfile | str" = "h100-nvlink"
                ) -> ChainAnalysis:
    """The model's pipeline units, in order, with their analytic statistics.

    ``layer_names`` are the model's top-level layers; ``variable_layers`` maps a
    variable path to the top-level layer owning it (default: the path's first
    component). ``hardware`` prices ``compute_seconds``.
    """
    places = place_ops(graph, layer_names=layer_names, model_name=model_name)
    order = _layer_order(graph, places)
    crossing = _cut_crossings(graph, places, order)
    units = _with_signatures(graph, places, group_units(graph, places, order))
    owner = {layer: unit.name for unit in units for layer in unit.layers}
    last_unit = units[-1].name

    def unit_of(place: OpPlace) -> str:
        return owner.get(place.layer, last_unit) if place.layer is not None else last_unit

    state, params = _state_bytes(graph, owner, variable_layers or {})
    activations, saved = _saved_activations(graph, places, unit_of, [u.name for u in units])
    transients = _transient_bytes(graph, places, unit_of, saved)
    workspaces = _workspace_bytes(graph, places, unit_of)
    seconds = _compute_seconds(graph, places, unit_of, hardware_profiles.profile(hardware))
    stats = tuple(LayerStats(name=u.name, state_bytes=state.get(u.name, 0),
                             activation_bytes=activations.get(u.name, 0),
                             transient_bytes=transients.get(u.name, 0),
                             workspace_bytes=workspaces.get(u.name, 0),
                             param_count=params.get(u.name, 0),
                             compute_seconds=seconds.get(u.name, 0.0)) for u in units)
    starts = [order.index(unit.layers[0]) for unit in units[1:]]
    boundary = tuple(crossing[c].nbytes for c in starts) + (0,)
    return ChainAnalysis(units=tuple(units), stats=stats, boundary_bytes=boundary)


# --------------------------------------------------------------------------- ops to layers


def place_ops(graph: ir.Graph, *, layer_names: Sequence[str],
              model_name: str) -> dict[str, OpPlace]:
    """Phase and top-level layer of every op of ``graph`` (see the module docstring)."""
    model_scope = _model_scope(graph, model_name)
    resolve = _scope_resolver(layer_names, suffixed=model_scope != model_name)
    backward_positions = [i for i, op in enumerate(graph.ops)
                          if op.name.split("/", 1)[0] == _BACKWARD_SCOPE]
    if not backward_positions:
        raise GraphStatsError("the captured step has no backward ops (no 'gradient_tape/' scope); "
                              "capture it with tofu_tf.capture_training_step")
    first_backward, last_backward = backward_positions[0], backward_positions[-1]
    places: dict[str, OpPlace] = {}
    previous_backward_layer = None
    for position, op in enumerate(graph.ops):
        parts = op.name.split("/")
        backward = parts[0] == _BACKWARD_SCOPE
        if backward:
            parts = parts[1:]
        layer = resolve(parts[1]) if len(parts) > 2 and parts[0] == model_scope else None
        if backward:
            phase = Phase.BACKWARD
            previous_backward_layer = layer
        elif position < first_backward:
            phase = Phase.FORWARD
        elif position <= last_backward:
            phase, layer = Phase.BACKWARD, previous_backward_layer  # gradient aggregation
        else:
            phase = Phase.UPDATE
        places[op.name] = OpPlace(phase, layer)
    return places


def _model_scope(graph: ir.Graph, model_name: str) -> str:
    """The name scope the model's forward ops live under: ``model_name`` or it suffixed."""
    pattern = re.compile(re.escape(model_name) + r"(_\d+)?")
    counts = Counter(op.name.split("/", 1)[0] for op in graph.ops if "/" in op.name)
    matches = [(n, scope) for scope, n in counts.items() if pattern.fullmatch(scope)]
    if not matches:
        raise GraphStatsError(
            f"no op of the captured step lies in the scope of model {model_name!r}; "
            "pass the model that was captured")
    return max(matches)[1]


def _scope_resolver(layer_names: Sequence[str], *, suffixed: bool):
    names = set(layer_names)

    def resolve(scope: str) -> str | None:
        stripped = _SUFFIX.match(scope)
        candidates = [scope]
        if stripped:
            candidates.insert(0 if suffixed else 1, stripped.group(1))
        return next((c for c in candidates if c in names), None)

    return resolve


def _layer_order(graph: ir.Graph, places: Mapping[str, OpPlace]) -> list[str]:
    """Top-level layers with forward ops, in the order their first forward op runs."""
    order: dict[str, None] = {}
    for op in graph.ops:
        place = places[op.name]
        if place.phase is Phase.FORWARD and place.layer is not None:
            order.setdefault(place.layer)
    if not order:
        raise GraphStatsError("no forward op of the captured step belongs to a model layer")
    return list(order)


# --------------------------------------------------------------------------- units


def group_units(graph: ir.Graph, places: Mapping[str, OpPlace], order: Sequence[str]) -> list[Unit]:
    """Merge layers so that every boundary between units is crossed by one tensor."""
    crossing = _cut_crossings(graph, places, order)
    groups: list[list[str]] = [[order[0]]]
    for position in range(1, len(order)):
        if crossing[position].count == 1:
            groups.append([order[position]])
        else:
            groups[-1].append(order[position])
    names = [_unit_name(group) for group in groups]
    repeated = {name for name in names if names.count(name) > 1}
    return [Unit(name=_split_name(name, group) if name in repeated else name, layers=tuple(group))
            for name, group in zip(names, groups)]


def _with_signatures(graph: ir.Graph, places: Mapping[str, OpPlace],
                     units: Sequence[Unit]) -> list[Unit]:
    """Units with a signature: the types and output shapes of their forward ops, in order.

    Two units with equal signatures (the blocks of a Transformer) cost the same
    memory, so a profiler measures one of them.
    """
    owner = {layer: i for i, unit in enumerate(units) for layer in unit.layers}
    parts: list[list[str]] = [[] for _ in units]
    for op in graph.ops:
        place = places[op.name]
        if place.phase is Phase.FORWARD and place.layer in owner:
            shapes = ",".join(str(graph.tensors[n].shape) for n in op.outputs if n in graph.tensors)
            parts[owner[place.layer]].append(f"{op.type}{shapes}")
    return [dataclasses.replace(unit, signature=hashlib.sha1(";".join(p).encode()).hexdigest()[:16])
            for unit, p in zip(units, parts)]


@dataclasses.dataclass
class _Crossing:
    count: int = 0
    nbytes: int = 0


def _cut_crossings(graph: ir.Graph, places: Mapping[str, OpPlace],
                   order: Sequence[str]) -> list[_Crossing]:
    """``crossing[c]``: the distinct tensors (count and bytes) produced before layer
    ``order[c]`` and read by the forward pass of it or a later layer (shape
    vectors do not count)."""
    position = {layer: i for i, layer in enumerate(order)}
    producer_position = {}
    for op in graph.ops:
        place = places[op.name]
        if place.phase is Phase.FORWARD and place.layer in position:
            for name in op.outputs:
                producer_position[name] = position[place.layer]
    aliases = alias_map(graph)
    spans: dict[str, tuple[int, int]] = {}
    for op in graph.ops:
        place = places[op.name]
        if place.phase is not Phase.FORWARD or place.layer not in position:
            continue
        reader = position[place.layer]
        for name in op.inputs:
            source = aliases.get(name, name)
            tensor = graph.tensors.get(source)
            if tensor is None or not _is_data(tensor):
                continue
            made = producer_position.get(source, -1 if tensor.role is ir.Role.INPUT else None)
            if made is None or made >= reader:
                continue
            low, high = spans.get(source, (made, reader))
            spans[source] = (min(low, made), max(high, reader))
    crossing = [_Crossing() for _ in order]
    for name, (made, last) in spans.items():
        for cut in range(max(made + 1, 1), last + 1):
            crossing[cut].count += 1
            crossing[cut].nbytes += graph.tensors[name].num_bytes
    return crossing


def _is_data(tensor: ir.Tensor) -> bool:
    """A value a pipeline stage would send: an activation or input, not a shape vector."""
    if tensor.role not in _VALUE_ROLES or tensor.num_bytes == 0:
        return False
    return tensor.rank >= 2 or tensor.dtype.startswith(("float", "bfloat", "half"))


def _split_name(prefix: str, layers: Sequence[str]) -> str:
    """``block_0(ln1..res1)``: a unit sharing its prefix with another one."""
    first, last = (name[len(prefix):].lstrip("_/-.") for name in (layers[0], layers[-1]))
    return f"{prefix}({first}..{last})"


def _unit_name(layers: Sequence[str]) -> str:
    if len(layers) == 1:
        return layers[0]
    prefix = os.path.commonprefix(list(layers)).rstrip("_/-.")
    return prefix if len(prefix) >= 2 else f"{layers[0]}..{layers[-1]}"


# --------------------------------------------------------------------------- bytes


def _state_bytes(graph: ir.Graph, owner: Mapping[str, str],
                 variable_layers: Mapping[str, str]) -> tuple[dict[str, int], dict[str, int]]:
    """Weights + gradients + optimizer slots, and trainable parameter counts, per unit."""
    state: dict[str, int] = {}
    params: dict[str, int] = {}
    for var in graph.weights():
        layer = variable_layers.get(var.path, var.path.split("/", 1)[0])
        unit = owner.get(layer)
        if unit is None:
            continue  # a variable of a layer without forward ops (unused by the step)
        total = var.num_bytes + sum(slot.num_bytes for slot in graph.slots_of(var.path))
        if var.gradient is not None and var.gradient in graph.tensors:
            total += graph.tensors[var.gradient].num_bytes
        state[unit] = state.get(unit, 0) + total
        if var.trainable:
            params[unit] = params.get(unit, 0) + (var.num_bytes // max(ir.dtype_size(var.dtype), 1))
    return state, params


def _saved_activations(graph: ir.Graph, places, unit_of, unit_names: Sequence[str]
                       ) -> tuple[dict[str, int], frozenset[str]]:
    """Bytes of forward values read by the backward pass, per unit, and their names."""
    rank = {name: i for i, name in enumerate(unit_names)}
    aliases = alias_map(graph)
    readers: dict[str, set[str]] = {}
    for op in graph.ops:
        place = places[op.name]
        if place.phase is not Phase.BACKWARD:
            continue
        for name in op.inputs:
            readers.setdefault(aliases.get(name, name), set()).add(unit_of(place))
    forward_made = {name for op in graph.ops if places[op.name].phase is Phase.FORWARD
                    for name in op.outputs}
    totals: dict[str, int] = {}
    saved = set()
    for name, units in readers.items():
        tensor = graph.tensors.get(name)
        if tensor is None or tensor.role not in _VALUE_ROLES or tensor.num_bytes == 0:
            continue
        if tensor.role is ir.Role.ACTIVATION and name not in forward_made:
            continue  # made by the backward pass itself: transient, not kept
        unit = min(units, key=rank.__getitem__)
        totals[unit] = totals.get(unit, 0) + tensor.num_bytes
        saved.add(name)
    return totals, frozenset(saved)


def _transient_bytes(graph: ir.Graph, places, unit_of, saved: frozenset[str]) -> dict[str, int]:
    """Live peak of each unit's unsaved values over its own forward and backward ops."""
    ops_of: dict[str, list[ir.Op]] = {}
    for op in graph.ops:
        place = places[op.name]
        if place.phase is not Phase.UPDATE:
            ops_of.setdefault(unit_of(place), []).append(op)
    peaks = {}
    for unit, ops in ops_of.items():
        made = {name for op in ops for name in op.outputs}
        tensors = {name: graph.tensors[name] for name in made
                   if name in graph.tensors and name not in saved
                   and graph.tensors[name].role is ir.Role.ACTIVATION}
        if not tensors:
            peaks[unit] = 0
            continue
        sub = ir.Graph(ops=tuple(ops), tensors=tensors)
        liveness = Liveness(sub)
        sizes = liveness.bytes_array({n: t.num_bytes for n, t in tensors.items()})
        curve = liveness.live_curve(sizes)
        peaks[unit] = int(curve.max()) if len(curve) else 0
    return peaks


_CONVOLUTION_GRADIENTS = frozenset({"Conv2DBackpropInput", "Conv2DBackpropFilter"})
# TensorFlow's CPU convolution-gradient kernels (Conv2DCustomBackpropInput/Filter)
# size their im2col buffer for these cache sizes, hard-coded in the kernels.
_TF_CPU_L2_BYTES = 256 << 10
_TF_CPU_L3_BYTES = 30 << 20
# Intra-op threads of the runs the workspaces are estimated for: the profiling
# subprocess runs one thread per pool (tofu_tf.pipeline.profile_worker).
_TF_CPU_THREADS = 1


def _workspace_bytes(graph: ir.Graph, places, unit_of) -> dict[str, int]:
    """The largest convolution-gradient workspace of each unit's backward ops."""
    peaks: dict[str, int] = {}
    for op in graph.ops:
        if op.type not in _CONVOLUTION_GRADIENTS or places[op.name].phase is Phase.UPDATE:
            continue
        unit = unit_of(places[op.name])
        peaks[unit] = max(peaks.get(unit, 0), convolution_workspace_bytes(op, graph))
    return peaks


def convolution_workspace_bytes(op: ir.Op, graph: ir.Graph, *,
                                threads: int = _TF_CPU_THREADS) -> int:
    r"""Bytes of the im2col buffer TensorFlow's CPU kernel of a 2-D convolution's
    input or filter gradient allocates (0 for other ops or unknown shapes).

    The kernels (``Conv2DCustomBackpropInputOp``, ``...FilterOp``) multiply
    per image ``A`` (output pixels x output channels, or the im2col matrix for
    the filter gradient), ``B`` and ``C`` (the other two operands), and buffer
    the im2col matrices of ``shard`` images at once, ``shard`` chosen so that a
    shard's ``A + B + C`` fills their hard-coded 30 MiB L3 cache:

    .. math::

        \mathrm{workspace} = \mathrm{shard} \cdot H_o W_o \cdot k_h k_w C_i
        \cdot \mathrm{dtype}, \quad
        \mathrm{shard} = \lceil L_3 / (\mathrm{dtype} \cdot (A + B + C)) \rceil

    -- independent of the batch, and tens of MiB for small convolutions. The
    input gradient uses one image at a time (``shard = 1``) when the batch is
    1 or a thread's share of ``A + B + C`` reaches the 256 KiB L2 cache.
    """
    if op.type == "Conv2DBackpropInput":
        kernel, produced = graph.tensors.get(op.inputs[1]), graph.tensors.get(op.inputs[2])
    elif op.type == "Conv2DBackpropFilter":
        kernel, produced = graph.tensors.get(op.outputs[0]), graph.tensors.get(op.inputs[2])
    else:
        return 0
    if kernel is None or produced is None or kernel.rank != 4 or produced.rank != 4:
        return 0
    if op.attrs.get("data_format", "NHWC") in ("NCHW", b"NCHW"):
        batch, _, rows, columns = produced.shape
    else:
        batch, rows, columns, _ = produced.shape
    kernel_rows, kernel_columns, in_channels, out_channels = kernel.shape
    pixels, patch = rows * columns, kernel_rows * kernel_columns * in_channels
    work = pixels * out_channels + patch * out_channels + pixels * patch  # A + B + C
    dtype = ir.dtype_size(produced.dtype)
    if work == 0 or dtype == 0:
        return 0
    one_at_a_time = op.type == "Conv2DBackpropInput" and (
        batch == 1 or work // max(threads, 1) >= _TF_CPU_L2_BYTES // dtype)
    shard = 1 if one_at_a_time else -(-(_TF_CPU_L3_BYTES // dtype) // work)
    return shard * pixels * patch * dtype


def _compute_seconds(graph: ir.Graph, places, unit_of, hardware) -> dict[str, float]:
    seconds: dict[str, float] = {}
    for op in graph.ops:
        place = places[op.name]
        if place.phase is Phase.UPDATE:
            continue
        unit = unit_of(place)
        seconds[unit] = seconds.get(unit, 0.0) + compute_cost.op_work(op, graph).seconds(hardware)
    return seconds
