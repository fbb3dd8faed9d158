"""Memory-centric pipeline partitioning (mCAP / CAPSlog style), TensorFlow-free.

Floors, from the ground up:

* ``stats`` -- ``LayerStats``, the per-layer figures (analytic or profiled);
* ``stage_model`` -- the peak of one stage under a ``Schedule`` (1F1B, GPipe);
* ``partition`` -- exact lexicographic min-max boundaries and the baselines.

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

from tofu_tf.pipeline.partition import (Method, StagePlan, balanced_boundaries, partition,
                                        uniform_boundaries)
from tofu_tf.pipeline.stage_model import (Schedule, StageCostModel, inflight_microbatches,
                                          stage_peak_bytes)
from tofu_tf.pipeline.stats import LayerStats, validate_chain

__all__ = [
    "LayerStats", "Method", "Schedule", "StageCostModel", "StagePlan", "balanced_boundaries",
    "inflight_microbatches", "partition", "stage_peak_bytes", "uniform_boundaries",
    "validate_chain",
]
