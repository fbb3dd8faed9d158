"""examples/plan_pipeline.py runs as a new user runs it: a fresh Python, from another directory."""

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow   # runs examples/plan_pipeline.py in a fresh Python

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_plan_pipeline_prints_the_partition_and_the_hybrid_plans(tmp_path):
    command = [sys.executable, os.path.join(ROOT, "examples", "plan_pipeline.py"),
               "--model=mlp", "--num_layers=3", "--width=32", "--num_devices=4",
               "--num_stages=2", "--batch_size=8", "--num_microbatches=2", "--schedule=gpipe"]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert "Pipeline units (analytic statistics" in out
    assert "StagePlan: 4 layers on 2 stages, method=optimal, schedule=gpipe" in out
    assert "Hybrid PP x TP x DP plans for 4 devices, global batch 8, gpipe" in out
    assert "Recommended: pp=" in out
    for method in ("optimal", "uniform", "parameters", "time"):
        assert f"  {method} " in out
