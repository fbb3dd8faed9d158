"""What DTensor executed for a plan's training step, beside what the plan modeled.

The planner prices each collective its layouts imply; DTensor's SPMD expansion inserts its own
(relayouts, gathers before ops its expanders refuse, all-reduces of partial sums), and its
lowering combines all-reduces. ``ExecutedFigures`` holds what was read from the program DTensor
compiled for one training step under a plan (``tofu_tf.tf.step_program`` reads it; ``tofu-plan
--measure`` and ``bench/executed.py`` measure it): collectives by kind, each priced as the cost
model prices the plan's (bytes each device sends per step), the collectives left after DTensor's
lowering, and the training state as placed. A ``Plan`` carries them (``Plan.executed``) once
measured, so its summary and its page show modeled and executed side by side.

``measure`` trains two steps under the plan in a child process
(``tofu_tf.strategies.step_measurement``, run as a program: the core never imports the
strategies) with TensorFlow's MLIR dumps on (``TF_DUMP_GRAPH_PREFIX``: DTensor writes its
program after each of its passes, which needs the process's logging configured before
TensorFlow starts), and reads the training step's program back: after SPMD expansion and
common-subexpression elimination (DTensor's collectives) and after its last pass (what runs).
This module reads program text; it imports no TensorFlow.
"""

from __future__ import annotations

import collections
import dataclasses
import glob
import json
import os
import re
import subprocess
import sys
import tempfile
from typing import Mapping

from tofu_tf.errors import TofuError

# DTensor's collectives after SPMD expansion (how it expressed the plan's relayouts) and the
# collectives its lowering passes leave in the program (what runs: on CPU an all-gather becomes an
# all-reduce of a zero-padded buffer, a reduce-scatter an all-reduce and a slice).
DTENSOR_KINDS = {"DTensorAllReduce": "all-reduce", "DTensorReduceScatter": "reduce-scatter",
                 "DTensorAllGather": "all-gather", "DTensorAllToAll": "all-to-all"}
RUN_KINDS = {"CollectiveReduceV2": "all-reduce", "CollectiveReduceScatterV2": "reduce-scatter",
             "CollectiveGatherV2": "all-gather", "CollectiveAllToAllV2": "all-to-all"}
_OP = re.compile(r'"tf\.(' + "|".join(list(DTENSOR_KINDS) + list(RUN_KINDS)) + r')"\(([^)]*)\)')
_TYPES = re.compile(r":\s*\((.*)\)\s*->\s*(.*)$")
_TENSOR = re.compile(r"tensor<([^>]*)>")
_DEFINES = r'^\s*(%[\w#]+)(?:, %[\w#]+)* = (?:tf_executor\.island wraps )?'
_SCALAR = re.compile(_DEFINES + r'"tf.Const"\(\) <\{value = dense<(\d+)> : tensor<i32>\}>')
_UPDATE = re.compile(_DEFINES + r'"tf\.TensorStridedSliceUpdate"\((%[\w#]+),')
_GROUPS = re.compile(_DEFINES + r'"tf.Const"\(\).*:\s*\(\)\s*->\s*tensor<(\d+)x(\d+)xi32>')
DTYPE_BYTES = {"f32": 4, "f16": 2, "bf16": 2, "f64": 8, "i32": 4, "i64": 8, "i8": 1, "i1": 1}
# What the child prints before its JSON line, so the parent finds it among the logs.
RESULT_MARK = "tofu-measured-step: "


class MeasurementError(TofuError, RuntimeError):
    """The measuring run failed, or TensorFlow wrote no DTensor program to read."""


@dataclasses.dataclass(frozen=True)
class ExecutedFigures:
    """One training step as DTensor compiled it under a plan.

    Attributes:
        collectives: Collective kind -> (count, bytes each device sends per step) of DTensor's
            collectives after SPMD expansion, priced as the cost model prices the plan's
            ``comm_by_collective`` (so an all-gather DTensor lowers to an all-reduce is priced so).
        lowered: The same for the collectives left after DTensor's lowering and all-reduce
            combining: what runs.
        state_bytes: Weights and optimizer slots per device as the variables were placed.
        lowered_padding: Of ``lowered``'s bytes, those of the zeros DTensor's combining pass
            appends to each combined all-reduce's buffer (to a multiple of 1024 elements, for
            XLA: ``tensorflow/dtensor/mlir/dtensor_allreduce_combine_optimization.cc``), priced
            the same way. The plan moves no such bytes; they are shown apart, not as a gap.
    """

    collectives: Mapping[str, tuple[int, float]]
    lowered: Mapping[str, tuple[int, float]]
    state_bytes: int
    lowered_padding: float = 0.0

    @property
    def collective_bytes(self) -> float:
        return sum(nbytes for _, nbytes in self.collectives.values())

    @property
    def lowered_bytes(self) -> float:
        return sum(nbytes for _, nbytes in self.lowered.values())

    @property
    def lowered_count(self) -> int:
        return sum(count for count, _ in self.lowered.values())

    @property
    def lowered_payload_bytes(self) -> float:
        """What runs without the combining pass's padding: the figure the plan's total models."""
        return self.lowered_bytes - self.lowered_padding

    def to_dict(self) -> dict:
        return {"collectives": {kind: list(value) for kind, value in self.collectives.items()},
                "lowered": {kind: list(value) for kind, value in self.lowered.items()},
                "state_bytes": self.state_bytes, "lowered_padding": self.lowered_padding}

    @classmethod
    def from_dict(cls, data) -> "ExecutedFigures":
        """The figures ``to_dict`` wrote (``lowered_padding`` may be absent: measured before it
        was read); ``ValueError`` naming what does not read."""
        if not isinstance(data, Mapping) or not {"collectives", "lowered", "state_bytes"} <= set(data) \
                or not set(data) <= {"collectives", "lowered", "state_bytes", "lowered_padding"}:
            raise ValueError(f"{data!r} is not an object of collectives, lowered, state_bytes and lowered_padding")

        def kinds(name):
            value = data[name]
            if not isinstance(value, Mapping) or not all(
                    isinstance(pair, (list, tuple)) and len(pair) == 2 and all(
                        isinstance(x, (int, float)) and not isinstance(x, bool) for x in pair)
                    for pair in value.values()):
                raise ValueError(f"{name}: {value!r} is not an object of kind -> [count, bytes]")
            return {kind: (int(count), float(nbytes)) for kind, (count, nbytes) in value.items()}

        state, padding = data["state_bytes"], data.get("lowered_padding", 0.0)
        if isinstance(state, bool) or not isinstance(state, int):
            raise ValueError(f"state_bytes: {state!r} is not an integer")
        if isinstance(padding, bool) or not isinstance(padding, (int, float)) or padding < 0:
            raise ValueError(f"lowered_padding: {padding!r} is not a number of bytes")
        return cls(kinds("collectives"), kinds("lowered"), state, float(padding))


def gap(executed: float, modeled: float) -> float:
    """How far apart an executed and a modeled figure are, as a share of the larger (0 when both are 0)."""
    if not executed and not modeled:
        return 0.0
    return abs(executed - modeled) / max(executed, modeled)


def comparison_rows(executed: ExecutedFigures, modeled_bytes: Mapping[str, float],
                    modeled_state: int) -> list[tuple[str, str, float, float, float]]:
    """Rows of (what, count, executed bytes, modeled bytes, gap): each collective kind either
    side has, the step's total after lowering, and the state per device."""
    rows = []
    for kind in sorted(set(executed.collectives) | {k for k, b in modeled_bytes.items() if b}):
        count, nbytes = executed.collectives.get(kind, (0, 0.0))
        modeled = modeled_bytes.get(kind, 0.0)
        rows.append((kind, str(count), nbytes, modeled, gap(nbytes, modeled)))
    total = sum(modeled_bytes.values())
    rows.append(("runs (lowered)", str(executed.lowered_count), executed.lowered_payload_bytes, total,
                 gap(executed.lowered_payload_bytes, total)))
    if executed.lowered_padding:
        rows.append(("combine padding", "", executed.lowered_padding, 0.0, 0.0))
    rows.append(("state/device", "", float(executed.state_bytes), float(modeled_state),
                 gap(executed.state_bytes, modeled_state)))
    return rows


def _tensor_bytes(text: str) -> int:
    """Bytes of an MLIR ``tensor<AxBxf32>`` (element type last)."""
    *dims, dtype = text.split("x")
    size = DTYPE_BYTES.get(dtype, 4)
    for dim in dims:
        size *= int(dim)
    return size


def collectives(mlir: str, kinds: Mapping[str, str], link) -> dict[str, tuple[int, float]]:
    """Per collective kind: (count, bytes each device sends per step) of the ops named in
    ``kinds`` in one DTensor program text, priced by the cost model's own ``collective_cost``
    on ``link`` (so an all-gather DTensor expresses is priced as the all-reduce it lowers to,
    as the plan prices it)."""
    from tofu_tf.cost.collectives import Collective, collective_cost
    sizes = _group_sizes(mlir)
    found = collections.defaultdict(lambda: [0, 0.0])
    for line in mlir.splitlines():
        op, types = _OP.search(line), _TYPES.search(line)
        if not op or not types or op.group(1) not in kinds:
            continue
        kind = kinds[op.group(1)]
        operands = [name.strip() for name in op.group(2).split(",")]
        local_in = _tensor_bytes(_TENSOR.findall(types.group(1))[0])
        local_out = _tensor_bytes(_TENSOR.findall(types.group(2))[0])
        n = _group_size(operands, sizes, local_in, local_out)
        # B of tofu_tf/cost/collectives.py: the tensor's bytes when replicated on the axis.
        whole = {"all-gather": local_out, "all-to-all": local_in * n}.get(kind, local_in)
        found[kind][0] += 1
        found[kind][1] += collective_cost(Collective(kind), whole, n, link).bytes
    return {kind: (count, nbytes) for kind, (count, nbytes) in found.items()}


def combine_padding(mlir: str, link) -> float:
    """Bytes each device sends per step for the zeros DTensor's combining pass appends to its
    combined all-reduces (priced as ``collectives`` prices them): each combined buffer is
    written by a chain of ``TensorStridedSliceUpdate`` (one per gradient it carries) into a flat
    zero buffer padded to a multiple of 1024 elements; its padding is the buffer's elements
    less those the chain writes."""
    from tofu_tf.cost.collectives import Collective, collective_cost
    written = {}                         # update's result -> (the buffer it updated, elements written)
    for line in mlir.splitlines():
        update, types = _UPDATE.match(line), _TYPES.search(line)
        if update and types:
            value = _TENSOR.findall(types.group(1))[-1]
            written[update.group(1)] = (update.group(2), _elements(value))
    sizes, padding = _group_sizes(mlir), 0.0
    for line in mlir.splitlines():
        op, types = _OP.search(line), _TYPES.search(line)
        if not op or not types or op.group(1) != "CollectiveReduceV2":
            continue
        operands = [name.strip() for name in op.group(2).split(",")]
        buffer, carried = operands[0], 0
        while buffer in written:
            buffer, elements = written[buffer]
            carried += elements
        local = _TENSOR.findall(types.group(1))[0]
        elements = _elements(local)
        pad = elements - carried
        # A combined buffer is flat and padded by less than 1024 elements; an all-gather lowered to
        # an all-reduce writes its shard into a zero tensor of the gathered shape the same way.
        if carried and local.count("x") == 1 and elements % 1024 == 0 and 0 < pad < 1024:
            n = _group_size(operands, sizes, 1, 1)
            padding += collective_cost(Collective.ALL_REDUCE, pad * _element_bytes(local), n, link).bytes
    return padding


def _group_sizes(mlir: str) -> dict[str, int]:
    """The program's i32 constants that can size a collective's group: a scalar group size, or
    a group assignment (groups x devices), by the value's name."""
    sizes = {}
    for line in mlir.splitlines():
        scalar, groups = _SCALAR.match(line), _GROUPS.match(line)
        if scalar:
            sizes[scalar.group(1)] = int(scalar.group(2))
        elif groups:
            sizes[groups.group(1)] = int(groups.group(3))
    return sizes


def _group_size(operands, sizes, local_in: int, local_out: int) -> int:
    """Devices in a collective's group: its second operand's constant, else the ratio of its
    per-device input and output (a gather's or a scatter's)."""
    group = operands[1] if len(operands) > 1 else None
    return sizes.get(group) or max(1, round(max(local_in, local_out) / max(min(local_in, local_out), 1)))


def _element_bytes(text: str) -> int:
    return DTYPE_BYTES.get(text.split("x")[-1], 4)


def _elements(text: str) -> int:
    """Elements of an MLIR ``tensor<AxBxf32>``."""
    return _tensor_bytes(text) // _element_bytes(text)


def training_step_programs(dump_dir: str) -> tuple[str, str]:
    """The training step's program (the function DTensor compiled with the largest program) as
    DTensor expanded it (after SPMD expansion and CSE) and as its last pass left it."""
    dumps = glob.glob(os.path.join(dump_dir, "dtensor.*.__inference_*"))
    if not dumps:
        raise MeasurementError(f"DTensor wrote no program to {dump_dir}: this TensorFlow does not honour "
                               "TF_DUMP_GRAPH_PREFIX, so the executed collectives cannot be read.")
    step = max(dumps, key=os.path.getsize).rsplit(".__inference_", 1)[1]
    stages = sorted(path for path in dumps if path.endswith(".__inference_" + step))
    expanded = [path for path in stages if ".after_CSE." in path]

    def read(path):
        with open(path, encoding="utf-8") as program:
            return program.read()
    return read(expanded[0] if expanded else stages[-1]), read(stages[-1])


def figures_from_dumps(dump_dir: str, link, state_bytes: int) -> ExecutedFigures:
    """The figures of the training step whose programs DTensor wrote to ``dump_dir``."""
    expanded, lowered = training_step_programs(dump_dir)
    return ExecutedFigures(collectives(expanded, DTENSOR_KINDS, link), collectives(lowered, RUN_KINDS, link),
                           state_bytes, combine_padding(lowered, link))


def dump_environment(dump_dir: str) -> dict[str, str]:
    """The environment under which TensorFlow writes DTensor's programs to ``dump_dir``."""
    return {**os.environ, "TF_DUMP_GRAPH_PREFIX": dump_dir, "TF_CPP_VMODULE": "dtensor_mlir_passes=4",
            "TF_CPP_MIN_LOG_LEVEL": "0"}


def measure(plan, request: Mapping, *, timeout_s: float = 1800.0) -> ExecutedFigures:
    """Train ``request``'s model two steps under ``plan`` in a child process and read what DTensor
    compiled. ``request``: ``model`` (MODULE:FUNCTION), ``model_kwargs``, ``batch_size``, ``loss``,
    ``optimizer``, ``num_devices`` (virtual CPUs where the GPUs are fewer), as ``tofu-plan`` takes
    them. Raises ``MeasurementError`` naming what failed."""
    from tofu_tf.cost import hardware
    link = hardware.profile(plan.hardware).intra_node
    with tempfile.TemporaryDirectory(prefix="tofu_measure_") as work:
        dumps = os.path.join(work, "dumps")
        os.mkdir(dumps)
        request_path = os.path.join(work, "request.json")
        with open(request_path, "w", encoding="utf-8") as handle:
            json.dump({**request, "plan": plan.to_dict()}, handle)
        try:
            out = subprocess.run([sys.executable, "-m", "tofu_tf.strategies.step_measurement", request_path],
                                 env=dump_environment(dumps), capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise MeasurementError(f"the measuring run of {request.get('model')} took over {timeout_s:.0f} s "
                                   "and was stopped; measure a smaller configuration.") from None
        results = [line[len(RESULT_MARK):] for line in out.stdout.splitlines() if line.startswith(RESULT_MARK)]
        if out.returncode or not results:
            tail = "\n".join(out.stderr.strip().splitlines()[-12:])
            raise MeasurementError(f"the measuring run of {request.get('model')} failed (exit {out.returncode}); "
                                   f"the end of its log:\n{tail}")
        return figures_from_dumps(dumps, link, int(json.loads(results[-1])["state_bytes"]))
