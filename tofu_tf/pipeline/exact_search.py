r"""The exact search behind ``partition(method="optimal")``.

This module owns how the optimal boundaries are found: greedy probes,
bisection on the min-max bound, boundary windows and the decomposition of the
chain into independent pieces; the lexicographic DP over the windows is
``tofu_tf.pipeline.lex_dp``. The objective (``partition``'s docstring) and the
stage costs (``stage_model``) are not its business. No TensorFlow.

Lexicographic dynamic program (``lex_dp``)
-----------------------------------------
Order multisets by their descending-sorted vectors, lexicographically. This order
is compatible with union and cancellative: ``A <= B  <=>  A + C <= B + C``
(``+`` is multiset union). Hence the chain DP is exact with multiset values::

    F_0(x_0) = {}
    F_{r+1}(j) = lexmin_{i < j}  F_r(i) + {c_r(i, j)}
    answer     = F_p(n)

A node keeps its parent, ``M_r(j) = max F_r(j)`` and ``F_r(j)`` itself, but
only the part after the last boundary with a single reachable node: what lies
before it is common to every candidate and cancels. Keys are run-length encoded
(identical layers repeat peaks). Candidates are ranked by
``max(M_r(i), c_r(i, j))`` first; only ties compare whole keys.

Exact pruning
-------------
For a bound ``U >= optimum``, every partition with all peaks ``<= U`` has
``x_r`` in a window ``[lo_r, hi_r]``: ``lo`` from a right-to-left greedy (each
stage takes all the layers that fit under ``U``, leaving one per earlier
stage), ``hi`` from the left-to-right greedy. By the exchange argument of
chains-on-chains partitioning (Pinar & Aykanat, JPDC 2004) both are exact when
``c_r(i, j)`` grows with the interval ``[i, j)`` and does not grow with ``r`` --
true of the analytic model and of measured figures with
``isolated_{l-1} + added_l >= isolated_l``. In that case the min-max bound
``B* = min over partitions of max_r c_r`` is found exactly by bisection with the
greedy as feasibility probe; a failed probe at ``B`` also proves every bound
below ``min_r c_r(stage r + its next layer)`` infeasible, so the search jumps.

Decomposition: a boundary whose window is one point lies on every partition
within the bound, so the chain splits there into independent pieces, and by
union compatibility the lexicographic optimum is the union of the pieces'
optima. Each piece is solved again with its own, lower, ``B*``, which narrows
its windows. Wide windows without such a point (identical layers: which stages
take the extra layer is free) narrow to the partitions with the fewest stages
at ``B*`` -- the optimum's count -- found by greedies that count those stages;
the DP's answer certifies the count, else the plain windows are used.

Non-monotone costs (measured offsets ``isolated - added`` that break the
inequality above, or chains mixing measured and analytic layers): the greedy
is not exact (CAPSlog's misses the optimum this way), so ``U`` is the best
peak of feasible greedy partitions, and the windows come from a monotone lower
bound ``l_r(i, j) <= c_r(i, j)`` (``StageCostModel.bound_form``), refined for
all-measured chains by exact forward/backward reachability (from a start the
feasible ends form an interval). Both are supersets of every partition within
``U``, so the DP over them stays exact.

Cost: ``O(n)`` per greedy probe and ``O(log)`` probes, started from a fluid
estimate close to the answer (on long monotone pieces a probe, and the left
greedy, are computed from tables, ``tofu_tf.pipeline.greedy_tables``: numpy
over the layers, one pointer per stage); the DP visits
``sum_r |W_r| |W_{r+1}|`` (start, stop) pairs. Windows stay a few layers wide on
ordinary chains; they grow towards ``n`` only when a huge number of partitions
tie at the top levels (one layer dominating every stage, many identical layers
with a large remainder), where the exact search slows down accordingly.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import numpy as np

from tofu_tf.pipeline.greedy_tables import GreedyTables
from tofu_tf.pipeline.lex_dp import INF as _INF
from tofu_tf.pipeline.lex_dp import lex_dp
from tofu_tf.pipeline.stage_model import LinearForm, StageCostModel

# Split a piece at its pinned boundaries when its DP would visit more than
# this many (start, stop) pairs per stage.
_SPLIT_WORK_PER_STAGE = 64
# Pieces of at least this many layers are probed from tables (greedy_tables).
_TABLE_MIN_LAYERS = 256
# Stage steps (stages x counts) allowed to the greedies that count stages at
# the min-max bound; beyond it, wide windows go to the DP as they are.
_COUNT_GREEDY_STEPS = 1 << 15
# Probe budget of the heuristic bound for non-monotone costs.
_HEURISTIC_PROBES = 64
# The bisection's first step away from its estimate is 2**-_STEP_SHIFT of the
# bound (doubling until bracketed); a bracket narrower than 2**-_NARROW_SHIFT of
# the bound has its lower end probed (see _bisect).
_STEP_SHIFT = 11
_NARROW_SHIFT = 11
# The same for the heuristic bound's secant guesses (see _secant_bisect).
_SECANT_JUMP_WIDTH = 1e-3


def optimal_boundaries(model: StageCostModel) -> tuple[int, ...]:
    """First layer of each stage of the lexicographically optimal partition."""
    return tuple(_Search(model).solve())


def min_max_prefix_split(weights: list[int], num_stages: int) -> tuple[int, ...]:
    """Contiguous split of ``weights`` minimising the heaviest stage, earlier stages
    filled first (the greedy at the exact min-max bound)."""
    zeros = (0,) * len(weights)
    form = LinearForm(base=tuple(weights), activation=zeros, offset=zeros, transient=zeros,
                      multiplier=(0,) * num_stages)
    piece = _Piece(0, len(weights), 0, num_stages)
    bound, _ = _bisect(form, piece, _form_lower_bound(form, piece))
    return tuple(_left_greedy(form, piece, bound)[:-1])

@dataclasses.dataclass(frozen=True)
class _Piece:
    """Layers [start, stop) on stages [first, stop_stage)."""

    start: int
    stop: int
    first: int
    stop_stage: int

    @property
    def stages(self) -> int:
        return self.stop_stage - self.first

    @property
    def layers(self) -> int:
        return self.stop - self.start


@dataclasses.dataclass(frozen=True)
class _Probe:
    """Outcome of a right-to-left greedy under a bound."""

    ok: bool                 # every stage within the bound, all layers covered
    starts: list[int]        # first layer of each stage of the piece
    peak: int                # largest stage cost taken (meaningful when ok)
    next_bound: int          # failed: no bound below this can succeed
    excess: int              # peak of the first stage minus the bound


class _Search:
    """Exact lexicographic partition of one chain under one ``StageCostModel``."""

    def __init__(self, model: StageCostModel):
        self.model = model
        self.exact = model.monotone
        self.window_form = model.exact_form if self.exact else model.bound_form
        self.tables = (GreedyTables(self.window_form, _shared_multipliers(self.window_form), _INF)
                       if self.exact else None)
        self.reach = None
        if not self.exact and model.exact_form is not None and not any(model.exact_form.transient):
            self.reach = _ReachTables.build(model.exact_form)

    @functools.cached_property
    def weights(self) -> dict[int, list[int]]:
        """``_shared_weights`` of the window form (for the layer-by-layer scans)."""
        return _shared_weights(self.window_form)

    def solve(self) -> list[int]:
        model = self.model
        starts = [0] * model.num_stages
        work = [_Piece(0, model.num_layers, 0, model.num_stages)]
        while work:
            piece = work.pop()
            solved = self._trivial(piece)
            if solved is None:
                solved, pieces = self._solve_piece(piece)
                work.extend(pieces)
            starts[piece.first: piece.first + len(solved)] = solved
        return starts

    @staticmethod
    def _trivial(piece: _Piece) -> list[int] | None:
        if piece.stages == 1:
            return [piece.start]
        if piece.stages == piece.layers:
            return list(range(piece.start, piece.stop))
        return None

    def _solve_piece(self, piece: _Piece) -> tuple[list[int], list[_Piece]]:
        """Either the piece's starts, or no starts and the sub-pieces to solve instead."""
        bound, greedy_starts = self._bound(piece)
        if bound == 0 and greedy_starts is not None:
            return greedy_starts, []  # every stage peaks at 0: all partitions tie
        lo, hi = self._windows(piece, bound, greedy_starts)
        wide = _window_work(lo, hi) > _SPLIT_WORK_PER_STAGE * piece.stages
        pins = [b for b in range(1, piece.stages) if lo[b] == hi[b]]
        if pins and wide:
            return [], _split(piece, pins, lo)
        if wide and self.exact:
            starts = self._fewest_top_stages(piece, bound)
            if starts is not None:
                return starts, []
        starts = lex_dp(self.model, piece.first, lo, hi, bound)
        if starts is None:
            raise RuntimeError(f"internal error: no partition within bound {bound}")
        return starts, []

    def _fewest_top_stages(self, piece: _Piece, bound: int) -> list[int] | None:
        """Solve within the narrower windows of partitions with the fewest stages at
        ``bound`` (the min-max), when that count is small; None when not applicable.

        The count comes from relaxed greedies, so it may fall short of the true
        minimum; the DP's answer then has more stages at the bound than the
        count, and is discarded. Otherwise it is the optimum: any partition
        outside the windows has more stages at the bound, so is worse.
        """
        max_count = _COUNT_GREEDY_STEPS // piece.stages - 1
        fewest = _fewest_top_windows(self.window_form, piece, bound, max_count, self.weights)
        if fewest is None:
            return None
        count, lo, hi = fewest
        starts = lex_dp(self.model, piece.first, lo, hi, bound)
        if starts is None:
            return None
        stops = starts[1:] + [piece.stop]
        peaks = self.model.peaks(np.arange(piece.first, piece.stop_stage), starts, stops)
        return starts if int(np.count_nonzero(peaks >= bound)) <= count else None

    def _windows(self, piece: _Piece, bound: int,
                 greedy_starts: list[int] | None) -> tuple[list[int], list[int]]:
        """``[lo_b, hi_b]`` holding boundary b of every partition of the piece within ``bound``.

        ``greedy_starts``, when given, is the window form's right greedy at a
        bound >= ``bound``: its starts are lower limits already.
        """
        if greedy_starts is None:
            greedy_starts = self._probe(piece, bound).starts
        lo = greedy_starts + [piece.stop]
        if self.tables is None or piece.layers < _TABLE_MIN_LAYERS or not self.tables.level:
            hi = _left_greedy(self.window_form, piece, bound)
        else:
            hi = self.tables.left_greedy(piece.start, piece.stop, piece.first, piece.stop_stage,
                                         bound)
        if self.reach is not None:
            lo, hi = self.reach.windows(piece, bound, lo, hi)
        if any(l > h for l, h in zip(lo, hi)):
            raise RuntimeError(f"internal error: empty boundary window under bound {bound}")
        return lo, hi

    def _probe(self, piece: _Piece, bound: int) -> _Probe:
        """The right greedy of the window form under ``bound`` (from tables on long
        monotone pieces, where interpreting layer by layer costs the most)."""
        if self.tables is None or piece.layers < _TABLE_MIN_LAYERS:
            return _right_greedy(self.window_form, piece, bound, self.weights)
        got = self.tables.right_greedy(piece.start, piece.stop, piece.first, piece.stop_stage,
                                       bound)
        return _Probe(ok=got.peak <= bound, starts=got.starts, peak=got.peak,
                      next_bound=got.next_bound, excess=got.first_cost - bound)

    def _bound(self, piece: _Piece) -> tuple[int, list[int] | None]:
        """A bound >= the piece's min-max peak (equal to it when the costs are
        monotone), and the right greedy's starts there if known."""
        if self.exact:
            lower = _form_lower_bound(self.window_form, piece)
            bound, partitions = _bisect(self.window_form, piece, lower, probe_with=self._probe)
            return bound, partitions[-1]
        return self._heuristic_bound(piece), None

    def _heuristic_bound(self, piece: _Piece) -> int:
        """Best true peak among greedy partitions found by bisecting a greedy's bound."""
        form = self.model.exact_form or self.model.bound_form
        _, partitions = _secant_bisect(form, piece, 0, max_probes=_HEURISTIC_PROBES)
        return min(self._true_peak(piece, starts) for starts in partitions)

    def _true_peak(self, piece: _Piece, starts: list[int]) -> int:
        stops = starts[1:] + [piece.stop]
        stages = np.arange(piece.first, piece.stop_stage)
        return int(self.model.peaks(stages, starts, stops).max())


@dataclasses.dataclass(frozen=True)
class _ReachTables:
    """Exact boundary windows for a transient-free ``LinearForm`` (measured figures).

    There ``c_r(i, j) = offset_i + W_r(j) - W_r(i)`` with ``W_r`` non-decreasing,
    so from a start i the feasible ends form an interval, and to an end j the
    cheapest continuation is the nearest feasible next boundary. Forward and
    backward reachability inside given superset windows are then exact, even
    though the cost is not monotone in the start.
    """

    base: np.ndarray        # prefix sums of LinearForm.base
    activation: np.ndarray  # prefix sums of LinearForm.activation
    offset: np.ndarray
    multiplier: tuple[int, ...]

    @classmethod
    def build(cls, form: LinearForm) -> "_ReachTables":
        arrays = form.arrays
        return cls(base=arrays.base, activation=arrays.activation,
                   offset=np.append(arrays.offset, 0), multiplier=form.multiplier)

    def windows(self, piece: _Piece, bound: int, lo: list[int],
                hi: list[int]) -> tuple[list[int], list[int]]:
        forward = [np.array([piece.start])]
        for b in range(piece.stages - 1):
            forward.append(self._step_forward(piece.first + b, forward[-1],
                                              np.arange(lo[b + 1], hi[b + 1] + 1), bound))
        members = [np.array([piece.stop])]
        for b in range(piece.stages - 1, 0, -1):
            members.append(self._step_backward(piece.first + b, forward[b], members[-1], bound))
        members.append(forward[0])
        members.reverse()
        if any(len(m) == 0 for m in members):
            raise RuntimeError(f"internal error: no partition within bound {bound}")
        return [int(m[0]) for m in members], [int(m[-1]) for m in members]

    def _level(self, stage: int, positions: np.ndarray) -> np.ndarray:
        return self.base[positions] + self.multiplier[stage] * self.activation[positions]

    def _step_forward(self, stage, starts, ends, bound) -> np.ndarray:
        """Ends reachable from ``starts`` (sorted) by one stage within ``bound``."""
        limit = bound - self.offset[starts] + self._level(stage, starts)
        index = np.searchsorted(self._level(stage, ends), limit, side="right") - 1
        farthest = np.maximum.accumulate(np.where(index >= 0, ends[np.maximum(index, 0)], -1))
        before = np.searchsorted(starts, ends, side="left")  # starts strictly before each end
        reach = (before > 0) & (farthest[np.maximum(before - 1, 0)] >= ends)
        return ends[reach]

    def _step_backward(self, stage, starts, ends, bound) -> np.ndarray:
        """``starts`` from which one stage within ``bound`` reaches one of ``ends`` (sorted)."""
        index = np.searchsorted(ends, starts, side="right")
        nearest = ends[np.minimum(index, len(ends) - 1)]
        cost = self.offset[starts] + self._level(stage, nearest) - self._level(stage, starts)
        return starts[(index < len(ends)) & (cost <= bound)]


def _fewest_top_windows(form: LinearForm, piece: _Piece, bound: int, max_count: int,
                        weights: dict[int, list[int]]) -> tuple[int, list[int], list[int]] | None:
    """Windows of the partitions within ``bound`` having at most ``count`` stages
    at ``bound`` (the rest at most ``bound - 1``), for the smallest ``count`` the
    relaxed greedies allow; None if that exceeds ``max_count``. Monotone forms."""
    count, limit = None, 1
    while count is None and limit <= 2 * max_count:
        right = _count_greedy(form, piece, bound, min(limit, max_count), True, weights)
        count = next((c for c, at in enumerate(right[0]) if at <= piece.start), None)
        limit *= 2
    if count is None:
        return None
    left = _count_greedy(form, piece, bound, count, False, weights)
    lo, hi = [], []
    for b in range(piece.stages + 1):
        ranges = [(right[b][c], left[b][count - c]) for c in range(count + 1)
                  if right[b][c] <= left[b][count - c]]
        if not ranges:
            return None
        lo.append(max(min(r for r, _ in ranges), piece.start + min(b, piece.stages - 1)))
        hi.append(min(max(g for _, g in ranges), piece.stop - (piece.stages - b)))
    lo[-1] = hi[-1] = piece.stop
    if any(l > h for l, h in zip(lo, hi)):
        return None
    return count, lo, hi


def _count_greedy(form: LinearForm, piece: _Piece, bound: int, max_count: int,
                  from_right: bool, weights: dict[int, list[int]]) -> list[list[int]]:
    """``at[b][c]``: the extreme position of boundary b over the stages on one side
    of it using at most c stages above ``bound - 1`` -- lowest when the stages
    after b are filled from the right, highest when those before b are filled
    from the left. Relaxed (a stage that fits nothing still advances, or stays)
    so the results are safe limits."""
    def stretch(b, at, limit):
        if from_right:
            return _stretch_left(form, weights, piece, b, at, limit)
        return _stretch_right(form, piece, b, at, limit)

    stages = range(piece.stages - 1, -1, -1) if from_right else range(piece.stages)
    edge = piece.stop if from_right else piece.start
    row = [edge] * (max_count + 1)
    rows = {piece.stages if from_right else 0: row}
    for b in stages:
        plain = [stretch(b, at, bound - 1) for at in row]
        top = [stretch(b, at, bound) for at in row]
        pick = min if from_right else max
        row = [pick(plain[c], top[c - 1]) if c else plain[0] for c in range(max_count + 1)]
        rows[b if from_right else b + 1] = row
    return [rows[b] for b in range(piece.stages + 1)]


def _stretch_left(form: LinearForm, weights: dict[int, list[int]], piece: _Piece, b: int,
                  stop: int, bound: int) -> int:
    """Lowest start of stage b ending at ``stop`` within ``bound`` (at least one layer)."""
    k, cap = form.multiplier[piece.first + b], piece.start + b
    if stop <= cap:
        return stop
    return _scan_left(form, weights.get(k) or _LazyWeights(form, k), cap, stop, bound)[0]


def _stretch_right(form: LinearForm, piece: _Piece, b: int, start: int, bound: int) -> int:
    """Highest end of stage b starting at ``start`` within ``bound`` (or ``start``),
    leaving a layer for each later stage."""
    k, cap = form.multiplier[piece.first + b], piece.stop - (piece.stages - 1 - b)
    base, act, transient = form.base, form.activation, form.transient
    stop, total, top, lead = start, 0, 0, form.offset[start] if start < piece.stop else 0
    while stop < cap:
        total += base[stop] + k * act[stop]
        if transient[stop] > top:
            top = transient[stop]
        if total + lead + top > bound:
            break
        stop += 1
    return stop


def _window_work(lo: list[int], hi: list[int]) -> int:
    sizes = [h - l + 1 for l, h in zip(lo, hi)]
    return sum(a * b for a, b in zip(sizes, sizes[1:]))


def _split(piece: _Piece, pins: list[int], lo: list[int]) -> list[_Piece]:
    cuts = [0, *pins, piece.stages]
    return [_Piece(lo[a], lo[b], piece.first + a, piece.first + b) for a, b in zip(cuts, cuts[1:])]


# --------------------------------------------------------------------------- greedy probes


def _right_greedy(form: LinearForm, piece: _Piece, bound: int,
                  weights: dict[int, list[int]] | None = None) -> _Probe:
    """Stages from the last: each takes every layer that fits under ``bound``;
    the first stage takes what is left.

    A stage whose single layer exceeds the bound takes it anyway (the probe
    fails) so that ``next_bound`` and ``excess`` stay informative.
    ``weights`` (see ``_shared_weights``) saves work for stages sharing a multiplier.
    """
    weights = weights or {}
    stop, peak, next_bound = piece.stop, 0, _INF
    starts = [piece.start] * piece.stages
    for b in range(piece.stages - 1, 0, -1):
        k = form.multiplier[piece.first + b]
        weight = weights.get(k) or _LazyWeights(form, k)
        start, cost, jump = _scan_left(form, weight, piece.start + b, stop, bound)
        starts[b] = stop = start
        if cost > peak:
            peak = cost
        if jump < next_bound:
            next_bound = jump
    first = _stage_cost(form, piece.first, piece.start, stop)
    if first > bound:
        next_bound = min(next_bound, first)
    return _Probe(ok=max(peak, first) <= bound, starts=starts, peak=max(peak, first),
                  next_bound=next_bound, excess=first - bound)


class _LazyWeights:
    """Layer l's ``base + k * activation``, computed on access."""

    def __init__(self, form: LinearForm, k: int):
        self.base, self.activation, self.k = form.base, form.activation, k

    def __getitem__(self, layer: int) -> int:
        return self.base[layer] + self.k * self.activation[layer]


def _shared_multipliers(form: LinearForm) -> set[int]:
    """The multipliers held by at least a quarter of the stages."""
    counts: dict[int, int] = {}
    for k in form.multiplier:
        counts[k] = counts.get(k, 0) + 1
    return {k for k, n in counts.items() if 4 * n >= len(form.multiplier)}


def _shared_weights(form: LinearForm) -> dict[int, list[int]]:
    """``base + k * activation`` per layer, for the multipliers k held by at
    least a quarter of the stages (the greedy scans read them in its inner loop)."""
    base = np.diff(form.arrays.base)
    act = np.diff(form.arrays.activation)
    return {k: (base + k * act).tolist() for k in _shared_multipliers(form)}


def _scan_left(form: LinearForm, weight, cap: int, stop: int,
               bound: int) -> tuple[int, int, int]:
    """A stage ending at ``stop`` takes layers leftwards while they fit (at least
    one, none before ``cap``); ``weight[l]`` is layer l's base + k * activation.

    Returns its start, its cost, and the smallest cost above ``bound`` met (a
    longer stage, or the forced single layer), ``_INF`` if none.
    """
    offset, transient = form.offset, form.transient
    s = stop - 1
    total, top = weight[s], transient[s]
    cost = total + offset[s] + top
    jump = cost if cost > bound else _INF
    while s > cap:
        prev = s - 1
        grown = total + weight[prev]
        tallest = transient[prev] if transient[prev] > top else top
        wider = grown + offset[prev] + tallest
        if wider > bound:
            return s, cost, min(jump, wider)
        s, total, top, cost = prev, grown, tallest, wider
    return s, cost, jump


def _stage_cost(form: LinearForm, stage: int, start: int, stop: int) -> int:
    k = form.multiplier[stage]
    total = sum(form.base[start:stop]) + k * sum(form.activation[start:stop])
    return total + form.offset[start] + max(form.transient[start:stop])


def _left_greedy(form: LinearForm, piece: _Piece, bound: int) -> list[int]:
    """Largest position of each boundary over partitions within ``bound`` (monotone costs).

    Stage ``b`` extends from the previous boundary while it fits, leaving one
    layer for each later stage; if nothing fits, the boundary stays put (the
    result remains an upper bound).
    """
    hi = [piece.start]
    for b in range(piece.stages - 1):
        hi.append(_stretch_right(form, piece, b, hi[-1], bound))
    hi.append(piece.stop)
    return hi


def _form_lower_bound(form: LinearForm, piece: _Piece) -> int:
    """No partition of the piece has a lower max: each layer must sit in a stage
    no later than its position allows, and the stages share the total."""
    arrays = form.arrays
    base = np.diff(arrays.base[piece.start: piece.stop + 1])
    act = np.diff(arrays.activation[piece.start: piece.stop + 1])
    offset = arrays.offset[piece.start: piece.stop]
    mult = arrays.multiplier[piece.first: piece.stop_stage]
    latest = np.minimum(np.arange(piece.layers), piece.stages - 1)
    single = base + mult[latest] * act + offset
    if arrays.transient_max is not None:
        single = single + arrays.transient_max.table[0, piece.start: piece.stop]
    shared = int(base.sum() + mult.min() * act.sum() + piece.stages * min(0, int(offset.min())))
    return max(int(single.max()), -(-shared // piece.stages))


def _fluid_estimate(form: LinearForm, piece: _Piece) -> int:
    """The bound at which stages of average layers would hold the piece.

    A greedy stage stops short of the bound by part of the layer that no
    longer fits; that layer is picked in proportion to its size, so a stage
    loses ``E[L**2] / (2 E[L])`` on average (``L`` a layer's cost under the
    stage's multiplier) -- ``E[L] / 2`` only for equal layers."""
    arrays, start, stop = form.arrays, piece.start, piece.stop
    base = np.diff(arrays.base[start: stop + 1]) + arrays.offset[start:stop] / 4
    act = np.diff(arrays.activation[start: stop + 1]).astype(np.float64)
    mult = arrays.multiplier[piece.first: piece.stop_stage].astype(np.float64)
    mean = np.maximum(base.mean() + mult * act.mean(), 1.0)
    square = ((base * base).mean() + 2 * mult * (base * act).mean()
              + mult * mult * (act * act).mean())
    transient = (0.0 if arrays.transient_max is None
                 else np.mean(arrays.transient_max.table[0, start:stop]))
    lost = np.sum(square / (2 * mean * mean))  # layers
    bound = transient + (piece.layers + lost) / np.sum(1 / mean)
    return int(min(bound, _INF // 2))


def _bisect(form: LinearForm, piece: _Piece, lower: int,
            probe_with: Callable[[_Piece, int], _Probe] | None = None
            ) -> tuple[int, list[list[int]]]:
    """Smallest bound the right greedy meets, and the partitions of successful probes.

    ``probe_with(piece, bound)`` runs the right greedy (``_right_greedy`` on
    ``form`` unless given). The exact min-max of a monotone form (``lower``
    must not exceed it); non-monotone forms take ``_secant_bisect``.

    Guesses: the first is the fluid estimate (``_fluid_estimate``, typically
    within a few 0.1% of the answer); steps of ``2**-_STEP_SHIFT`` of the
    bound, doubling, bracket the answer; the bracket is then halved. A failed
    probe raises the lower end to the next cost it met (no smaller bound can
    change its outcome), a successful one lowers the upper end to its peak. Once
    the bracket is narrow (``2**-_NARROW_SHIFT`` of the bound) its lower end is
    probed, halving again after a lower end that fails: the lower end of a
    failure just below the answer is the answer (8192 layers / 1024 stages: 4
    to 12 probes, 7 under 1F1B with 64 micro-batches, where the excess secant
    used before took 4 to 22, and 8).
    """
    probe_with = probe_with or (lambda part, bound: _right_greedy(form, part, bound))
    upper, found, failed, jumped = None, [], False, False
    guess, shift = max(lower, _fluid_estimate(form, piece)), _STEP_SHIFT
    while True:
        probe = probe_with(piece, guess)
        if probe.ok:
            upper = probe.peak
            found.append(probe.starts)
        else:
            lower = max(guess + 1, probe.next_bound)
            failed = True
        if upper is not None and lower >= upper:
            break
        step = max(1, guess >> shift)
        if upper is None:  # below the answer: step up
            guess, shift = max(lower, min(guess + step, _INF // 2)), max(0, shift - 1)
        elif not failed:  # above it: step down
            guess, shift = max(lower, min(upper - 1, guess - step)), max(0, shift - 1)
        elif (upper - lower) << _NARROW_SHIFT <= upper and not (jumped and not probe.ok):
            guess, jumped = lower, True
            continue
        else:
            guess = lower + (upper - lower) // 2
        jumped = False
    return upper, found


def _half_layer_estimate(form: LinearForm, piece: _Piece) -> int:
    """The bound at which stages of average layers would hold the piece, each
    stage losing half a layer to rounding (the start of ``_secant_bisect``)."""
    arrays, start, stop = form.arrays, piece.start, piece.stop
    layer = ((arrays.base[stop] - arrays.base[start]) / piece.layers
             + np.mean(arrays.offset[start:stop]) / 4)
    mult = arrays.multiplier[piece.first: piece.stop_stage].astype(np.float64)
    activation = (arrays.activation[stop] - arrays.activation[start]) / piece.layers
    per_layer = np.maximum(layer + mult * activation, 1.0)
    transient = (0.0 if arrays.transient_max is None
                 else np.mean(arrays.transient_max.table[0, start:stop]))
    bound = transient + (piece.layers + piece.stages / 2) / np.sum(1 / per_layer)
    return int(min(bound, _INF // 2))


def _secant_bisect(form: LinearForm, piece: _Piece, lower: int, max_probes: int | None = None,
                   probe_with: Callable[[_Piece, int], _Probe] | None = None
                   ) -> tuple[int, list[list[int]]]:
    """``_bisect`` with the guesses that suit non-monotone forms (the heuristic
    bound, where a probe's success does not grow with the bound): fewer probes
    there than ``_bisect``'s bracketing.

    Guesses: a failed probe leaves the first stage ``excess`` over the bound,
    and raising the bound by d lets each of the other stages absorb about d,
    so the root of the excess is extrapolated (secant of the last two
    failures). Whenever the bracket fails to halve, the next guess halves it.
    Once the bracket is narrow (``_SECANT_JUMP_WIDTH`` of the bound), its lower end --
    a stage cost a failed probe met, the next value the min-max can take -- is
    probed once: on chains of distinct layers that probe usually ends the
    search.
    """
    probe_with = probe_with or (lambda part, bound: _right_greedy(form, part, bound))
    upper, found, fails, probes, jumped = None, [], [], 0, None
    guess, width = max(lower, _half_layer_estimate(form, piece)), None
    while max_probes is None or probes < max_probes:
        probe = probe_with(piece, guess)
        probes += 1
        if probe.ok:
            upper = probe.peak
            found.append(probe.starts)
        else:
            lower = max(guess + 1, probe.next_bound)
            fails = [*fails[-1:], (guess, probe.excess)]
        if upper is not None and lower >= upper:
            break
        guess, width = _next_guess(lower, upper, fails, width, piece.stages)
        if (upper is not None and jumped != lower and fails
                and upper - lower <= upper * _SECANT_JUMP_WIDTH):
            guess = jumped = lower
    if upper is None:  # only reachable with a probe budget
        probe = _right_greedy(form, piece, _INF - 1)
        upper, found = probe.peak, [probe.starts]
    return upper, found


def _next_guess(lower: int, upper: int | None, fails: list[tuple[int, int]], width: int | None,
                stages: int) -> tuple[int, int | None]:
    """Next bound to probe, and the bracket width it was chosen in."""
    if len(fails) == 2 and fails[1][1] < fails[0][1]:
        (b0, e0), (b1, e1) = fails
        step = e1 * (b1 - b0) // (e0 - e1)
    elif fails:
        step = fails[-1][1] // stages
    else:
        step = None
    guess = None if step is None else fails[-1][0] + step + step // 16 + 1
    if upper is None:
        return max(lower, guess), None
    gap = upper - lower
    if guess is None or guess >= upper or (width is not None and 2 * gap > width):
        return lower + gap // 2, gap
    return min(max(guess, lower), upper - 1), gap
