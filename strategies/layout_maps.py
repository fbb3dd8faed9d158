"""Keras layout maps as TofuStrategy's constraints: ``TofuStrategy(layout_map=...)``.

A layout map is an expert's plan for the weights: regular expressions over variable
paths, each with a layout over a named mesh (keras-hub's ``Backbone.get_layout_map``,
Keras 3's ``keras.distribution.LayoutMap``; tf-keras's
``tf_keras.dtensor.experimental.LayoutMap``). Both Keras versions leave a variable no
key matches replicated, silently, and a key that matches nothing goes unnoticed. Here
the map's mesh becomes the plan's mesh, every key must match at least one weight of
the captured step, and each matched weight is pinned to the key's layout
(``tofu_tf.search.pins``): the planner keeps those and decides the rest.

Keys match as each Keras version matches them: Keras 3 an exact path or else
``re.fullmatch``, tf-keras ``re.match`` (a prefix); a path two keys match is refused,
as Keras 3 refuses it.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Mapping

from tofu_tf.search.pins import PinError


@dataclasses.dataclass(frozen=True)
class LayoutMapSpec:
    """What TofuStrategy reads from a layout map: the mesh, and per key its layout."""

    mesh_shape: Mapping[str, int]                  # axis name -> size, in the map's order
    entries: tuple[tuple[str, tuple], ...]          # (key, per dim an axis name or None)
    fullmatch: bool                                 # Keras 3 semantics; False: tf-keras re.match

    def pinned_layouts(self, paths) -> dict[str, tuple]:
        """Each weight path's layout from the map; raises ``PinError`` for a key that matches no
        path and a path that two keys match."""
        pinned, matched_by, problems = {}, {}, []
        for key, layout in self.entries:
            hits = [path for path in paths if self._matches(key, path)]
            if not hits:
                problems.append(f"key {key!r}: matches no weight of the model (its weights are named like "
                                f"{', '.join(repr(p) for p in list(paths)[:3])})")
            for path in hits:
                if path in matched_by:
                    problems.append(f"{path}: matched by keys {matched_by[path]!r} and {key!r}; make each weight "
                                    "match one key")
                matched_by[path] = key
                pinned[path] = layout
        if problems:
            raise PinError(problems)
        return pinned

    @property
    def data_axis(self) -> str:
        """The mesh axis the batch is split over: the map's first, as Keras 3's
        ``ModelParallel`` takes it when no ``batch_dim_name`` is given."""
        return next(iter(self.mesh_shape))

    def computed_layout(self, layout: tuple) -> tuple:
        """Where a weight stored in ``layout`` is computed with: gathered over the data axis.

        keras-hub's maps split weights over the batch's axis too (``('batch', 'model')``),
        as XLA's GSPMD runs them: each weight stored split over every device, gathered over
        the data axis where it is read, its gradient reduce-scattered back (fully sharded
        data parallel). DTensor does not do that by itself: it computes with the weight as it
        is stored, and its matmul refuses a contraction split over two different axes. So the
        planner plans with the weight split as computed, and the strategy stores it as the
        map says and gathers it at each read (``TofuVariable``)."""
        return tuple(None if axis == self.data_axis else axis for axis in layout)

    def _matches(self, key: str, path: str) -> bool:
        if self.fullmatch:
            return key == path or re.fullmatch(key, path) is not None
        return re.match(key, path) is not None


def read_layout_map(layout_map) -> LayoutMapSpec:
    """A Keras 3 ``keras.distribution.LayoutMap`` or a tf-keras ``LayoutMap`` as a ``LayoutMapSpec``."""
    if hasattr(layout_map, "device_mesh"):                       # Keras 3
        mesh = layout_map.device_mesh
        entries = tuple((key, tuple(value.axes)) for key, value in layout_map.items())
        return LayoutMapSpec(dict(zip(mesh.axis_names, (int(size) for size in mesh.shape))), entries, fullmatch=True)
    if hasattr(layout_map, "get_default_mesh"):                  # tf-keras
        from tensorflow.experimental import dtensor
        mesh = layout_map.get_default_mesh()
        entries = tuple((key, tuple(None if spec == dtensor.UNSHARDED else spec for spec in value.sharding_specs))
                        for key, value in layout_map.items())
        if mesh is None and entries:
            mesh = layout_map[entries[0][0]].mesh
        if mesh is None:
            raise PinError(["the layout map has no mesh and no entry: give it one (LayoutMap(mesh=...))"])
        return LayoutMapSpec(dict(zip(mesh.dim_names, mesh.shape())), entries, fullmatch=False)
    raise TypeError(f"layout_map= takes a keras.distribution.LayoutMap or a tf_keras.dtensor.experimental.LayoutMap, "
                    f"not a {type(layout_map).__name__}")
