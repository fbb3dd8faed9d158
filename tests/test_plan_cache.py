"""plan_cache: a plan searched once is read back equal; every input of the search keys it."""

import dataclasses
import json
import logging

import pytest

import tofu_tf.search
from tofu_tf import plan_cache
from tofu_tf.cost.hardware import H100_NVLINK


@pytest.fixture
def searches(monkeypatch):
    """The plan_graph calls made, in order (each one is a search)."""
    calls = []
    real = tofu_tf.search.plan_graph

    def counted(graph, **options):
        calls.append(options)
        return real(graph, **options)
    monkeypatch.setattr(tofu_tf.search, "plan_graph", counted)
    return calls


def test_a_second_plan_comes_from_the_cache_equal_and_without_a_search(tiny_mlp_graph, tmp_path, searches):
    first = plan_cache.cached_plan_graph(tiny_mlp_graph, cache_dir=tmp_path, num_devices=4, hardware="cpu-virtual")
    cache = plan_cache.PlanCache(tmp_path)
    again = plan_cache.plan_with_cache(tiny_mlp_graph, cache=cache, num_devices=4, hardware="cpu-virtual")
    assert len(searches) == 1 and again.from_cache and again.plan == first
    assert again.path.parent == tmp_path and json.loads(again.path.read_text())["version"] == 1


def test_every_planning_input_keys_its_own_plan(tiny_mlp_graph):
    base = plan_cache.fingerprint(tiny_mlp_graph, num_devices=4)
    changed = [dict(num_devices=8), dict(num_devices=4, hardware="cpu-virtual"), dict(num_devices=4, method="ilp"),
               dict(num_devices=4, memory_budget_bytes=2**20), dict(num_devices=4, mesh_shape=(2, 2)),
               dict(num_devices=4, objective="memory"), dict(num_devices=4, target="ideal"),
               dict(num_devices=4, time_limit_s=5.0),
               dict(num_devices=4, hardware=dataclasses.replace(H100_NVLINK, flops=1e12))]
    keys = [plan_cache.fingerprint(tiny_mlp_graph, **options) for options in changed]
    assert base not in keys and len(set(keys)) == len(keys)
    # The same search, said differently, is the same key.
    assert plan_cache.fingerprint(tiny_mlp_graph, num_devices=4, hardware=H100_NVLINK, method="tofu",
                                  memory_budget_bytes=None, objective="time") == base
    other = dataclasses.replace(tiny_mlp_graph, batch_size=16)
    assert plan_cache.fingerprint(other, num_devices=4) != base


def test_an_unknown_option_is_named(tiny_mlp_graph):
    with pytest.raises(TypeError, match="plan_graph has no option 'num_gpus'; its options are .*num_devices"):
        plan_cache.fingerprint(tiny_mlp_graph, num_gpus=4)


def _absl_warnings(caplog):
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


@pytest.mark.parametrize("damage", ["cut short", "another version", "not a plan"])
def test_a_damaged_entry_is_replaced_with_a_warning(tiny_mlp_graph, tmp_path, searches, caplog, damage):
    options = dict(num_devices=4, hardware="cpu-virtual")
    first = plan_cache.cached_plan_graph(tiny_mlp_graph, cache_dir=tmp_path, **options)
    path = plan_cache.PlanCache(tmp_path).path(plan_cache.fingerprint(tiny_mlp_graph, **options))
    text = path.read_text()
    if damage == "cut short":
        path.write_text(text[: len(text) // 2])
    elif damage == "another version":
        path.write_text(json.dumps({**json.loads(text), "version": 0}))
    else:
        path.write_bytes(b"\xff\xfe not even text")
    with caplog.at_level(logging.WARNING, logger="absl"):
        again = plan_cache.plan_with_cache(tiny_mlp_graph, cache=plan_cache.PlanCache(tmp_path), **options)
    (warning,) = _absl_warnings(caplog)
    assert f"ignoring {path}, which does not read as a plan" in warning and "planning again" in warning
    assert len(searches) == 2 and not again.from_cache
    assert dataclasses.replace(again.plan, search_seconds=0) == dataclasses.replace(first, search_seconds=0)
    assert plan_cache.PlanCache(tmp_path).load(path.stem) == again.plan      # the file is whole again


def test_the_cache_directory_comes_from_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv(plan_cache.CACHE_ENV, str(tmp_path / "plans"))
    assert plan_cache.PlanCache().directory == tmp_path / "plans"
    monkeypatch.delenv(plan_cache.CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert plan_cache.default_cache_dir() == tmp_path / "xdg" / "tofu_tf" / "plans"


def test_a_custom_strategy_provider_is_planned_without_the_cache(tiny_mlp_graph, tmp_path, searches, caplog):
    from tofu_tf.semantics import strategies
    with caplog.at_level(logging.WARNING, logger="absl"):
        found = plan_cache.plan_with_cache(tiny_mlp_graph, cache=plan_cache.PlanCache(tmp_path), num_devices=2,
                                           strategy_provider=strategies)
    assert not found.from_cache and found.path is None and len(searches) == 1
    assert not list(tmp_path.iterdir())
    assert "cannot be fingerprinted" in _absl_warnings(caplog)[0]



_SCRIPT = """
import sys
import numpy as np
from absl import logging
from tofu_tf.tf import devices
logging.set_verbosity(logging.INFO)
devices.configure_virtual_cpus(8)
import tf_keras as keras
from tofu_tf import TofuStrategy, models
keras.utils.set_random_seed(3)
x = np.random.default_rng(0).normal(size=(16, 32)).astype("float32")
y = np.arange(16) % 10
with TofuStrategy(8).scope():
    model = models.mlp(input_dim=32, width=32, depth=2, num_classes=10)
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="sparse_categorical_crossentropy")
model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
np.savez(sys.argv[1], *model.get_weights())
"""


@pytest.mark.slow   # trains under TofuStrategy (the script twice, in fresh Pythons)
def test_a_second_run_of_a_script_takes_its_plan_from_the_cache_and_trains_alike(tmp_path):
    """TofuStrategy plans through the cache (``$TOFU_PLAN_CACHE`` here): the same script run
    again searches nothing, says so, and trains as the first run did."""
    import os
    import subprocess
    import sys
    import numpy as np
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root, TOFU_PLAN_CACHE=str(tmp_path / "plans"), TF_CPP_MIN_LOG_LEVEL="2")
    logs, weights = [], []
    for run in range(2):
        out = tmp_path / f"weights{run}.npz"
        done = subprocess.run([sys.executable, "-c", _SCRIPT, str(out)], env=env, capture_output=True, text=True,
                              timeout=300, check=False)
        assert done.returncode == 0, done.stderr[-3000:]
        logs.append(done.stderr)
        weights.append(np.load(out))
    assert "plan searched in" in logs[0] and "plan taken from" not in logs[0]
    assert "plan taken from" in logs[1] and "(no search)" in logs[1]
    assert len(list((tmp_path / "plans").glob("*.json"))) == 1
    for name in weights[0].files:
        np.testing.assert_array_equal(weights[1][name], weights[0][name])


@pytest.mark.slow   # trains under TofuStrategy (the script twice, in fresh Pythons)
def test_the_strategy_caches_only_where_told(tmp_path, searches):
    """An explicit directory caches even with ``$TOFU_PLAN_CACHE=off`` (this suite's setting);
    ``plan_cache=False``, and the default under ``off``, search and keep nothing."""
    from tofu_tf.strategies import TofuStrategy
    from tests import strategy_helpers as h
    x, y = h.data_for(h.build("mlp"))
    for cache in (tmp_path, False, True):
        with TofuStrategy(8, plan_cache=cache).scope():
            model = h.build("mlp")
            h.compile_model(model)
        model.fit(x[:8], y[:8], batch_size=h.BATCH, epochs=1, verbose=0)
    assert len(searches) == 3
    assert len(list(tmp_path.glob("*.json"))) == 1
