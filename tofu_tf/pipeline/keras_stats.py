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
    """The memory and compute figures of each pipeline unit of ``model``, for ``partition``.

    A pipeline can cut a model only where one tensor crosses from a layer to the next, so the
    top-level layers between two such places form one unit (a Transformer block with its
    residual connection is one unit, a Dense layer stays one). Each unit's ``LayerStats`` hold
    its weights, gradients and optimizer slots, the activations it keeps per micro-batch and
    its transient peak, at the micro-batch size ``batch_size // num_microbatches``.

    By default the figures are analytic, read off the captured training step, so nothing
    model-sized is allocated. ``profile=True`` measures them instead, by running trimmed
    stages of the model in subprocesses (``tofu_tf.pipeline.profile``): slower, and it needs
    the memory the stages use.

    Args:
        model: A built Keras model (tf-keras or Keras 3) whose top-level layers form a chain.
        batch_size: The global batch size of one step.
        loss: What ``model.compile`` takes as its loss: a name or a loss object.
        optimizer: What ``model.compile`` takes as its optimizer: a name or an optimizer.
        num_microbatches: How many micro-batches a step is split into; it divides
            ``batch_size``.
        profile: Whether to measure each unit's ``isolated_bytes``, ``added_bytes`` and
            ``activation_bytes`` instead of deriving them.
        model_fn: With ``profile=True``, a picklable zero-argument callable that rebuilds the
            model in the subprocesses, such as ``functools.partial(tofu_tf.models.gpt,
            num_layers=4)``; None rebuilds it from its Keras config.
        profile_devices: With ``profile=True``, how many devices one profiling run stands
            for: the stages to measure are packed into runs of that many.
        hardware: A hardware profile name or ``tofu_tf.cost.HardwareProfile``; it prices
            each unit's ``compute_seconds``.

    Returns:
        One ``LayerStats`` per unit, in model order, named after the layers it holds.

    Raises:
        ValueError: ``batch_size`` or ``num_microbatches`` is not a positive int, or does
            not split into equal micro-batches; with ``profile=True`` and no ``model_fn``,
            a model that cannot be rebuilt from its Keras config.
        tofu_tf.tf.keras_adapter.UnsupportedModelError: ``model`` is not a built Keras model.
        tofu_tf.DynamicShapeError: A tensor of the step has a dimension unknown at trace time.
        tofu_tf.pipeline.graph_stats.GraphStatsError: The captured step does not map onto the
            model's top-level layers.
        tofu_tf.pipeline.profile.ProfilingError: With ``profile=True``, a profiling subprocess
            failed, or ``model_fn`` cannot be pickled.

    Example:
        >>> from tofu_tf import models, pipeline
        >>> stats = pipeline.layer_stats(models.mlp(depth=4), batch_size=32, num_microbatches=4,
        ...                              loss="sparse_categorical_crossentropy", optimizer="adam")
        >>> [unit.name for unit in stats]
        ['dense_0', 'dense_1', 'dense_2', 'dense_3', 'head']
        >>> pipeline.partition(stats, 2, num_microbatches=4).num_stages
        2
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
    from tofu_tf.tf import keras_adapter
    from tofu_tf.tf.capture import capture_training_step

    keras_adapter.framework_of(model)  # a clear error for a non-Keras object
    names = [layer.name for layer in model.layers]
    owners = {}
    for layer in model.layers:
        for weight in layer.weights:
            owners.setdefault(keras_adapter.variable_path(weight), layer.name)
    graph = capture_training_step(model, batch_size=micro_batch, loss=loss,
                                          optimizer=optimizer)
    return graph, names, owners


def recommend_hybrid(model, *, num_devices: int, batch_size: int, loss, optimizer,
                     memory_budget_bytes: int | None = None, num_microbatches: int | None = None,
                     schedule="1f1b", regression: MemoryRegression | None = None,
                     profile: bool = False, model_fn: Callable | None = None,
                     hardware="h100-nvlink") -> HybridRecommendation:
    """Rank every pipeline x tensor x data parallel split of ``num_devices`` for ``model``.

    Each factorisation ``pp * tp * dp = num_devices`` is a candidate: the model's units
    (``layer_stats``) are cut into ``pp`` balanced stages, each sharded ``tp`` ways and
    replicated ``dp`` ways, and its peak memory per device and step time are predicted.
    The peak comes from ``regression``, fitted on measured stage peaks, because the analytic
    figures leave out memory a running stage holds (gradient accumulation, the optimizer's
    temporaries). The model is captured at micro-batch sizes 1 and 2 only: every figure is
    affine in the micro-batch size (``hybrid.ScalableChain``), so two captures give it at
    any size.

    Args:
        model: A built Keras model (tf-keras or Keras 3) whose top-level layers form a chain.
        num_devices: How many devices the candidates split.
        batch_size: The global batch size of one step.
        loss: What ``model.compile`` takes as its loss: a name or a loss object.
        optimizer: What ``model.compile`` takes as its optimizer: a name or an optimizer.
        memory_budget_bytes: Peak bytes allowed per device. None ranks by lowest predicted
            peak; with a budget, the fastest candidates that fit come first.
        num_microbatches: Micro-batches per step for every candidate; None picks per
            candidate (one without a pipeline, else the largest divisor of the replica's
            batch up to ``4 * pp``). A candidate whose batch does not split is left out.
        schedule: The pipeline schedule, "1f1b" or "gpipe".
        regression: The ``MemoryRegression`` that predicts a stage's peak; None takes the
            one fitted on the stage profiles shipped with tofu_tf, or with ``profile=True``
            one fitted on measured stages of this model.
        profile: Whether to fit the regression on stages of this model, measured in
            subprocesses (slower), when ``regression`` is None.
        model_fn: With ``profile=True``, a picklable zero-argument callable that rebuilds the
            model in the subprocesses; None rebuilds it from its Keras config.
        hardware: A hardware profile name or ``tofu_tf.cost.HardwareProfile``; it prices the
            step time (compute and each group's links).

    Returns:
        A ``HybridRecommendation``: ``candidates`` ranked best first (``best`` is the first),
        each with its ``pp``, ``tp``, ``dp``, micro-batches, stage boundaries, predicted peak
        and step time; ``table(top)`` prints them.

    Raises:
        tofu_tf.InfeasibleBudgetError: No candidate's predicted peak fits
            ``memory_budget_bytes``; the message gives the lowest.
        ValueError: No factorisation splits ``batch_size`` into the micro-batches; a
            ``num_devices`` that is not a positive int, an unknown ``schedule`` or
            ``hardware``; with ``profile=True`` and no ``model_fn``, a model that cannot be
            rebuilt from its Keras config.
        tofu_tf.tf.keras_adapter.UnsupportedModelError, tofu_tf.DynamicShapeError,
            tofu_tf.pipeline.graph_stats.GraphStatsError: As ``layer_stats`` raises them.
        tofu_tf.pipeline.profile.ProfilingError: With ``profile=True``, a profiling subprocess
            failed, or ``model_fn`` cannot be pickled.

    Example:
        >>> from tofu_tf import models, pipeline
        >>> recommendation = pipeline.recommend_hybrid(
        ...     models.gpt(num_layers=4), num_devices=8, batch_size=16,
        ...     loss="sparse_categorical_crossentropy", optimizer="adam")
        >>> best = recommendation.best
        >>> best.pp * best.tp * best.dp
        8
        >>> print(recommendation.table(top=3))  # doctest: +ELLIPSIS
        Hybrid PP x TP x DP plans for 8 devices, global batch 16, 1f1b; ...
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
