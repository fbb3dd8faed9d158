"""Memory-centric pipeline partitioning (mCAP / CAPSlog style), TensorFlow-free.

Floors, from the ground up:

* ``stats`` -- ``LayerStats``, the per-layer figures (analytic or profiled);
* ``stage_model`` -- the peak of one stage under a ``Schedule`` (1F1B, GPipe);
* ``partition`` -- exact lexicographic min-max boundaries and the baselines,
  searched by ``exact_search`` (bisection, greedy probes, windows),
  ``greedy_tables`` (the probes vectorised over layers) and ``lex_dp`` (the
  lexicographic DP);
* ``graph_stats`` -- analytic ``LayerStats`` of a captured training step;
* ``keras_stats`` -- ``layer_stats(model, ...)``: capture + ``graph_stats``
  (TensorFlow is imported only when it is called);
* ``profile`` / ``profile_worker`` -- measured statistics from trimmed stage
  runs in BFC-allocator subprocesses;
* ``regression`` -- the stage-peak regression fitted on measured stages;
* ``hybrid`` -- PP x TP x DP candidates ranked by predicted peak per device.

Example:
    >>> from tofu_tf.pipeline import LayerStats, partition
    >>> layers = [LayerStats(name=f"l{i}", state_bytes=100, activation_bytes=10,
    ...                      transient_bytes=0) for i in range(9)]
    >>> plan = partition(layers, 4, schedule="1f1b", num_microbatches=8)
    >>> plan.boundaries, plan.stage_peak_bytes
    ((0, 2, 4, 6), (280, 260, 240, 330))
    >>> partition(layers, 4, num_microbatches=8, method="uniform").max_peak_bytes
    420
"""

from tofu_tf.pipeline.graph_stats import ChainAnalysis, Unit, chain_stats
from tofu_tf.pipeline.hybrid import (HybridCandidate, HybridRecommendation, InfeasibleBudgetError,
                                     ScalableChain, factorizations, rank_hybrid)
from tofu_tf.pipeline.keras_stats import layer_stats, recommend_hybrid
from tofu_tf.pipeline.regression import MemoryRegression, StageSample, default_regression
from tofu_tf.pipeline.partition import (Method, StagePlan, balanced_boundaries, partition,
                                        uniform_boundaries)
from tofu_tf.pipeline.stage_model import (Schedule, StageCostModel, inflight_microbatches,
                                          stage_peak_bytes)
from tofu_tf.pipeline.stats import LayerStats, validate_chain

__all__ = [
    "ChainAnalysis", "HybridCandidate", "HybridRecommendation", "InfeasibleBudgetError",
    "LayerStats", "MemoryRegression", "ScalableChain", "StageSample", "Unit", "chain_stats",
    "default_regression", "factorizations", "layer_stats", "rank_hybrid", "recommend_hybrid",
    "Method", "Schedule", "StageCostModel", "StagePlan", "balanced_boundaries",
    "inflight_microbatches", "partition", "stage_peak_bytes", "uniform_boundaries",
    "validate_chain",
]
