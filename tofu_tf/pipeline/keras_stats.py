"""The Keras-facing entry points: ``layer_stats`` and ``recommend_hybrid``.

This is the one module of ``tofu_tf.pipeline`` that touches TensorFlow, and it
does so lazily (inside the functions), so ``import tofu_tf.pipeline`` stays
TF-free. It asks Keras three questions -- the top-level layers in order, the
layer owning each variable, the model's name -- captures the training step at
the micro-batch size (``tofu_tf.capture_training_step``), and hands the IR to
``tofu_tf.pipeline.graph_stats``, which does the accounting. With
``profile=True`` the figures are measured instead (``tofu_tf.pipeline.profile``).
"""

from __future__ import annotations

from typing import Callable

from absl import logging

from tofu_tf.pipeline.graph_stats import ChainAnalysis, chain_stats
from tofu_tf.pipeline.hybrid import HybridRecommendation, ScalableChain, rank_hybrid
from tofu_tf.pipeline.regression import MemoryRegression, StageSample, default_regression
from tofu_tf.pipeline.stats import LayerStats


def micro_batch_size(batch_size: int, num_microbatches: int) -> int:
    """``batch_size / num_microbatches``, refusing a split that is not exact."""
    for label, value in (("batch_size", batch_size), ("num_microbatches", num_microbatches)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{label} must be a positive int, got {value!r}")
    if batch_size % num_microbatches:
        raise ValueError(
            f"batch_size={batch_size} does not split into num_microbatches={num_microbatches} "
            "equal micro-batches; choose a batch size divisible by the micro-batch count")
    return batch_size // num_microbatches


def layer_stats(model, *, batch_size: int, loss, optimizer, num_microbatches: int,
                profile: bool = False, model_fn: Callable | None = None,
                profile_devices: int = 8, hardware="h100-nvlink") -> list[LayerStats]:
    """One ``LayerStats`` per pipeline unit of ``model`` at micro-batch size
    ``batch_size // num_microbatches``.

    Analytic by default, from the captured training step (no model-sized
    allocation). ``profile=True`` measures every unit's ``isolated_bytes``,
    ``added_bytes`` and per-micro-batch ``activation_bytes`` by running trimmed
    stages in subprocesses (``tofu_tf.pipeline.profile``), ``profile_devices``
    stages per profiling run. The subprocesses rebuild the model from
    ``model_fn``, a picklable zero-argument callable such as
    ``functools.partial(tofu_tf.models.gpt, num_layers=4)``, or, without one,
    from the model's Keras config. ``hardware`` (a profile name or
    ``tofu_tf.cost.HardwareProfile``) prices ``compute_seconds``.
    """
    micro = micro_batch_size(batch_size, num_microbatches)
    analysis = analyze_model(model, micro_batch=micro, loss=loss, optimizer=optimizer,
                             hardware=hardware)
    if not profile:
        return list(analysis.stats)
    result = profile_model(model, analysis, micro_batch=micro, loss=loss, optimizer=optimizer,
                           model_fn=model_fn, num_devices=profile_devices)
    return list(result.stats)


def analyze_model(model, *, micro_batch: int, loss, optimizer,
                  hardware="h100-nvlink") -> ChainAnalysis:
    """Pipeline units of ``model`` and their analytic statistics at ``micro_batch``."""
    graph, names, owners = capture_for_stats(model, micro_batch=micro_batch, loss=loss,
                                             optimizer=optimizer)
    analysis = chain_stats(graph, layer_names=names, model_name=model.name,
                           variable_layers=owners, hardware=hardware)
    logging.info("layer_stats: %d layers of %s -> %d pipeline units at micro-batch %d",
                 len(names), model.name, len(analysis.units), micro_batch)
    return analysis


def profile_model(model, analysis: ChainAnalysis, *, micro_batch: int, loss, optimizer,
                  model_fn: Callable | None = None, num_devices: int = 8):
    """Measured statistics of ``analysis``'s units (a ``profile.ProfileResult``)."""
    from tofu_tf.pipeline import profile as profiling
    builder = model_fn if model_fn is not None else profiling.config_builder(model)
    result = profiling.measure(analysis, builder, micro_batch=micro_batch, loss=loss,
                               optimizer=optimizer, num_devices=num_devices)
    logging.info("profiled %d units in %d runs of %d stages (mCAP's scheme: %s runs)",
                 len(analysis.units), result.runs, num_devices, result.mcap_runs)
    return result


def capture_for_stats(model, *, micro_batch: int, loss, optimizer):
    """The step's IR at ``micro_batch``, the top-level layer names, and variable owners."""
    import tofu_tf
    from tofu_tf.tf import keras_adapter

    keras_adapter.framework_of(model)  # a clear error for a non-Keras object
    names = [layer.name for layer in model.layers]
    owners = {}
    for layer in model.layers:
        for weight in layer.weights:
            owners.setdefault(keras_adapter.variable_path(weight), layer.name)
    graph = tofu_tf.capture_training_step(model, batch_size=micro_batch, loss=loss,
                                          optimizer=optimizer)
    return graph, names, owners


def recommend_hybrid(model, *, num_devices: int, batch_size: int, loss, optimizer,
                     memory_budget_bytes: int | None = None, num_microbatches: int | None = None,
                     schedule="1f1b", regression: MemoryRegression | None = None,
                     profile: bool = False, model_fn: Callable | None = None,
                     hardware="h100-nvlink") -> HybridRecommendation:
    """Rank every PP x TP x DP factorisation of ``num_devices`` for ``model``.

    The model's units are analysed at micro-batch sizes 1 and 2 (two captures;
    every figure is affine in the micro-batch size, see ``hybrid.ScalableChain``),
    and ``hybrid.rank_hybrid`` predicts each candidate's peak per device with
    ``regression``: by default the one fitted on the stage profiles shipped
    with tofu_tf (``regression.default_regression``); with ``profile=True`` one
    fitted on stages of this very model, measured in subprocesses
    (``fit_memory_regression``). Lowest predicted peak first, or with
    ``memory_budget_bytes`` the fastest plan that fits (``InfeasibleBudgetError``
    if none does). ``.table()`` prints the top candidates.
    """
    low = analyze_model(model, micro_batch=1, loss=loss, optimizer=optimizer, hardware=hardware)
    high = analyze_model(model, micro_batch=2, loss=loss, optimizer=optimizer, hardware=hardware)
    chain = ScalableChain.from_two(low.stats, 1, low.boundary_bytes,
                                   high.stats, 2, high.boundary_bytes)
    if regression is None:
        if profile:
            micro = max(1, batch_size // num_devices)
            analysis = analyze_model(model, micro_batch=micro, loss=loss, optimizer=optimizer,
                                     hardware=hardware)
            regression = fit_memory_regression(model, analysis, micro_batch=micro, loss=loss,
                                               optimizer=optimizer, model_fn=model_fn)
        else:
            regression = default_regression()
    return rank_hybrid(chain, num_devices=num_devices, batch_size=batch_size,
                       regression=regression, schedule=schedule,
                       num_microbatches=num_microbatches, memory_budget_bytes=memory_budget_bytes,
                       hardware=hardware)


def fit_memory_regression(model, analysis: ChainAnalysis, *, micro_batch: int, loss, optimizer,
                          model_fn: Callable | None = None, num_stages: int = 12
                          ) -> MemoryRegression:
    """A ``MemoryRegression`` fitted on ``num_stages`` measured stages of this model.

    Stages are spread over lengths (one unit, a quarter, half, all of the
    chain) and positions, each measured at one and at three micro-batches in
    flight, in one profiling subprocess.
    """
    from tofu_tf.pipeline import profile as profiling
    builder = model_fn if model_fn is not None else profiling.config_builder(model)
    probes = calibration_probes(len(analysis.units), num_stages)
    peaks = profiling.measure_stage_peaks(analysis, builder, probes, micro_batch=micro_batch,
                                          loss=loss, optimizer=optimizer)
    samples = [StageSample.of(model.name, analysis.stats[p.start:p.stop], k, peak)
               for p, measured in zip(probes, peaks) for k, peak in zip(p.inflights, measured)]
    regression = MemoryRegression.fit(samples)
    logging.info("memory regression for %s: %s", model.name, regression.describe())
    return regression


def calibration_probes(num_units: int, num_stages: int) -> list:
    """Distinct stages of several lengths and positions, at 1 and 3 micro-batches in flight."""
    from tofu_tf.pipeline.profile import StageProbe
    lengths = sorted({1, max(1, num_units // 4), max(1, num_units // 2), num_units})
    chosen: dict[tuple[int, int], None] = {}
    offset = 0
    while len(chosen) < num_stages and offset < num_units:
        for length in lengths:
            start = min((offset * (length + 1)) % num_units, num_units - length)
            chosen.setdefault((start, start + length))
        offset += 1
    return [StageProbe(a, b, (1, 3)) for a, b in list(chosen)[:num_stages]]
