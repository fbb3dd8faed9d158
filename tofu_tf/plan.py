"""A frozen, serializable partition plan: what the search decided and what it costs.

The plan is the hand-off from the planner to the lowering (``TofuStrategy``):
it names a mesh shape, a DTensor layout for every variable (optimizer slots
included, by their Keras path) and batch input, and the layout each op's
outputs are produced in. It also carries the modeled cost (communication
bytes and seconds per step, by collective kind and by layer; peak memory per
device with its breakdown), how long the search took, and which method made
it, so plans from different methods compare in one table. The modeled step
time is communication seconds plus compute seconds (``tofu_tf.cost.compute``).

Layouts are tuples with one entry per tensor dim: a mesh axis name or None.
JSON is versioned; loading another version raises with the remedy.
"""

from __future__ import annotations

import dataclasses
import enum
import json
from typing import Mapping

from tofu_tf.cost.memory import MemoryReport

PLAN_VERSION = 1


class Method(enum.Enum):
    TOFU = "tofu"
    ILP = "ilp"
    DATA_PARALLEL = "data_parallel"
    MEGATRON = "megatron"


class Objective(enum.Enum):
    TIME = "time"      # modeled step seconds (communication + compute), under a memory budget
    COMM = "comm"      # modeled communication seconds per step only, under a memory budget
    MEMORY = "memory"  # peak memory per device (pure Tofu), communication breaks ties


class PlanVersionError(ValueError):
    """Plan JSON written by another version of tofu_tf."""


@dataclasses.dataclass(frozen=True)
class CommCost:
    """Bytes sent and seconds spent per device per step, one collective kind or layer."""

    bytes: float
    seconds: float


@dataclasses.dataclass(frozen=True)
class Plan:
    method: Method
    mesh_axes: tuple[tuple[str, int], ...]
    variable_layouts: Mapping[str, tuple]
    input_layouts: Mapping[str, tuple]
    tensor_layouts: Mapping[str, tuple]
    partial_tensors: Mapping[str, tuple]
    op_strategies: Mapping[str, tuple]
    comm_by_collective: Mapping[str, CommCost]
    comm_by_layer: Mapping[str, CommCost]
    memory: MemoryReport
    search_seconds: float
    hardware: str
    objective: Objective = Objective.TIME
    memory_budget_bytes: int | None = None
    proved_optimal: bool | None = None
    notes: tuple[str, ...] = ()
    compute_seconds: float = 0.0
    target: str = "dtensor"

    # -- what other components read ----------------------------------------
    @property
    def mesh_shape(self) -> dict[str, int]:
        return dict(self.mesh_axes)

    @property
    def num_devices(self) -> int:
        out = 1
        for _, size in self.mesh_axes:
            out *= size
        return out

    @property
    def comm_bytes(self) -> float:
        return sum(c.bytes for c in self.comm_by_collective.values())

    @property
    def comm_seconds(self) -> float:
        return sum(c.seconds for c in self.comm_by_collective.values())

    @property
    def step_seconds(self) -> float:
        """Modeled seconds per training step: communication plus compute."""
        return self.comm_seconds + self.compute_seconds

    @property
    def peak_memory_bytes(self) -> int:
        return self.memory.peak_bytes

    # -- for people ----------------------------------------------------------
    def summary(self, *, top: int = 10) -> str:
        """A table a person reads in a terminal."""
        mesh = " x ".join(f"{n}={s}" for n, s in self.mesh_axes) or "(1 device)"
        mem = self.memory
        lines = [
            f"Plan ({self.method.value}, objective {self.objective.value}) on mesh {mesh}, hardware {self.hardware}",
            f"  step time       {self.step_seconds * 1e3:>12.3f} ms  (compute {self.compute_seconds * 1e3:.3f} ms, "
            f"target {self.target})",
            f"  comm per step   {_mib(self.comm_bytes):>12} MiB {self.comm_seconds * 1e3:>10.3f} ms",
            f"  peak memory     {_mib(mem.peak_bytes):>12} MiB  (budget "
            f"{'none' if self.memory_budget_bytes is None else _mib(self.memory_budget_bytes) + ' MiB'})",
            f"    weights {_mib(mem.weight_bytes)}  slots {_mib(mem.optimizer_slot_bytes)}  "
            f"gradients {_mib(mem.gradient_bytes_at_peak)}  activations {_mib(mem.activation_bytes_at_peak)} MiB"
            f"  (peak at {mem.peak_op})",
            f"  search          {self.search_seconds:.2f} s"
            + ("" if self.proved_optimal is None else f"  (proved optimal: {self.proved_optimal})"),
        ]
        collectives = sorted(self.comm_by_collective.items(), key=lambda kv: -kv[1].seconds)
        layers = sorted(self.comm_by_layer.items(), key=lambda kv: -kv[1].seconds)[:top]
        layer_header = f"layer (top {top})"
        width = _name_width(["collective", layer_header] + [name for name, _ in collectives + layers])
        lines.append(_row("collective", width, f"{'MiB':>12} {'ms':>10}"))
        lines.extend(_row(kind, width, _cost_cells(cost)) for kind, cost in collectives)
        lines.append(_row(layer_header, width, f"{'MiB':>12} {'ms':>10}"))
        lines.extend(_row(layer, width, _cost_cells(cost)) for layer, cost in layers)
        variables = list(self.variable_layouts.items())[:top]
        width = _name_width(["variable"] + [path for path, _ in variables])
        lines.append(_row("variable", width, "layout"))
        lines.extend(_row(path, width, _layout_text(layout)) for path, layout in variables)
        if len(self.variable_layouts) > top:
            lines.append(f"  ... and {len(self.variable_layouts) - top} more variables")
        lines.extend(f"  note: {note}" for note in self.notes[:top])
        return "\n".join(lines)

    # -- JSON ----------------------------------------------------------------
    def to_dict(self) -> dict:
        return {
            "version": PLAN_VERSION,
            "method": self.method.value,
            "mesh_axes": [list(a) for a in self.mesh_axes],
            "variable_layouts": {k: list(v) for k, v in self.variable_layouts.items()},
            "input_layouts": {k: list(v) for k, v in self.input_layouts.items()},
            "tensor_layouts": {k: list(v) for k, v in self.tensor_layouts.items()},
            "partial_tensors": {k: list(v) for k, v in self.partial_tensors.items()},
            "op_strategies": {k: list(v) for k, v in self.op_strategies.items()},
            "comm_by_collective": {k: [c.bytes, c.seconds] for k, c in self.comm_by_collective.items()},
            "comm_by_layer": {k: [c.bytes, c.seconds] for k, c in self.comm_by_layer.items()},
            "memory": self.memory.to_dict(),
            "search_seconds": self.search_seconds,
            "hardware": self.hardware,
            "objective": self.objective.value,
            "memory_budget_bytes": self.memory_budget_bytes,
            "proved_optimal": self.proved_optimal,
            "notes": list(self.notes),
            "compute_seconds": self.compute_seconds,
            "target": self.target,
        }

    def to_json(self, **json_kwargs) -> str:
        return json.dumps(self.to_dict(), **json_kwargs)

    @classmethod
    def from_dict(cls, data: Mapping) -> "Plan":
        if data.get("version") != PLAN_VERSION:
            raise PlanVersionError(
                f"plan JSON has version {data.get('version')!r}; this tofu_tf reads version "
                f"{PLAN_VERSION}. Plan the model again with this version (tofu_tf.plan_model).")
        tuples = lambda d: {k: tuple(v) for k, v in d.items()}  # noqa: E731
        costs = lambda d: {k: CommCost(float(b), float(s)) for k, (b, s) in d.items()}  # noqa: E731
        return cls(
            method=Method(data["method"]),
            mesh_axes=tuple((str(n), int(s)) for n, s in data["mesh_axes"]),
            variable_layouts=tuples(data["variable_layouts"]),
            input_layouts=tuples(data["input_layouts"]),
            tensor_layouts=tuples(data["tensor_layouts"]),
            partial_tensors=tuples(data["partial_tensors"]),
            op_strategies=tuples(data["op_strategies"]),
            comm_by_collective=costs(data["comm_by_collective"]),
            comm_by_layer=costs(data["comm_by_layer"]),
            memory=MemoryReport.from_dict(data["memory"]),
            search_seconds=float(data["search_seconds"]),
            hardware=data["hardware"],
            objective=Objective(data["objective"]),
            memory_budget_bytes=data.get("memory_budget_bytes"),
            proved_optimal=data.get("proved_optimal"),
            notes=tuple(data.get("notes", ())),
            compute_seconds=float(data.get("compute_seconds", 0.0)),
            target=str(data.get("target", "dtensor")),
        )

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        return cls.from_dict(json.loads(text))


def format_bytes(nbytes: float) -> str:
    """Bytes in the largest binary unit that keeps the number >= 1 (for messages)."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(nbytes) >= size:
            return f"{nbytes / size:.2f} {unit}"
    return f"{nbytes:.0f} B"


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:,.1f}"


# The summary's name columns grow to the longest name shown, up to this; a longer
# name keeps its distinctive tail ("...", then its last characters).
_NAME_COLUMN_MAX = 80


def _name_width(names) -> int:
    return min(max(len(name) for name in names), _NAME_COLUMN_MAX)


def _row(name: str, width: int, cells: str) -> str:
    """One summary row: the name in a column ``width`` wide, two spaces, then ``cells``."""
    if len(name) > width:
        name = "..." + name[len(name) - width + 3:]
    return f"  {name:<{width}}  {cells}"


def _cost_cells(cost: CommCost) -> str:
    return f"{_mib(cost.bytes):>12} {cost.seconds * 1e3:>10.3f}"


def _layout_text(layout: tuple) -> str:
    return "(" + ", ".join("-" if a is None else a for a in layout) + ")"
