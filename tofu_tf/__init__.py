"""tofu_tf: automatic partitioning of Keras training steps across devices.

The planner core (``tofu_tf.ir``, ``tofu_tf.pipeline`` ...) imports no
TensorFlow, so importing this package is cheap; the TF-facing entry points are
loaded on first use.
"""

from tofu_tf.errors import InfeasibleBudgetError, TofuError
from tofu_tf.ir import Graph, Op, Role, Tensor, Variable, VariableKind

__version__ = "0.1.0"

_LAZY = {
    "TofuStrategy": ("tofu_tf.strategies.tofu_strategy", "TofuStrategy"),
    "capture_training_step": ("tofu_tf.tf.capture", "capture_training_step"),
    "DynamicShapeError": ("tofu_tf.tf.capture", "DynamicShapeError"),
    "coverage": ("tofu_tf.semantics", "coverage"),
    "register_op": ("tofu_tf.semantics", "register_op"),
    "plan_model": ("tofu_tf.search", "plan_model"),
    "plan_graph": ("tofu_tf.search", "plan_graph"),
    "UnsupportedOpError": ("tofu_tf.search", "UnsupportedOpError"),
    "Plan": ("tofu_tf.plan", "Plan"),
    "one_device_copy": ("tofu_tf.strategies.export", "one_device_copy"),
    "DTensorExportError": ("tofu_tf.tf.variables", "DTensorExportError"),
    "PlanError": ("tofu_tf.plan_check", "PlanError"),
}


def __getattr__(name):
    if name in _LAZY:
        import importlib
        module_name, attr = _LAZY[name]
        return getattr(importlib.import_module(module_name), attr)
    raise AttributeError(f"module 'tofu_tf' has no attribute {name!r}")


__all__ = ["Graph", "Op", "Role", "Tensor", "Variable", "VariableKind", "TofuError", "InfeasibleBudgetError", *_LAZY]
