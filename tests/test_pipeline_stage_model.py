"""Tests for tofu_tf.pipeline.stats and tofu_tf.pipeline.stage_model (no TensorFlow)."""

import numpy as np
import pytest

from tofu_tf.pipeline import (LayerStats, Schedule, StageCostModel, inflight_microbatches,
                              stage_peak_bytes, validate_chain)


def _analytic(state, act, trans):
    return [LayerStats(name=f"l{i}", state_bytes=s, activation_bytes=a, transient_bytes=t)
            for i, (s, a, t) in enumerate(zip(state, act, trans))]


def _random_chain(rng, n, kind):
    """kind: analytic | measured | mixed."""
    layers = []
    for i in range(n):
        measured = kind == "measured" or (kind == "mixed" and rng.random() < 0.5)
        extra = {}
        if measured:
            extra = dict(isolated_bytes=int(rng.integers(0, 60)),
                         added_bytes=int(rng.integers(0, 30)))
        layers.append(LayerStats(
            name=f"l{i}", state_bytes=int(rng.integers(0, 40)),
            activation_bytes=int(rng.integers(0, 10)), transient_bytes=int(rng.integers(0, 20)),
            **extra))
    return layers


# --------------------------------------------------------------------------- schedules


def test_inflight_1f1b_counts_down_from_num_stages():
    assert [inflight_microbatches(r, 4, "1f1b", 8) for r in range(4)] == [4, 3, 2, 1]


def test_inflight_1f1b_capped_by_microbatches():
    assert [inflight_microbatches(r, 4, Schedule.ONE_F_ONE_B, 2) for r in range(4)] == [2, 2, 2, 1]


def test_inflight_gpipe_keeps_every_microbatch():
    assert [inflight_microbatches(r, 4, "gpipe", 8) for r in range(4)] == [8, 8, 8, 8]


def test_schedule_from_user_normalizes_strings():
    assert Schedule.from_user("1F1B ") is Schedule.ONE_F_ONE_B
    assert Schedule.from_user("GPipe") is Schedule.GPIPE
    assert Schedule.from_user(Schedule.GPIPE) is Schedule.GPIPE


@pytest.mark.parametrize("bad", ["pipedream", 3, None])
def test_schedule_from_user_rejects_unknown(bad):
    with pytest.raises(ValueError, match=r"unknown schedule .*expected one of '1f1b', 'gpipe'"):
        Schedule.from_user(bad)


def test_inflight_rejects_bad_arguments():
    with pytest.raises(ValueError, match="stage_index 4 out of range for 4 stages"):
        inflight_microbatches(4, 4, "1f1b", 8)
    with pytest.raises(ValueError, match="num_microbatches must be an integer >= 1, got 0"):
        inflight_microbatches(0, 4, "1f1b", 0)
    with pytest.raises(ValueError, match="num_stages must be an integer >= 1"):
        inflight_microbatches(0, 0, "gpipe", 1)


# --------------------------------------------------------------------------- stage peaks by hand


def test_analytic_stage_peak_1f1b_by_hand():
    layers = _analytic(state=[100, 200, 300], act=[10, 20, 30], trans=[7, 50, 5])
    # stage 0 of 4, m=8 -> 4 in flight: 300 + 4 * 30 + max(7, 50) = 470
    assert stage_peak_bytes(layers, 0, 2, 0, 4, "1f1b", 8) == 470
    # stage 3 of 4 -> 1 in flight: 600 + 60 + 50 = 710
    assert stage_peak_bytes(layers, 0, 3, 3, 4, "1f1b", 8) == 710
    # GPipe keeps all 8: 500 + 8 * 50 + 50 = 950
    assert stage_peak_bytes(layers, 1, 3, 3, 4, "gpipe", 8) == 950


def test_measured_stage_peak_uses_isolated_of_first_plus_added_of_rest():
    layers = [LayerStats(name=f"l{i}", state_bytes=0, activation_bytes=a, transient_bytes=0,
                         isolated_bytes=iso, added_bytes=add)
              for i, (a, iso, add) in enumerate([(10, 500, 400), (20, 300, 250), (30, 900, 100)])]
    # 1 in flight: what the profile measured, nothing more
    assert stage_peak_bytes(layers, 0, 3, 3, 4, "1f1b", 8) == 500 + 250 + 100
    # 3 in flight: two more micro-batches of activations (10 + 20 + 30 each)
    assert stage_peak_bytes(layers, 0, 3, 1, 4, "1f1b", 8) == 850 + 2 * 60
    assert stage_peak_bytes(layers, 1, 2, 0, 4, "gpipe", 5) == 300 + 4 * 20


def test_stage_with_an_unmeasured_layer_falls_back_to_analytic():
    layers = [LayerStats(name="a", state_bytes=100, activation_bytes=10, transient_bytes=1,
                         isolated_bytes=1000, added_bytes=900),
              LayerStats(name="b", state_bytes=50, activation_bytes=5, transient_bytes=2)]
    assert stage_peak_bytes(layers, 0, 2, 0, 2, "1f1b", 4) == 150 + 2 * 15 + 2
    assert stage_peak_bytes(layers, 0, 1, 0, 2, "1f1b", 4) == 1000 + 1 * 10


def test_stage_peak_rejects_empty_or_out_of_range_layers():
    layers = _analytic([1, 2], [1, 1], [0, 0])
    with pytest.raises(ValueError, match=r"\[1, 1\) are not a non-empty range of 2 layers"):
        stage_peak_bytes(layers, 1, 1, 0, 1, "gpipe", 1)
    with pytest.raises(ValueError, match=r"\[0, 3\)"):
        stage_peak_bytes(layers, 0, 3, 0, 1, "gpipe", 1)


# --------------------------------------------------------------------------- vectorised model


@pytest.mark.parametrize("kind", ["analytic", "measured", "mixed"])
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_vectorised_peaks_match_reference(kind, schedule):
    rng = np.random.default_rng(7)
    for trial in range(20):
        n, p = int(rng.integers(1, 9)), int(rng.integers(1, 6))
        m = int(rng.integers(1, 7))
        layers = _random_chain(rng, n, kind)
        model = StageCostModel.build(layers, p, schedule, m)
        r, i, j = np.meshgrid(np.arange(p), np.arange(n), np.arange(n + 1), indexing="ij")
        keep = i < j
        got = model.peaks(r[keep], i[keep], j[keep])
        want = [stage_peak_bytes(layers, a, b, s, p, schedule, m)
                for s, a, b in zip(r[keep], i[keep], j[keep])]
        np.testing.assert_array_equal(got, want)


def _form_cost(form, stage, start, stop):
    k = form.multiplier[stage]
    return (sum(form.base[start:stop]) + k * sum(form.activation[start:stop])
            + form.offset[start] + max(form.transient[start:stop]))


@pytest.mark.parametrize("kind", ["analytic", "measured", "mixed"])
def test_linear_forms_exact_and_lower_bound(kind):
    rng = np.random.default_rng(11)
    for trial in range(20):
        n, p, m = 6, 3, int(rng.integers(1, 5))
        layers = _random_chain(rng, n, kind)
        model = StageCostModel.build(layers, p, "1f1b", m)
        measured = [layer.is_measured for layer in layers]
        assert (model.exact_form is None) == (any(measured) and not all(measured))
        for r in range(p):
            for i in range(n):
                for j in range(i + 1, n + 1):
                    peak = stage_peak_bytes(layers, i, j, r, p, "1f1b", m)
                    if model.exact_form is not None:
                        assert _form_cost(model.exact_form, r, i, j) == peak
                    assert _form_cost(model.bound_form, r, i, j) <= peak


@pytest.mark.parametrize("kind", ["analytic", "measured", "mixed"])
def test_form_arrays_and_validated_builder_agree(kind):
    """``LinearForm.arrays`` holds the form's figures (prefix sums, range maxima),
    and ``for_chain`` builds the same model as ``build`` (which validates)."""
    rng = np.random.default_rng(12)
    for trial in range(10):
        n, p, m = int(rng.integers(1, 9)), 3, int(rng.integers(1, 5))
        layers = _random_chain(rng, n, kind)
        model = StageCostModel.build(layers, p, "1f1b", m)
        same = StageCostModel.for_chain(validate_chain(layers), p, "1f1b", m)
        for form, other in ((model.exact_form, same.exact_form),
                            (model.bound_form, same.bound_form)):
            assert form == other
            if form is None:
                continue
            arrays = form.arrays
            assert arrays.base.tolist() == [sum(form.base[:i]) for i in range(n + 1)]
            assert arrays.activation.tolist() == [sum(form.activation[:i]) for i in range(n + 1)]
            assert arrays.offset.tolist() == list(form.offset)
            assert arrays.multiplier.tolist() == list(form.multiplier)
            for i in range(n):
                for j in range(i + 1, n + 1):
                    top = 0 if arrays.transient_max is None else int(arrays.transient_max(i, j))
                    assert top == max(form.transient[i:j])
        starts = np.repeat(np.arange(n), n)
        stops = np.tile(np.arange(1, n + 1), n)
        stages = starts % p
        assert (model.peaks(stages, starts, stops) == same.peaks(stages, starts, stops)).all()


def test_monotone_flag():
    rng = np.random.default_rng(3)
    assert StageCostModel.build(_random_chain(rng, 5, "analytic"), 2, "1f1b", 2).monotone
    assert not StageCostModel.build(_random_chain(rng, 5, "mixed"), 2, "1f1b", 2).monotone
    growing = [LayerStats(name=f"l{i}", state_bytes=0, activation_bytes=1, transient_bytes=0,
                          isolated_bytes=iso, added_bytes=add)
               for i, (iso, add) in enumerate([(10, 5), (12, 4), (3, 3)])]
    assert StageCostModel.build(growing, 2, "1f1b", 2).monotone  # 10 + 4 >= 12, 12 + 3 >= 3
    offset = [*growing[:2], LayerStats(name="big", state_bytes=0, activation_bytes=1,
                                       transient_bytes=0, isolated_bytes=99, added_bytes=3)]
    assert not StageCostModel.build(offset, 2, "1f1b", 2).monotone  # 12 + 3 < 99


def test_model_rejects_sizes_beyond_int64_headroom():
    layers = _analytic([1 << 61, 1 << 61], [0, 0], [0, 0])
    with pytest.raises(ValueError, match=r"beyond the 2\*\*62 .* coarser unit"):
        StageCostModel.build(layers, 1, "gpipe", 1)


# --------------------------------------------------------------------------- LayerStats


def test_layer_stats_accepts_numpy_integers_and_normalizes():
    layer = LayerStats(name="x", state_bytes=np.int64(5), activation_bytes=np.uint32(2),
                       transient_bytes=0, compute_seconds=np.float32(0.5))
    assert type(layer.state_bytes) is int and layer.state_bytes == 5
    assert layer.compute_seconds == 0.5 and not layer.is_measured


@pytest.mark.parametrize("field", ["state_bytes", "activation_bytes", "transient_bytes",
                                   "param_count", "isolated_bytes", "added_bytes"])
def test_layer_stats_rejects_negative_counts(field):
    values = dict(state_bytes=1, activation_bytes=1, transient_bytes=1)
    values[field] = -3
    with pytest.raises(ValueError, match=rf"layer 'embed': {field} must be >= 0, got -3"):
        LayerStats(name="embed", **values)


def test_layer_stats_rejects_non_integers_and_bad_seconds():
    with pytest.raises(TypeError, match="layer 'x': state_bytes must be an integer, got 1.5"):
        LayerStats(name="x", state_bytes=1.5, activation_bytes=0, transient_bytes=0)
    with pytest.raises(TypeError, match="activation_bytes must be an integer, got True"):
        LayerStats(name="x", state_bytes=1, activation_bytes=True, transient_bytes=0)
    with pytest.raises(ValueError, match="layer 'x': compute_seconds must be finite and >= 0"):
        LayerStats(name="x", state_bytes=1, activation_bytes=0, transient_bytes=0,
                   compute_seconds=-1.0)
    with pytest.raises(ValueError, match="compute_seconds must be finite"):
        LayerStats(name="x", state_bytes=1, activation_bytes=0, transient_bytes=0,
                   compute_seconds=float("nan"))
    with pytest.raises(ValueError, match="name must be a non-empty string"):
        LayerStats(name="", state_bytes=1, activation_bytes=0, transient_bytes=0)


def test_layer_stats_is_frozen():
    layer = LayerStats(name="x", state_bytes=1, activation_bytes=0, transient_bytes=0)
    with pytest.raises(AttributeError):
        layer.state_bytes = 2


def test_validate_chain_errors():
    layer = LayerStats(name="x", state_bytes=1, activation_bytes=0, transient_bytes=0)
    with pytest.raises(ValueError, match="stats is empty"):
        validate_chain([])
    with pytest.raises(ValueError, match="duplicate layer name 'x' at positions 0 and 1"):
        validate_chain([layer, layer])
    with pytest.raises(TypeError, match=r"stats\[1\] is dict, expected LayerStats"):
        validate_chain([layer, {"name": "y"}])
