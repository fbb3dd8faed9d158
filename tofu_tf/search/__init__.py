"""The partition search: coarsening, Tofu's recursive DP, the ILP reference, baselines.

Imports no TensorFlow (``plan_model`` imports capture lazily).
"""

from tofu_tf.search.api import InfeasibleBudgetError, plan_graph, plan_model
from tofu_tf.search.targets import UnsupportedOpError

__all__ = ["plan_graph", "plan_model", "InfeasibleBudgetError", "UnsupportedOpError"]
