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

What DTensor runs differs from the table for two kinds: outside TPUs it lowers
an all-gather to an all-reduce of a zero-padded buffer of the gathered size, and
a reduce-scatter to an all-reduce followed by a local slice (TensorFlow's
``tensorflow/dtensor/mlir/collectives.cc``; ``bench/executed.py`` reads them in
the program it compiles). A link that runs them so
(``Link.gathers_by_all_reduce``, every built-in profile) prices both kinds as
an all-reduce of ``B``: ``2 (n-1)/n * B`` bytes in ``2 (n-1)`` steps. The kind
reported stays the relayout the plan asks for.

DTensor also combines independent all-reduces into one (its all-reduce combining
pass): the gradients' all-reduces of a step run as one or two (bench/executed.py:
the data-parallel MLP's 7 as 1, Llama's 24 as 1). On a link that pays its latency
per collective (``Link.combines_gradient_all_reduces``, the CPU profile, where that
latency is milliseconds), the step's price pays it once per collective DTensor runs
(``tofu_tf.cost.combining``); here, where one conversion is priced alone (the axis
problems), a gradient's all-reduce pays only its bytes. "A gradient" is
any tensor on the weight-gradient side of the step (``gradient_side``): a kernel
gradient summed over the batch and then reshaped (an einsum's, through
``BroadcastGradientArgs``) is all-reduced at the sum, before its reshapes, and runs
in the same combined all-reduce.
"""

from __future__ import annotations

import dataclasses
import enum
import functools

from tofu_tf import ir
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


# The kinds DTensor runs as an all-reduce on a link with ``gathers_by_all_reduce``.
_RUN_AS_ALL_REDUCE = (Collective.ALL_GATHER, Collective.REDUCE_SCATTER)


def collective_cost(kind: Collective, nbytes: float, n: int, link: Link) -> Transfer:
    runs_as = Collective.ALL_REDUCE if link.gathers_by_all_reduce and kind in _RUN_AS_ALL_REDUCE else kind
    moved = _BYTES_FACTOR[runs_as](n) * nbytes
    steps = 1 if link.latency_per_collective else _STEPS[runs_as](n)
    return Transfer(kind, moved, steps * link.latency + moved / link.bandwidth)


def gradient_side(graph: ir.Graph) -> frozenset[str]:
    """The tensors that lead to one weight gradient and nothing else: the gradients themselves
    and what only one of them is made of (a kernel gradient's ``Sum`` over the batch, the
    reshapes after it). The all-reduces of such tensors are independent of one another, so
    DTensor's combining pass runs them as one (``bench/executed.py``: BERT's data-parallel step,
    45 all-reduces expressed, 1 run, most at a ``Sum`` two reshapes before its gradient). The
    backward signal, which leads to every earlier layer's gradients, is not on this side: an
    all-reduce of it comes before theirs."""
    many = None                                     # reaches more than one gradient
    reach: dict[str, object] = {}                   # tensor -> the one gradient it reaches, or many
    only: dict[str, bool] = {}                      # tensor -> every reader leads to gradients only
    readers: dict[str, list] = {}
    for op in graph.ops:
        for name in op.inputs:
            readers.setdefault(name, []).append(op)
    for op in reversed(graph.ops):     # topological order reversed: a tensor's readers are decided first
        for name in op.outputs:
            tensor = graph.tensors.get(name)
            if tensor is not None and tensor.role is ir.Role.GRADIENT:
                reach[name], only[name] = name, True
                continue
            outputs = [out for reader in readers.get(name, ()) for out in reader.outputs]
            reached = {reach.get(out, many) for out in outputs}
            reach[name] = reached.pop() if len(reached) == 1 else many
            only[name] = bool(outputs) and all(only.get(out, False) for out in outputs)
    return frozenset(name for name, gradient in reach.items() if gradient is not many and only[name])


@functools.lru_cache(maxsize=1 << 16)
def transfer(src: TensorSplit, dst: TensorSplit, nbytes: float, n: int, link: Link) -> Transfer | None:
    """The collective (with bytes and seconds) that converts ``src`` to ``dst``
    for a tensor of ``nbytes`` on an axis of ``n`` devices; None when free."""
    if n <= 1 or nbytes <= 0:
        return None
    kind = collective_for(src, dst)
    return None if kind is None else collective_cost(kind, nbytes, n, link)


def transfer_seconds(src: TensorSplit, dst: TensorSplit, nbytes: float, n: int, link: Link, *,
                     gradient: bool = False) -> float:
    """Seconds of ``transfer``; ``gradient``: the tensor is a gradient the optimizer reads, whose
    all-reduce on a link that combines them (``combines_gradient_all_reduces``) pays no latency of
    its own (the step's one combined all-reduce pays it once: ``StepPricer``) but the copy of its
    bytes into and out of the combined buffer (``Link.combine_copy_bandwidth``); where that copy
    costs more than the latency, the latency (the step's price runs all-reduces one by one where
    that is cheaper: ``tofu_tf.cost.combining``)."""
    moved = transfer(src, dst, nbytes, n, link)
    if moved is None:
        return 0.0
    if gradient and link.combines_gradient_all_reduces and moved.kind is Collective.ALL_REDUCE:
        latency = collective_cost(Collective.ALL_REDUCE, 0.0, n, link).seconds
        packing = 0.0 if link.combine_copy_bandwidth is None else nbytes / link.combine_copy_bandwidth
        return moved.seconds - latency + min(latency, packing)
    return moved.seconds

