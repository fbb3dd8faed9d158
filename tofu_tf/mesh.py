"""Device-free mesh specs and tensor layouts: the vocabulary of a plan.

This module owns what a plan says about devices *without* touching any: a
``MeshSpec`` is an ordered tuple of named axes with sizes (like JAX's
``AbstractMesh``), and a ``Layout`` says, per tensor dim, which mesh axis shards
it (or ``None``). It enforces DTensor's rules -- one mesh axis per tensor dim,
each mesh axis at most once per tensor, even division -- so every layer above
can build layouts without re-checking them. It must not import TensorFlow:
lowering a spec to a real ``dtensor.Mesh`` is ``tofu_tf.tf``'s job.

Mesh shapes are searched over ordered factorizations of the device count (XLA
auto-sharding's ``try_multiple_mesh_shapes``): DTensor cannot shard one dim over
two axes, so "split dim 0 four ways" must be one axis of size 4. Beyond one host
the search keeps to meshes that follow the hosts (``host_aligned_factorizations``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Iterator, Sequence

from tofu_tf.errors import TofuError

AxisName = str
# One entry per tensor dim: the mesh axis sharding that dim, or None.
Layout = tuple


class LayoutError(TofuError, ValueError):
    """A layout breaks one of DTensor's rules for the given mesh and shape."""


@dataclasses.dataclass(frozen=True)
class MeshSpec:
    """An ordered mesh of named axes, e.g. ``MeshSpec((("batch", 2), ("model", 4)))``."""

    axes: tuple[tuple[AxisName, int], ...]

    def __post_init__(self):
        names = [name for name, _ in self.axes]
        if len(set(names)) != len(names):
            raise LayoutError(f"mesh axis names must be unique, got {names}")
        for name, size in self.axes:
            if not isinstance(size, int) or size < 1:
                raise LayoutError(f"mesh axis {name!r} has size {size!r}; sizes are positive ints")

    @classmethod
    def from_user_input(cls, value) -> "MeshSpec":
        """Normalize a dict ``{"batch": 2, "model": 4}``, a sequence of sizes
        ``(2, 4)`` (axes named ``a0, a1, ...``) or a ``MeshSpec``."""
        if isinstance(value, MeshSpec):
            return value
        if isinstance(value, dict):
            return cls(tuple((str(k), int(v)) for k, v in value.items()))
        if isinstance(value, (tuple, list)) and all(isinstance(v, int) for v in value):
            return cls(tuple((f"a{i}", int(v)) for i, v in enumerate(value)))
        raise LayoutError(
            f"cannot read a mesh shape from {value!r}: pass a dict axis name -> size, "
            "a tuple of sizes, or a MeshSpec")

    @property
    def names(self) -> tuple[AxisName, ...]:
        return tuple(name for name, _ in self.axes)

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(size for _, size in self.axes)

    @property
    def num_devices(self) -> int:
        return math.prod(self.sizes)

    def size(self, name: AxisName) -> int:
        for axis, size in self.axes:
            if axis == name:
                return size
        raise LayoutError(f"mesh axis {name!r} is not in mesh {self.text()}")

    def as_dict(self) -> dict[AxisName, int]:
        return dict(self.axes)

    def text(self) -> str:
        return "(" + ", ".join(f"{n}={s}" for n, s in self.axes) + ")"


def ordered_factorizations(n: int) -> list[tuple[int, ...]]:
    """Every ordered factorization of ``n`` into factors > 1 (``n=1`` gives ``[()]``).

    Order matters: the recursive search applies axes one at a time, and DTensor
    places the first axis outermost (the slowest-varying device index)."""
    if n < 1:
        raise LayoutError(f"device count must be positive, got {n}")
    return list(_factorizations(n))


def host_aligned_factorizations(n: int, devices_per_node: int, *, max_axes_across: int = 2,
                                max_axes: int = 3) -> list[tuple[int, ...]]:
    """The mesh shapes whose axes each stay inside a host or span whole hosts.

    Every ordered factorization of ``n`` devices grows about linearly with ``n`` (512 of
    1024), and the search solves one axis problem per distinct prefix of them. On ``n``
    devices of ``devices_per_node`` per host this keeps the meshes a cluster's topology
    suggests: up to ``max_axes_across`` outer axes over the hosts (what hybrid systems put
    there: data parallel, and one more split) followed by the ordered factorizations of a
    host's devices, at most ``max_axes`` axes in all, plus the one axis over all devices
    (data parallel's and Megatron's mesh). Their prefixes grow with the logarithm of the
    host count, not with ``n``. No axis then mixes links: each is priced on the host's
    link or the network's.
    Within one host (``n <= devices_per_node``), or where hosts do not divide ``n``, every
    ordered factorization is kept."""
    if n <= devices_per_node or n % devices_per_node:
        return ordered_factorizations(n)
    inner = ordered_factorizations(devices_per_node)
    shapes = [outer + host for outer in ordered_factorizations(n // devices_per_node)
              if len(outer) <= max_axes_across for host in inner if len(outer) + len(host) <= max_axes]
    return list(dict.fromkeys(shapes + [(n,)]))


def _factorizations(n: int) -> Iterator[tuple[int, ...]]:
    if n == 1:
        yield ()
        return
    for first in range(2, n + 1):
        if n % first == 0:
            for rest in _factorizations(n // first):
                yield (first,) + rest


def replicated(rank: int) -> Layout:
    return (None,) * rank


def shard_shape(shape: Sequence[int], layout: Layout, mesh: MeshSpec) -> tuple[int, ...]:
    """The per-device shape of a tensor of ``shape`` under ``layout``."""
    return tuple(d // mesh.size(a) if a is not None else d for d, a in zip(shape, layout))


def check_layout(shape: Sequence[int], layout: Layout, mesh: MeshSpec, *, what: str = "tensor") -> None:
    """Raise ``LayoutError`` unless ``layout`` is legal for DTensor on ``mesh``."""
    if len(layout) != len(shape):
        raise LayoutError(f"{what}: layout {layout} has {len(layout)} entries for rank-{len(shape)} shape {tuple(shape)}")
    used = [a for a in layout if a is not None]
    if len(set(used)) != len(used):
        raise LayoutError(f"{what}: layout {layout} uses a mesh axis twice; DTensor shards one dim per axis")
    for dim, (extent, axis) in enumerate(zip(shape, layout)):
        if axis is None:
            continue
        size = mesh.size(axis)
        if extent % size:
            raise LayoutError(
                f"{what}: dim {dim} of shape {tuple(shape)} ({extent}) does not divide evenly over "
                f"mesh axis {axis!r} of size {size}; leave that dim unsplit")
