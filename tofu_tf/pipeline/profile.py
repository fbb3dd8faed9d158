"""Measured per-layer statistics (mCAP / CAPSlog style), from few trimmed runs.

This module owns the profiling *plan* and the bookkeeping around it: which
stages to run, how they pack into runs, how the peaks become ``isolated_bytes``
and ``added_bytes``, and how many runs mCAP's scheme would need instead. The
stages themselves run in subprocesses (``tofu_tf.pipeline.profile_worker``),
the only place TensorFlow is imported, with ``TF_CPU_ALLOCATOR_USE_BFC=true`` so
``tf.config.experimental.get_memory_info`` reports peaks (it must be set before
TensorFlow starts, and DTensor misbehaves under it, hence a fresh process).

mCAP's figures (Euro-Par'22): ``isolated[l]`` is the peak of a stage holding
layer ``l`` alone, ``added[l]`` how much a stage's peak grows when ``l`` is
appended; a stage ``[i, j)`` is then predicted as
``isolated[i] + sum(added[i+1..j-1])`` (``tofu_tf.pipeline.stage_model``).

The plan here. A stage's peak depends only on its own layers, so a stage need
not sit in a full pipeline: the layers around it are *trimmed* -- replaced by
stand-ins that feed it an input of the right shape and a gradient for its
output (CAPSlog's dummy tensors, taken to the limit: trimmed layers do not run
at all). Then

* ``isolated[l]`` needs the one-unit stage ``[l]``;
* ``added[l] = peak([l-1, l]) - isolated[l-1]`` needs the two-unit stage
  ``[l-1, l]`` -- at most two intact layers per device, as in CAPSlog;
* the growth of ``[l]``'s peak from one to two micro-batches in flight (a
  second step of the same stage, in the same run) is its measured
  ``activation_bytes`` (what each further in-flight micro-batch
  costs, in the same allocator's terms as the other two figures);
* units with equal signatures (same forward ops on the same shapes: the blocks
  of a Transformer) share figures, and so do equal neighbour pairs, so only
  distinct stages run. The first and last units (model input; loss) are never
  shared.

A *run* is one profiling job on ``num_devices`` devices, as in mCAP and
CAPSlog: one launch, each device holding a few layers. A device here holds at
most two intact neighbouring units, ``[l-1, l]`` (CAPSlog's limit), and
measures every distinct stage nested in them that the plan still needs, one
training step each with the peak statistics reset in between: the pair itself
and the single units ``[l-1]`` and ``[l]`` (each single at one and two
micro-batches in flight). It never holds more than the pair stage it measures,
so its memory is that stage's; what it spends is up to five measured steps
(plus one warm-up step per stage) where a device of an mCAP run measures one
stage in one step. Devices are then ``distinct pairs`` (plus any single left
over), and runs ``ceil(devices / num_devices)`` -- about ``L / p`` for ``L``
units without repeats, against about ``L - 2`` for mCAP's scheme
(``get_mCAP_partitionings`` in CAPSlog's code, one full pipeline per layer it
isolates; ``mcap_run_count``). On CPU a run is one subprocess whose devices'
stages execute one after another, each peak read after ``reset_memory_stats``.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import subprocess
import sys
import tempfile
from typing import Callable, Sequence

from absl import logging

from tofu_tf.errors import TofuError
from tofu_tf.pipeline.graph_stats import ChainAnalysis
from tofu_tf.pipeline.stats import LayerStats

# A profiling subprocess that has not finished by then is stuck, not slow.
_WORKER_TIMEOUT_S = 900


class ProfilingError(TofuError, RuntimeError):
    """A profiling subprocess failed; the message carries its error output."""


@dataclasses.dataclass(frozen=True)
class StageProbe:
    """One stage to measure: units ``[start, stop)``, once per in-flight micro-batch count."""

    start: int
    stop: int
    inflights: tuple[int, ...] = (1,)


@dataclasses.dataclass(frozen=True)
class StageJob:
    """What a worker needs to build and run one stage of the real model."""

    layers: tuple[str, ...]     # top-level layer names, in order
    first: bool                 # the stage starts at the model input
    last: bool                  # the stage ends at the model output (runs the loss)
    inflights: tuple[int, ...]  # micro-batches alive together, one measured step each


@dataclasses.dataclass(frozen=True)
class WorkerRequest:
    """One subprocess's work: build the model, run each stage, report peaks."""

    builder: Callable
    micro_batch: int
    loss: object
    optimizer: object
    stages: tuple[StageJob, ...]


@dataclasses.dataclass(frozen=True)
class ProfileResult:
    """Measured statistics and what they cost."""

    stats: tuple[LayerStats, ...]
    probes: tuple[StageProbe, ...]        # distinct stages run
    peaks: tuple[tuple[int, ...], ...]    # their measured peaks (bytes) per in-flight count
    runs: int                             # profiling runs on num_devices devices
    mcap_runs: int | None                 # runs mCAP's scheme needs (None: chain too short for it)
    num_devices: int
    steps_per_device: int                 # most measured steps one device takes in a run

    @property
    def run_ratio(self) -> float | None:
        return None if self.mcap_runs is None else self.runs / self.mcap_runs


def mcap_run_count(num_layers: int, num_devices: int) -> int:
    """Runs mCAP's profiling scheme needs (CAPSlog's ``get_mCAP_partitionings``).

    One profiling partitioning per layer ``l`` in ``1 .. L-2``: the first layers
    fill devices ``(L-2) // (p-2) + 1`` at a time up to ``l``, layer ``l`` gets a
    device of its own, the rest spread evenly; partitionings without a layer
    left for every remaining device are skipped, and two more are added when
    the last one does not end in three single-layer stages.
    """
    if num_devices < 3 or num_layers < 2 * num_devices - 2:
        raise ValueError(f"mCAP's scheme needs num_devices >= 3 and num_layers >= "
                         f"2 * num_devices - 2, got {num_layers} layers, {num_devices} devices")
    per_device = (num_layers - 2) // (num_devices - 2) + 1
    partitionings = []
    for layer in range(1, num_layers - 1):
        head = _mcap_head(layer, per_device)
        left_devices, left_layers = num_devices - len(head), num_layers - sum(head)
        if left_layers >= left_devices:
            partitionings.append(head + _even(left_devices, left_layers))
    extra = 2 if partitionings and partitionings[-1][-3:] != [1, 1, 1] else 0
    return len(partitionings) + extra


def _mcap_head(layer: int, per_device: int) -> list[int]:
    """Devices up to and including the isolated layer ``layer`` (mCAP's fill)."""
    devices = layer // per_device + 1
    head, left = [], layer
    for _ in range(devices):
        take = min(per_device, left)
        head.append(take)
        left -= take
    if head[-1] == 0:
        head[-2] += 1
        head[-1] = 1
    return head + [1]


def _even(devices: int, layers: int) -> list[int]:
    if devices == 0:
        return []
    size, extra = divmod(layers, devices)
    return [size + (1 if d < extra else 0) for d in range(devices)]


@dataclasses.dataclass(frozen=True)
class ProbePlan:
    """Distinct stages to measure, how they share devices, and, per unit, which of
    them give its figures."""

    probes: tuple[StageProbe, ...]
    isolated: tuple[int, ...]            # unit l alone, at one and two micro-batches in flight
    paired: tuple[int | None, ...]       # units l-1 and l (None for the first unit)
    devices: tuple[tuple[int, ...], ...]  # probes measured by one device, nested in its units

    def run_indices(self, num_devices: int) -> list[tuple[int, ...]]:
        """The probe indices of each run: devices packed ``num_devices`` to a run."""
        return [tuple(i for device in self.devices[d: d + num_devices] for i in device)
                for d in range(0, len(self.devices), num_devices)]

    def runs(self, num_devices: int) -> list[tuple[StageProbe, ...]]:
        """The probes of each run (see ``run_indices``)."""
        return [tuple(self.probes[i] for i in run) for run in self.run_indices(num_devices)]

    def steps_per_device(self) -> int:
        """Most measured steps one device takes in a run (one per in-flight count
        of each of its stages)."""
        return max(sum(len(self.probes[i].inflights) for i in device) for device in self.devices)


def plan_probes(analysis: ChainAnalysis) -> ProbePlan:
    """The stages a profile needs, each distinct stage once (see the module docstring)."""
    units = analysis.units
    last = len(units) - 1

    def key(index: int) -> str:
        return f"#{index}" if index in (0, last) else units[index].signature or f"#{index}"

    probes: list[StageProbe] = []
    index_of: dict[tuple, int] = {}

    def probe(start: int, stop: int, inflights: tuple[int, ...]) -> int:
        shape = tuple(key(i) for i in range(start, stop))
        if shape not in index_of:
            index_of[shape] = len(probes)
            probes.append(StageProbe(start, stop, inflights))
        return index_of[shape]

    isolated = tuple(probe(i, i + 1, (1, 2)) for i in range(len(units)))
    paired = (None,) + tuple(probe(i - 1, i + 1, (1,)) for i in range(1, len(units)))
    return ProbePlan(tuple(probes), isolated, paired, _devices(probes, isolated, paired))


def _devices(probes: list[StageProbe], isolated: tuple[int, ...],
             paired: tuple[int | None, ...]) -> tuple[tuple[int, ...], ...]:
    """One device per distinct pair stage, also measuring the not yet assigned
    single-unit stages nested in it; a single left over gets a device of its own."""
    devices, assigned = [], set()
    for index, pair in enumerate(paired):
        if pair is None or pair in assigned:
            continue
        probe = probes[pair]
        singles = [isolated[u] for u in range(probe.start, probe.stop)]
        device = [i for i in dict.fromkeys(singles) if i not in assigned] + [pair]
        assigned.update(device)
        devices.append(tuple(device))
    devices += [(i,) for i in dict.fromkeys(isolated) if i not in assigned]
    return tuple(devices)


def measure(analysis: ChainAnalysis, builder: Callable, *, micro_batch: int, loss, optimizer,
            num_devices: int = 8) -> ProfileResult:
    """Measure every unit's ``isolated_bytes``, ``added_bytes`` and, from one more
    micro-batch in flight, its ``activation_bytes`` (see the module docstring)."""
    if num_devices < 1:
        raise ValueError(f"num_devices must be >= 1, got {num_devices}")
    plan = plan_probes(analysis)
    runs = plan.run_indices(num_devices)
    peaks: list[tuple[int, ...]] = [()] * len(plan.probes)
    for number, run in enumerate(runs):
        logging.info("profiling run %d/%d: %d stages", number + 1, len(runs), len(run))
        measured = measure_stage_peaks(analysis, builder, [plan.probes[i] for i in run],
                                       micro_batch=micro_batch, loss=loss, optimizer=optimizer)
        for index, peak in zip(run, measured):
            peaks[index] = peak
    stats = []
    for index, layer in enumerate(analysis.stats):
        iso, doubled = peaks[plan.isolated[index]]
        added = (iso if index == 0 else
                 peaks[plan.paired[index]][0] - peaks[plan.isolated[index - 1]][0])
        stats.append(dataclasses.replace(layer, isolated_bytes=iso, added_bytes=max(added, 0),
                                         activation_bytes=max(doubled - iso, 0)))
    units = len(analysis.units)
    mcap = (mcap_run_count(units, num_devices)
            if units >= 2 * num_devices - 2 and num_devices >= 3 else None)
    return ProfileResult(stats=tuple(stats), probes=plan.probes, peaks=tuple(peaks),
                         runs=len(runs), mcap_runs=mcap, num_devices=num_devices,
                         steps_per_device=plan.steps_per_device())


def measure_stage_peaks(analysis: ChainAnalysis, builder: Callable, probes: Sequence[StageProbe], *,
                        micro_batch: int, loss, optimizer) -> list[tuple[int, ...]]:
    """Peak bytes of each stage at each of its in-flight counts, measured in one
    subprocess (one run)."""
    last = len(analysis.units)
    jobs = tuple(StageJob(layers=tuple(name for unit in analysis.units[p.start:p.stop]
                                       for name in unit.layers),
                          first=p.start == 0, last=p.stop == last, inflights=p.inflights)
                 for p in probes)
    request = WorkerRequest(builder=builder, micro_batch=micro_batch, loss=loss,
                            optimizer=optimizer, stages=jobs)
    return run_worker(request)


def run_worker(request: WorkerRequest) -> list[tuple[int, ...]]:
    """Run ``request`` in a fresh Python with the BFC allocator; return its peaks."""
    try:
        payload = pickle.dumps(request)
    except Exception as error:  # pickling failures come in many types
        raise ProfilingError(
            f"cannot send the model builder to a profiling subprocess ({error}); pass "
            "model_fn, a picklable zero-argument callable such as "
            "functools.partial(tofu_tf.models.gpt, num_layers=4)") from error
    env = dict(os.environ, TF_CPU_ALLOCATOR_USE_BFC="true", TF_CPP_MIN_LOG_LEVEL="2",
               PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    with tempfile.TemporaryDirectory() as folder:
        out_path = os.path.join(folder, "peaks.pickle")
        done = subprocess.run([sys.executable, "-m", "tofu_tf.pipeline.profile_worker", out_path],
                              input=payload, env=env, capture_output=True,
                              timeout=_WORKER_TIMEOUT_S, check=False)
        if done.returncode != 0 or not os.path.exists(out_path):
            tail = done.stderr.decode(errors="replace")[-3000:]
            raise ProfilingError(f"profiling subprocess failed (exit {done.returncode}):\n{tail}")
        with open(out_path, "rb") as handle:
            return pickle.load(handle)


def config_builder(model) -> Callable:
    """A picklable builder that rebuilds ``model`` from its Keras config, or a
    clear error when the model cannot be rebuilt that way."""
    from tofu_tf.pipeline import profile_worker
    return profile_worker.ConfigBuilder.of(model)


