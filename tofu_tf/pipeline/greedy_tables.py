"""The greedy probes for monotone stage costs, vectorised over layers (no TensorFlow).

``exact_search`` bisects the min-max bound with a greedy probe: stages from the
last, each taking every layer that still fits under the bound. Scanning layer
by layer in Python costs O(layers) interpreter steps per probe. This module
computes the same probe from tables: for a bound ``B`` and a multiplier ``k``,
``first_fit[j]`` is the first layer of the longest stage ending at ``j`` within
``B``, for every ``j`` at once with numpy. The greedy then only follows one
pointer per stage (a step table through each run of stages sharing ``k``).
The left greedy that gives the windows' upper ends is computed the same way
from ``last_fit[i]``, the last end of the longest stage starting at ``i``. It
owns nothing else: the search logic and the stage costs stay in
``exact_search`` and ``stage_model``.

Why a binary search finds ``first_fit``. The cost is the ``LinearForm``
``c_k(i, j) = P_k(j) - P_k(i) + offset_i + max(transient[i:j])`` with ``P_k``
the prefix sums of ``base + k * activation``. It is monotone (never drops as
the stage grows), so ``g(i) = P_k(i) - offset_i`` never decreases with ``i``;
without transients ``c_k(i, j) <= B`` iff ``g(i) >= P_k(j) - B``, one
``searchsorted``. Transients only raise the cost, so the true first fit lies
at or after that point; only ends where the tallest transient could break
the fit are checked: a few vectorised single steps forward settle most, a
vectorised bisection the rest (``last_fit`` mirrors this).

Stages whose multiplier is rare (the last stages under 1F1B keep fewer
micro-batches each, so they are also the longest) get no table: each finds
its own start (or end) in plain Python over the same prefix sums, galloping
then bisecting, O(log) steps instead of one per layer.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from tofu_tf.pipeline.stage_model import LinearForm, RangeMax

# Single steps forward tried before the remaining ends are bisected.
_LINEAR_STEPS = 4


@dataclasses.dataclass(frozen=True)
class GreedyOutcome:
    """The right greedy's starts and what the bisection needs from them."""

    starts: list[int]        # first layer of each stage of the piece
    peak: int                # largest stage cost
    first_cost: int          # cost of the first stage (what is left over)
    next_bound: int          # smallest cost above the bound met (a stage one layer longer,
                             # or a forced single layer); inf if none


class GreedyTables:
    """Prefix sums of one monotone ``LinearForm`` and the probes built on them."""

    def __init__(self, form: LinearForm, shared: set[int], inf: int):
        self.form = form
        self.inf = inf
        arrays = form.arrays
        self.base = arrays.base
        self.activation = arrays.activation
        self.offset = arrays.offset
        self.multiplier = arrays.multiplier
        self.range_max: RangeMax | None = arrays.transient_max
        self.level = {k: self.base + k * self.activation for k in shared}
        self.floor = {k: level[:-1] - self.offset for k, level in self.level.items()}
        self.top = 0 if self.range_max is None else int(self.range_max.table[0].max())

    @functools.cached_property
    def _lists(self) -> "_ScalarCost":
        return _ScalarCost(self)

    def cost(self, multiplier, start, stop) -> np.ndarray:
        """``c_k(start, stop)`` elementwise (``stop > start``)."""
        total = (self.base[stop] - self.base[start]
                 + multiplier * (self.activation[stop] - self.activation[start]) + self.offset[start])
        return total if self.range_max is None else total + self.range_max(start, stop)

    def first_fit(self, k: int, start: int, stop: int, bound: int) -> list[int]:
        """For each end ``j`` in ``(start, stop]``, the first layer ``i >= start`` with
        ``c_k(i, j) <= bound``, or ``j`` when not even layer ``j - 1`` alone fits;
        entry ``j - start - 1``."""
        return self._first_fit(k, start, stop, bound).tolist()

    def _first_fit(self, k: int, start: int, stop: int, bound: int) -> np.ndarray:
        ends = np.arange(start + 1, stop + 1)
        level = self.level[k]
        first = np.searchsorted(self.floor[k][start:stop], level[ends] - bound, side="left") + start
        first = np.minimum(first, ends)
        if self.range_max is not None:  # only where the tallest transient could break the fit
            doubt = (first < ends) & (level[ends] - self.floor[k][np.minimum(first, stop - 1)]
                                      + self.top > bound)
            self._past_transients(k, first, ends, bound, np.flatnonzero(doubt))
        return first

    def _steps(self, k: int, start: int, stop: int, bound: int) -> list[int]:
        """Entry ``j - start`` for ``j`` in ``[start, stop]``: where the right greedy
        goes from a stage ending at ``j`` -- its first fit, or ``j - 1`` when not
        even one layer fits (before the stage's cap is applied)."""
        ends = np.arange(start + 1, stop + 1)
        step = np.minimum(self._first_fit(k, start, stop, bound), ends - 1)
        return [start, *step.tolist()]

    def _past_transients(self, k: int, first: np.ndarray, ends: np.ndarray, bound: int,
                         live: np.ndarray) -> None:
        """Move each ``first`` (of the indices ``live``) forward to where the
        transient maximum fits too (in place)."""
        for _ in range(_LINEAR_STEPS):
            over = self.cost(k, first[live], ends[live]) > bound
            live = live[over]
            first[live] += 1
            live = live[first[live] < ends[live]]
            if not live.size:
                return
        low, high, stops = first[live], ends[live].copy(), ends[live]
        while True:  # invariant: cost(high) fits or high == end; cost(i) over bound for i < low
            open_ = low < high
            if not open_.any():
                break
            mid = (low + high) // 2
            fits = np.zeros(len(mid), dtype=bool)
            fits[open_] = self.cost(k, mid[open_], stops[open_]) <= bound
            high = np.where(open_ & fits, mid, high)
            low = np.where(open_ & ~fits, mid + 1, low)
        first[live] = low

    def last_fit(self, k: int, start: int, stop: int, bound: int) -> list[int]:
        """For each start ``i`` in ``[start, stop]``, the last end ``j`` in ``[i, stop]``
        with ``j == i`` or ``c_k(i, j) <= bound``; entry ``i - start``."""
        begins = np.arange(start, stop + 1)
        level = self.level[k]
        lead = np.append(self.offset, 0)[begins]
        last = np.searchsorted(level[:stop + 1], bound + level[begins] - lead, side="right") - 1
        last = np.maximum(last, begins)
        if self.range_max is not None:  # only where the tallest transient could break the fit
            doubt = (last > begins) & (level[last] - level[begins] + lead + self.top > bound)
            self._before_transients(k, begins, last, bound, np.flatnonzero(doubt))
        return last.tolist()

    def _before_transients(self, k: int, begins: np.ndarray, last: np.ndarray, bound: int,
                           live: np.ndarray) -> None:
        """Move each ``last`` (of the indices ``live``) back to where the transient
        maximum fits too (in place)."""
        for _ in range(_LINEAR_STEPS):
            over = self.cost(k, begins[live], last[live]) > bound
            live = live[over]
            last[live] -= 1
            live = live[last[live] > begins[live]]
            if not live.size:
                return
        low, high, starts = begins[live], last[live], begins[live]
        while True:  # invariant: low == start or cost(low) fits; cost(j) over bound for j > high
            open_ = low < high
            if not open_.any():
                break
            mid = (low + high + 1) // 2
            fits = np.zeros(len(mid), dtype=bool)
            fits[open_] = self.cost(k, starts[open_], mid[open_]) <= bound
            low = np.where(open_ & fits, mid, low)
            high = np.where(open_ & ~fits, mid - 1, high)
        last[live] = low

    def left_greedy(self, start: int, stop: int, first_stage: int, stop_stage: int,
                    bound: int) -> list[int]:
        """Largest position of each boundary over partitions within ``bound``
        (``exact_search._left_greedy``): stage b extends from the previous boundary
        while it fits, leaving one layer for each later stage, or stays put."""
        multipliers = self.form.multiplier[first_stage:stop_stage]
        stages = len(multipliers)
        tables = {k: self.last_fit(k, start, stop, bound)
                  for k in set(multipliers) if k in self.level}
        hi = [start]
        at = start
        for b in range(stages - 1):
            k = multipliers[b]
            cap = stop - (stages - 1 - b)
            if at < cap:
                table = tables.get(k)
                reach = (table[at - start] if table is not None
                         else self._lists.last_fit(k, at, cap, bound))
                at = min(reach, cap)
            hi.append(at)
        hi.append(stop)
        return hi

    def right_greedy(self, start: int, stop: int, first_stage: int, stop_stage: int,
                     bound: int) -> GreedyOutcome:
        """Stages ``[first_stage, stop_stage)`` over layers ``[start, stop)``: from the
        last, each takes every layer that fits under ``bound`` (at least one, none
        before its cap: one layer is left for each earlier stage); the first takes
        what is left."""
        multipliers = self.form.multiplier[first_stage:stop_stage]
        steps = {k: self._steps(k, start, stop, bound)
                 for k in set(multipliers) if k in self.level}
        starts = [start] * len(multipliers)
        at, b = stop, len(multipliers) - 1
        while b > 0:
            k = multipliers[b]
            step = steps.get(k)
            if step is None:  # a rare multiplier: this stage alone
                fit = self._lists.first_fit(k, start + b, at, bound)
                at = at - 1 if fit >= at else max(fit, start + b)
                starts[b] = at
                b -= 1
                continue
            while b > 0 and multipliers[b] == k:  # the run of stages sharing k
                at = step[at - start]
                if at < start + b:
                    at = start + b
                starts[b] = at
                b -= 1
        multipliers = self.multiplier[first_stage:stop_stage]
        begin = np.asarray(starts, dtype=np.int64)
        end = np.append(begin[1:], stop)
        costs = self.cost(multipliers, begin, end)
        caps = start + np.arange(len(multipliers))
        # a stage stopped by the bound, not by its cap, met the cost one layer longer
        longer = np.flatnonzero((begin > caps) & (costs <= bound))
        longer = longer[longer > 0]
        wider = self.cost(multipliers[longer], begin[longer] - 1, end[longer])
        over = np.concatenate([wider, costs[costs > bound]])
        return GreedyOutcome(starts=starts, peak=int(costs.max()), first_cost=int(costs[0]),
                             next_bound=int(over.min()) if over.size else self.inf)


class _ScalarCost:
    """The tables' prefix sums as Python lists, for one stage at a time."""

    def __init__(self, tables: GreedyTables):
        self.base = tables.base.tolist()
        self.activation = tables.activation.tolist()
        self.offset = tables.offset.tolist()
        rmax = tables.range_max
        self.transient = None if rmax is None else rmax.table[0].tolist()

    def first_fit(self, k: int, cap: int, stop: int, bound: int) -> int:
        """First layer ``i >= cap`` with ``c_k(i, stop) <= bound``, or ``stop``.

        The cost never grows with ``i`` (monotone form), so a binary search
        finds it: first without the transients (``c_k`` is then
        ``P_k(stop) - g(i)`` with ``g`` non-decreasing), which only move the
        answer right; then, unless that layer already fits with its transient
        maximum, over the rest with the maximum taken by ``max`` on a slice."""
        base, act, offset = self.base, self.activation, self.offset
        need = base[stop] + k * act[stop] - bound  # fits iff g(i) - top(i) >= need
        high, step = stop, 1  # gallop leftwards: the stage is short next to the range
        while high - step >= cap:
            at = high - step
            if base[at] + k * act[at] - offset[at] < need:
                break
            high = at
            step *= 2
        low = max(high - step, cap - 1) + 1
        while low < high:
            mid = (low + high) // 2
            if base[mid] + k * act[mid] - offset[mid] >= need:
                high = mid
            else:
                low = mid + 1
        transient = self.transient
        if transient is None or low == stop:
            return low

        def fits(i: int) -> bool:
            return base[i] + k * act[i] - offset[i] - max(transient[i:stop]) >= need

        if fits(low):
            return low
        low, high = low + 1, stop
        while low < high:
            mid = (low + high) // 2
            if fits(mid):
                high = mid
            else:
                low = mid + 1
        return low

    def last_fit(self, k: int, start: int, cap: int, bound: int) -> int:
        """Last end ``j`` in ``[start, cap]`` with ``j == start`` or
        ``c_k(start, j) <= bound``: binary searches as in ``first_fit``, the
        cost never dropping as the stage grows (transients only move it left)."""
        base, act = self.base, self.activation
        room = bound + base[start] + k * act[start] - self.offset[start]
        low, step = start, 1  # gallop: the stage is short next to the range
        while low + step <= cap and base[low + step] + k * act[low + step] <= room:
            low += step
            step *= 2
        high = min(low + step, cap + 1) - 1
        while low < high:
            mid = (low + high + 1) // 2
            if base[mid] + k * act[mid] <= room:
                low = mid
            else:
                high = mid - 1
        transient = self.transient
        if transient is None or low == start:
            return low

        def fits(j: int) -> bool:
            return base[j] + k * act[j] + max(transient[start:j]) <= room

        if fits(low):
            return low
        low, high = start, low - 1
        while low < high:
            mid = (low + high + 1) // 2
            if fits(mid):
                low = mid
            else:
                high = mid - 1
        return low
