"""Partition strategies of one op, derived from its description.

This module owns Tofu's analysis: given a bound ``Description`` and the number
of parts ``P`` of one mesh axis, which ways of splitting the op are legal.
It reads descriptions only -- never op types -- and imports no TensorFlow.

A strategy splits exactly one index ``v`` of the description into ``P``
contiguous blocks of ``size(v) / P`` (sizes not divisible by ``P`` are not
split), and every device computes the op on its block. For each tensor the
analysis asks how the coordinates it touches move when ``v`` moves from one
block to the next (a shift of ``delta = size(v) / P``):

* a dim whose coordinate does not move is *invariant*: every part touches
  the same coordinates of it (the dim is not split);
* a dim whose coordinate moves by exactly one block of the dim
  (``coef * delta * P == dim size``) and whose first part stays inside the
  first block is *split*: part ``p`` touches only block ``p``. An affine
  window ``h*s + r*d - pad`` passes only without halo (``pad == 0`` and a
  window no longer than its stride); a reshape digit only where the split
  commutes with the reshape;
* anything else (a halo, a shifted slice, a dim that moves with one access
  and not with another, two dims moving) makes ``v`` unsplittable.

A tensor is then ``S(dim)`` when one dim is split, replicated when all are
invariant. An output that does not carry ``v`` is *partial* when ``v`` is one
of its top-level reduction indices (partition-n-reduce; a product does not
split), replicated when its expression does not involve ``v``. The
replicate-all strategy is always first.
"""

from __future__ import annotations

import enum

from tofu_tf.errors import TofuError
from tofu_tf.semantics.language import Affine, Description, Digit, Gathered, Use, Whole
from tofu_tf.semantics.strategy import REPLICATED, OpStrategy, TensorSplit, replicate_all


class _Dim(enum.Enum):
    INVARIANT = "invariant"
    SPLIT = "split"
    FAIL = "fail"


class _Unsplittable(TofuError):
    """Raised inside the analysis of one index; never escapes this module."""


def derive(desc: Description, num_parts: int) -> tuple[OpStrategy, ...]:
    """Every legal strategy of ``desc`` on a mesh axis of ``num_parts`` devices,
    replicate-all first."""
    if not isinstance(num_parts, int) or num_parts < 1:
        raise ValueError(f"num_parts must be a positive int (a mesh axis size), got {num_parts!r}")
    base = replicate_all(len(desc.inputs), len(desc.outputs))
    if num_parts == 1 or desc.replicated is not None:
        return (base,)
    found = [base]
    seen = {((), ())}  # strategies by their non-replicated entries (cheap to hash)
    extent = dict(desc.sizes)
    accesses = _tensor_accesses(desc)
    readers, writers = _users(desc, accesses)
    for index, size in desc.sizes:
        if index in desc.fixed or size % num_parts or size < num_parts:
            continue
        try:
            strategy, key = _split(desc, accesses, readers.get(index, ()), writers.get(index, ()), extent,
                                   index, size // num_parts, num_parts)
        except _Unsplittable:
            continue
        if key not in seen:
            seen.add(key)
            found.append(strategy)
    return tuple(found)


def _tensor_accesses(desc: Description):
    """Per input: every access, the variable updates included."""
    per_input = [list(d.accesses) for d in desc.inputs]
    for position, access in desc.updates:
        per_input[position].append(access)
    return per_input


def _users(desc: Description, accesses):
    """Index -> the inputs that read it and the outputs that carry or reduce it,
    so each index looks only at its own tensors (an IdentityN has hundreds)."""
    readers: dict[str, list[int]] = {}
    writers: dict[str, list[int]] = {}
    for position, (d, per) in enumerate(zip(desc.inputs, accesses)):
        if d.use in (Use.DATA, Use.SHAPE_ONLY):
            for name in {n for access in per for dim in access for n in dim.indices()}:
                readers.setdefault(name, []).append(position)
    for position, out in enumerate(desc.outputs):
        if out.use is Use.DATA:
            names = {n for dim in out.access for n in dim.indices()} | {n for n, _ in out.reduce}
            for name in names:
                writers.setdefault(name, []).append(position)
    return readers, writers


def _split(desc, accesses, readers, writers, extent, index, delta, parts):
    first = dict(extent)
    first[index] = delta
    in_splits = [(i, _input_split(accesses[i], desc.input_shapes[i], index, delta, parts, first)) for i in readers]
    out_splits = [(k, _output_split(desc.outputs[k], desc.output_shapes[k], index, delta, parts, first))
                  for k in writers]
    key = (tuple(sorted((i, s) for i, s in in_splits if s is not REPLICATED)),
           tuple(sorted((k, s) for k, s in out_splits if s is not REPLICATED)))
    if key == ((), ()):
        raise _Unsplittable
    inputs = [REPLICATED] * len(desc.inputs)
    for i, split in in_splits:
        inputs[i] = split
    outputs = [REPLICATED] * len(desc.outputs)
    for k, split in out_splits:
        outputs[k] = split
    partial = any(split.partial is not None for _, split in out_splits)
    return OpStrategy(f"{index}(reduce)" if partial else index, tuple(inputs), tuple(outputs)), key


def _input_split(accesses, shape, index, delta, parts, first) -> TensorSplit:
    dim = _tensor_dim(accesses, shape, index, delta, parts, first)
    return REPLICATED if dim is None else TensorSplit(dim)


def _output_split(out, shape, index, delta, parts, first) -> TensorSplit:
    dim = _tensor_dim((out.access,), shape, index, delta, parts, first)
    if dim is not None:
        return TensorSplit(dim)
    kind = out.reduce_kind(index)
    if kind is not None:
        if kind.reduction is None:
            raise _Unsplittable
        return TensorSplit(partial=kind.reduction)
    if any(index in d.indices() for d in out.access):
        raise _Unsplittable  # written at coordinates that depend on the index through data
    return REPLICATED


def _tensor_dim(accesses, shape, index, delta, parts, first) -> int | None:
    """The one dim of a tensor that ``index`` splits, None if it splits none;
    raises ``_Unsplittable`` when the accesses disagree."""
    status: list[_Dim | None] = [None] * len(shape)
    for access in accesses:
        for d, expr in enumerate(access):
            s = _dim_status(expr, index, delta, parts, shape[d], first)
            if s is _Dim.FAIL or (status[d] is not None and status[d] is not s):
                raise _Unsplittable
            status[d] = s
    split = [d for d, s in enumerate(status) if s is _Dim.SPLIT]
    if len(split) > 1:
        raise _Unsplittable
    return split[0] if split else None


def _dim_status(expr, index, delta, parts, size, first) -> _Dim:
    if isinstance(expr, (Whole, Gathered)):
        return _Dim.INVARIANT  # the whole dim (a lookup may land anywhere in it)
    if isinstance(expr, Affine):
        c = expr.coef(index)
        if c == 0:
            return _Dim.INVARIANT
        if c * delta * parts != size:
            return _Dim.FAIL
        lo, hi = expr.bounds(first)
        return _Dim.SPLIT if 0 <= lo and hi < size // parts else _Dim.FAIL
    if isinstance(expr, Digit):
        return _digit_status(expr, index, delta, parts, size, first)
    raise TypeError(f"unknown index expression {expr!r}")


def _digit_status(expr: Digit, index, delta, parts, size, first) -> _Dim:
    c = expr.base.coef(index)
    if c == 0:
        return _Dim.INVARIANT
    shift = c * delta
    if shift % expr.div:
        return _Dim.FAIL
    moved = shift // expr.div
    if expr.mod is not None:
        return _Dim.INVARIANT if moved % expr.mod == 0 else _Dim.FAIL
    if moved * parts != size:
        return _Dim.FAIL
    lo, hi = expr.base.bounds(first)
    return _Dim.SPLIT if 0 <= lo and hi // expr.div < size // parts else _Dim.FAIL
