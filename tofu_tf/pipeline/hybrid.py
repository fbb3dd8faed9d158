r"""Hybrid PP x TP x DP recommendation by predicted peak memory (CAPTURE style).

This module owns the choice of a pipeline x tensor x data parallel
factorisation of ``N`` devices for one model: it enumerates every
``pp * tp * dp = N``, predicts each one's peak memory per device and step
time, and ranks them -- lowest peak first, or, under a memory budget, fastest
among those that fit. It imports no TensorFlow; ``keras_stats.recommend_hybrid``
feeds it a model's statistics.

Per candidate, with global batch ``B``, ``m`` micro-batches of ``b = B / (dp m)``:

* Statistics at micro-batch ``b``: activation, transient and compute figures
  of each unit are affine in the micro-batch size (batch-sized tensors plus
  fixed ones), so ``ScalableChain`` interpolates them exactly from two captures.
  Convolution workspaces (``LayerStats.workspace_bytes``) are not affine:
  TensorFlow's CPU kernels size them by a cache, not by the batch, except
  that one image takes a smaller path; ``ScalableChain`` keeps both captures'
  values and uses the one-image figure at micro-batch 1, the other above.
* Tensor parallelism: even sharding of weights, optimizer state, activations
  and transients over ``tp`` devices (workspaces stay whole: a kernel's
  buffer does not shrink with fewer channels in proportion) (Megatron-style splits get close to it;
  replicated LayerNorm inputs make it optimistic for small ``tp``).
* Data parallelism: every replica holds the full state of its stage (no ZeRO).
* Pipeline: the exact partitioner (``tofu_tf.pipeline.partition``) splits the
  units into ``pp`` stages under the schedule; stage ``r`` keeps
  ``min(m, pp - r)`` micro-batches in flight under 1F1B.
* Peak per device: the ``MemoryRegression`` fitted on measured stage peaks,
  :math:`\beta_0 + \beta_S S + \beta_A A + \beta_W W + \beta_C C` of the worst stage; the
  partition minimises exactly that (the regression's ``scaled`` figures).
* Step time: ``(m + pp - 1)`` times the slowest stage's time per micro-batch
  (its compute over ``tp``, plus two ``tp``-way all-reduces of each weighted
  unit's output, plus sending and receiving its boundary tensors), plus the
  ``dp``-way all-reduce of the slowest stage's gradients. Devices are
  numbered with ``tp`` innermost, then ``dp``, then ``pp`` (Megatron's order),
  so a group gets the intra-node link when it fits in one node.

Default micro-batch count: ``m = 1`` without a pipeline; otherwise the largest
divisor of ``B / dp`` up to ``4 pp``. A candidate whose ``pp`` exceeds the
units, or whose batch does not split, is left out.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from tofu_tf.cost import hardware as hardware_profiles
from tofu_tf.cost.collectives import Collective, collective_cost
from tofu_tf.errors import InfeasibleBudgetError
from tofu_tf.pipeline.partition import partition
from tofu_tf.pipeline.regression import MemoryRegression
from tofu_tf.pipeline.stage_model import Schedule, inflight_microbatches
from tofu_tf.pipeline.stats import LayerStats

_FP32 = 4
_MAX_MICROBATCHES_PER_STAGE = 4


@dataclasses.dataclass(frozen=True)
class ScalableChain:
    """Per-unit figures as affine functions of the micro-batch size.

    Built from the same chain analysed at two micro-batch sizes; state and
    parameter counts must agree between them (they do not depend on the batch).
    """

    names: tuple[str, ...]
    state: tuple[int, ...]
    params: tuple[int, ...]
    activation: tuple[tuple[float, float], ...]   # (intercept, per sample)
    transient: tuple[tuple[float, float], ...]
    compute: tuple[tuple[float, float], ...]
    boundary: tuple[tuple[float, float], ...]     # bytes sent to the next unit
    workspace: tuple[tuple[int, int], ...] = ()   # (at the smaller, at the larger batch)
    workspace_split: float = 1.0                  # micro-batches above it use the larger

    @classmethod
    def from_two(cls, low: Sequence[LayerStats], low_batch: int, low_boundary: Sequence[int],
                 high: Sequence[LayerStats], high_batch: int,
                 high_boundary: Sequence[int]) -> "ScalableChain":
        if low_batch == high_batch:
            raise ValueError("ScalableChain needs the chain at two different micro-batch sizes")
        if [s.name for s in low] != [s.name for s in high]:
            raise ValueError("the two analyses have different units; analyse the same model twice")
        span = high_batch - low_batch

        def line(a: float, b: float) -> tuple[float, float]:
            slope = (b - a) / span
            return (a - slope * low_batch, slope)

        return cls(
            names=tuple(s.name for s in low),
            state=tuple(s.state_bytes for s in low),
            params=tuple(s.param_count for s in low),
            activation=tuple(line(a.activation_bytes, b.activation_bytes)
                             for a, b in zip(low, high)),
            transient=tuple(line(a.transient_bytes, b.transient_bytes) for a, b in zip(low, high)),
            compute=tuple(line(a.compute_seconds, b.compute_seconds) for a, b in zip(low, high)),
            boundary=tuple(line(a, b) for a, b in zip(low_boundary, high_boundary)),
            workspace=tuple((a.workspace_bytes, b.workspace_bytes) if low_batch < high_batch
                            else (b.workspace_bytes, a.workspace_bytes)
                            for a, b in zip(low, high)),
            workspace_split=min(low_batch, high_batch))

    def at(self, micro_batch: float, tp: int = 1) -> list[LayerStats]:
        """The chain at ``micro_batch`` samples per micro-batch, sharded ``tp`` ways."""
        def value(pair):
            return max(pair[0] + pair[1] * micro_batch, 0.0)

        workspace = self.workspace or ((0, 0),) * len(self.names)
        larger = micro_batch > self.workspace_split
        return [LayerStats(name=name, state_bytes=round(state / tp),
                           activation_bytes=round(value(act) / tp),
                           transient_bytes=round(value(transient) / tp),
                           param_count=params, compute_seconds=value(compute) / tp,
                           workspace_bytes=pair[1] if larger else pair[0])
                for name, state, params, act, transient, compute, pair in zip(
                    self.names, self.state, self.params, self.activation, self.transient,
                    self.compute, workspace)]

    def boundary_bytes(self, micro_batch: float) -> list[float]:
        return [max(a + s * micro_batch, 0.0) for a, s in self.boundary]


@dataclasses.dataclass(frozen=True)
class HybridCandidate:
    """One factorisation of the devices and what it is predicted to cost."""

    pp: int
    tp: int
    dp: int
    num_microbatches: int
    micro_batch_size: int
    boundaries: tuple[int, ...]          # first unit of each pipeline stage
    predicted_peak_bytes: int            # the regression's peak per device (worst stage)
    analytic_peak_bytes: int             # the plain stage model's peak of that stage split
    step_seconds: float
    fits_budget: bool | None             # None when no budget was given

    @property
    def shape(self) -> str:
        return f"{self.pp}x{self.tp}x{self.dp}"


@dataclasses.dataclass(frozen=True)
class HybridRecommendation:
    """Candidates ranked best first, and how they were judged."""

    candidates: tuple[HybridCandidate, ...]
    num_devices: int
    batch_size: int
    schedule: Schedule
    memory_budget_bytes: int | None
    regression: MemoryRegression
    unit_names: tuple[str, ...]

    @property
    def best(self) -> HybridCandidate:
        return self.candidates[0]

    def table(self, top: int = 10) -> str:
        """The top candidates as a table a person reads."""
        goal = ("lowest predicted peak per device" if self.memory_budget_bytes is None else
                f"fastest within {_mib(self.memory_budget_bytes):.2f} MiB per device")
        lines = [f"Hybrid PP x TP x DP plans for {self.num_devices} devices, global batch "
                 f"{self.batch_size}, {self.schedule.value}; ranked by {goal}",
                 f"memory model: {self.regression.describe()}",
                 f"{'rank':>4}  {'pp x tp x dp':>12}  {'m':>3}  {'micro':>5}  "
                 f"{'peak MiB':>10}  {'analytic MiB':>12}  {'step ms':>9}  {'fits':>4}  "
                 "stages (units)"]
        for rank, c in enumerate(self.candidates[:top], 1):
            fits = "-" if c.fits_budget is None else ("yes" if c.fits_budget else "no")
            lines.append(f"{rank:>4}  {c.shape:>12}  {c.num_microbatches:>3}  "
                         f"{c.micro_batch_size:>5}  {_mib(c.predicted_peak_bytes):>10.2f}  "
                         f"{_mib(c.analytic_peak_bytes):>12.2f}  {c.step_seconds * 1e3:>9.3f}  "
                         f"{fits:>4}  {self._stages(c)}")
        if len(self.candidates) > top:
            lines.append(f"... and {len(self.candidates) - top} more")
        return "\n".join(lines)

    def _stages(self, candidate: HybridCandidate) -> str:
        """Unit index ranges of the stages, e.g. ``0-4 5-9 10-16 17-19``."""
        stops = candidate.boundaries[1:] + (len(self.unit_names),)
        return " ".join(f"{a}-{b - 1}" if b - a > 1 else f"{a}"
                        for a, b in zip(candidate.boundaries, stops))


def factorizations(num_devices: int) -> list[tuple[int, int, int]]:
    """Every ``(pp, tp, dp)`` with ``pp * tp * dp == num_devices``."""
    if isinstance(num_devices, bool) or not isinstance(num_devices, int) or num_devices < 1:
        raise ValueError(f"num_devices must be a positive int, got {num_devices!r}")
    out = []
    for pp in _divisors(num_devices):
        for tp in _divisors(num_devices // pp):
            out.append((pp, tp, num_devices // (pp * tp)))
    return out


def rank_hybrid(chain: ScalableChain, *, num_devices: int, batch_size: int,
                regression: MemoryRegression, schedule: "Schedule | str" = "1f1b",
                num_microbatches: int | None = None, memory_budget_bytes: int | None = None,
                hardware: "hardware_profiles.HardwareProfile | str" = "h100-nvlink"
                ) -> HybridRecommendation:
    """Evaluate every factorisation of ``num_devices`` and rank them (module docstring)."""
    schedule = Schedule.from_user(schedule)
    hardware = hardware_profiles.profile(hardware)
    candidates = []
    for pp, tp, dp in factorizations(num_devices):
        m = _microbatches(batch_size, pp, dp, num_microbatches)
        if m is None or pp > len(chain.names):
            continue
        candidates.append(_evaluate(chain, pp, tp, dp, m, batch_size, schedule, regression,
                                    hardware, memory_budget_bytes))
    if not candidates:
        raise ValueError(
            f"no PP x TP x DP factorisation of {num_devices} devices splits batch {batch_size} "
            f"into {num_microbatches or 'whole'} micro-batches with at most "
            f"{len(chain.names)} stages; change batch_size or num_microbatches")
    ranked = _rank(candidates, memory_budget_bytes)
    return HybridRecommendation(candidates=tuple(ranked), num_devices=num_devices,
                                batch_size=batch_size, schedule=schedule,
                                memory_budget_bytes=memory_budget_bytes, regression=regression,
                                unit_names=chain.names)


def _rank(candidates: list[HybridCandidate], budget: int | None) -> list[HybridCandidate]:
    if budget is None:
        return sorted(candidates, key=lambda c: (c.predicted_peak_bytes, c.step_seconds))
    fitting = sorted((c for c in candidates if c.fits_budget),
                     key=lambda c: (c.step_seconds, c.predicted_peak_bytes))
    if not fitting:
        lowest = min(candidates, key=lambda c: c.predicted_peak_bytes)
        raise InfeasibleBudgetError(
            f"no PP x TP x DP plan fits {_mib(budget):.2f} MiB per device: the lowest predicted "
            f"peak is {_mib(lowest.predicted_peak_bytes):.2f} MiB ({lowest.shape}, "
            f"{lowest.num_microbatches} micro-batches). Raise the budget, add devices, or use "
            "more micro-batches")
    rest = sorted((c for c in candidates if not c.fits_budget),
                  key=lambda c: (c.predicted_peak_bytes, c.step_seconds))
    return fitting + rest


def _microbatches(batch_size: int, pp: int, dp: int, requested: int | None) -> int | None:
    if batch_size % dp:
        return None
    per_replica = batch_size // dp
    if requested is not None:
        return requested if per_replica % requested == 0 else None
    if pp == 1:
        return 1
    limit = min(per_replica, _MAX_MICROBATCHES_PER_STAGE * pp)
    return max(d for d in _divisors(per_replica) if d <= limit)


def _evaluate(chain, pp, tp, dp, m, batch_size, schedule, regression, hardware,
              budget) -> HybridCandidate:
    micro = batch_size // (dp * m)
    stats = chain.at(micro, tp)
    scaled = regression.scaled(stats)
    plan = partition(scaled, pp, schedule=schedule, num_microbatches=m)
    predicted = round(regression.coefficients[0] + plan.max_peak_bytes)
    worst = plan.stage_peak_bytes.index(plan.max_peak_bytes)
    start, stop = plan.stage_ranges[worst]
    k = inflight_microbatches(worst, pp, schedule, m)
    stage = stats[start:stop]
    analytic = (sum(s.state_bytes for s in stage) + k * sum(s.activation_bytes for s in stage)
                + max(s.transient_bytes for s in stage))
    seconds = _step_seconds(chain, stats, plan.stage_ranges, pp, tp, dp, m, micro, hardware)
    return HybridCandidate(pp=pp, tp=tp, dp=dp, num_microbatches=m, micro_batch_size=micro,
                           boundaries=plan.boundaries, predicted_peak_bytes=predicted,
                           analytic_peak_bytes=analytic, step_seconds=seconds,
                           fits_budget=None if budget is None else predicted <= budget)


def _step_seconds(chain, stats, ranges, pp, tp, dp, m, micro, hardware) -> float:
    tp_link = _link(hardware, tp)
    dp_link = _link(hardware, tp * dp)
    pp_link = _link(hardware, tp * dp * pp)
    boundary = chain.boundary_bytes(micro)
    slowest, gradient_sync = 0.0, 0.0
    for start, stop in ranges:
        per_micro = sum(s.compute_seconds for s in stats[start:stop])
        if tp > 1:
            per_micro += sum(2 * collective_cost(Collective.ALL_REDUCE, boundary[l], tp,
                                                 tp_link).seconds
                             for l in range(start, stop) if chain.params[l] > 0)
        if pp > 1:
            sent = boundary[stop - 1] + (boundary[start - 1] if start > 0 else 0.0)
            per_micro += sent / tp / pp_link.bandwidth + 2 * pp_link.latency
        slowest = max(slowest, per_micro)
        if dp > 1:
            gradient_bytes = _FP32 * sum(chain.params[start:stop]) / tp
            gradient_sync = max(gradient_sync, collective_cost(Collective.ALL_REDUCE,
                                                               gradient_bytes, dp, dp_link).seconds)
    return (m + pp - 1) * slowest + gradient_sync


def _link(hardware, span: int):
    fits = span <= hardware.devices_per_node and hardware.devices_per_node % span == 0
    return hardware.intra_node if fits else hardware.inter_node


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _mib(nbytes: float) -> float:
    return nbytes / 2**20
