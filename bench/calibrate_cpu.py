"""Measure what the `cpu-virtual` hardware profile should say, on this machine.

DTensor on CPU runs a collective as one call into the collective executor, not as
the n-1 ring steps a GPU library pipelines; whether its fixed cost grows with the
group size decides which meshes the planner prefers. So this times all-gathers
and all-reduces (partial sums) over groups of 2, 4 and 8 of the 8 virtual CPU
devices, at a small and a large size, and fits both latency models by least squares:

* ``per step``: seconds = ring steps x latency + ring bytes / bandwidth (GPU rings);
* ``per call``: seconds = latency + ring bytes / bandwidth (one call per collective).

(The fit weighs every point by its relative error, so the 4 KiB points decide the
latency as much as the 4 MiB points decide the bandwidth.)

It prints every point, both fits with their mean absolute percentage error, the
FLOP rate of a matmul every device runs at once and the bytes/s of an element-wise
update every device runs at once (the compute term's two rates).

Last, the price of DTensor's all-reduce combining (``Link.combine_copy_bandwidth``): a step
that all-reduces k independent partial sums (k = 2, 8, 32; 0.5, 4 and 16 MiB in all) is
compiled twice, combined (DTensor's default) and one by one
(``DTENSOR_ALLREDUCE_COMBINE_OPTIMIZATION_GROUP_SIZE=1``, read at each compile), and the
differences are fit as combined - one by one = bytes / copy bandwidth - (k - 1) x latency
(the latency an independent all-reduce adds beside others, which overlap). Run:
    python bench/calibrate_cpu.py [--repeats=7]
"""

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app, flags, logging  # noqa: E402

flags.DEFINE_integer("repeats", 7, "Timed calls per point (median reported).")
FLAGS = flags.FLAGS

NUM_DEVICES = 8
GROUPS = (2, 4, 8)
SIZES_BYTES = (4 * 2**10, 256 * 2**10, 4 * 2**20)


def _median_seconds(fn):
    fn()  # trace and warm up
    fn()
    times = []
    for _ in range(FLAGS.repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _collective_points(tf, dtensor):
    """(kind, group, bytes per device, ring steps, ring bytes, seconds) for every point."""
    from tofu_tf.cost.collectives import Collective, _BYTES_FACTOR, _STEPS
    devices = [f"CPU:{i}" for i in range(NUM_DEVICES)]
    points = []
    for group in GROUPS:
        mesh = dtensor.create_mesh([("r", NUM_DEVICES // group), ("x", group)], devices=devices)
        replicated = dtensor.Layout.replicated(mesh, 2)
        gather = tf.function(lambda t: dtensor.relayout(t, replicated))
        reduce = tf.function(lambda t: tf.reduce_sum(t, axis=0))  # partial sums over x, then all-reduce
        for nbytes in SIZES_BYTES:
            # all-gather: each device ends with `nbytes`; reduce: each device holds `nbytes` of partials
            rows = group * 8
            gathered = dtensor.call_with_layout(tf.ones, dtensor.Layout(["x", dtensor.UNSHARDED], mesh),
                                                shape=(rows, nbytes // 4 // rows))
            partial = dtensor.call_with_layout(tf.ones, dtensor.Layout(["x", dtensor.UNSHARDED], mesh),
                                               shape=(group, nbytes // 4))
            for kind, fn, arg in ((Collective.ALL_GATHER, gather, gathered),
                                  (Collective.ALL_REDUCE, reduce, partial)):
                seconds = _median_seconds(lambda: dtensor.unpack(fn(arg))[0].numpy())
                points.append((kind, group, nbytes, _STEPS[kind](group), _BYTES_FACTOR[kind](group) * nbytes,
                               seconds))
                print(f"{kind.value:>15}{group:>7}{nbytes / 2**10:>10.0f}{seconds * 1e3:>10.2f}", flush=True)
    return points


COMBINED_COUNTS = (2, 8, 32)
COMBINED_BYTES = (2**19, 4 * 2**20, 16 * 2**20)
_GROUP_SIZE_ENV = "DTENSOR_ALLREDUCE_COMBINE_OPTIMIZATION_GROUP_SIZE"


def _combining_points(tf, dtensor):
    """(k, bytes per device, combined seconds, one-by-one seconds) per point."""
    devices = [f"CPU:{i}" for i in range(NUM_DEVICES)]
    mesh = dtensor.create_mesh([("batch", NUM_DEVICES)], devices=devices)
    replicated = dtensor.Layout.replicated(mesh, 2)
    batch = dtensor.Layout.batch_sharded(mesh, "batch", 2)
    points = []
    for k in COMBINED_COUNTS:
        for total in COMBINED_BYTES:
            width = int((total / 4 / k) ** 0.5) // 8 * 8
            xs = [dtensor.call_with_layout(tf.ones, batch, shape=(8, width)) for _ in range(k)]
            sums = [dtensor.DVariable(dtensor.call_with_layout(tf.zeros, replicated, shape=(width, width)))
                    for _ in range(k)]

            def step():
                for x, held in zip(xs, sums):      # partial sums over the batch, all-reduced into `held`
                    held.assign_add(tf.matmul(x, x, transpose_a=True))
                return tf.add_n([held[0, 0] for held in sums])
            seconds = []
            for group_size in (None, "1"):
                if group_size is None:
                    os.environ.pop(_GROUP_SIZE_ENV, None)
                else:
                    os.environ[_GROUP_SIZE_ENV] = group_size
                compiled = tf.function(step)       # a new program: compiled under this setting
                seconds.append(_median_seconds(lambda: compiled().numpy()))
            os.environ.pop(_GROUP_SIZE_ENV, None)
            points.append((k, k * width * width * 4, *seconds))
            print(f"{k:>4}{k * width * width * 4 / 2**20:>10.2f}{seconds[0] * 1e3:>12.2f}{seconds[1] * 1e3:>12.2f}",
                  flush=True)
    return points


def _fit_combining(points):
    """(copy bytes per second, latency) for combined - one by one = bytes / rate - (k - 1) latency."""
    import numpy as np
    a = np.array([[nbytes, -(k - 1)] for k, nbytes, _, _ in points], dtype=float)
    d = np.array([combined - alone for _, _, combined, alone in points])
    (inverse_rate, latency), *_ = np.linalg.lstsq(a, d, rcond=None)
    return 1.0 / inverse_rate, latency, float(np.mean(np.abs(a @ np.array([inverse_rate, latency]) - d))) * 1e3


def _fit(points, per_call):
    """(latency, bandwidth) for seconds = a * latency + ring_bytes / bandwidth, least squares on
    relative error (each point divided by its time: small collectives count as much as large)."""
    import numpy as np
    a = np.array([[1.0 if per_call else steps, moved] for _, _, _, steps, moved, _ in points])
    t = np.array([seconds for *_, seconds in points])
    (latency, inverse_bandwidth), *_ = np.linalg.lstsq(a / t[:, None], np.ones_like(t), rcond=None)
    predicted = a @ np.array([latency, inverse_bandwidth])
    mape = float(np.mean(np.abs(predicted - t) / t)) * 100
    return latency, 1.0 / inverse_bandwidth, mape


def _rates(tf, dtensor):
    devices = [f"CPU:{i}" for i in range(NUM_DEVICES)]
    mesh = dtensor.create_mesh([("x", NUM_DEVICES)], devices=devices)
    replicated = dtensor.Layout.replicated(mesh, 2)
    matmul = tf.function(lambda a, b: tf.matmul(a, b))
    a = dtensor.call_with_layout(tf.ones, replicated, shape=(16, 4096))
    b = dtensor.call_with_layout(tf.ones, replicated, shape=(4096, 4096))
    seconds = _median_seconds(lambda: dtensor.unpack(matmul(a, b))[0].numpy())
    flops = 2 * 16 * 4096 * 4096 / seconds
    # an Adam-like element-wise update on a 4 Mi-element shard per device: 4 reads, 1 write
    sharded = dtensor.Layout(["x", dtensor.UNSHARDED], mesh)
    shape = (NUM_DEVICES * 1024, 4096)
    p, g, m, v = (dtensor.call_with_layout(tf.ones, sharded, shape=shape) for _ in range(4))
    update = tf.function(lambda p, g, m, v: p - 0.01 * (0.9 * m + 0.1 * g) / (tf.sqrt(0.99 * v) + 1e-7))
    seconds = _median_seconds(lambda: dtensor.unpack(update(p, g, m, v))[0].numpy())
    touched = 5 * 4 * 1024 * 4096
    return flops, touched / seconds, seconds


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)  # DTensor logs every mesh it creates
    from tofu_tf.tf import devices
    devices.configure_virtual_cpus(NUM_DEVICES)
    import tensorflow as tf
    from tensorflow.experimental import dtensor

    print(f"load average at start: {open('/proc/loadavg').read().split()[:3]}")
    print(f"{'collective':>15}{'group':>7}{'KiB':>10}{'ms':>10}")
    points = _collective_points(tf, dtensor)
    for per_call in (False, True):
        latency, bandwidth, mape = _fit(points, per_call)
        label = "per call" if per_call else "per step"
        print(f"latency {label}: Link(bandwidth={bandwidth / 1e9:.3f} GB/s, latency={latency * 1e3:.2f} ms"
              f"{', latency_per_collective=True' if per_call else ''}), fit error {mape:.0f}% (MAPE)")
    flops, bandwidth, seconds = _rates(tf, dtensor)
    print(f"replicated 16x4096x4096 matmul on every device: {flops / 1e9:.1f} GFLOP/s per device")
    print(f"element-wise update, 4 Mi elements per device: {seconds * 1e3:.1f} ms, "
          f"{bandwidth / 1e9:.2f} GB/s per device")
    print(f"{'k':>4}{'MiB':>10}{'combined ms':>12}{'1 by 1 ms':>12}")
    rate, latency, error = _fit_combining(_combining_points(tf, dtensor))
    print(f"all-reduce combining: Link(combine_copy_bandwidth={rate / 1e9:.2f} GB/s), an independent "
          f"all-reduce beside others {latency * 1e3:.2f} ms; mean absolute error {error:.1f} ms")
    print(f"load average at end: {open('/proc/loadavg').read().split()[:3]}")


if __name__ == "__main__":
    app.run(main)
