"""Layouts the user fixes before the search: an expert's layout map as constraints.

A layout map (keras-hub's ``get_layout_map``, a tf-keras ``LayoutMap``) names, per
weight, which mesh axis splits which dim. ``plan_graph(pinned_layouts=...)`` keeps
exactly those layouts and searches everything else (the other weights, activations,
where relayouts go) with the same cost model. Per mesh axis, a pinned weight's group
(the weight with its optimizer slots, one layout) may take only the split its layout
gives on that axis, so the pin is a restriction of the search problem, as the
baselines are (``tofu_tf.search.baselines``).

Every pin is checked before any search: the variable exists, the layout has its rank,
names only the mesh's axes, each at most once, each dividing its dim, and the target
can run it (DTensor cannot split a weight it needs replicated). An embedding table's
rows, which DTensor's gather cannot read split, are stored split as the map says and
read whole. A layout the map gives is never replaced silently.
"""

from __future__ import annotations

from typing import Callable, Mapping

from tofu_tf import ir
from tofu_tf.errors import TofuError
from tofu_tf.mesh import MeshSpec
from tofu_tf.search.coarsen import GraphIndex, NodeId, NodeKind
from tofu_tf.search.problem import Option
from tofu_tf.semantics.strategy import REPLICATED, TensorSplit

Layout = tuple  # per dim, a mesh axis name or None


class PinError(TofuError, ValueError):
    """A fixed layout that cannot be planned: every problem, one per line."""

    def __init__(self, problems: list[str]):
        self.problems = tuple(problems)
        super().__init__("the layout map cannot be planned:\n  " + "\n  ".join(problems))


def check_pins(graph: ir.Graph, pinned: Mapping[str, Layout], mesh: MeshSpec, *,
               replicated_only: frozenset[str] = frozenset()) -> None:
    """Raise ``PinError`` naming every pin that cannot be laid out on ``mesh``.

    ``replicated_only`` is what the lowering target cannot split at all
    (``targets.pinned_variables``). A table a gather reads may be pinned with split rows:
    DTensor's gather cannot read it so, and the lowering stores it split and reads it whole
    (an all-gather per read; ``tofu_tf.tf.lowering.Lowered.read_layouts``)."""
    variables = {v.path: v for v in graph.variables.values()}
    sizes = dict(mesh.axes)
    problems = []
    for path, layout in pinned.items():
        variable = variables.get(path)
        if variable is None:
            problems.append(f"{path}: no variable of the model has this path")
            continue
        layout = tuple(layout)
        where = f"{path} {tuple(variable.shape)}: layout {layout}"
        if len(layout) != len(variable.shape):
            problems.append(f"{where} has {len(layout)} entries for a rank-{len(variable.shape)} variable")
            continue
        named = [axis for axis in layout if axis is not None]
        unknown = [axis for axis in named if axis not in sizes]
        if unknown:
            problems.append(f"{where} names {', '.join(map(repr, unknown))}, not an axis of the mesh "
                            f"{mesh.text()}")
            continue
        if len(set(named)) != len(named):
            problems.append(f"{where} splits two dims on one mesh axis")
            continue
        for dim, axis in enumerate(layout):
            if axis is not None and variable.shape[dim] % sizes[axis]:
                problems.append(f"{where}: dim {dim} ({variable.shape[dim]}) does not divide over {axis!r} "
                                f"({sizes[axis]} devices)")
        if named and path in replicated_only:
            problems.append(f"{where}: DTensor runs this variable only replicated (a convolution filter, or a "
                            "weight its ops cannot split); drop its entry")
    if problems:
        raise PinError(problems)


def pin_restriction(index: GraphIndex, pinned: Mapping[str, Layout], axis: str
                    ) -> Callable[[NodeId, Option], bool]:
    """On mesh axis ``axis``: a pinned weight's group takes the split its layout gives there."""
    wanted: dict[str, TensorSplit] = {}
    for key, group in index.groups.items():
        for path in group.paths:
            if path in pinned:
                layout = tuple(pinned[path])
                wanted[key] = TensorSplit(layout.index(axis)) if axis in layout else REPLICATED

    def allowed(node: NodeId, option: Option) -> bool:
        split = wanted.get(node.name) if node.kind is NodeKind.VARIABLE else None
        return split is None or option.var_split == split
    return allowed


def both(first, second):
    """Options both restrictions keep (None: no restriction)."""
    if first is None or second is None:
        return first or second
    return lambda node, option: first(node, option) and second(node, option)


def check_kept(pinned: Mapping[str, Layout], variable_layouts: Mapping[str, Layout]) -> None:
    """Raise ``PinError`` where a plan does not hold a pinned layout (the search found no
    option with it on some axis: the weight's ops cannot run split that way)."""
    problems = [f"{path}: the map's layout {tuple(layout)} cannot be kept (the plan could only give "
                f"{tuple(variable_layouts.get(path, ()))}: no way to run its ops with that split)"
                for path, layout in pinned.items()
                if tuple(variable_layouts.get(path, (None,) * len(layout))) != tuple(layout)]
    if problems:
        raise PinError(problems)
