"""Checks of a partition plan that is handed in rather than searched: every problem named.

A plan given to ``TofuStrategy(plan=...)`` may be a file written by another
version, edited by hand, or made for another model. DTensor and Keras do not
say when such a plan is wrong: a layout entry matching no variable, or one of
the wrong rank, leaves that variable replicated without a word (keras-hub#2810
shipped MoE weights 100% replicated that way), and an unknown mesh axis fails
deep inside DTensor. So a plan is checked in three places, each as early as
what it checks is known:

* **the plan itself** (``plan_problems``), when the strategy adopts it and
  before any variable exists: the mesh (names, sizes, product equal to the
  device count) and every variable and input layout (entries are mesh axis
  names or None, each axis at most once, every axis in the mesh);
* **each variable** (``variable_problem``), as it is created: a variable the
  plan names must have the layout's rank, and every split dim must divide;
* **what the plan names but no variable took** (``unmatched_entries``), once
  the model's first step has made every variable: entries that split a tensor
  but matched nothing mean the plan was written for other names.

Problems are collected, not raised one at a time, so one error lists them all.
This module owns the checks and their wording; it reads plain data (mappings
and tuples) and imports no TensorFlow. Reading plans from JSON is
``tofu_tf.plan``'s; applying them is the strategy's.

One conflict is not checked here: a weight dim and the batch on the same mesh
axis. DTensor trains most such layouts exactly (a row or a column split of one
Dense kernel on the batch axis matched one device on the tests' MLP), and the
pair it refuses (a column split feeding a row split, both on the batch axis:
"output layout of Relayout op after layout propagation does not match", at the
first step) depends on which layers feed which, which a plan does not record.
"""

from __future__ import annotations

import math
from typing import Iterable, Mapping, Sequence

from tofu_tf.errors import TofuError

# The attributes the strategy reads from a plan; a ``tofu_tf.Plan`` has more.
PLAN_ATTRIBUTES = ("mesh_shape", "variable_layouts", "input_layouts")


class PlanError(TofuError, ValueError):
    """A plan that cannot be used as given. ``problems`` lists each reason, one line each."""

    # Raised while Keras' first step is traced: TF's autograph would re-create the error as a
    # StagingError with its own trace in the message; this marker (TF's own, see its
    # op_selector.UnliftableError) lets it through unchanged.
    ag_pass_through = True

    def __init__(self, message: str, problems: Sequence[str] = ()):
        super().__init__(message)
        self.problems = tuple(problems)


def raise_problems(problems: Sequence[str], what: str, fix: str) -> None:
    """Raise one ``PlanError`` listing every problem (nothing when there are none)."""
    if not problems:
        return
    lines = "\n".join(f"  - {problem}" for problem in problems)
    count = f"{len(problems)} problem{'s' if len(problems) > 1 else ''}"
    raise PlanError(f"{what} cannot be used ({count}):\n{lines}\n{fix}", problems)


def mesh_text(mesh_sizes: Mapping[str, int]) -> str:
    return "(" + ", ".join(f"{name}={size}" for name, size in mesh_sizes.items()) + ")"


def mesh_problems(axes: Sequence, field: str = "mesh_axes") -> list[str]:
    """Problems with a mesh given as (name, size) pairs: names unique strings, sizes positive ints."""
    problems, seen = [], set()
    for entry in axes:
        if not isinstance(entry, (list, tuple)) or len(entry) != 2:
            problems.append(f"{field}: {entry!r} is not a [name, size] pair")
            continue
        name, size = entry
        if not isinstance(name, str) or not name:
            problems.append(f"{field}: axis name {name!r} is not a non-empty string")
        elif name in seen:
            problems.append(f"{field}: axis {name!r} appears twice; axis names are unique")
        seen.add(name)
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            problems.append(f"{field}: axis {name!r} has size {size!r}; sizes are positive integers")
    return problems


def layout_problems(field: str, name: str, layout, mesh_sizes: Mapping[str, int] | None) -> list[str]:
    """Problems with one layout: a sequence of mesh axis names or None, each axis at most once.

    ``mesh_sizes`` None (the mesh itself is broken) skips the check that axes exist."""
    where = f"{field}[{name!r}]"
    if isinstance(layout, (str, bytes)) or not isinstance(layout, Sequence):
        return [f"{where}: {layout!r} is not a layout; a layout is a list with one entry per tensor dim, "
                "each a mesh axis name or null"]
    problems, used = [], []
    for dim, axis in enumerate(layout):
        if axis is None:
            continue
        if not isinstance(axis, str):
            problems.append(f"{where}: dim {dim} is {axis!r}; entries are mesh axis names or null")
            continue
        if mesh_sizes is not None and axis not in mesh_sizes:
            problems.append(f"{where}: dim {dim} names axis {axis!r}, which is not in mesh "
                            f"{mesh_text(mesh_sizes)}")
        if axis in used:
            problems.append(f"{where}: axis {axis!r} splits two dims of {tuple(layout)}; DTensor splits one "
                            "dim per mesh axis")
        used.append(axis)
    return problems


def layouts_problems(field: str, layouts, mesh_sizes: Mapping[str, int] | None) -> list[str]:
    """``layout_problems`` for every entry of a mapping name -> layout."""
    if not isinstance(layouts, Mapping):
        return [f"{field}: {type(layouts).__name__} is not a mapping from names to layouts"]
    problems = []
    for name, layout in layouts.items():
        if not isinstance(name, str):
            problems.append(f"{field}: key {name!r} is not a string")
        problems.extend(layout_problems(field, str(name), layout, mesh_sizes))
    return problems


def plan_problems(plan, num_devices: int) -> list[str]:
    """Everything wrong with a plan-like object for a strategy on ``num_devices`` devices.

    Reads only ``mesh_shape``, ``variable_layouts`` and ``input_layouts``, so hand-written
    plan objects are checked as a ``tofu_tf.Plan`` is."""
    missing = [name for name in PLAN_ATTRIBUTES if not hasattr(plan, name)]
    if missing:
        return [f"the plan has no {name!r}" for name in missing]
    mesh_shape = plan.mesh_shape
    if not isinstance(mesh_shape, Mapping):
        return [f"mesh_shape: {mesh_shape!r} is not a mapping from axis names to sizes"]
    problems = mesh_problems(list(mesh_shape.items()), "mesh_shape")
    mesh_sizes = None if problems else dict(mesh_shape)
    if mesh_sizes is not None and math.prod(mesh_sizes.values()) != num_devices:
        problems.append(
            f"mesh_shape: mesh {mesh_text(mesh_sizes)} has {math.prod(mesh_sizes.values())} devices and the "
            f"strategy has {num_devices}; the axis sizes must multiply to {num_devices} (or pass "
            f"num_gpus={math.prod(mesh_sizes.values())})")
    problems.extend(layouts_problems("variable_layouts", plan.variable_layouts, mesh_sizes))
    problems.extend(layouts_problems("input_layouts", plan.input_layouts, mesh_sizes))
    return problems


def check_plan(plan, num_devices: int) -> None:
    """Raise a ``PlanError`` naming every problem ``plan_problems`` finds."""
    raise_problems(plan_problems(plan, num_devices), "the plan",
                   "Fix those entries, or plan the model again (tofu_tf.plan_model, or TofuStrategy without plan=).")


def variable_problem(path: str, shape: Sequence[int], layout: Sequence, mesh_sizes: Mapping[str, int]) -> str | None:
    """Why the plan's ``layout`` cannot lay out the variable at ``path`` of ``shape`` (None: it can)."""
    shape = tuple(shape)
    layout = tuple(layout)
    start = f"plan layout {layout} for variable {path!r} of shape {shape} is not legal on mesh {mesh_text(mesh_sizes)}"
    if len(layout) != len(shape):
        return (f"{start}: it has {len(layout)} entries and the variable has rank {len(shape)} "
                f"(one entry per dim). Give {path!r} a layout of {len(shape)} entries, or re-plan the model.")
    for dim, (extent, axis) in enumerate(zip(shape, layout)):
        if axis is None:
            continue
        if axis not in mesh_sizes:
            return f"{start}: axis {axis!r} is not in the mesh. Name an axis of the mesh, or re-plan the model."
        if extent % mesh_sizes[axis]:
            return (f"{start}: dim {dim} ({extent}) does not divide evenly over mesh axis {axis!r} of size "
                    f"{mesh_sizes[axis]}; a split dim must divide evenly. Leave dim {dim} unsplit (null), "
                    "or re-plan the model.")
    return None


class EntryLedger:
    """Which of a plan's variable entries the variables took, as they are made.

    The strategy records each variable's plan name (``took``); once the model's first
    training step has made every variable, ``problems`` names the entries that split a
    tensor and that no variable took, and the model's weights no entry matched."""

    def __init__(self, layouts: Mapping[str, Sequence]):
        self.layouts = layouts
        self.taken: set[str] = set()
        self.shapes: dict[str, tuple] = {}     # plan name -> shape, every variable recorded
        self.names: dict[int, str] = {}        # id of a variable -> its plan name

    def took(self, variable, path: str, shape) -> None:
        self.shapes[path] = tuple(shape)
        self.names[id(variable)] = path
        if path in self.layouts:
            self.taken.add(path)

    def problems(self, weights: Sequence | None = None) -> list[str]:
        """One line per lost entry (none: the plan was applied as written). ``weights``: the
        model's variables, to name the ones no entry matched (default: every variable)."""
        unmatched = unmatched_entries(self.layouts, self.taken)
        if not unmatched:
            return []
        paths = list(self.shapes) if weights is None else [self.names.get(id(w)) for w in weights]
        unplanned = [path for path in dict.fromkeys(paths)
                     if path is not None and self.shapes[path] and path not in self.layouts]
        return unmatched_problems(self.layouts, unmatched, self.shapes, unplanned)


def unmatched_entries(layouts: Mapping[str, Sequence], matched: Iterable[str]) -> list[str]:
    """Plan entries that split a tensor and that no variable took, in the plan's order.

    An unmatched entry that splits nothing asks for what an unnamed variable gets anyway
    (replication), so it is no loss; planner plans carry such entries for variables Keras
    names differently from capture (``optimizer/iteration``)."""
    matched = set(matched)
    return [path for path, layout in layouts.items()
            if path not in matched and any(axis is not None for axis in layout)]


def unmatched_problems(layouts: Mapping[str, Sequence], unmatched: Sequence[str],
                       variables: Mapping[str, tuple], unplanned: Sequence[str]) -> list[str]:
    """One line per unmatched entry, naming variables whose path ends with it (and their
    shapes), then ``unplanned``, the model's weights no entry matched (the likely renames),
    largest first."""
    problems = []
    for path in unmatched:
        layout = tuple(layouts[path])
        near = [f"{name!r} of shape {shape}" for name, shape in variables.items()
                if name.endswith("/" + path) and len(shape) != len(layout)]
        hint = f"; {', '.join(near[:3])} ends with it but has another rank" if near else ""
        problems.append(f"variable_layouts[{path!r}] {layout} matches no variable of the model{hint}")
    if unplanned:
        biggest = sorted(unplanned, key=lambda name: -math.prod(variables[name]))[:10]
        more = f" and {len(unplanned) - len(biggest)} more" if len(unplanned) > len(biggest) else ""
        problems.append("weights no entry matched (they run replicated): "
                        + ", ".join(f"{name!r} {variables[name]}" for name in biggest) + more)
    return problems
