"""bench/step_profile.py: op times read back from TensorFlow's profiler, per step."""

import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench import step_profile  # noqa: E402


def _fitted_dense(steps, batch_size):
    import tf_keras
    tf_keras.utils.set_random_seed(0)
    model = tf_keras.Sequential([tf_keras.Input((32,)), tf_keras.layers.Dense(8, use_bias=False)])
    model.compile(optimizer=tf_keras.optimizers.SGD(0.1), loss="mse")
    x = np.random.default_rng(0).normal(size=(steps * batch_size, 32)).astype("float32")
    y = np.zeros((steps * batch_size, 8), "float32")
    model.fit(x, y, batch_size=batch_size, verbose=0)           # traced before the profile
    return model, x, y


def test_counts_each_steps_kernels(tmp_path):
    """One Dense layer on one device: each step runs its forward matmul and its kernel's gradient
    matmul (the input needs no gradient), whatever kernel names oneDNN gives them."""
    model, x, y = _fitted_dense(steps=5, batch_size=4)
    times = step_profile.profile_fit(model, x, y, batch_size=4, logdir=str(tmp_path))
    matmuls = {op: t for op, t in times.items() if "MatMul" in op}
    assert sum(t.runs_per_step for t in matmuls.values()) == 2, matmuls
    assert all(t.ms_per_step > 0 for t in matmuls.values())
    assert step_profile.kernel_total(times) >= sum(t.ms_per_step for t in matmuls.values())
    assert not {"Run", "Process", "Start", "Done", "Generator"} & set(times)   # the executor's ``Class::Method``s


def test_table_ranks_by_difference(tmp_path):
    shared = step_profile.OpTime(5.0, 1.0)
    sides = {"a": {"Same": shared, "OnlyA": step_profile.OpTime(3.0, 2.0)},
             "b": {"Same": shared, "CollectiveReduceV2": step_profile.OpTime(9.0, 1.0)}}
    lines = step_profile.table(sides, top=2).splitlines()
    assert "CollectiveReduceV2 (incl. wait)" in lines[1] and "OnlyA" in lines[2]
    assert lines[-1].split()[-2:] == ["8.0", "5.0"]          # collectives left out of the totals
