"""An independent check that a plan is legal for DTensor and consistent with its graph.

Written against the ``Plan`` and ``ir.Graph`` only -- it shares no code with
the search -- so tests can run it on whatever the search produced:

* the mesh has unique axis names and its sizes multiply to the device count;
* every variable (optimizer slots included) has a layout of its rank; every
  layout uses known axes, each axis at most once, and divides evenly;
* optimizer slots share their weight's layout, and reads of a variable carry it;
* every batch input has a layout, and every tensor layout is legal;
* a tensor is never both partial and sharded on the same axis.
"""

from __future__ import annotations

from tofu_tf import ir
from tofu_tf.errors import TofuError
from tofu_tf.mesh import LayoutError, MeshSpec, check_layout
from tofu_tf.plan import Plan


class IllegalPlanError(TofuError, ValueError):
    """A plan breaks a DTensor rule or disagrees with its graph."""


def violations(graph: ir.Graph, plan: Plan, *, num_devices: int | None = None) -> list[str]:
    found: list[str] = []
    try:
        mesh = MeshSpec(tuple(plan.mesh_axes))
    except LayoutError as error:
        return [str(error)]
    if num_devices is not None and mesh.num_devices != num_devices:
        found.append(f"mesh {mesh.text()} has {mesh.num_devices} devices, expected {num_devices}")
    for path, var in graph.variables.items():
        layout = plan.variable_layouts.get(path)
        if layout is None:
            found.append(f"variable {path} has no layout")
            continue
        _check(found, var.shape, layout, mesh, f"variable {path}")
        if var.slot_of is not None and var.shape == graph.variables[var.slot_of].shape \
                and layout != plan.variable_layouts.get(var.slot_of):
            found.append(f"slot {path} has layout {layout}, its weight {var.slot_of} has "
                         f"{plan.variable_layouts.get(var.slot_of)}")
    for op in graph.ops:
        if op.type == "Placeholder" and op.outputs and op.outputs[0] not in plan.input_layouts:
            found.append(f"input {op.outputs[0]} has no layout")
        if op.type == "ReadVariableOp" and op.outputs:
            tensor = graph.tensors[op.outputs[0]]
            if tensor.variable_path in plan.variable_layouts and \
                    plan.tensor_layouts.get(tensor.name) != plan.variable_layouts[tensor.variable_path]:
                found.append(f"read {tensor.name} of {tensor.variable_path} is laid out "
                             f"{plan.tensor_layouts.get(tensor.name)}, the variable "
                             f"{plan.variable_layouts[tensor.variable_path]}")
    for name, layout in {**plan.tensor_layouts, **plan.input_layouts}.items():
        tensor = graph.tensors.get(name)
        if tensor is None:
            found.append(f"plan lays out {name}, which is not in the graph")
            continue
        _check(found, tensor.shape, layout, mesh, f"tensor {name}")
        shared = set(plan.partial_tensors.get(name, ())) & set(a for a in layout if a is not None)
        if shared:
            found.append(f"tensor {name} is both partial and sharded on axes {sorted(shared)}")
    return found


def _check(found: list[str], shape, layout, mesh: MeshSpec, what: str) -> None:
    try:
        check_layout(shape, layout, mesh, what=what)
    except LayoutError as error:
        found.append(str(error))


def check_plan(graph: ir.Graph, plan: Plan, *, num_devices: int | None = None) -> None:
    """Raise ``IllegalPlanError`` listing every violation, or return quietly."""
    found = violations(graph, plan, num_devices=num_devices)
    if found:
        more = f" (and {len(found) - 10} more)" if len(found) > 10 else ""
        raise IllegalPlanError("illegal plan: " + "; ".join(found[:10]) + more)
