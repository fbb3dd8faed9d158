"""Lower a plan to DTensor: a mesh over real devices and a layout per variable
and per batch input.

A plan names mesh axes and, per tensor dim, a mesh axis or None; DTensor
wants ``dtensor.Mesh`` and ``dtensor.Layout`` objects with ``UNSHARDED`` for
None. Activations are not given layouts here: DTensor's per-op SPMD expansion
propagates them from the variables and the batch, which is what the plan's
activation layouts follow from in the first place.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence

from tensorflow.experimental import dtensor

from tofu_tf import plan_check
from tofu_tf.tf.devices import DeviceSet


@dataclasses.dataclass(frozen=True)
class Lowered:
    """The DTensor objects a strategy needs, derived once from a plan."""

    mesh: dtensor.Mesh
    variable_layouts: Mapping[str, tuple]
    batch_axis: str | None
    # Weights stored in one layout and read in another (``TofuVariable``): those a layout
    # map splits over its data axis, read gathered over it, and embedding tables it splits
    # by rows, read whole (DTensor's gather refuses split rows). Path -> read layout.
    read_layouts: Mapping[str, tuple] = dataclasses.field(default_factory=dict)

    def layout_for(self, path: str, shape) -> dtensor.Layout:
        """The planned layout of a variable; replicated when the plan does not name it.

        A layout the plan gives that cannot lay this variable out (another rank, a split dim
        its axis does not divide) raises ``PlanError`` naming the variable, its shape and the
        layout: replicating it instead would silently drop the plan's split."""
        shape = tuple(shape)
        spec = self.variable_layouts.get(path)
        if spec is None:
            return dtensor.Layout.replicated(self.mesh, rank=len(shape))
        problem = plan_check.variable_problem(path, shape, spec, dict(zip(self.mesh.dim_names, self.mesh.shape())))
        if problem is not None:
            raise plan_check.PlanError(problem, (problem,))
        return dtensor.Layout([dtensor.UNSHARDED if a is None else a for a in spec], self.mesh)

    def batch_layout(self, rank: int) -> dtensor.Layout:
        """Batch dim split on the plan's batch axis; the rest replicated."""
        if rank == 0 or self.batch_axis is None:
            return dtensor.Layout.replicated(self.mesh, rank=rank)
        return dtensor.Layout.batch_sharded(self.mesh, self.batch_axis, rank=rank)


def planned_name(path: str, layouts: Mapping[str, tuple], shape) -> str | None:
    """The plan's name for a variable made at ``path``: the path itself, or for an optimizer slot
    (``Adam/m/dense/kernel``) the suffix naming a planned variable of the same rank; None when
    the plan holds neither."""
    if path in layouts:
        return path
    parts = path.split("/")
    for start in range(1, len(parts)):
        candidate = "/".join(parts[start:])
        if candidate in layouts and len(layouts[candidate]) == len(shape):
            return candidate
    return None


def make_mesh(mesh_shape: Mapping[str, int], devices: DeviceSet) -> dtensor.Mesh:
    sizes = list(mesh_shape.values())
    total = 1
    for size in sizes:
        total *= size
    if total != devices.count:
        raise ValueError(
            f"mesh {dict(mesh_shape)} has {total} devices but {devices.count} are available "
            f"({devices.device_type}); pick a mesh whose axis sizes multiply to {devices.count}.")
    if devices.cluster.is_multi_client:
        # Global device ids run row-major over the axes, each client holding a contiguous
        # block: the last axes lie within a client, the first across clients.
        return dtensor.create_distributed_mesh(list(mesh_shape.items()), local_devices=list(devices.names),
                                               device_type=devices.device_type)
    return dtensor.create_mesh(list(mesh_shape.items()), devices=list(devices.names),
                               device_type=devices.device_type)


def lower(mesh_shape: Mapping[str, int], variable_layouts: Mapping[str, tuple],
          input_layouts: Sequence[tuple], devices: DeviceSet, *, pinned: Sequence[str] = (),
          gathered_axis: str | None = None) -> Lowered:
    """Mesh + layouts for a plan. The batch axis is the mesh axis that splits
    dim 0 of the plan's batch inputs (None when the batch is replicated).
    ``pinned``: the weights a layout map fixed (``Plan.pinned_variables``), stored as
    the map says; ``gathered_axis``: the map's data axis, which such weights are
    gathered over where they are read."""
    batch_axis = None
    for layout in input_layouts:
        if layout and layout[0] is not None:
            batch_axis = layout[0]
            break
    adjusted = dtensor_natural(variable_layouts, pinned=frozenset(pinned))
    return Lowered(mesh=make_mesh(mesh_shape, devices), variable_layouts=adjusted, batch_axis=batch_axis,
                   read_layouts=_read_layouts(adjusted, frozenset(pinned), gathered_axis))


def _read_layouts(layouts: Mapping[str, tuple], pinned: frozenset[str], gathered_axis: str | None):
    """Pinned weights read otherwise than stored: gathered over ``gathered_axis``, and an
    embedding table with split rows read whole. Slots are never read so: only updated."""
    out = {}
    for path in pinned:
        layout = layouts.get(path)
        if not layout:
            continue
        read = tuple(None if axis == gathered_axis else axis for axis in layout)
        if _is_table(path) and read[0] is not None:
            read = (None,) * len(read)
        if read != tuple(layout):
            out[path] = read
    return out


def _is_table(path: str) -> bool:
    """An embedding table, by Keras' weight name (tf-keras, Keras 3, keras-hub)."""
    return path.rsplit("/", 1)[-1] == "embeddings"


# Keras parameters that meet an activation's feature dim inside one op. DTensor
# expands such an op only when both carry the same split, and a plan may price a
# conversion between them that DTensor will not insert; these stay replicated.
_FEATURE_PARAMETERS = ("gamma", "beta", "moving_mean", "moving_variance")


def dtensor_natural(variable_layouts: Mapping[str, tuple], *, pinned: frozenset[str] = frozenset()) -> dict[str, tuple]:
    """Variable layouts DTensor's per-op expanders accept as they meet in one op.

    * a bias takes its kernel's output-dim axis (DTensor refuses a BiasAdd whose
      operands are split on different axes);
    * normalization parameters stay replicated;
    * an embedding table is not split on its vocabulary rows (DTensor's
      ResourceGather refuses a sharded dim 0), unless a layout map pinned it so
      (``pinned``): then it is stored split and read whole (``Lowered.read_layouts``).
    Slots follow their weight's adjusted layout: Keras 3 and tf-keras name them
    ``<optimizer>/<slot>/<weight path>`` (``Adam/m/dense/kernel``), tf-keras's legacy
    optimizers ``<optimizer>/<weight path>/<slot>`` (``SGD/dense/bias/momentum``). A
    legacy optimizer updates a weight and its slots in one fused op
    (``ResourceApplyKerasMomentum``), and DTensor's expander for it does not relayout
    a slot laid out otherwise than its weight: the process dies (segfault; reproducer in
    ``tests/test_dtensor_expanders.py``).
    """
    adjusted = dict(variable_layouts)
    for path, layout in variable_layouts.items():
        leaf = path.rsplit("/", 1)[-1]
        kernel = adjusted.get(path[: -len(leaf)] + "kernel")
        if leaf == "bias" and kernel and len(layout) == 1:
            adjusted[path] = (kernel[-1],)
        elif leaf in _FEATURE_PARAMETERS:
            adjusted[path] = (None,) * len(layout)
        elif _is_table(path) and layout and path not in pinned:
            adjusted[path] = (None,) + tuple(layout[1:])
    for path, layout in variable_layouts.items():
        weight = _weight_of_slot(path, layout, variable_layouts)
        if weight is not None:
            adjusted[path] = adjusted[weight]
    return adjusted


def _weight_of_slot(path: str, layout: tuple, variable_layouts: Mapping[str, tuple]) -> str | None:
    """The weight whose slot ``path`` is, by the optimizers' slot names; None for a weight."""
    parts = path.split("/")
    for candidate in ("/".join(parts[2:]), "/".join(parts[1:-1])):
        if candidate and candidate != path and len(variable_layouts.get(candidate, ())) == len(layout) \
                and candidate in variable_layouts:
            return candidate
    return None
