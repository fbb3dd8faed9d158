"""The lexicographic dynamic program over boundary windows (exact, no TensorFlow).

Given windows ``[lo_b, hi_b]`` for every stage boundary of a piece of the chain
and a bound on every stage's peak, ``lex_dp`` returns the starts of the
partition whose descending-sorted stage peaks are lexicographically smallest
(the recurrence is in ``tofu_tf.pipeline.exact_search``'s docstring). This
module owns the DP's keys, its per-stage steps and the stage peaks of each
block, computed by ``StageCostModel.peaks``.

Segments. A boundary whose window is one point (``lo_b == hi_b``) lies on every
partition within the bound, so the piece splits there into segments solved
independently; by union compatibility their optima together are the piece's.

Ranked keys (the fast path). Within a segment of ``S`` stages, number the
distinct peaks its (start, stop) pairs can take ``0, 1, 2, ...`` in increasing
order and give rank ``q`` a binary digit field of ``w_q`` bits, wide enough for
the most stages of that peak one path can hold: ``2 ** w_q > min(S, n_q)``
with ``n_q`` the pairs of that peak (a path takes one pair per stage). A stage
of rank ``q`` weighs ``2 ** o_q``, ``o_q`` the total width of the lower ranks. A
path's multiset of peaks then maps to the sum of its weights: a number whose
fields count the peaks of each rank (no field carries, as no count reaches
``2 ** w_q``). Comparing two such sums compares the counts from the largest
peak down: exactly the lexicographic order of the descending-sorted peak
vectors. The DP becomes a plain min-plus chain DP over Python integers,
``F_{r+1}(j) = min_i F_r(i) + weight(i, j)``, whose additions and comparisons
run in C. Distinct peaks (the usual case) take one bit each, so keys stay
about as long as the segment has distinct peaks. A pair over the bound weighs
more than any path (``2 ** sum_q w_q``).

Multiset keys (the fallback, for segments whose ranked keys would be too long:
many distinct peaks and many stages, or blocks too large to hold at once). A
node's key is the multiset of its path's stage peaks since the last boundary
with a single reachable node (earlier peaks are common to every candidate and
cancel), run-length encoded as ``((-peak, -count), ...)`` by descending peak.
Among keys of equally many peaks, a larger tuple is a lexicographically smaller
descending peak vector; repeated peaks (identical layers) keep keys short.
Candidates are ranked by their largest peak first; only ties compare keys.
"""

from __future__ import annotations

import bisect
import dataclasses
import operator

import numpy as np

from tofu_tf.pipeline.stage_model import StageCostModel

INF = int(np.iinfo(np.int64).max)
_INF = INF
# DP blocks up to this many entries are scanned in plain Python, larger ones in numpy.
_SMALL_BLOCK = 64
# Peaks computed per numpy call when filling DP blocks.
_BLOCK_ENTRIES = 1 << 20
# Longest ranked key (bits) a segment may use; longer ones take the multiset keys.
_MAX_KEY_BITS = 1 << 14


def lex_dp(model: StageCostModel, first_stage: int, lo: list[int], hi: list[int],
           bound: int) -> list[int] | None:
    """Lexicographically optimal starts of stages ``first_stage, first_stage + 1, ...``
    of a piece whose boundary b lies in ``[lo[b], hi[b]]`` (``lo[0] == hi[0]``
    is the piece's first layer, ``lo[-1] == hi[-1]`` its end), every peak
    within ``bound``; None if there is no such partition."""
    pairs = _PairCosts.build(model, first_stage, lo, hi, bound)
    if pairs is None:  # too many pairs to hold at once
        return _keyed_dp(model, first_stage, lo, hi, bound,
                         _cost_blocks(model, first_stage, lo, hi))
    segments = [_Segment(a, b, entry=0, exit=0, bound=bound) for a, b in _segments(lo, hi)]
    # Pruning a long segment narrows ``valid`` in that segment's pairs only; the copy keeps
    # ``pairs`` as built.
    return _solve_segments(model, first_stage, pairs, segments, pairs.valid.copy())


def _solve_segments(model: StageCostModel, first_stage: int, pairs: "_PairCosts",
                    segments: list["_Segment"], valid: np.ndarray) -> list[int] | None:
    """Consecutive segments solved one by one (ranked keys where they fit, else
    pruned by ``_solve_long``) and their starts joined; None if one has no partition."""
    key_bits, weights = _ranked_weights(pairs, [(s.a, s.b) for s in segments], valid)
    starts: list[int] = []
    for segment, bits in zip(segments, key_bits):
        found = (_ranked_dp(pairs, segment, valid, bits, weights) if bits is not None
                 else _solve_long(model, first_stage, pairs, segment, valid))
        if found is None:
            return None
        starts += found
    return starts


@dataclasses.dataclass(frozen=True)
class _PairCosts:
    """Every (start, stop) pair the windows allow, stage by stage, with its peak.

    Pairs of stage t are stored stop-major: entry ``offsets[t] + c * rows[t] + r``
    is the stage from ``lo[t] + r`` to ``lo[t + 1] + c``. ``valid``: the pair is
    a stage (start before stop) within the bound.
    """

    lo: list[int]
    rows: list[int]
    cols: list[int]
    offsets: list[int]
    costs: np.ndarray
    valid: np.ndarray

    @classmethod
    def build(cls, model: StageCostModel, first_stage: int, lo: list[int], hi: list[int],
              bound: int) -> "_PairCosts | None":
        rows = np.asarray(hi[:-1]) - np.asarray(lo[:-1]) + 1
        cols = np.asarray(hi[1:]) - np.asarray(lo[1:]) + 1
        sizes = rows * cols
        total = int(sizes.sum())
        if total > _BLOCK_ENTRIES:
            return None
        offsets = np.zeros(len(sizes) + 1, dtype=np.int64)
        np.cumsum(sizes, out=offsets[1:])
        stage = np.repeat(np.arange(len(sizes)), sizes)
        local = np.arange(total) - offsets[stage]
        lo_arr = np.asarray(lo)
        starts = lo_arr[stage] + local % rows[stage]
        stops = lo_arr[stage + 1] + local // rows[stage]
        costs = model.peaks(first_stage + stage, starts, stops)
        return cls(lo=list(lo), rows=rows.tolist(), cols=cols.tolist(), offsets=offsets.tolist(),
                   costs=costs, valid=(starts < stops) & (costs <= bound))

    def block(self, stage: int, valid: np.ndarray) -> np.ndarray:
        """Peaks of stage ``stage`` as a (starts x stops) array, ``_INF`` where not valid."""
        part = slice(self.offsets[stage], self.offsets[stage + 1])
        flat = np.where(valid[part], self.costs[part], _INF)
        return flat.reshape(self.cols[stage], self.rows[stage]).T


@dataclasses.dataclass(frozen=True)
class _Segment:
    """Stages a .. b-1 between boundaries a and b, each of which has a single node
    left: row ``entry`` of boundary a's window, column ``exit`` of boundary b's."""

    a: int
    b: int
    entry: int
    exit: int
    bound: int


def _segments(lo: list[int], hi: list[int]) -> list[tuple[int, int]]:
    """Boundary ranges between pinned boundaries (windows of one point)."""
    pins = [b for b in range(1, len(lo) - 1) if lo[b] == hi[b]]
    cuts = [0, *pins, len(lo) - 1]
    return list(zip(cuts, cuts[1:]))


def _ranked_weights(pairs: _PairCosts, segments: list[tuple[int, int]],
                    valid: np.ndarray) -> tuple[list[int | None], list]:
    """Per segment its key length in bits (None when over ``_MAX_KEY_BITS``), and
    per pair of a segment that fits ``2 ** (offset of its peak's rank)``, or
    ``2 ** key_bits`` (heavier than any path) for a pair that is not valid
    (module docstring). Pairs outside the segments, or of segments that do not
    fit, weigh 1."""
    count = len(segments)
    first, last = pairs.offsets[segments[0][0]], pairs.offsets[segments[-1][1]]
    costs, valid = pairs.costs[first:last], valid[first:last]
    bounds = [pairs.offsets[b] - first for _, b in segments]
    segment_of = np.searchsorted(np.asarray(bounds), np.arange(last - first), side="right")
    index = np.flatnonzero(valid)
    by_cost = index[np.argsort(costs[index])]  # then by segment, stably (a radix sort)
    small = np.int16 if count < 1 << 15 else np.int64
    order = by_cost[np.argsort(segment_of[by_cost].astype(small), kind="stable")]
    seg_sorted, cost_sorted = segment_of[order], costs[order]
    fresh = np.ones(len(order), dtype=bool)
    fresh[1:] = (np.diff(seg_sorted) != 0) | (np.diff(cost_sorted) != 0)
    rank = np.cumsum(fresh) - 1  # distinct (segment, peak), over all segments
    # digit width of a rank: enough for the most pairs of that peak one path can
    # hold (one per stage, so at most the segment's stages or the peak's pairs)
    stages = np.asarray([b - a for a, b in segments], dtype=np.int64)
    most = np.minimum(np.bincount(rank), stages[seg_sorted[fresh]])
    width = np.frexp(most.astype(np.float64))[1].astype(np.int64)  # bit_length
    digit = np.zeros(len(width) + 1, dtype=np.int64)
    np.cumsum(width, out=digit[1:])
    segment_digit = np.zeros(count + 1, dtype=np.int64)  # first digit of each segment
    segment_digit[1:] = np.bincount(seg_sorted[fresh], weights=width, minlength=count).cumsum()
    key_bits = np.diff(segment_digit)
    usable = key_bits <= _MAX_KEY_BITS
    shift = np.where(usable, key_bits, 0)[segment_of]  # not valid: the key's length
    shift[order] = digit[rank] - segment_digit[seg_sorted]
    shift[~usable[segment_of]] = 0
    shifts = shift.tolist()
    power = {s: 1 << s for s in set(shifts)}  # one object per rank (not valid: per segment)
    weights = [1] * first + list(map(power.__getitem__, shifts))
    return [int(k) if ok else None for k, ok in zip(key_bits, usable)], weights


def _ranked_dp(pairs: _PairCosts, segment: _Segment, valid: np.ndarray, key_bits: int,
               weights: list) -> list[int] | None:
    """Min-plus DP over the ranked weights of one segment (see the module docstring).

    Only the keys are kept per boundary; the path is recovered backwards by
    finding, at each boundary, a start whose key plus the stage's weight gives
    the key already chosen."""
    unreachable = 1 << key_bits
    keys = [unreachable] * pairs.rows[segment.a]
    keys[segment.entry] = 0
    history = [keys]
    add = operator.add
    for t in range(segment.a, segment.b):
        rows, cols, at = pairs.rows[t], pairs.cols[t], pairs.offsets[t]
        sums = map(add, keys * cols, weights[at: at + rows * cols])  # stop-major
        if rows == 1:
            keys = list(sums)
        else:  # the minimum of each run of ``rows`` sums, all in C
            keys = list(map(min, *([iter(sums)] * rows)))
        history.append(keys)
    if keys[segment.exit] >= unreachable:
        return None
    starts, col = [], segment.exit
    for t in range(segment.b - 1, segment.a - 1, -1):
        rows = pairs.rows[t]
        at = pairs.offsets[t] + col * rows
        sums = list(map(operator.add, history[t - segment.a], weights[at: at + rows]))
        col = sums.index(history[t + 1 - segment.a][col])  # row in window t: stage t-1's stop
        starts.append(pairs.lo[t] + col)
    return starts[::-1]


def _solve_long(model: StageCostModel, first_stage: int, pairs: _PairCosts, segment: _Segment,
                valid: np.ndarray) -> list[int] | None:
    """A segment whose ranked keys are too long: prune it to the pairs on paths
    within its own min-max bound, which pins new boundaries, and solve the parts
    (``valid`` is updated in place).

    A node's forward value is the least possible largest peak of a path from
    the entry to it, its backward value the same from it to the exit; the
    segment's min-max is the exit's forward value ``B``. A pair lies on a path
    whose peaks are all within ``B`` iff the larger of its start's forward
    value, its peak and its stop's backward value is within ``B``; every
    lexicographically optimal path has largest peak ``B``, so it uses only such
    pairs. A boundary left with one such node splits the segment there (exact by
    union compatibility). Without a new split, the multiset keys solve it.
    """
    grid = _Grid.of(pairs, segment, valid)
    forward, backward = grid.bottleneck_values(segment.entry, segment.exit)
    bound = int(forward[-1, segment.exit])
    if bound >= _INF:
        return None
    alive = grid.prune(valid, forward, backward, bound)
    counts = alive.sum(axis=1)
    nodes = alive.argmax(axis=1).tolist()
    pinned = (np.flatnonzero(counts[1:-1] == 1) + 1 + segment.a).tolist()
    cuts = [segment.a, *pinned, segment.b]
    if len(cuts) == 2:
        return _keyed_segment(model, first_stage, pairs, segment, valid)
    parts = [_Segment(a, b, entry=nodes[a - segment.a], exit=nodes[b - segment.a],
                      bound=bound) for a, b in zip(cuts, cuts[1:])]
    return _solve_segments(model, first_stage, pairs, parts, valid)


@dataclasses.dataclass(frozen=True)
class _Grid:
    """A segment's pair peaks padded to a (stages, width, width) array: entry
    ``[t, r, c]`` is stage ``a + t`` from node r of its start window to node c
    of its stop window, ``_INF`` where not a valid pair (or outside a window).
    ``index`` maps the segment's flat pairs into the grid."""

    costs: np.ndarray
    index: np.ndarray
    first: int
    last: int

    @classmethod
    def of(cls, pairs: _PairCosts, segment: _Segment, valid: np.ndarray) -> "_Grid":
        a, b = segment.a, segment.b
        first, last = pairs.offsets[a], pairs.offsets[b]
        rows, cols = np.asarray(pairs.rows[a:b]), np.asarray(pairs.cols[a:b])
        width = int(max(rows.max(), cols.max()))
        stage = np.repeat(np.arange(b - a), rows * cols)
        local = np.arange(last - first) - (np.asarray(pairs.offsets[a:b]) - first)[stage]
        per_stage = rows[stage]
        index = (stage * width + local % per_stage) * width + local // per_stage
        grid = np.full((b - a) * width * width, _INF, dtype=np.int64)
        grid[index] = np.where(valid[first:last], pairs.costs[first:last], _INF)
        return cls(costs=grid.reshape(b - a, width, width), index=index, first=first, last=last)

    def bottleneck_values(self, entry: int, exit: int) -> tuple[np.ndarray, np.ndarray]:
        """Forward and backward min-max values, (stages + 1, width), of every node."""
        stages, width, _ = self.costs.shape
        forward = np.full((stages + 1, width), _INF, dtype=np.int64)
        backward = np.full((stages + 1, width), _INF, dtype=np.int64)
        forward[0, entry] = 0
        backward[stages, exit] = 0
        scratch = np.empty((width, width), dtype=np.int64)
        for t in range(stages):
            np.maximum(forward[t][:, None], self.costs[t], out=scratch)
            scratch.min(axis=0, out=forward[t + 1])
        for t in range(stages - 1, -1, -1):
            np.maximum(self.costs[t], backward[t + 1][None, :], out=scratch)
            scratch.min(axis=1, out=backward[t])
        return forward, backward

    def prune(self, valid: np.ndarray, forward: np.ndarray, backward: np.ndarray,
              bound: int) -> np.ndarray:
        """Keep (in ``valid``) only pairs on paths within ``bound``; return which
        nodes of each boundary survive, (stages + 1, width)."""
        through = np.maximum(np.maximum(forward[:-1, :, None], self.costs), backward[1:, None, :])
        valid[self.first:self.last] &= through.ravel()[self.index] <= bound
        return (forward <= bound) & (backward <= bound)


def _keyed_segment(model: StageCostModel, first_stage: int, pairs: _PairCosts,
                   segment: _Segment, valid: np.ndarray) -> list[int] | None:
    """The multiset-key DP on a segment, over the hull of its surviving nodes."""
    a, b = segment.a, segment.b
    lo = [pairs.lo[a] + segment.entry] + pairs.lo[a + 1: b] + [pairs.lo[b] + segment.exit]
    hi = [lo[0]] + [l + c - 1 for l, c in zip(pairs.lo[a + 1: b], pairs.cols[a: b - 1])] + [lo[-1]]
    blocks = []
    for t in range(a, b):
        block = pairs.block(t, valid)
        rows = slice(segment.entry, segment.entry + 1) if t == a else slice(None)
        cols = slice(segment.exit, segment.exit + 1) if t == b - 1 else slice(None)
        blocks.append(block[rows, cols])
    return _keyed_dp(model, first_stage + a, lo, hi, segment.bound, iter(blocks))


def _keyed_dp(model: StageCostModel, first_stage: int, lo: list[int], hi: list[int],
              bound: int, blocks) -> list[int] | None:
    """The DP with multiset keys (see the module docstring); ``blocks`` yields each
    stage's (starts x stops) peaks, or None for a block too big to hold at once."""
    layer = _Layer(keys=[()], tops=[0])
    parents: list[list[int]] = []
    for b, costs in enumerate(blocks):
        if sum(top < _INF for top in layer.tops) == 1:
            layer = layer.restarted()
        if costs is None:
            layer, chosen = _dp_step_chunked(model, first_stage + b, layer, lo[b], lo[b + 1],
                                             hi[b + 1], bound)
        else:
            step = _dp_step_small if costs.size <= _SMALL_BLOCK else _dp_step_large
            layer, chosen = step(layer, lo[b], lo[b + 1], costs, bound)
        parents.append(chosen)
    if layer.tops[-1] >= _INF:
        return None
    starts, at = [], lo[-1]
    for b in range(len(lo) - 1, 0, -1):
        at = parents[b - 1][at - lo[b]]
        starts.append(at)
    return starts[::-1]


@dataclasses.dataclass(frozen=True)
class _Layer:
    """The DP nodes at one boundary: each node's key (None: unreachable) and its
    largest peak (``_INF``: unreachable)."""

    keys: list
    tops: list[int]

    def restarted(self) -> "_Layer":
        """Drop the history every path shares (one node is reachable)."""
        return _Layer(keys=[None if k is None else () for k in self.keys],
                      tops=[t if t >= _INF else 0 for t in self.tops])


def _insert(key: tuple, cost: int) -> tuple:
    at = bisect.bisect_left(key, (-cost,))
    if at < len(key) and key[at][0] == -cost:
        return key[:at] + ((-cost, key[at][1] - 1),) + key[at + 1:]
    return key[:at] + ((-cost, -1),) + key[at:]


def _pick(layer: _Layer, rows: list[int], costs: list[int]) -> tuple[tuple, int]:
    """Among tied candidates, the lexicographically best key, and its row."""
    best, best_row = None, -1
    for row, cost in zip(rows, costs):
        key = _insert(layer.keys[row], cost)
        if best is None or key > best:
            best, best_row = key, row
    return best, best_row


def _dp_step_small(layer: _Layer, row0: int, col0: int, costs: np.ndarray,
                   bound: int) -> tuple[_Layer, list[int]]:
    """One DP layer in plain Python: each end (column) takes its best start (row)."""
    table = costs.tolist()
    live = [(row, top) for row, top in enumerate(layer.tops) if top < _INF]
    keys, tops, parents = [], [], []
    for col in range(costs.shape[1]):
        best, rows, picked = _INF, None, None
        limit = col0 + col - row0  # rows (starts) strictly before this end
        for row, top in live:
            if row >= limit:
                break
            cost = table[row][col]
            if cost > bound:
                continue
            value = cost if cost > top else top
            if value < best:
                best, rows, picked = value, [row], [cost]
            elif value == best:
                rows.append(row)
                picked.append(cost)
        if rows is None:
            keys.append(None), tops.append(_INF), parents.append(-1)
            continue
        if len(rows) == 1:
            key, row = _insert(layer.keys[rows[0]], picked[0]), rows[0]
        else:
            key, row = _pick(layer, rows, picked)
        keys.append(key), tops.append(best), parents.append(row0 + row)
    return _Layer(keys=keys, tops=tops), parents


def _dp_step_large(layer: _Layer, row0: int, col0: int, costs: np.ndarray,
                   bound: int) -> tuple[_Layer, list[int]]:
    """``_dp_step_small`` vectorised, for wide windows."""
    top = np.asarray(layer.tops, dtype=np.int64)[:, None]
    starts = np.arange(row0, row0 + costs.shape[0])[:, None]
    stops = np.arange(col0, col0 + costs.shape[1])[None, :]
    valid = (starts < stops) & (costs <= bound) & (top < _INF)
    values = np.where(valid, np.maximum(top, costs), _INF)
    best = values.min(axis=0)
    ties: list[list[int]] = [[] for _ in range(costs.shape[1])]
    for col, row in zip(*np.nonzero((valid & (values == best)).T)):
        ties[col].append(int(row))
    keys, parents = [], []
    for col, rows in enumerate(ties):
        key, row = _pick(layer, rows, [int(costs[r, col]) for r in rows]) if rows else (None, -1)
        keys.append(key)
        parents.append(row0 + row if rows else -1)
    return _Layer(keys=keys, tops=best.tolist()), parents


def _dp_step_chunked(model: StageCostModel, stage: int, layer: _Layer, row0: int, col0: int,
                     col_last: int, bound: int) -> tuple[_Layer, list[int]]:
    """``_dp_step_large`` over column slices, for blocks too big to hold at once."""
    rows = np.arange(row0, row0 + len(layer.tops))[:, None]
    width = max(1, _BLOCK_ENTRIES // len(layer.tops))
    keys, tops, parents = [], [], []
    for start in range(col0, col_last + 1, width):
        cols = np.arange(start, min(start + width, col_last + 1))[None, :]
        part, chosen = _dp_step_large(layer, row0, start, model.peaks(stage, rows, cols), bound)
        keys += part.keys
        tops += part.tops
        parents += chosen
    return _Layer(keys=keys, tops=tops), parents


def _cost_blocks(model: StageCostModel, first_stage: int, lo: list[int], hi: list[int]):
    """Yield, stage by stage, the peaks of every (start, stop) pair the windows allow,
    or None for a stage whose block is too big to compute at once."""
    rows = np.asarray(hi[:-1]) - np.asarray(lo[:-1]) + 1
    cols = np.asarray(hi[1:]) - np.asarray(lo[1:]) + 1
    sizes = rows * cols
    first = 0
    while first < len(lo) - 1:
        if sizes[first] > _BLOCK_ENTRIES:
            yield None
            first += 1
            continue
        last = first + int(np.searchsorted(np.cumsum(sizes[first:]), _BLOCK_ENTRIES, side="right"))
        flat = _flat_peaks(model, first_stage, lo, first, last, rows, cols)
        offset = 0
        for b in range(first, last):
            yield flat[offset: offset + sizes[b]].reshape(rows[b], cols[b])
            offset += sizes[b]
        first = last


def _flat_peaks(model, first_stage, lo, first, last, rows, cols) -> np.ndarray:
    counts = rows[first:last] * cols[first:last]
    stage = np.repeat(np.arange(first, last), counts)
    local = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
    width = cols[stage]
    lo_arr = np.asarray(lo)
    starts = lo_arr[stage] + local // width
    stops = lo_arr[stage + 1] + local % width
    return model.peaks(first_stage + stage, starts, stops)
