"""The base of every error tofu_tf raises, and the errors shared by more than one module.

A training script can catch ``tofu_tf.TofuError`` to tell the library's refusals
(a plan that cannot fit, a model DTensor cannot run, a plan file that does not
read) from TensorFlow's own failures. Each class keeps the built-in base it had
(``ValueError``, ``RuntimeError``, ``TypeError`` ...), so code that caught those
keeps working. This module imports nothing: every other module may import it.
"""


class TofuError(Exception):
    """Base of every exception tofu_tf and its strategies raise."""


class InfeasibleBudgetError(TofuError, ValueError):
    """No plan the search can build fits the per-device memory budget: the tensor-parallel
    search (``tofu_tf.search``) or the pipeline/hybrid recommendation (``tofu_tf.pipeline``)."""
