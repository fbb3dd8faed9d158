"""The frozen form of an operator description: what ``tofu_tf.semantics.tdl``
programs reduce to and what strategy derivation reads.

This module owns the data model of the description language -- index
expressions per tensor dim (``Affine``, ``Digit``, ``Whole``, ``Gathered``),
per-tensor uses, reductions, the bound ``Description`` -- and its one-line
text form, Shardy style::

    ([i, k],[k, j])->([i, j]) {i=8, j=16, k=8} sum(k)

Marks in that text: ``[..]|[..]`` the accesses of one input, ``&`` a
variable's value read through a resource handle, ``#`` metadata (shapes,
axes), ``~`` only the input's static shape is read, ``_`` backend workspace,
``$1[b, s]`` a coordinate read from input 1 (a lookup), ``:`` a whole dim.
After the extents: the reductions by kind (``sum(k)``), indices that must not
be split (``fixed(r)``), variables the op writes (``update(0:[i, j])``).

Nothing here knows particular ops, strategies or TensorFlow.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Mapping

from tofu_tf.errors import TofuError
from tofu_tf.semantics.strategy import Reduction


class DescriptionError(TofuError, ValueError):
    """A program does not describe the op it was traced for (wrong arity, rank,
    missing index size ...). The message names the op and what to change."""


# -- the frozen description ------------------------------------------------------

class ReduceKind(enum.Enum):
    """How a reduction combines elements; partial results combine the same way
    (``reduction``), except a product, which tofu_tf does not split."""

    SUM = "sum"
    MEAN = "mean"
    MAX = "max"
    MIN = "min"
    PROD = "prod"

    @property
    def reduction(self) -> Reduction | None:
        return _REDUCTIONS.get(self)


_REDUCTIONS = {ReduceKind.SUM: Reduction.SUM, ReduceKind.MEAN: Reduction.MEAN,
               ReduceKind.MAX: Reduction.MAX, ReduceKind.MIN: Reduction.MIN}


class Use(enum.Enum):
    """What an op does with one of its tensors."""

    DATA = "data"              # reads / writes its elements
    META = "meta"              # a small vector read as metadata (a shape, axes, a permutation)
    SHAPE_ONLY = "shape_only"  # reads only its static shape: any layout will do
    WORKSPACE = "workspace"    # backend scratch space shared by a forward/backward kernel pair


class MetaKind(enum.Enum):
    """How a metadata input is rewritten for the op a device runs on its part."""

    STATIC = "static"                  # used as is (axes, permutations, paddings of unsplit dims)
    OUTPUT_SHAPE = "output_shape"      # the shape of output 0: becomes that output's local shape
    TILE_MULTIPLES = "tile_multiples"  # local output shape / local input 0 shape, per dim


@dataclasses.dataclass(frozen=True)
class Affine:
    """``sum(coef * index) + offset``: the coordinate of a dim as a function of indices."""

    terms: tuple[tuple[str, int], ...] = ()
    offset: int = 0

    def coef(self, index: str) -> int:
        for name, c in self.terms:
            if name == index:
                return c
        return 0

    def indices(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.terms)

    @property
    def pure(self) -> str | None:
        """The index when this is exactly one index (``i``), else None."""
        if self.offset == 0 and len(self.terms) == 1 and self.terms[0][1] == 1:
            return self.terms[0][0]
        return None

    def bounds(self, extent: Mapping[str, int]) -> tuple[int, int]:
        """Inclusive range of values when each index runs over ``[0, extent)``."""
        lo = hi = self.offset
        for name, c in self.terms:
            top = c * (extent[name] - 1)
            lo, hi = (lo + top, hi) if c < 0 else (lo, hi + top)
        return lo, hi

    def text(self) -> str:
        parts = []
        for name, c in self.terms:
            term = name if abs(c) == 1 else f"{name}*{abs(c)}"
            sign = "-" if c < 0 else ("+" if parts else "")
            parts.append(sign + term)
        if self.offset or not parts:
            parts.append(f"{self.offset:+d}" if parts else str(self.offset))
        return "".join(parts)


@dataclasses.dataclass(frozen=True)
class Digit:
    """``(base // div) % mod`` (``mod=None``: no modulo): one dim of a reshaped
    or tiled tensor, as a digit of a flat affine position."""

    base: Affine
    div: int = 1
    mod: int | None = None

    def indices(self) -> tuple[str, ...]:
        return self.base.indices()

    def text(self) -> str:
        base = self.base.text()
        if len(self.base.terms) + (1 if self.base.offset else 0) > 1:
            base = f"({base})"
        if self.div != 1:
            base += f"//{self.div}"
        if self.mod is not None:
            base += f"%{self.mod}"
        return base


@dataclasses.dataclass(frozen=True)
class Whole:
    """The whole dim, ``:``: every element of it is read."""

    def indices(self) -> tuple[str, ...]:
        return ()

    def text(self) -> str:
        return ":"


@dataclasses.dataclass(frozen=True)
class Gathered:
    """A data-dependent coordinate: the value of input ``source`` at ``at``."""

    source: int
    at: tuple["DimExpr", ...]

    def indices(self) -> tuple[str, ...]:
        return tuple(name for dim in self.at for name in dim.indices())

    def text(self) -> str:
        return f"${self.source}[{', '.join(d.text() for d in self.at)}]"


DimExpr = Affine | Digit | Whole | Gathered
Access = tuple[DimExpr, ...]


def _access_text(access: Access) -> str:
    return "[" + ", ".join(d.text() for d in access) + "]"


@dataclasses.dataclass(frozen=True)
class InputDesc:
    """One input: how the op uses it and every access to its elements."""

    use: Use
    accesses: tuple[Access, ...] = ()
    meta: MetaKind | None = None
    variable: bool = False  # a resource handle: accesses are to the variable's value

    def text(self) -> str:
        if self.use is Use.META:
            return "#"
        if self.use is Use.WORKSPACE:
            return "_"
        if self.use is Use.SHAPE_ONLY:
            return "~"
        body = "|".join(_access_text(a) for a in self.accesses) or "*"
        return ("&" if self.variable else "") + body


@dataclasses.dataclass(frozen=True)
class OutputDesc:
    """One output: the coordinates it is written at and the indices it reduces over."""

    use: Use
    access: Access = ()
    reduce: tuple[tuple[str, ReduceKind], ...] = ()

    def reduce_kind(self, index: str) -> ReduceKind | None:
        for name, kind in self.reduce:
            if name == index:
                return kind
        return None

    def text(self) -> str:
        if self.use is Use.META:
            return "#"
        if self.use is Use.WORKSPACE:
            return "_"
        return _access_text(self.access)


@dataclasses.dataclass(frozen=True)
class Description:
    """What one op computes, bound to its static shapes: the unit strategy
    derivation works on. ``sizes`` lists every index with its extent (output
    indices first); ``fixed`` indices must not be split; ``updates`` are the
    variables the op writes (input position, coordinates written);
    ``replicated`` (a reason) marks an op described only as "run it whole"."""

    inputs: tuple[InputDesc, ...]
    outputs: tuple[OutputDesc, ...]
    input_shapes: tuple[tuple[int, ...], ...]
    output_shapes: tuple[tuple[int, ...], ...]
    sizes: tuple[tuple[str, int], ...] = ()
    fixed: frozenset[str] = frozenset()
    updates: tuple[tuple[int, Access], ...] = ()
    replicated: str | None = None
    hidden: frozenset[str] = frozenset()  # indices of shape-only inputs, left out of the text
    shape_attrs: tuple[tuple[str, int], ...] = ()  # (attribute, output) pairs: attrs stating an output's shape

    @property
    def size_of(self) -> dict[str, int]:
        return dict(self.sizes)

    def text(self) -> str:
        ins = ",".join(t.text() for t in self.inputs)
        outs = ",".join(t.text() for t in self.outputs)
        head = f"({ins})->({outs})"
        if self.replicated is not None:
            return f"{head} replicated({self.replicated})"
        shown = [(n, s) for n, s in self.sizes if n not in self.hidden]
        text = head + " {" + ", ".join(f"{n}={s}" for n, s in shown) + "}"
        order = [n for n, _ in self.sizes]
        for kind in ReduceKind:
            names = {name for out in self.outputs for name, k in out.reduce if k is kind}
            if names:
                text += f" {kind.value}({','.join(n for n in order if n in names)})"
        if self.fixed:
            text += f" fixed({','.join(n for n in order if n in self.fixed)})"
        for position, access in self.updates:
            text += f" update({position}:{_access_text(access)})"
        return text

    def __str__(self) -> str:
        return self.text()


def replicated(num_inputs: int, num_outputs: int, reason: str, *,
               input_shapes=None, output_shapes=None) -> Description:
    """The conservative description: the op runs whole on every device."""
    return Description(
        inputs=(InputDesc(Use.META),) * num_inputs, outputs=(OutputDesc(Use.META),) * num_outputs,
        input_shapes=tuple(input_shapes or ((),) * num_inputs),
        output_shapes=tuple(output_shapes or ((),) * num_outputs), replicated=reason)
