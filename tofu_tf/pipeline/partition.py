r"""Where to cut a sequential model into pipeline stages so memory is balanced.

This module owns the choice of stage boundaries: the exact memory-centric
partitioner (``method="optimal"``, CAPSlog's objective) and the baselines it is
compared with (Megatron's uniform split, DeepSpeed's ``partition_method=
"parameters"``, torchgpipe's ``balance_by_time``). What a stage costs is not its
business -- that is ``stage_model`` -- and it imports no TensorFlow.

Problem
-------
Layers ``0..n-1`` go to ``p`` stages in order: stage ``r`` holds ``[x_r, x_{r+1})``
with ``0 = x_0 < x_1 < ... < x_p = n``; ``c_r(i, j)`` is its peak
(``StageCostModel.peaks``). "optimal" minimises the vector of stage peaks sorted
in descending order, lexicographically: first the largest peak, then the second
largest, and so on (CAPSlog's tie-breaking rule, made exact).

How: ``tofu_tf.pipeline.exact_search`` (bisection on the min-max bound with
greedy probes, boundary windows, decomposition into independent pieces) and
``tofu_tf.pipeline.lex_dp`` (the lexicographic DP over the windows); their
docstrings give the recurrence and why each pruning step is exact.
"""

from __future__ import annotations

import dataclasses
import enum
import time
from typing import Sequence

from tofu_tf.pipeline.exact_search import min_max_prefix_split, optimal_boundaries
from tofu_tf.pipeline.stage_model import (Schedule, StageCostModel, check_pipeline_shape,
                                          inflight_microbatches, stage_peak_bytes)
from tofu_tf.pipeline.stats import LayerStats, validate_chain


class Method(enum.Enum):
    """How ``partition`` chooses boundaries."""

    OPTIMAL = "optimal"        # exact lexicographic min of the stage peaks
    UNIFORM = "uniform"        # equal layer counts (Megatron-LM)
    PARAMETERS = "parameters"  # balanced param_count (DeepSpeed partition_method)
    TIME = "time"              # balanced compute_seconds (torchgpipe balance_by_time)

    @classmethod
    def from_user(cls, value: "Method | str") -> "Method":
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            for method in cls:
                if method.value == value.strip().lower():
                    return method
        allowed = ", ".join(repr(m.value) for m in cls)
        raise ValueError(f"unknown method {value!r}; expected one of {allowed}")


@dataclasses.dataclass(frozen=True)
class StagePlan:
    """Stage boundaries for one chain, with the peak each stage will reach."""

    boundaries: tuple[int, ...]        # first layer of each stage; boundaries[0] == 0
    stage_peak_bytes: tuple[int, ...]  # peak of each stage under the stage model
    method: Method
    schedule: Schedule
    num_microbatches: int
    search_seconds: float
    layer_names: tuple[str, ...]

    @property
    def num_stages(self) -> int:
        return len(self.boundaries)

    @property
    def max_peak_bytes(self) -> int:
        return max(self.stage_peak_bytes)

    @property
    def stage_ranges(self) -> tuple[tuple[int, int], ...]:
        """``(start, stop)`` layer range of each stage."""
        stops = self.boundaries[1:] + (len(self.layer_names),)
        return tuple(zip(self.boundaries, stops))

    def summary(self) -> str:
        """A table a person reads: layers, in-flight micro-batches and peak per stage."""
        header = (f"StagePlan: {len(self.layer_names)} layers on {self.num_stages} stages, "
                  f"method={self.method.value}, schedule={self.schedule.value}, "
                  f"{self.num_microbatches} micro-batches, "
                  f"search {self.search_seconds * 1e3:.1f} ms")
        rows = [f"{'stage':>5}  {'layers':>6}  {'in-flight':>9}  {'peak':>11}  first .. last"]
        for r, (start, stop) in enumerate(self.stage_ranges):
            inflight = inflight_microbatches(r, self.num_stages, self.schedule,
                                             self.num_microbatches)
            names = f"{self.layer_names[start]} .. {self.layer_names[stop - 1]}"
            rows.append(f"{r:>5}  {stop - start:>6}  {inflight:>9}  "
                        f"{_format_bytes(self.stage_peak_bytes[r]):>11}  {names}")
        worst = self.stage_peak_bytes.index(self.max_peak_bytes)
        footer = f"max stage peak {_format_bytes(self.max_peak_bytes)} (stage {worst})"
        return "\n".join([header, *rows, footer])


def partition(stats: Sequence[LayerStats], num_stages: int, *, schedule: "Schedule | str" = "1f1b",
              num_microbatches: int, method: "Method | str" = "optimal") -> StagePlan:
    """Cut a chain of layers into ``num_stages`` pipeline stages with balanced peak memory.

    A stage's peak (``stage_peak_bytes``) is its layers' state, plus the activations of
    every micro-batch it holds in flight under ``schedule``, plus its largest transient
    (measured figures replace these where every layer has them). Under 1F1B the first
    stage holds the most micro-batches, so equal layer counts leave it fullest. "optimal"
    minimizes the largest stage peak, then the second largest, and so on, exactly; the
    other methods are the baselines it is compared with.

    Args:
        stats: One ``LayerStats`` per layer (or unit), in order, such as ``layer_stats``
            returns; names must be unique.
        num_stages: How many stages to cut the chain into; at most one per layer.
        schedule: The pipeline schedule, "1f1b" or "gpipe" (or a ``Schedule``).
        num_microbatches: Micro-batches per step; with the schedule, it sets how many each
            stage holds in flight.
        method: "optimal" (the exact lexicographic minimum of the stage peaks), "uniform"
            (equal layer counts, Megatron-LM), "parameters" (balanced ``param_count``,
            DeepSpeed) or "time" (balanced ``compute_seconds``, torchgpipe); or a ``Method``.

    Returns:
        A ``StagePlan``: the first layer of each stage (``boundaries``), each stage's peak
        (``stage_peak_bytes``, under the stage model whatever the method); ``summary()``
        prints it.

    Raises:
        ValueError: ``stats`` is empty or has two layers of one name, ``num_stages`` or
            ``num_microbatches`` is not an integer >= 1, ``num_stages`` exceeds the layers,
            or ``schedule`` or ``method`` is unknown.
        TypeError: An item of ``stats`` is not a ``LayerStats``.

    Example:
        >>> from tofu_tf.pipeline import LayerStats
        >>> layers = [LayerStats(name=f"l{i}", state_bytes=s, activation_bytes=1,
        ...                      transient_bytes=0) for i, s in enumerate([8, 1, 1, 1, 1, 8])]
        >>> plan = partition(layers, 2, schedule="gpipe", num_microbatches=1)
        >>> plan.boundaries, plan.stage_peak_bytes
        ((0, 3), (13, 13))
    """
    chain = validate_chain(stats)
    method = Method.from_user(method)
    schedule = Schedule.from_user(schedule)
    check_pipeline_shape(num_stages, num_microbatches)
    if num_stages > len(chain):
        raise ValueError(f"num_stages={num_stages} exceeds the {len(chain)} layers; "
                         "every stage needs at least one layer")
    started = time.perf_counter()
    boundaries = _boundaries(method, chain, num_stages, schedule, num_microbatches)
    seconds = time.perf_counter() - started
    stops = boundaries[1:] + (len(chain),)
    peaks = tuple(stage_peak_bytes(chain, start, stop, r, num_stages, schedule, num_microbatches)
                  for r, (start, stop) in enumerate(zip(boundaries, stops)))
    return StagePlan(boundaries=boundaries, stage_peak_bytes=peaks, method=method,
                     schedule=schedule, num_microbatches=int(num_microbatches),
                     search_seconds=seconds, layer_names=tuple(l.name for l in chain))


def _boundaries(method: Method, chain, num_stages, schedule, num_microbatches) -> tuple[int, ...]:
    if method is Method.OPTIMAL:
        model = StageCostModel.for_chain(chain, num_stages, schedule, num_microbatches)
        return optimal_boundaries(model)
    if method is Method.UNIFORM:
        return uniform_boundaries(len(chain), num_stages)
    if method is Method.PARAMETERS:
        return balanced_boundaries([l.param_count for l in chain], num_stages)
    return balanced_boundaries([round(l.compute_seconds * 1e9) for l in chain], num_stages)


# --------------------------------------------------------------------------- baselines


def uniform_boundaries(num_layers: int, num_stages: int) -> tuple[int, ...]:
    """Equal layer counts; the first ``num_layers % num_stages`` stages get one more."""
    size, extra = divmod(num_layers, num_stages)
    return tuple(r * size + min(r, extra) for r in range(num_stages))


def balanced_boundaries(weights: Sequence[int], num_stages: int) -> tuple[int, ...]:
    """Contiguous split minimising the heaviest stage's weight sum (a balanced prefix split).

    Among the splits reaching that minimum, the one filling earlier stages first,
    as DeepSpeed's ``partition_balanced`` does. All-zero weights split uniformly.
    """
    weights = [int(w) for w in weights]
    if not any(weights):
        return uniform_boundaries(len(weights), num_stages)
    return min_max_prefix_split(weights, num_stages)


def _format_bytes(count: int) -> str:
    if count < 1024:
        return f"{count} B"
    value, unit = float(count), "B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        value /= 1024
        if value < 1024:
            break
    return f"{value:.2f} {unit}"

