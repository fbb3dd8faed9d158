"""The lexicographic dynamic program over boundary windows (exact, no TensorFlow).

Given windows ``[lo_b, hi_b]`` for every stage boundary of a piece of the chain
and a bound on every stage's peak, ``lex_dp`` returns the starts of the
partition whose descending-sorted stage peaks are lexicographically smallest
(the recurrence is in ``tofu_tf.pipeline.exact_search``'s docstring). This
module owns the DP's keys, its per-stage steps (plain Python for small blocks,
numpy for wide ones, column slices for huge ones) and the stage peaks of each
block, computed by ``StageCostModel.peaks``.

A node's key is the multiset of its path's stage peaks since the last
boundary with a single reachable node (earlier peaks are common to every
candidate and cancel), run-length encoded as ``((-peak, -count), ...)`` by
descending peak. Among keys of equally many peaks, a larger tuple is a
lexicographically smaller descending peak vector; repeated peaks (identical
layers) keep keys short.
"""

from __future__ import annotations

import bisect
import dataclasses

import numpy as np

from tofu_tf.pipeline.stage_model import StageCostModel

INF = int(np.iinfo(np.int64).max)
_INF = INF
# DP blocks up to this many entries are scanned in plain Python, larger ones in numpy.
_SMALL_BLOCK = 64
# Peaks computed per numpy call when filling DP blocks.
_BLOCK_ENTRIES = 1 << 20


def lex_dp(model: StageCostModel, first_stage: int, lo: list[int], hi: list[int],
           bound: int) -> list[int] | None:
    """Lexicographically optimal starts of stages ``first_stage, first_stage + 1, ...``
    of a piece whose boundary b lies in ``[lo[b], hi[b]]`` (``lo[0] == hi[0]``
    is the piece's first layer, ``lo[-1] == hi[-1]`` its end), every peak
    within ``bound``; None if there is no such partition."""
    layer = _Layer(keys=[()], tops=[0])
    parents: list[list[int]] = []
    for b, costs in enumerate(_cost_blocks(model, first_stage, lo, hi)):
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
