"""bench/gpu_check.py, the prepared GPU run, in its dry mode: 8 virtual CPUs, a small keras-hub Llama,
MirroredStrategy and TofuStrategy each trained in a fresh process, the table printed (the
device's memory figures are n/a on CPU). The GPU part runs where a GPU is lent, never here."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = pytest.mark.slow


def test_the_dry_run_trains_both_sides_and_prints_the_table():
    out = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "gpu_check.py"), "--dry_run"], cwd=ROOT,
                         capture_output=True, text=True, timeout=900,
                         env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})
    assert out.returncode == 0, out.stderr[-3000:]
    rows = {line.split()[0]: line.split() for line in out.stdout.splitlines()
            if line.startswith(("mirrored", "tofu"))}
    assert set(rows) == {"mirrored", "tofu"}, out.stdout
    assert rows["mirrored"][1] == rows["tofu"][1]             # the same model on both sides
    for side in rows.values():
        assert float(side[2]) > 0                            # a steady step was measured
        assert side[3] == "n/a"                              # no per-device allocator on CPU
    assert float(rows["tofu"][4]) > 0                        # the plan's modeled peak per device
    assert "'model'" in out.stdout or "'batch'" in out.stdout  # the plan's mesh
