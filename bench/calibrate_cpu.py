"""Measure what the `cpu-virtual` hardware profile should say, on this machine.

Times DTensor all-gathers of growing size across 8 virtual CPU devices (latency
and bandwidth of a collective) and a matmul every device runs at once (FLOP rate
per device when the devices share the host's cores). Prints the figures and the
Link/flops values they imply. Run:
    python bench/calibrate_cpu.py
"""

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

NUM_DEVICES = 8


def _median_seconds(fn, repeats=5):
    fn()  # trace and warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main():
    from tofu_tf.tf import devices
    devices.configure_virtual_cpus(NUM_DEVICES)
    import tensorflow as tf
    from tensorflow.experimental import dtensor

    mesh = dtensor.create_mesh([("x", NUM_DEVICES)], devices=[f"CPU:{i}" for i in range(NUM_DEVICES)])
    gather = tf.function(lambda v: dtensor.relayout(v, dtensor.Layout.replicated(mesh, 1)))
    print(f"{'all-gather MiB':>15}{'seconds':>10}")
    points = []
    for mib in (1, 16, 64):
        sharded = dtensor.call_with_layout(tf.ones, dtensor.Layout(["x"], mesh), shape=(mib * 2**18,))
        seconds = _median_seconds(lambda: dtensor.unpack(gather(sharded))[0].numpy())
        points.append((mib * 2**20 * (NUM_DEVICES - 1) / NUM_DEVICES, seconds))
        print(f"{mib:>15}{seconds:>10.4f}")
    (b0, t0), (b1, t1) = points[0], points[-1]
    bandwidth = (b1 - b0) / (t1 - t0)
    latency = t0 - b0 / bandwidth
    matmul = tf.function(lambda a, b: tf.matmul(a, b))
    a = dtensor.call_with_layout(tf.ones, dtensor.Layout.replicated(mesh, 2), shape=(16, 4096))
    b = dtensor.call_with_layout(tf.ones, dtensor.Layout.replicated(mesh, 2), shape=(4096, 4096))
    seconds = _median_seconds(lambda: dtensor.unpack(matmul(a, b))[0].numpy())
    flops = 2 * 16 * 4096 * 4096 / seconds
    print(f"replicated 16x4096x4096 matmul on every device: {seconds:.4f} s")
    print(f"implied: Link(bandwidth={bandwidth / 1e9:.3f} GB/s, latency={latency * 1e3:.1f} ms), "
          f"flops={flops / 1e9:.1f} GFLOP/s per device")


if __name__ == "__main__":
    main()
