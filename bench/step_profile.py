"""Where a training step's time goes, by op type, from TensorFlow's profiler.

``bench/vs_mirrored.py --profile`` traces a few steady ``fit`` steps of each side and prints,
per op type, the CPU milliseconds its kernels took per step summed over the devices, and how
many ran. Two sides computing the same step should spend about the same on the same kernels;
what one runs and the other does not is the gap. Found this way (bench/README.md): DTensor packs
the gradients it all-reduces together into one buffer with a ``TensorStridedSliceUpdate`` per
gradient and ``Slice``\\ s them out again, where MirroredStrategy packs with one ``ConcatV2`` and
one ``SplitV``.

Only TensorFlow op events are counted (the profiler names them ``name:Type``); the executor's,
the input pipeline's and Python's own events nest around them and are left out. A collective's
time includes its wait for the other devices, so it is shown but not added to the op total.
"""

from __future__ import annotations

import collections
import dataclasses
import glob
import os

COLLECTIVES = ("CollectiveReduceV2", "CollectiveGatherV2", "CollectiveAllToAllV2", "CollectiveReduceScatterV2",
               "CollectiveReduce", "CollectiveGather", "CollectiveBcastSend", "CollectiveBcastRecv")


@dataclasses.dataclass(frozen=True)
class OpTime:
    """One op type's kernels in the traced steps: CPU ms per step (over every device) and runs per step."""
    ms_per_step: float
    runs_per_step: float


def op_times(logdir: str, steps: int) -> dict[str, OpTime]:
    """Per op type, its kernels' time per step in the newest trace under ``logdir``."""
    from tensorflow.tsl.profiler.protobuf import xplane_pb2
    paths = sorted(glob.glob(os.path.join(logdir, "**", "*.xplane.pb"), recursive=True))
    if not paths:
        raise FileNotFoundError(f"no profiler trace (*.xplane.pb) under {logdir}")
    space = xplane_pb2.XSpace()
    with open(paths[-1], "rb") as trace:
        space.ParseFromString(trace.read())
    picoseconds, runs = collections.Counter(), collections.Counter()
    for plane in space.planes:
        if plane.name != "/host:CPU":
            continue
        for line in plane.lines:
            for event in line.events:
                name = plane.event_metadata[event.metadata_id].name
                if name.count(":") != 1 or name.startswith(("EagerLocalExecute", "MakeIterator")):
                    continue                                 # not an op: ``Class::Method`` and the like
                op_type = name.split(":")[1]
                if not op_type.lstrip("_")[:1].isalpha():
                    continue
                picoseconds[op_type] += event.duration_ps
                runs[op_type] += 1
    return {op: OpTime(picoseconds[op] / 1e9 / steps, runs[op] / steps) for op in picoseconds}


def profile_fit(model, x, y, *, batch_size: int, logdir: str) -> dict[str, OpTime]:
    """Op times of one more ``fit`` epoch over ``x, y`` of an already trained (traced) model."""
    import tensorflow as tf
    tf.profiler.experimental.start(logdir)
    try:
        model.fit(x, y, batch_size=batch_size, shuffle=False, verbose=0)
    finally:
        tf.profiler.experimental.stop()
    return op_times(logdir, steps=-(-len(x) // batch_size))


def kernel_total(times: dict[str, OpTime]) -> float:
    """CPU ms per step of every kernel but the collectives (whose time is mostly waiting)."""
    return sum(t.ms_per_step for op, t in times.items() if op not in COLLECTIVES)


def table(sides: dict[str, dict[str, OpTime]], top: int = 12) -> str:
    """The ``top`` op types by the largest difference between the sides, each side's ms and runs per
    step, then every side's kernel total."""
    names = list(sides)
    ops = set().union(*sides.values())

    def spread(op):
        values = [sides[side].get(op, OpTime(0.0, 0.0)).ms_per_step for side in names]
        return max(values) - min(values)

    header = f"  {'op type (CPU ms / step, runs / step)':<38}" + "".join(f"{name:>22}" for name in names)
    lines = [header]
    for op in sorted(ops, key=spread, reverse=True)[:top]:
        cells = []
        for side in names:
            t = sides[side].get(op)
            cells.append(f"{'-':>22}" if t is None else f"{t.ms_per_step:>13.1f} ({t.runs_per_step:>4.0f})")
        label = op + (" (incl. wait)" if op in COLLECTIVES else "")
        lines.append(f"  {label:<38}" + "".join(cells))
    lines.append(f"  {'kernels but collectives':<38}" + "".join(f"{kernel_total(sides[s]):>13.1f}{'':>9}" for s in names))
    return "\n".join(lines)
