"""What DTensor runs, read from the program it compiles (bench/executed.py), against the plan.

Each measurement trains a model two steps in a fresh process with TensorFlow's MLIR dumps on and
reads the training step's collectives back."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = pytest.mark.slow


def _user_environment() -> dict:
    """The measuring processes' environment: as a user's, with DTensor's all-reduce combining on
    (tests/conftest.py switches it off for this process's pipeline tests)."""
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    env.pop("DTENSOR_ENABLE_COMBINE_ALL_REDUCES_OPTIMIZATION", None)
    return env


def _mesh(rows, model) -> str:
    """The mesh the state row names (``mesh {'batch': 8}``)."""
    return " ".join(rows[(model, "state/device")]).split(" mesh ", 1)[1]


def _table(*models, flags=()):
    out = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "executed.py"), f"--models={','.join(models)}",
                          *flags],
                         cwd=ROOT, capture_output=True, text=True, timeout=900, env=_user_environment())
    rows = {}
    for line in out.stdout.splitlines():
        cells = line.split()
        if cells and cells[0] in models:
            rows[(cells[0], cells[1])] = cells
    return out, rows


def test_a_sharded_mlp_runs_the_one_all_reduce_its_plan_prices():
    """A 2 x 1024 MLP split Megatron-style: one all-reduce of the second layer's partial sums,
    executed with the bytes the cost model gives it (to 10%: the plan also reduces two bias
    gradients it computes from batch slices, 7 KiB that DTensor, computing them whole, does not
    move), the one run the plan's price pays a latency for, and the state placed as modeled."""
    out, rows = _table("mlp")
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    count, expressed, modeled, gap = rows[("mlp", "all-reduce")][2:6]
    assert count == "1" and float(expressed) == pytest.approx(float(modeled), rel=0.1)
    runs = rows[("mlp", "runs")]                       # "runs (lowered)": what DTensor's lowering left
    assert runs[3] == "1" and " ".join(runs[7:]) == "1 all-reduce; modeled: 1 runs"
    assert float(runs[4]) == pytest.approx(float(runs[5]), rel=0.1)
    assert rows[("mlp", "state/device")][4] == "0%"


def test_a_gradient_adam_reads_twice_is_priced_as_the_one_all_reduce_dtensor_runs():
    """Data parallel: Adam reads each gradient twice (its two moments), DTensor all-reduces it
    once; the cost model prices the conversion once per tensor and layout, not per reader.
    Its 7 gradients (5 MiB) cost more to pack into one combined all-reduce than the latencies
    that saves, so the plan runs them one by one and TofuStrategy compiles the step so: 7 runs,
    as priced (DTensor combined them into 1 before, the copy making the step 1.2-1.3x
    MirroredStrategy's: bench/README.md)."""
    out, rows = _table("mlp", flags=("--method=data_parallel",))
    count, expressed, modeled, gap = rows[("mlp", "all-reduce")][2:6]
    assert float(expressed) == pytest.approx(float(modeled), rel=1e-6), out.stdout
    runs = rows[("mlp", "runs")]
    assert runs[6] == "0%", out.stdout
    assert runs[3] == "7" and " ".join(runs[7:]) == "7 all-reduce; modeled: 7 runs", out.stdout


def test_an_embeddings_deduplicated_gradient_is_priced_as_the_gather_dtensor_runs():
    """The tf-keras GPT, data parallel: tf-keras' Adam sums the token embedding's duplicate rows
    after ``tf.unique`` of the batch's token ids, which DTensor runs on the whole id vector, so it
    gathers the ids and the gradient's rows. Before, the plan priced an all-reduce of the dense
    embedding gradient instead (all-gather 0 KiB modeled against 227.5 executed)."""
    out, rows = _table("gpt")
    assert _mesh(rows, "gpt") == "{'batch': 8}", out.stdout                      # the premise: data parallel
    count, expressed, modeled, gap = rows[("gpt", "all-gather")][2:6]
    assert float(expressed) > 0 and float(expressed) == pytest.approx(float(modeled), rel=0.02), out.stdout
    count, expressed, modeled, gap = rows[("gpt", "all-reduce")][2:6]
    assert float(expressed) == pytest.approx(float(modeled), rel=0.02), out.stdout


def test_batch_statistics_run_as_partial_sums_as_the_plan_prices_them():
    """The CNN on the CPU profile: the plan is data parallel, BatchNormalization's moments partial
    sums all-reduced, and DTensor runs those all-reduces and nothing else. Until 2026-12-07 the plan
    gathered the first normalization's input (225.8 KiB) and computed its statistics whole, which
    DTensor ran (the lowering's ``statistics_input_relayout``, still covered by
    tests/test_normalization.py) and which measured slower than data parallelism: the data-parallel
    baseline it was compared with priced a reduce-scatter and an all-gather around each statistic
    that DTensor never runs (tests/test_data_parallel_baseline.py)."""
    out, rows = _table("cnn")
    assert _mesh(rows, "cnn") == "{'batch': 8}", out.stdout
    assert ("cnn", "all-gather") not in rows, out.stdout                             # nothing gathered
    count, expressed, modeled, gap = rows[("cnn", "all-reduce")][2:6]
    assert float(expressed) == pytest.approx(float(modeled), rel=0.05), out.stdout
    assert out.returncode == 0, out.stdout                                           # no gap over 10% left
    # The runs the price pays for are the runs DTensor's program makes. Until 2026-12-07 it made
    # 5 of 14 all-reduces, the price 4: tf-keras computed the statistics per replica group under
    # the strategy (a repeat, and a mean of it for the moving averages: all-reduces of another
    # reduction), not with one device's ops ("batch_norm_global_moments").
    runs = rows[("cnn", "runs")]
    assert count == "11" and runs[3] == "4" and runs[-2:] == ["4", "runs"], out.stdout
