"""How much memory one pipeline stage needs: the stage model.

This module owns the answer to "what is the peak of stage r of p if it holds
layers [i, j)?" under a pipeline schedule, in three forms that must agree:

* ``stage_peak_bytes`` -- the reference, plain Python over ``LayerStats``;
* ``StageCostModel.peaks`` -- the same numbers, vectorised with numpy, for the
  search in ``tofu_tf.pipeline.partition``;
* ``LinearForm`` -- the per-layer sums the search's greedy probes scan.

It does not choose boundaries (that is ``partition``) and imports no TensorFlow.

The model. Stage r (0-based) of p keeps ``k_r`` micro-batches in flight:
``k_r = min(m, p - r)`` under 1F1B (the first stage runs p forwards before its
first backward) and ``k_r = m`` under GPipe (all forwards before any backward).

* Analytic figures (any layer of the stage lacks measurements)::

      peak(r, i, j) = sum_{l in [i,j)} state_l
                    + k_r * sum_{l in [i,j)} activation_l
                    + max_{l in [i,j)} transient_l

* Measured figures (every layer of the stage has ``isolated_bytes`` and
  ``added_bytes``), mCAP's predictor plus the schedule's extra micro-batches::

      peak(r, i, j) = isolated_i + sum_{l in (i,j)} added_l
                    + (k_r - 1) * sum_{l in [i,j)} activation_l

  The profiled figures already contain one micro-batch of activations (the
  one inside the profiling run), so only the ``k_r - 1`` others are added.

Embedding, LM head and loss are layers like any other: whatever stage holds
them pays for them, so first/last-stage extras need no special case.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
from typing import Sequence

import numpy as np

from tofu_tf.pipeline.stats import LayerStats, validate_chain

# Every stage peak must fit int64 with room to spare; the search adds and
# compares peaks in numpy int64.
_MAX_TOTAL_BYTES = 1 << 62


class Schedule(enum.Enum):
    """Pipeline schedule; decides how many micro-batches each stage keeps alive."""

    ONE_F_ONE_B = "1f1b"
    GPIPE = "gpipe"

    @classmethod
    def from_user(cls, value: "Schedule | str") -> "Schedule":
        """``value`` as a ``Schedule``; accepts the enum or its string ("1f1b", "gpipe")."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            for schedule in cls:
                if schedule.value == value.strip().lower():
                    return schedule
        allowed = ", ".join(repr(s.value) for s in cls)
        raise ValueError(f"unknown schedule {value!r}; expected one of {allowed}")


def check_pipeline_shape(num_stages: int, num_microbatches: int) -> None:
    """Raise if the stage or micro-batch count is not a positive integer."""
    for label, value in (("num_stages", num_stages), ("num_microbatches", num_microbatches)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{label} must be an integer >= 1, got {value!r}")


def inflight_microbatches(stage_index: int, num_stages: int, schedule: "Schedule | str",
                          num_microbatches: int) -> int:
    """Micro-batches whose activations stage ``stage_index`` keeps at its peak.

    >>> [inflight_microbatches(r, 4, "1f1b", 8) for r in range(4)]
    [4, 3, 2, 1]
    >>> inflight_microbatches(0, 4, "gpipe", 8)
    8
    """
    schedule = Schedule.from_user(schedule)
    check_pipeline_shape(num_stages, num_microbatches)
    if not 0 <= stage_index < num_stages:
        raise ValueError(
            f"stage_index {stage_index} out of range for {num_stages} stages")
    return _inflight(stage_index, num_stages, schedule, num_microbatches)


def _inflight(stage_index: int, num_stages: int, schedule: Schedule, num_microbatches: int) -> int:
    if schedule is Schedule.GPIPE:
        return int(num_microbatches)
    return int(min(num_microbatches, num_stages - stage_index))


def stage_peak_bytes(stats: Sequence[LayerStats], start: int, stop: int, stage_index: int,
                     num_stages: int, schedule: "Schedule | str", num_microbatches: int) -> int:
    """Peak bytes of stage ``stage_index`` of ``num_stages`` holding ``stats[start:stop]``."""
    if not 0 <= start < stop <= len(stats):
        raise ValueError(
            f"stage layers [{start}, {stop}) are not a non-empty range of {len(stats)} layers")
    inflight = inflight_microbatches(stage_index, num_stages, schedule, num_microbatches)
    layers = stats[start:stop]
    activations = sum(layer.activation_bytes for layer in layers)
    if all(layer.is_measured for layer in layers):
        added = sum(layer.added_bytes for layer in layers[1:])
        return layers[0].isolated_bytes + added + (inflight - 1) * activations
    state = sum(layer.state_bytes for layer in layers)
    transient = max(layer.transient_bytes for layer in layers)
    return state + inflight * activations + transient


@dataclasses.dataclass(frozen=True)
class LinearForm:
    """A stage cost that a greedy probe can accumulate layer by layer.

    ``cost(r, i, j) = sum_{l in [i,j)} (base_l + multiplier_r * activation_l)
    + offset_i + max_{l in [i,j)} transient_l``.
    """

    base: tuple[int, ...]
    activation: tuple[int, ...]
    offset: tuple[int, ...]
    transient: tuple[int, ...]
    multiplier: tuple[int, ...]  # one per stage index

    @functools.cached_property
    def arrays(self) -> "FormArrays":
        """The same figures as numpy arrays (prefix sums where the search sums ranges)."""
        return FormArrays.of(self)


@dataclasses.dataclass(frozen=True, eq=False)
class FormArrays:
    """A ``LinearForm`` in numpy: ``base`` and ``activation`` as prefix sums (entry
    i sums layers ``[0, i)``), ``offset`` per layer, the transients' range maxima
    (None when all are 0) and the multipliers."""

    base: np.ndarray
    activation: np.ndarray
    offset: np.ndarray
    transient_max: "RangeMax | None"
    multiplier: np.ndarray

    @classmethod
    def of(cls, form: LinearForm) -> "FormArrays":
        return cls(base=_prefix(form.base), activation=_prefix(form.activation),
                   offset=np.fromiter(form.offset, np.int64, len(form.offset)),
                   transient_max=RangeMax.of(form.transient),
                   multiplier=np.asarray(form.multiplier, dtype=np.int64))


@dataclasses.dataclass(frozen=True, eq=False)
class StageCostModel:
    """Vectorised stage peaks for one chain under one schedule and micro-batch count.

    ``monotone`` is True when a stage's peak never drops as it gains layers
    (always for analytic figures; for measured ones when
    ``isolated_{l-1} + added_l >= isolated_l``). Peaks never grow with the stage
    index, since ``k_r`` does not. ``exact_form`` is the stage cost as a
    ``LinearForm`` when the chain is all analytic or all measured (else None);
    ``bound_form`` is a monotone ``LinearForm`` that never exceeds the true peak.
    Derived tables are built on first use.
    """

    chain: tuple[LayerStats, ...] = dataclasses.field(repr=False)
    num_stages: int
    inflight: tuple[int, ...]

    @classmethod
    def build(cls, stats: Sequence[LayerStats], num_stages: int, schedule: "Schedule | str",
              num_microbatches: int) -> "StageCostModel":
        return cls.for_chain(validate_chain(stats), num_stages, schedule, num_microbatches)

    @classmethod
    def for_chain(cls, chain: tuple[LayerStats, ...], num_stages: int,
                  schedule: "Schedule | str", num_microbatches: int) -> "StageCostModel":
        """``build`` for a chain ``validate_chain`` already returned."""
        check_pipeline_shape(num_stages, num_microbatches)
        schedule = Schedule.from_user(schedule)
        inflight = tuple(_inflight(r, num_stages, schedule, num_microbatches)
                         for r in range(num_stages))
        model = cls(chain=chain, num_stages=int(num_stages), inflight=inflight)
        _check_magnitude(model._columns, max(inflight))
        return model

    @property
    def num_layers(self) -> int:
        return len(self.chain)

    @functools.cached_property
    def _columns(self) -> "_Columns":
        return _Columns.of(self.chain)

    @functools.cached_property
    def monotone(self) -> bool:
        measured = self._columns.measured
        if not any(measured):
            return True
        iso, added = self._columns.isolated, self._columns.added
        return all(measured) and all(iso[l - 1] + added[l] >= iso[l] for l in range(1, len(iso)))

    @functools.cached_property
    def exact_form(self) -> LinearForm | None:
        measured = self._columns.measured
        if all(measured):
            return _measured_form(self._columns, self.inflight)
        if not any(measured):
            return _analytic_form(self._columns, self.inflight)
        return None

    @functools.cached_property
    def bound_form(self) -> LinearForm:
        return _bound_form(self._columns, self.inflight)

    @functools.cached_property
    def _arrays(self) -> dict:
        if any(self._columns.measured):
            return _prefix_arrays(self._columns, self.inflight)
        form = self.exact_form.arrays  # the analytic form holds the same prefix sums
        return {"inflight": np.asarray(self.inflight, dtype=np.int64), "state": form.base,
                "act": form.activation, "measured": None, "range_max": form.transient_max}

    def peaks(self, stage, start, stop) -> np.ndarray:
        """int64 peaks for broadcastable arrays of stage indices and [start, stop) ranges.

        Entries with ``stop <= start`` are meaningless (but computed safely).
        """
        arr = self._arrays
        stage = np.asarray(stage)
        start = np.asarray(start, dtype=np.int64)
        stop = np.maximum(np.asarray(stop, dtype=np.int64), start + 1)
        k = arr["inflight"][stage]
        act = arr["act"][stop] - arr["act"][start]
        analytic = arr["state"][stop] - arr["state"][start] + k * act + _range_max(arr, start, stop)
        if arr["measured"] is None:
            return analytic
        measured = arr["iso"][start] + arr["added"][stop] - arr["added"][start + 1] + (k - 1) * act
        all_measured = (arr["measured"][stop] - arr["measured"][start]) == (stop - start)
        return np.where(all_measured, measured, analytic)


@dataclasses.dataclass(frozen=True)
class _Columns:
    """The chain's figures column by column (missing measurements as 0)."""

    state: tuple[int, ...]
    activation: tuple[int, ...]
    transient: tuple[int, ...]
    isolated: tuple[int, ...]
    added: tuple[int, ...]
    measured: tuple[bool, ...]

    @classmethod
    def of(cls, chain: Sequence[LayerStats]) -> "_Columns":
        isolated = [l.isolated_bytes for l in chain]
        added = [l.added_bytes for l in chain]
        if isolated.count(None) == len(chain) and added.count(None) == len(chain):
            measured = (False,) * len(chain)  # all analytic (the common case, quickly)
        else:
            measured = tuple([i is not None and a is not None for i, a in zip(isolated, added)])
        if not all(measured):
            isolated = [x or 0 for x in isolated]
            added = [x or 0 for x in added]
        return cls(state=tuple([l.state_bytes for l in chain]),
                   activation=tuple([l.activation_bytes for l in chain]),
                   transient=tuple([l.transient_bytes for l in chain]),
                   isolated=tuple(isolated), added=tuple(added), measured=measured)


def _check_magnitude(columns: _Columns, max_inflight: int) -> None:
    total = (sum(columns.state) + sum(columns.transient) + sum(columns.isolated)
             + sum(columns.added) + max_inflight * sum(columns.activation))
    if total >= _MAX_TOTAL_BYTES:
        raise ValueError(
            f"the chain's bytes sum to {total}, beyond the 2**62 the exact search supports; "
            "express the statistics in a coarser unit (e.g. KiB)")


def _analytic_form(columns: _Columns, inflight) -> LinearForm:
    return LinearForm(base=columns.state, activation=columns.activation,
                      offset=(0,) * len(columns.state), transient=columns.transient,
                      multiplier=inflight)


def _measured_form(columns: _Columns, inflight) -> LinearForm:
    return LinearForm(
        base=columns.added, activation=columns.activation,
        offset=tuple(i - a for i, a in zip(columns.isolated, columns.added)),
        transient=(0,) * len(columns.state), multiplier=tuple(k - 1 for k in inflight))


def _bound_form(columns: _Columns, inflight) -> LinearForm:
    """sum_l (floor_l + (k_r - 1) * activation_l) <= the true peak of any stage.

    An analytic layer costs state + k * activation = (state + activation) +
    (k - 1) * activation; a measured one costs at least min(isolated, added)
    on top of its (k - 1) activations in a measured stage, and its analytic
    figure otherwise.
    """
    analytic = [s + a for s, a in zip(columns.state, columns.activation)]
    floor = tuple(min(x, i, a) if m else x for x, i, a, m
                  in zip(analytic, columns.isolated, columns.added, columns.measured))
    zeros = (0,) * len(floor)
    return LinearForm(base=floor, activation=columns.activation, offset=zeros, transient=zeros,
                      multiplier=tuple(k - 1 for k in inflight))


def _prefix(values) -> np.ndarray:
    out = np.zeros(len(values) + 1, dtype=np.int64)
    np.cumsum(np.fromiter(values, np.int64, len(values)), out=out[1:])
    return out


def _prefix_arrays(columns: _Columns, inflight) -> dict:
    arrays = {
        "inflight": np.asarray(inflight, dtype=np.int64),
        "state": _prefix(columns.state),
        "act": _prefix(columns.activation),
        "measured": None,
    }
    arrays["range_max"] = RangeMax.of(columns.transient)
    if any(columns.measured):
        arrays["measured"] = _prefix(columns.measured)
        arrays["iso"] = np.asarray(columns.isolated + (0,), dtype=np.int64)
        arrays["added"] = _prefix(columns.added)
    return arrays


@dataclasses.dataclass(frozen=True, eq=False)
class RangeMax:
    """``max(values[start:stop])`` in O(1) for arrays of ranges (a sparse table:
    row q holds ``max(values[i : i + 2**q])``)."""

    table: np.ndarray
    log2: np.ndarray

    @classmethod
    def of(cls, values) -> "RangeMax | None":
        """The table, or None when every value is 0 (every range maximum is 0)."""
        base = np.fromiter(values, np.int64, len(values))
        if not base.any():
            return None
        rows = [base]
        while (2 << (len(rows) - 1)) <= len(base):
            half = 1 << (len(rows) - 1)
            prev = rows[-1]
            row = np.zeros_like(base)
            row[: len(base) - 2 * half + 1] = np.maximum(prev[: len(base) - 2 * half + 1],
                                                         prev[half: len(base) - half + 1])
            rows.append(row)
        log2 = np.zeros(len(base) + 1, dtype=np.int64)
        log2[1:] = np.frexp(np.arange(1, len(base) + 1))[1] - 1  # floor(log2(length))
        return cls(table=np.stack(rows), log2=log2)

    def __call__(self, start, stop) -> np.ndarray:
        """Maxima over ``[start, stop)`` (``stop > start``), elementwise."""
        level = self.log2[stop - start]
        return np.maximum(self.table[level, start], self.table[level, stop - np.left_shift(1, level)])


def _range_max(arrays: dict, start: np.ndarray, stop: np.ndarray):
    table = arrays["range_max"]
    return 0 if table is None else table(start, stop)
