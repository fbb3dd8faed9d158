"""How one operator can be split along one mesh axis: the contract between
operator semantics (which derive strategies) and the search (which picks one
per op).

A strategy says, for each input and output of the op, which tensor dim is
split across the axis's devices (``dim``), or that the tensor is whole on
every device (``dim=None``), or -- for outputs only -- that every device holds
a *partial* value that must still be reduced (``partial=...``), Tofu's
"partition-n-reduce". Nothing here knows about costs or TF.
"""

from __future__ import annotations

import dataclasses
import enum
import functools


class Reduction(enum.Enum):
    """How partial values combine into the full one."""

    SUM = "sum"
    MAX = "max"
    MIN = "min"
    MEAN = "mean"  # the full value is the mean of equal-sized parts' values (all-reduce, then / n)


@dataclasses.dataclass(frozen=True)
class TensorSplit:
    """One tensor under a strategy: split on ``dim``, replicated (``dim=None``),
    or partial (``partial`` set, ``dim=None``)."""

    dim: int | None = None
    partial: Reduction | None = None

    def __post_init__(self):
        if self.partial is not None and self.dim is not None:
            raise ValueError("a partial tensor is not also split: give dim=None with partial")

    @property
    def replicated(self) -> bool:
        return self.dim is None and self.partial is None

    def text(self) -> str:
        if self.partial is not None:
            return f"partial({self.partial.value})"
        return "R" if self.dim is None else f"S{self.dim}"


REPLICATED = TensorSplit()


@dataclasses.dataclass(frozen=True)
class OpStrategy:
    """One legal way to run an op on the devices of one mesh axis.

    ``name`` says which index of the op's description is split (``"i"``,
    ``"k(reduce)"``, ``"replicate"``); ``inputs``/``outputs`` are one
    ``TensorSplit`` per op input/output, in the op's order.
    """

    name: str
    inputs: tuple[TensorSplit, ...]
    outputs: tuple[TensorSplit, ...]

    @functools.cached_property
    def divides_work(self) -> bool:
        """Whether any tensor is split or partial, i.e. the axis's devices share the op's
        work. Every per-axis problem asks this per op, option and earlier axis, and
        strategies are shared objects (cached per op signature), so it is kept here."""
        return any(not s.replicated for s in (*self.inputs, *self.outputs))

    def text(self) -> str:
        ins = ",".join(s.text() for s in self.inputs)
        outs = ",".join(s.text() for s in self.outputs)
        return f"{self.name}: ({ins})->({outs})"


def replicate_all(num_inputs: int, num_outputs: int) -> OpStrategy:
    """The strategy every op has: each device computes the whole op."""
    return OpStrategy("replicate", (REPLICATED,) * num_inputs, (REPLICATED,) * num_outputs)
