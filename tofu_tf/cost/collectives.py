"""The price of changing a tensor's layout on one mesh axis.

A producer emits a tensor split one way on an axis (or replicated, or partial);
a consumer needs it another way. The conversion is one collective over that
axis's devices, priced with ring-algorithm bytes (what each device sends):

=================  ==========================  =====================  =========
from -> to         collective                  bytes per device       steps
=================  ==========================  =====================  =========
partial -> R       all-reduce                  2 (n-1)/n * B          2 (n-1)
partial -> S(d)    reduce-scatter              (n-1)/n * B            n-1
S(d)    -> R       all-gather                  (n-1)/n * B            n-1
S(d)    -> S(e)    all-to-all                  (n-1)/n * B / n        n-1
R -> S, R/S -> P   local slice / zero-pad      0                      0
=================  ==========================  =====================  =========

``B`` is the tensor's bytes on a device as far as this axis is concerned (the
size it has when replicated on this axis). Seconds are ``steps * latency +
bytes / bandwidth`` of the axis's link, or ``latency + bytes / bandwidth`` on a
link that pays its latency once per collective (``Link.latency_per_collective``:
DTensor on CPU).
"""

from __future__ import annotations

import dataclasses
import enum
import functools

from tofu_tf.cost.hardware import Link
from tofu_tf.semantics.strategy import TensorSplit


class Collective(enum.Enum):
    ALL_REDUCE = "all-reduce"
    REDUCE_SCATTER = "reduce-scatter"
    ALL_GATHER = "all-gather"
    ALL_TO_ALL = "all-to-all"


@dataclasses.dataclass(frozen=True)
class Transfer:
    """One collective: its kind, bytes each device sends, and modeled seconds."""

    kind: Collective
    bytes: float
    seconds: float


def collective_for(src: TensorSplit, dst: TensorSplit) -> Collective | None:
    """The collective turning ``src`` into ``dst`` on one axis, or None if local."""
    if src.partial is not None:
        if dst.partial == src.partial:
            return None
        if dst.dim is not None:
            return Collective.REDUCE_SCATTER
        return Collective.ALL_REDUCE
    if dst.partial is not None or src.dim is None or src.dim == dst.dim:
        return None
    return Collective.ALL_GATHER if dst.dim is None else Collective.ALL_TO_ALL


_BYTES_FACTOR = {
    Collective.ALL_REDUCE: lambda n: 2 * (n - 1) / n,
    Collective.REDUCE_SCATTER: lambda n: (n - 1) / n,
    Collective.ALL_GATHER: lambda n: (n - 1) / n,
    Collective.ALL_TO_ALL: lambda n: (n - 1) / (n * n),
}
_STEPS = {
    Collective.ALL_REDUCE: lambda n: 2 * (n - 1),
    Collective.REDUCE_SCATTER: lambda n: n - 1,
    Collective.ALL_GATHER: lambda n: n - 1,
    Collective.ALL_TO_ALL: lambda n: n - 1,
}


def collective_cost(kind: Collective, nbytes: float, n: int, link: Link) -> Transfer:
    moved = _BYTES_FACTOR[kind](n) * nbytes
    steps = 1 if link.latency_per_collective else _STEPS[kind](n)
    return Transfer(kind, moved, steps * link.latency + moved / link.bandwidth)


@functools.lru_cache(maxsize=1 << 16)
def transfer(src: TensorSplit, dst: TensorSplit, nbytes: float, n: int, link: Link) -> Transfer | None:
    """The collective (with bytes and seconds) that converts ``src`` to ``dst``
    for a tensor of ``nbytes`` on an axis of ``n`` devices; None when free."""
    if n <= 1 or nbytes <= 0:
        return None
    kind = collective_for(src, dst)
    return None if kind is None else collective_cost(kind, nbytes, n, link)


def transfer_seconds(src: TensorSplit, dst: TensorSplit, nbytes: float, n: int, link: Link) -> float:
    moved = transfer(src, dst, nbytes, n, link)
    return 0.0 if moved is None else moved.seconds
