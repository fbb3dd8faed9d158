"""Tests for tofu_tf.pipeline.profile: the profiling plan (no TF) and one real profiled model."""

import functools
import math

import pytest

from tofu_tf import models
from tofu_tf.pipeline import ChainAnalysis, LayerStats, Unit, keras_stats, partition
from tofu_tf.pipeline import profile
from tofu_tf.pipeline.profile_worker import ConfigBuilder

LOSS = "sparse_categorical_crossentropy"


def test_mcap_run_count_matches_hand_enumeration():
    # L=6, p=4 (3 layers per filled device): [1,1,2,2] [2,1,2,1] ([4,1,1] skipped: no layer
    # left for the fourth device) [3,1,1,1] -> ends in [1,1,1], no extra partitionings
    assert profile.mcap_run_count(6, 4) == 3
    # L=8, p=4: [1,1,3,3] [2,1,3,2] [3,1,2,2] [5,1,1,1] [4,1,1,2] [4,2,1,1], last does not
    # end in [1,1,1]: two more
    assert profile.mcap_run_count(8, 4) == 8
    with pytest.raises(ValueError, match="num_layers >= 2 \\* num_devices - 2"):
        profile.mcap_run_count(5, 4)


def _analysis(signatures):
    units = tuple(Unit(name=f"u{i}", layers=(f"l{i}",), signature=s)
                  for i, s in enumerate(signatures))
    stats = tuple(LayerStats(name=f"u{i}", state_bytes=1, activation_bytes=1, transient_bytes=0)
                  for i in range(len(signatures)))
    return ChainAnalysis(units=units, stats=stats, boundary_bytes=(1,) * len(signatures))


def test_probe_plan_measures_each_distinct_stage_once():
    # embedding, 3 x (attention, mlp) blocks, head; first and last are never shared
    plan = profile.plan_probes(_analysis(["e", "a", "m", "a", "m", "a", "m", "e"]))
    shapes = {(p.start, p.stop, p.inflights) for p in plan.probes}
    assert shapes == {(0, 1, (1, 2)), (1, 2, (1, 2)), (2, 3, (1, 2)), (7, 8, (1, 2)),
                      (0, 2, (1,)), (1, 3, (1,)), (2, 4, (1,)), (6, 8, (1,))}
    assert plan.isolated[3] == plan.isolated[1] and plan.isolated[7] != plan.isolated[0]
    assert plan.paired[0] is None and plan.paired[5] == plan.paired[3]
    # one device per distinct pair, each also measuring the singles nested in it
    assert len(plan.devices) == 4
    runs = plan.runs(3)
    assert len(runs) == math.ceil(4 / 3) and sum(map(len, runs)) == 8


def _check_devices(plan):
    """Every probe measured once, by a device holding at most two neighbouring
    units, all of its stages nested in its largest one."""
    measured = [i for device in plan.devices for i in device]
    assert sorted(measured) == list(range(len(plan.probes)))
    for device in plan.devices:
        stages = [plan.probes[i] for i in device]
        start, stop = min(p.start for p in stages), max(p.stop for p in stages)
        assert stop - start <= 2
        assert any((p.start, p.stop) == (start, stop) for p in stages)


def test_probe_plan_without_repeats_needs_one_device_per_pair():
    for units in (2, 3, 10, 16):
        plan = profile.plan_probes(_analysis([f"s{i}" for i in range(units)]))
        assert len(plan.probes) == 2 * units - 1
        assert len(plan.devices) == units - 1
        _check_devices(plan)
        assert plan.steps_per_device() <= 5
    plan = profile.plan_probes(_analysis([f"s{i}" for i in range(16)]))
    assert len(plan.runs(4)) == 4 and profile.mcap_run_count(16, 4) == 16


def test_probe_plan_devices_with_repeats_and_a_single_unit():
    _check_devices(profile.plan_probes(_analysis(["e", "a", "m", "a", "m", "a", "m", "e"])))
    _check_devices(profile.plan_probes(_analysis(["e", "a", "a", "a", "a", "e"])))
    single = profile.plan_probes(_analysis(["only"]))
    assert single.devices == ((0,),) and single.runs(4) == [single.probes]


def test_unpicklable_builder_is_refused_with_the_fix():
    request = profile.WorkerRequest(builder=lambda: None, micro_batch=1, loss=LOSS,
                                    optimizer="adam", stages=())
    with pytest.raises(profile.ProfilingError, match="picklable zero-argument callable"):
        profile.run_worker(request)


def test_config_builder_rebuilds_builtin_models_and_names_the_fix_otherwise():
    mlp = models.mlp(input_dim=8, width=16, depth=1)
    rebuilt = ConfigBuilder.of(mlp)()
    assert [layer.name for layer in rebuilt.layers] == [layer.name for layer in mlp.layers]
    gpt = models.gpt(num_layers=1, d_model=16, num_heads=2, seq_len=4, vocab_size=16)
    with pytest.raises(ValueError, match="Pass model_fn"):
        ConfigBuilder.of(gpt)


@pytest.mark.slow   # profiles a real model in a fresh Python
def test_profiled_mlp_predicts_its_own_stages():
    """One profiling run (3 units, 5 distinct stages on 2 devices) and one run of
    real stages: mCAP's predictor from the measured figures must land within 10%."""
    build = functools.partial(models.mlp, input_dim=64, width=128, depth=2)
    model = build()
    analysis = keras_stats.analyze_model(model, micro_batch=8, loss=LOSS, optimizer="adam")
    result = keras_stats.profile_model(model, analysis, micro_batch=8, loss=LOSS,
                                       optimizer="adam", model_fn=build, num_devices=8)
    assert result.runs == 1 and len(result.probes) == 5 and result.mcap_runs is None
    assert result.steps_per_device == 5
    for measured, analytic in zip(result.stats, analysis.stats):
        assert measured.is_measured
        assert measured.isolated_bytes >= analytic.state_bytes  # weights, grads, slots at least
        assert measured.activation_bytes > 0
    plan = partition(result.stats, 2, schedule="1f1b", num_microbatches=4)
    probes = [profile.StageProbe(a, b, (2 - r,)) for r, (a, b) in enumerate(plan.stage_ranges)]
    real = profile.measure_stage_peaks(analysis, build, probes, micro_batch=8, loss=LOSS,
                                       optimizer="adam")
    for predicted, (peak,) in zip(plan.stage_peak_bytes, real):
        assert abs(predicted - peak) / peak < 0.10


@pytest.mark.slow   # profiles a real model in a fresh Python
def test_keras3_sequential_profiles_from_its_config():
    """No model_fn: the subprocess rebuilds the Keras 3 model from its config, and
    cuts Sequential stages by replaying the shared layers."""
    import keras
    from tofu_tf.pipeline import layer_stats
    model = models.mlp(input_dim=16, width=32, depth=2, keras=keras)
    stats = layer_stats(model, batch_size=8, loss=LOSS, optimizer="adam", num_microbatches=2,
                        profile=True)
    assert [s.name for s in stats] == ["dense_0", "dense_1", "head"]
    assert all(s.is_measured and s.isolated_bytes >= s.state_bytes for s in stats)
