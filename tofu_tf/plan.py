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
JSON is versioned; loading another version raises with the remedy. Loading
checks every field and names every problem in one ``PlanError``
(``tofu_tf.plan_check``): a plan file may be edited by hand or written for
another model, and a layout that does not read must not be dropped silently.
``read_plan`` takes what a user passes as ``TofuStrategy(plan=...)``.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import os
from typing import Mapping

from tofu_tf.cost.memory import MemoryReport
from tofu_tf.executed import ExecutedFigures, comparison_rows
from tofu_tf.plan_check import (PLAN_ATTRIBUTES, PlanError, layouts_problems, mesh_problems,
                                raise_problems)

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


class PlanVersionError(PlanError):
    """Plan JSON written by another version of tofu_tf."""


@dataclasses.dataclass(frozen=True)
class CommCost:
    """Bytes sent and seconds spent per device per step, one collective kind or layer."""

    bytes: float
    seconds: float


@dataclasses.dataclass(frozen=True)
class Plan:
    """A partition plan: a mesh, a DTensor layout for every tensor of the step, the modeled cost.

    ``plan_model`` and ``plan_graph`` make it and ``TofuStrategy(plan=...)`` trains with it.
    It is frozen and reads back from its JSON (``to_json``, ``from_json``), so a plan can be
    searched once, inspected or edited, and reused. A layout is a tuple with one entry per dim
    of the tensor: the name of the mesh axis that dim is split over, or None where it is whole.

    Attributes:
        method: The search that made the plan (``Method``).
        mesh_axes: ``(name, size)`` of each mesh axis, outermost first.
        variable_layouts: Keras variable path (optimizer slots included) -> layout.
        input_layouts: Batch input tensor -> layout.
        tensor_layouts: Every tensor of the step -> the layout its op produces it in.
        partial_tensors: Tensor -> the mesh axes over which it is held as partial sums that a
            later collective reduces.
        op_strategies: Op -> the name of its partition strategy on each mesh axis.
        comm_by_collective: Collective kind -> ``CommCost`` per device per step.
        comm_by_layer: Keras layer -> ``CommCost`` per device per step.
        memory: The modeled peak per device and what makes it up (``MemoryReport``).
        search_seconds: Wall-clock seconds the search took.
        hardware: The name of the hardware profile that priced the plan.
        objective: What the search minimized (``Objective``).
        memory_budget_bytes: The budget asked for; None when the hardware's memory was used.
        proved_optimal: For "ilp", whether HiGHS proved the plan optimal; None otherwise.
        notes: Remarks a person should read, such as variables kept replicated because no dim
            divides a mesh axis.
        compute_seconds: Modeled compute seconds per step.
        target: "dtensor" (layouts DTensor runs) or "ideal" (Tofu's whole space).
        pinned_variables: Weight paths whose layouts a layout map fixed (their optimizer slots
            follow); the summary marks them.
        executed: What DTensor compiled for a training step under this plan, when it was
            measured (``tofu-plan --measure``); the summary and the page show it beside the
            modeled figures. None until measured.
        all_reduces_combined: Whether the training step was priced with DTensor combining its
            all-reduces into one per run (True) or running them one by one (False), whichever
            the cost model found cheaper (``tofu_tf.cost.combining``); TofuStrategy compiles the
            training step so. None where the hardware prices no combining (GPU links) or nothing
            combines: DTensor's default then.
        packing_seconds: Of the all-reduces' modeled seconds, those of copying the combined
            ones into and out of their one buffer (0 where none are combined).

    Example:
        >>> import tofu_tf
        >>> from tofu_tf import models
        >>> plan = tofu_tf.plan_model(models.mlp(width=1024), num_devices=8, batch_size=32)
        >>> plan.num_devices
        8
        >>> len(plan.variable_layouts["dense_0/kernel"])   # an axis name or None per dim
        2
    """

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
    pinned_variables: tuple[str, ...] = ()
    executed: ExecutedFigures | None = None
    all_reduces_combined: bool | None = None
    packing_seconds: float = 0.0

    # -- what other components read ----------------------------------------
    @property
    def mesh_shape(self) -> dict[str, int]:
        return dict(self.mesh_axes)

    def _pinned(self, path: str) -> bool:
        """Whether a layout map fixed ``path``'s layout (a weight, or a slot named after it)."""
        return any(path == weight or path.endswith("/" + weight) for weight in self.pinned_variables)

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

    @property
    def all_reduces_combining(self) -> str | None:
        """How the training step runs its all-reduces, in words (None: DTensor's default, unpriced)."""
        if self.all_reduces_combined is None:
            return None
        if self.all_reduces_combined:
            return f"combined, as DTensor does by default (packing them: {self.packing_seconds * 1e3:.3f} ms)"
        return "one by one: packing them into DTensor's combined all-reduce costs more than the latencies it saves"

    # -- for people ----------------------------------------------------------
    def summary(self, *, top: int = 10) -> str:
        """The plan as a table a person reads in a terminal.

        The mesh, the modeled step time, communication and peak memory (with its parts and
        the budget), how long the search took, the collectives, the layers that communicate
        most, the first variables' layouts and the notes.

        Args:
            top: How many layers, variables and notes to list.

        Returns:
            The table, lines joined by newlines.

        Example:
            >>> print(plan.summary(top=3))  # doctest: +ELLIPSIS
            Plan (tofu, objective time) on mesh ...
        """
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
        if self.all_reduces_combining is not None:
            lines.append(f"  all-reduces     {self.all_reduces_combining}")
        collectives = sorted(self.comm_by_collective.items(), key=lambda kv: -kv[1].seconds)
        layers = sorted(self.comm_by_layer.items(), key=lambda kv: -kv[1].seconds)[:top]
        layer_header = f"layer (top {top})"
        width = _name_width(["collective", layer_header] + [name for name, _ in collectives + layers])
        lines.append(_row("collective", width, f"{'MiB':>12} {'ms':>10}"))
        lines.extend(_row(kind, width, _cost_cells(cost)) for kind, cost in collectives)
        lines.extend(self._executed_lines())
        lines.append(_row(layer_header, width, f"{'MiB':>12} {'ms':>10}"))
        lines.extend(_row(layer, width, _cost_cells(cost)) for layer, cost in layers)
        variables = list(self.variable_layouts.items())[:top]
        width = _name_width(["variable"] + [path for path, _ in variables])
        lines.append(_row("variable", width, "layout"))
        lines.extend(_row(path, width, _layout_text(layout) + ("  (layout map)" if self._pinned(path) else ""))
                     for path, layout in variables)
        if len(self.variable_layouts) > top:
            lines.append(f"  ... and {len(self.variable_layouts) - top} more variables")
        lines.extend(f"  note: {note}" for note in self.notes[:top])
        return "\n".join(lines)

    def _executed_lines(self) -> list[str]:
        """The measured figures beside the modeled ones (nothing before a measurement)."""
        if self.executed is None:
            return []
        memory = self.memory
        rows = comparison_rows(self.executed, {k: c.bytes for k, c in self.comm_by_collective.items()},
                               memory.weight_bytes + memory.optimizer_slot_bytes)
        width = _name_width(["executed (measured)"] + [row[0] for row in rows])
        lines = [_row("executed (measured)", width, f"{'ops':>5} {'MiB':>12} {'modeled MiB':>12} {'gap':>6}")]
        lines.extend(_row(what, width, f"{count:>5} {done / 2**20:>12,.3f} {modeled / 2**20:>12,.3f} {gap:>6.0%}")
                     for what, count, done, modeled, gap in rows)
        return lines

    def to_html(self, path, *, graph=None, comparison=None) -> None:
        """Write the plan's page to ``path``: one self-contained HTML file, no network needed.

        The page (``tofu_tf.plan_report``) shows the mesh, memory per device by role against
        the budget, communication by collective kind and by layer, and the layouts by layer.

        Args:
            path: The file to write (a str or path-like); it is replaced if it exists.
            graph: The captured step the plan was made for; with it, the layouts by layer
                name the activations (the plan alone does not say which tensors are).
            comparison: Method name -> another plan of the same step to compare with, or a
                str saying why that method gave none.

        Raises:
            OSError: ``path`` cannot be written.

        Example:
            >>> plan.to_html("plan.html")
        """
        from tofu_tf import plan_report
        plan_report.write_html(self, path, graph=graph, comparison=comparison)

    def to_png(self, path, *, comparison=None) -> None:
        """Draw memory per device by role against the budget, and communication by layer, as a PNG.

        Args:
            path: The PNG file to write (a str or path-like).
            comparison: Method name -> another plan of the same step, drawn beside this one in
                the memory chart (a str, for a method that gave no plan, is left out).

        Raises:
            tofu_tf.plan_report.PlotUnavailableError: matplotlib, which draws the chart, is not
                installed (``pip install 'tofu_tf[plot]'``); ``to_html`` needs nothing.
            OSError: ``path`` cannot be written.

        Example:
            >>> plan.to_png("plan.png")
        """
        from tofu_tf import plan_report
        plan_report.write_png(self, path, comparison=comparison)

    def _repr_html_(self) -> str:
        from tofu_tf import plan_report
        return plan_report.html_fragment(self)

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
            "pinned_variables": list(self.pinned_variables),
            "compute_seconds": self.compute_seconds,
            "target": self.target,
            "all_reduces_combined": self.all_reduces_combined,
            "packing_seconds": self.packing_seconds,
            **({} if self.executed is None else {"executed": self.executed.to_dict()}),
        }

    def to_json(self, **json_kwargs) -> str:
        """The plan as JSON text, which ``from_json`` reads back equal.

        The text carries ``PLAN_VERSION``, so a later tofu_tf refuses it with the remedy
        instead of misreading it.

        Args:
            **json_kwargs: Passed on to ``json.dumps``, e.g. ``indent=2``.

        Returns:
            The JSON text of ``to_dict()``.

        Example:
            >>> text = plan.to_json(indent=2)
            >>> tofu_tf.Plan.from_json(text) == plan
            True
        """
        return json.dumps(self.to_dict(), **json_kwargs)

    @classmethod
    def from_dict(cls, data: Mapping, *, source: str = "plan JSON") -> "Plan":
        """The plan ``to_dict`` wrote. Every problem (a missing or unknown field, a value of
        the wrong kind, a layout naming an axis the mesh lacks) is named in one ``PlanError``;
        ``source`` says where the data came from in that message (a file's path)."""
        if not isinstance(data, Mapping):
            raise PlanError(f"{source} is a {type(data).__name__}, not a plan: a plan is the JSON object "
                            "Plan.to_json() writes.")
        if data.get("version") != PLAN_VERSION:
            raise PlanVersionError(
                f"{source} has version {data.get('version')!r}; this tofu_tf reads version "
                f"{PLAN_VERSION}. Plan the model again with this version (tofu_tf.plan_model).")
        fields, problems = _read_fields(data)
        raise_problems(problems, source, "Fix those fields (Plan.to_json() writes every field), or plan the "
                                         "model again (tofu_tf.plan_model).")
        return cls(**fields)

    @classmethod
    def from_json(cls, text: str, *, source: str = "plan JSON") -> "Plan":
        """The plan in JSON text written by ``to_json``, every field checked.

        A plan may have been edited by hand or written for another model, so every problem
        (invalid JSON, a missing or unknown field, a value of the wrong kind, a layout naming
        an axis the mesh lacks) is reported, all at once, instead of being dropped.

        Args:
            text: The JSON text.
            source: What the text is, as the error messages name it (a file's path).

        Returns:
            The ``Plan``.

        Raises:
            tofu_tf.PlanError: The text is not JSON, not a JSON object, or has fields that do
                not read; the message lists each problem.
            tofu_tf.plan.PlanVersionError: The text has another plan version, or none (a
                ``PlanError``); plan the model again.

        Example:
            >>> tofu_tf.Plan.from_json(plan.to_json()) == plan
            True
        """
        try:
            data = json.loads(text)
        except json.JSONDecodeError as error:
            raise PlanError(f"{source} is not valid JSON: {error.msg} at line {error.lineno} column "
                            f"{error.colno}. Write it with Plan.to_json().") from None
        return cls.from_dict(data, source=source)

    @classmethod
    def from_file(cls, path) -> "Plan":
        """The plan in the JSON file at ``path``, read with ``from_json``.

        Args:
            path: A file holding ``to_json()`` text (a str or path-like), UTF-8.

        Returns:
            The ``Plan``.

        Raises:
            OSError: The file cannot be opened (``FileNotFoundError`` when it does not exist).
            tofu_tf.PlanError: Its text does not read as a plan; the message names the file
                and each problem (``PlanVersionError`` for another plan version).

        Example:
            >>> import pathlib
            >>> _ = pathlib.Path("plan.json").write_text(plan.to_json())
            >>> tofu_tf.Plan.from_file("plan.json") == plan
            True
        """
        with open(path, encoding="utf-8") as handle:
            return cls.from_json(handle.read(), source=f"plan file {os.fspath(path)!r}")


def read_plan(value):
    """What ``TofuStrategy(plan=...)`` was given, as a plan: a ``Plan`` as it is; a dict
    (``Plan.to_dict()``), JSON text or the path of a JSON file read with ``Plan.from_dict``
    (every problem named); any other object with ``mesh_shape``, ``variable_layouts`` and
    ``input_layouts`` (a plan written by hand) as it is, for ``plan_check.check_plan``."""
    if isinstance(value, Plan):
        return value
    if isinstance(value, Mapping):
        return Plan.from_dict(value, source="the plan dict")
    if isinstance(value, str) and value.lstrip().startswith("{"):
        return Plan.from_json(value)
    if isinstance(value, (str, os.PathLike)):
        if not os.path.isfile(value):
            raise PlanError(f"plan={os.fspath(value)!r} is neither plan JSON text (an object, starting with "
                            "'{') nor the path of an existing file. Pass Plan.to_json() text, a path to a file "
                            "holding it, its dict, or the Plan.")
        return Plan.from_file(value)
    missing = [name for name in PLAN_ATTRIBUTES if not hasattr(value, name)]
    if missing:
        raise PlanError(f"plan= got a {type(value).__name__}, which has no {', '.join(missing)}. Pass a "
                        "tofu_tf.Plan, its JSON text, a path to a JSON file holding it, its dict (Plan.to_dict()), "
                        "or an object with mesh_shape, variable_layouts and input_layouts.")
    return value


# -- reading plan JSON: each field checked, every problem kept -------------------------------

def _required_fields() -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(Plan)
                 if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)


def _read_fields(data: Mapping) -> tuple[dict, list[str]]:
    """Plan's constructor arguments from ``data`` and the problems found reading them."""
    names = [f.name for f in dataclasses.fields(Plan)]
    problems = [f"missing field {name!r}" for name in _required_fields() if name not in data]
    unknown = [key for key in data if key not in names and key != "version"]
    if unknown:
        problems.append(f"unknown field{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}; "
                        f"a plan's fields are version, {', '.join(names)}")
    fields: dict = {}
    mesh_sizes = None
    if "mesh_axes" in data:
        axes = data["mesh_axes"]
        found = (mesh_problems(axes) if isinstance(axes, (list, tuple))
                 else [f"mesh_axes: {axes!r} is not a list of [name, size] pairs"])
        problems.extend(found)
        if not found:
            fields["mesh_axes"] = tuple((name, size) for name, size in axes)
            mesh_sizes = dict(fields["mesh_axes"])
    for name in ("variable_layouts", "input_layouts", "tensor_layouts", "partial_tensors"):
        if name in data:
            # Axes are checked against the mesh only when the mesh itself reads (mesh_sizes).
            found = layouts_problems(name, data[name], mesh_sizes)
            problems.extend(found)
            if not found:
                fields[name] = {key: tuple(layout) for key, layout in data[name].items()}
    readers = {
        "method": _enum(Method), "objective": _enum(Objective), "op_strategies": _strategies,
        "comm_by_collective": _costs, "comm_by_layer": _costs, "memory": _memory,
        "search_seconds": _number, "compute_seconds": _number, "hardware": _text, "target": _text,
        "memory_budget_bytes": _optional(_integer), "proved_optimal": _optional(_boolean), "notes": _notes,
        "pinned_variables": _notes, "executed": _optional(ExecutedFigures.from_dict),
        "all_reduces_combined": _optional(_boolean), "packing_seconds": _number,
    }
    for name, read in readers.items():
        if name not in data:
            continue
        try:
            fields[name] = read(data[name])
        except ValueError as error:
            problems.append(f"{name}: {error}")
    return fields, problems


def _enum(kind):
    def read(value):
        try:
            return kind(value)
        except ValueError:
            raise ValueError(f"{value!r} is not one of {', '.join(repr(m.value) for m in kind)}") from None
    return read


def _number(value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{value!r} is not a number")
    return float(value)


def _integer(value) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{value!r} is not an integer")
    return value


def _boolean(value) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{value!r} is not true or false")
    return value


def _text(value) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{value!r} is not a string")
    return value


def _optional(read):
    return lambda value: None if value is None else read(value)


def _mapping(value) -> Mapping:
    if not isinstance(value, Mapping):
        raise ValueError(f"{type(value).__name__} is not a mapping")
    return value


def _strategies(value) -> dict[str, tuple]:
    out = {}
    for op, names in _mapping(value).items():
        if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
            raise ValueError(f"op {op!r}: {names!r} is not a list of strategy names")
        out[op] = tuple(names)
    return out


def _costs(value) -> dict[str, CommCost]:
    out = {}
    for name, cost in _mapping(value).items():
        if not isinstance(cost, (list, tuple)) or len(cost) != 2:
            raise ValueError(f"{name!r}: {cost!r} is not a [bytes, seconds] pair")
        out[name] = CommCost(_number(cost[0]), _number(cost[1]))
    return out


def _memory(value) -> MemoryReport:
    names = [f.name for f in dataclasses.fields(MemoryReport)]
    value = _mapping(value)
    missing = [name for name in names if name not in value]
    unknown = [key for key in value if key not in names]
    if missing or unknown:
        raise ValueError(", ".join([f"missing {name!r}" for name in missing] + [f"unknown {key!r}" for key in unknown])
                         + f" (a memory report has {', '.join(names)})")
    try:
        return MemoryReport.from_dict(value)
    except (TypeError, ValueError) as error:
        raise ValueError(f"top_contributors is not a list of [name, bytes] pairs ({error})") from None


def _notes(value) -> tuple[str, ...]:
    if not isinstance(value, (list, tuple)) or not all(isinstance(n, str) for n in value):
        raise ValueError(f"{value!r} is not a list of strings")
    return tuple(value)


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
