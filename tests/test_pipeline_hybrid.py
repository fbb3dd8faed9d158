"""Tests for tofu_tf.pipeline.hybrid (no TensorFlow)."""

import math

import pytest

from tofu_tf.pipeline import (InfeasibleBudgetError, LayerStats, MemoryRegression, ScalableChain,
                              factorizations, partition, rank_hybrid, stage_peak_bytes)

UNIT = MemoryRegression(coefficients=(0.0, 1.0, 1.0, 0.0), num_samples=0, fit_mape=0.0,
                        loo_mape=0.0, models=())


def _chain_at(micro, names=("emb", "b0", "b1", "b2", "b3", "head")):
    """Units whose activations grow with the micro-batch (10 + 100 * micro bytes)."""
    state = {"emb": 4000, "head": 6000}
    return [LayerStats(name=n, state_bytes=state.get(n, 2000),
                       activation_bytes=10 + 100 * micro, transient_bytes=5 + 7 * micro,
                       param_count=state.get(n, 2000) // 16, compute_seconds=1e-3 * micro)
            for n in names]


def _chain():
    return ScalableChain.from_two(_chain_at(1), 1, [64] * 6, _chain_at(3), 3, [192] * 6)


def test_factorizations_cover_every_product_once():
    shapes = factorizations(12)
    assert all(pp * tp * dp == 12 for pp, tp, dp in shapes)
    assert len(shapes) == len(set(shapes)) == 18  # d3(12) = sum over pp|12 of d(12/pp)
    assert factorizations(1) == [(1, 1, 1)]
    with pytest.raises(ValueError, match="num_devices must be a positive int"):
        factorizations(0)


def test_scalable_chain_interpolates_affine_figures_and_shards_them():
    chain = _chain()
    at5 = chain.at(5)
    assert [s.activation_bytes for s in at5] == [510] * 6
    assert [s.transient_bytes for s in at5] == [40] * 6
    assert at5[0].compute_seconds == pytest.approx(5e-3)
    sharded = chain.at(5, tp=2)
    assert sharded[0].state_bytes == 2000 and sharded[0].activation_bytes == 255
    assert chain.boundary_bytes(2) == [128.0] * 6
    with pytest.raises(ValueError, match="two different micro-batch sizes"):
        ScalableChain.from_two(_chain_at(1), 1, [0] * 6, _chain_at(1), 1, [0] * 6)


def test_scalable_chain_keeps_workspaces_of_one_image_and_of_more_unsharded():
    import dataclasses
    low = [dataclasses.replace(s, workspace_bytes=100) for s in _chain_at(1)]
    high = [dataclasses.replace(s, workspace_bytes=7000) for s in _chain_at(3)]
    chain = ScalableChain.from_two(low, 1, [64] * 6, high, 3, [192] * 6)
    assert [s.workspace_bytes for s in chain.at(1)] == [100] * 6
    assert [s.workspace_bytes for s in chain.at(2)] == [7000] * 6
    assert [s.workspace_bytes for s in chain.at(8, tp=4)] == [7000] * 6
    assert [s.workspace_bytes for s in _chain().at(4)] == [0] * 6


def test_every_candidate_factors_the_devices_and_ranking_is_by_peak():
    result = rank_hybrid(_chain(), num_devices=8, batch_size=32, regression=UNIT)
    six_units = {shape for shape in factorizations(8) if shape[0] <= 6}
    assert {(c.pp, c.tp, c.dp) for c in result.candidates} == six_units
    for c in result.candidates:
        assert c.pp * c.tp * c.dp == 8
        assert c.micro_batch_size * c.num_microbatches * c.dp == 32
        assert len(c.boundaries) == c.pp
    peaks = [c.predicted_peak_bytes for c in result.candidates]
    assert peaks == sorted(peaks)
    assert result.best is result.candidates[0]


def test_candidate_peak_is_the_regression_optimal_partition_of_its_sharded_chain():
    chain = _chain()
    model = MemoryRegression(coefficients=(1000.0, 1.0, 2.0, 0.5), num_samples=0, fit_mape=0.0,
                             loo_mape=0.0, models=())
    result = rank_hybrid(chain, num_devices=8, batch_size=32, regression=model)
    for c in result.candidates:
        stats = chain.at(c.micro_batch_size, c.tp)
        plan = partition(model.scaled(stats), c.pp, schedule="1f1b",
                         num_microbatches=c.num_microbatches)
        assert c.boundaries == plan.boundaries
        assert c.predicted_peak_bytes == 1000 + plan.max_peak_bytes
        worst = max(range(c.pp), key=lambda r: plan.stage_peak_bytes[r])
        start, stop = plan.stage_ranges[worst]
        k = min(c.num_microbatches, c.pp - worst)
        assert c.predicted_peak_bytes == pytest.approx(
            model.predict_stage(stats[start:stop], k), abs=2)
        assert c.analytic_peak_bytes == stage_peak_bytes(stats, start, stop, worst, c.pp, "1f1b",
                                                         c.num_microbatches)


def test_budget_ranks_fitting_plans_by_time_then_the_rest_by_peak():
    by_peak = rank_hybrid(_chain(), num_devices=8, batch_size=32, regression=UNIT)
    budget = sorted(c.predicted_peak_bytes for c in by_peak.candidates)[4]
    result = rank_hybrid(_chain(), num_devices=8, batch_size=32, regression=UNIT,
                         memory_budget_bytes=budget)
    fits = [c for c in result.candidates if c.fits_budget]
    assert len(fits) == 5 and result.candidates[:5] == tuple(fits)
    times = [c.step_seconds for c in fits]
    assert times == sorted(times)
    rest = [c.predicted_peak_bytes for c in result.candidates[5:]]
    assert rest == sorted(rest) and min(rest) > budget
    assert "fastest within" in result.table()


def test_infeasible_budget_names_the_lowest_peak_and_the_fix():
    with pytest.raises(InfeasibleBudgetError, match=r"lowest predicted peak .* Raise the budget"):
        rank_hybrid(_chain(), num_devices=8, batch_size=32, regression=UNIT,
                    memory_budget_bytes=100)


def test_more_stages_than_units_and_unsplittable_batches_are_left_out():
    chain = ScalableChain.from_two(_chain_at(1, ("a", "b")), 1, [1, 0],
                                   _chain_at(2, ("a", "b")), 2, [2, 0])
    result = rank_hybrid(chain, num_devices=4, batch_size=6, regression=UNIT)
    assert all(c.pp <= 2 for c in result.candidates)
    assert all(6 % c.dp == 0 for c in result.candidates)
    with pytest.raises(ValueError, match="no PP x TP x DP factorisation"):
        rank_hybrid(chain, num_devices=4, batch_size=5, regression=UNIT, num_microbatches=2)


def test_default_microbatches_and_requested_ones():
    result = rank_hybrid(_chain(), num_devices=4, batch_size=16, regression=UNIT)
    by_shape = {(c.pp, c.tp, c.dp): c for c in result.candidates}
    assert by_shape[(1, 4, 1)].num_microbatches == 1
    assert by_shape[(2, 1, 2)].num_microbatches == 8   # largest divisor of 16/2 up to 4 * pp
    assert by_shape[(4, 1, 1)].num_microbatches == 16
    fixed = rank_hybrid(_chain(), num_devices=4, batch_size=16, regression=UNIT,
                        num_microbatches=4)
    assert {c.num_microbatches for c in fixed.candidates} == {4}


def test_tensor_parallelism_and_data_parallelism_trade_memory_for_time():
    result = rank_hybrid(_chain(), num_devices=4, batch_size=16, regression=UNIT)
    by_shape = {(c.pp, c.tp, c.dp): c for c in result.candidates}
    assert by_shape[(1, 4, 1)].predicted_peak_bytes < by_shape[(1, 1, 4)].predicted_peak_bytes
    assert math.isfinite(by_shape[(1, 1, 4)].step_seconds)
    assert by_shape[(1, 1, 4)].step_seconds < by_shape[(1, 4, 1)].step_seconds * 4
    table = result.table(top=3)
    assert "pp x tp x dp" in table and "... and" in table
