"""Tests for tofu_tf.pipeline.regression (no TensorFlow)."""

import json

import numpy as np
import pytest

from tofu_tf.pipeline import LayerStats, MemoryRegression, StageSample, partition
from tofu_tf.pipeline import regression as regression_module


def _samples(coefficients, rng, count=40, noise=0.0):
    """Synthetic stages; with a fifth (workspace) coefficient, half of them hold
    convolution workspaces."""
    b0, b_state, b_act, b_working, *rest = coefficients
    b_workspace = rest[0] if rest else 0.0
    samples = []
    for i in range(count):
        layers = int(rng.integers(1, 5))
        state = rng.integers(1 << 16, 1 << 22, layers)
        act = rng.integers(1 << 12, 1 << 20, layers)
        transient = rng.integers(0, 1 << 18, layers)
        workspace = (rng.integers(0, 1 << 24, layers) if rest and i % 2
                     else np.zeros(layers, dtype=np.int64))
        k = int(rng.integers(1, 5))
        exact = (b0 + b_state * state.sum() + b_act * k * act.sum()
                 + b_working * (state + transient).max() + b_workspace * workspace.max())
        measured = int(exact * (1 + noise * rng.standard_normal()))
        samples.append(StageSample(model=f"m{i % 3}", inflight=k, state_bytes=tuple(state),
                                   activation_bytes=tuple(act), transient_bytes=tuple(transient),
                                   workspace_bytes=tuple(workspace) if rest else (),
                                   measured_bytes=measured))
    return samples


def test_fit_recovers_known_coefficients_and_reports_zero_error():
    truth = (200_000.0, 1.0, 1.5, 0.6, 0.9)
    fitted = MemoryRegression.fit(_samples(truth, np.random.default_rng(0)))
    np.testing.assert_allclose(fitted.coefficients, truth, rtol=1e-5)  # integer bytes
    assert fitted.fit_mape < 1e-6 and fitted.loo_mape < 1e-6  # measured bytes are integers
    assert fitted.num_samples == 40 and fitted.models == ("m0", "m1", "m2")


def test_errors_are_computed_from_the_data():
    samples = _samples((1e5, 1.2, 1.4, 0.3, 1.1), np.random.default_rng(1), noise=0.05)
    fitted = MemoryRegression.fit(samples)
    measured = np.array([s.measured_bytes for s in samples], dtype=float)
    predicted = np.array([fitted.predict(s) for s in samples])
    assert fitted.fit_mape == pytest.approx(np.mean(np.abs(predicted - measured) / measured))
    loo = []
    for i in range(len(samples)):
        rest = MemoryRegression.fit(samples[:i] + samples[i + 1:])
        loo.append(abs(rest.predict(samples[i]) - measured[i]) / measured[i])
    assert fitted.loo_mape == pytest.approx(np.mean(loo))
    by_model = regression_module.errors_by_model(samples)
    assert sorted(by_model) == ["m0", "m1", "m2"]
    for model, (fit, held_out) in by_model.items():
        mine = [i for i, s in enumerate(samples) if s.model == model]
        assert fit == pytest.approx(np.mean([abs(predicted[i] - measured[i]) / measured[i]
                                             for i in mine]))
        assert held_out == pytest.approx(np.mean([loo[i] for i in mine]))
    assert 0.01 < fitted.fit_mape < 0.1  # 5% noise shows up, nothing more


def test_coefficients_are_never_negative():
    rng = np.random.default_rng(2)
    samples = _samples((0.0, 1.0, 0.0, 0.0), rng, count=12)
    flipped = [StageSample(model=s.model, inflight=s.inflight, state_bytes=s.state_bytes,
                           activation_bytes=s.activation_bytes, transient_bytes=s.transient_bytes,
                           measured_bytes=max(1, int(s.measured_bytes - 0.5 * s.inflight
                                                     * sum(s.activation_bytes))))
               for s in samples]
    assert min(MemoryRegression.fit(flipped).coefficients) >= 0.0


def test_too_few_samples_and_corrupt_samples_are_refused():
    samples = _samples((0.0, 1.0, 1.0, 1.0), np.random.default_rng(3), count=4)
    with pytest.raises(ValueError, match="at least 6 measured stages"):
        MemoryRegression.fit(samples)
    with pytest.raises(ValueError, match="equal length"):
        StageSample(model="x", inflight=1, state_bytes=(1, 2), activation_bytes=(1,),
                    transient_bytes=(1, 2), measured_bytes=5)
    with pytest.raises(ValueError, match="equal length"):
        StageSample(model="x", inflight=1, state_bytes=(1, 2), activation_bytes=(1, 2),
                    transient_bytes=(1, 2), workspace_bytes=(3,), measured_bytes=5)


def test_samples_without_workspaces_and_four_coefficient_regressions_mean_no_workspace():
    sample = StageSample(model="x", inflight=2, state_bytes=(10, 20), activation_bytes=(1, 2),
                         transient_bytes=(5, 1), measured_bytes=100)
    assert sample.workspace_bytes == (0, 0)
    np.testing.assert_array_equal(sample.features(), [1, 30, 6, 21, 0])
    old = MemoryRegression(coefficients=(1.0, 1.0, 1.0, 1.0), num_samples=0, fit_mape=0.0,
                           loo_mape=0.0, models=())
    assert old.coefficients == (1.0, 1.0, 1.0, 1.0, 0.0)
    assert old.predict(sample) == 1 + 30 + 6 + 21
    with pytest.raises(ValueError, match="5 coefficients"):
        MemoryRegression(coefficients=(1.0, 1.0), num_samples=0, fit_mape=0.0, loo_mape=0.0,
                         models=())


def test_scaled_stats_make_the_partitioner_minimise_the_prediction():
    rng = np.random.default_rng(4)
    fitted = MemoryRegression.fit(_samples((3e5, 1.1, 1.6, 0.7), rng, noise=0.03))
    stats = [LayerStats(name=f"l{i}", state_bytes=int(rng.integers(1 << 16, 1 << 22)),
                        activation_bytes=int(rng.integers(1 << 12, 1 << 20)),
                        transient_bytes=int(rng.integers(0, 1 << 18))) for i in range(12)]
    plan = partition(fitted.scaled(stats), 4, schedule="1f1b", num_microbatches=8)
    for r, (start, stop) in enumerate(plan.stage_ranges):
        predicted = fitted.predict_stage(stats[start:stop], min(8, 4 - r))
        offset = fitted.coefficients[0]
        assert plan.stage_peak_bytes[r] + offset == pytest.approx(predicted, rel=1e-6)


def test_scaled_workspaces_are_exact_when_one_layer_holds_both_maxima_and_below_otherwise():
    fitted = MemoryRegression(coefficients=(100.0, 1.0, 2.0, 0.5, 1.0), num_samples=0,
                              fit_mape=0.0, loo_mape=0.0, models=())
    conv = LayerStats(name="conv", state_bytes=1000, activation_bytes=10, transient_bytes=500,
                      workspace_bytes=20_000)
    relu = LayerStats(name="relu", state_bytes=0, activation_bytes=10, transient_bytes=10)
    dense = LayerStats(name="dense", state_bytes=9000, activation_bytes=10, transient_bytes=10)
    for stage, exact in (([conv, relu], True), ([relu, conv], True), ([conv, dense], False)):
        scaled = fitted.scaled(stage)
        charged = (100 + sum(s.state_bytes for s in scaled) + 3 * sum(s.activation_bytes
                                                                       for s in scaled)
                   + max(s.transient_bytes for s in scaled))
        predicted = fitted.predict_stage(stage, 3)
        assert (charged == pytest.approx(predicted)) is exact
        assert charged <= predicted + 1e-9
    # [conv, dense]: W is dense's 9010 bytes, C conv's 20000; the shared max charges
    # conv's 0.5 * 1500 + 20000 instead of 0.5 * 9010 + 20000
    assert fitted.predict_stage([conv, dense], 1) == 100 + 10000 + 40 + 4505 + 20000


def test_samples_round_trip_and_versions_are_checked(tmp_path):
    samples = _samples((0.0, 1.0, 1.0, 1.0), np.random.default_rng(5), count=6)
    path = tmp_path / "samples.json"
    regression_module.save_samples(samples, str(path), source="test")
    assert regression_module.load_samples(str(path)) == samples
    data = json.loads(path.read_text())
    data["version"] = 1  # before convolution workspaces
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="version 1.*reads version 2.*--calibrate"):
        regression_module.load_samples(str(path))
    data["version"] = 99
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="version 99.*--calibrate"):
        regression_module.load_samples(str(path))
    with pytest.raises(FileNotFoundError, match="--calibrate"):
        regression_module.load_samples(str(tmp_path / "missing.json"))


def test_shipped_regression_fits_its_measured_samples():
    shipped = regression_module.default_regression()
    assert shipped.num_samples >= 40
    assert shipped.coefficients[1] > 0.5  # state is paid at least half: the data is sane
    assert "cnn 16px c8" in shipped.models  # fitted on convolution workspaces too
    assert 0.5 < shipped.coefficients[4] < 2.0  # TF's im2col buffers: about what is estimated
    assert shipped.loo_mape < 0.2
    assert "leave-one-out MAPE" in shipped.describe()
