"""Per-layer memory statistics: the only input the pipeline partitioner needs.

This module owns ``LayerStats`` -- what one layer of a sequential model costs in
memory (and, for the time-balanced baseline, in compute) -- and the checks that
turn user numbers into trusted ones. It knows nothing about stages, schedules or
search; it imports no TensorFlow, so statistics can come from a profiler run,
from an analytic estimate, or be typed in by hand.

Two kinds of figure are accepted, following the memory-centric partitioners
(mCAP, Euro-Par'22; CAPSlog, PDP'24):

* analytic: ``state_bytes`` (weights + gradients + optimizer slots),
  ``activation_bytes`` (what one micro-batch keeps for the backward pass) and
  ``transient_bytes`` (the working peak of the layer's own forward/backward),
  and, optional, ``workspace_bytes`` (the largest scratch buffer one of its
  kernels allocates beside the graph's tensors, such as a convolution's
  im2col buffer; 0 by default);
* measured: ``isolated_bytes`` (peak of a stage holding this layer alone) and
  ``added_bytes`` (how much the peak grows when the layer is appended to a
  stage), both for one micro-batch in flight.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from typing import Iterable

_BYTE_FIELDS = ("state_bytes", "activation_bytes", "transient_bytes", "param_count",
                "workspace_bytes")
_OPTIONAL_BYTE_FIELDS = ("isolated_bytes", "added_bytes")


@dataclasses.dataclass(frozen=True)
class LayerStats:
    """Memory (and compute) figures of one layer of a sequential model.

    Example:
        >>> layer = LayerStats(name="block_0", state_bytes=16 << 20,
        ...                    activation_bytes=4 << 20, transient_bytes=1 << 20)
        >>> layer.is_measured
        False
    """

    name: str
    state_bytes: int
    activation_bytes: int
    transient_bytes: int
    param_count: int = 0
    compute_seconds: float = 0.0
    isolated_bytes: int | None = None
    added_bytes: int | None = None
    workspace_bytes: int = 0

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"LayerStats name must be a non-empty string, got {self.name!r}")
        for field in _BYTE_FIELDS:
            object.__setattr__(self, field, self._count(field, getattr(self, field)))
        for field in _OPTIONAL_BYTE_FIELDS:
            value = getattr(self, field)
            if value is not None:
                object.__setattr__(self, field, self._count(field, value))
        object.__setattr__(self, "compute_seconds", self._seconds(self.compute_seconds))

    @property
    def is_measured(self) -> bool:
        """True when both profiled figures (isolated and added) are present."""
        return self.isolated_bytes is not None and self.added_bytes is not None

    def _count(self, field: str, value) -> int:
        if isinstance(value, bool):
            raise TypeError(f"layer {self.name!r}: {field} must be an integer, got {value!r}")
        try:
            count = operator.index(value)
        except TypeError:
            raise TypeError(
                f"layer {self.name!r}: {field} must be an integer, got {value!r}") from None
        if count < 0:
            raise ValueError(f"layer {self.name!r}: {field} must be >= 0, got {count}")
        return int(count)

    def _seconds(self, value) -> float:
        try:
            seconds = float(value)
        except (TypeError, ValueError):
            raise TypeError(
                f"layer {self.name!r}: compute_seconds must be a number, got {value!r}") from None
        if not math.isfinite(seconds) or seconds < 0:
            raise ValueError(
                f"layer {self.name!r}: compute_seconds must be finite and >= 0, got {value!r}")
        return seconds


def validate_chain(stats: Iterable[LayerStats]) -> tuple[LayerStats, ...]:
    """The layers as a tuple, checked: non-empty, all ``LayerStats``, unique names."""
    chain = tuple(stats)
    if not chain:
        raise ValueError("stats is empty: a pipeline needs at least one layer")
    for index, layer in enumerate(chain):
        if not isinstance(layer, LayerStats):
            raise TypeError(
                f"stats[{index}] is {type(layer).__name__}, expected LayerStats")
    if len({layer.name for layer in chain}) < len(chain):
        _raise_duplicate(chain)
    return chain


def _raise_duplicate(chain: tuple[LayerStats, ...]) -> None:
    seen: dict[str, int] = {}
    for index, layer in enumerate(chain):
        if layer.name in seen:
            raise ValueError(
                f"duplicate layer name {layer.name!r} at positions {seen[layer.name]} "
                f"and {index}; give every layer a unique name")
        seen[layer.name] = index
