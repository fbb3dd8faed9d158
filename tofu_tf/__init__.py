"""tofu_tf: automatic partitioning of Keras training steps across devices.

The planner core (``tofu_tf.ir``, ``tofu_tf.pipeline`` ...) imports no
TensorFlow, so importing this package is cheap; the TF-facing entry points are
loaded on first use. ``TofuStrategy`` lives in ``tofu_tf.strategies``, which
imports the core and is never imported by it: this module names it lazily.

The IR's classes (``Graph``, ``Op``, ``Tensor``, ``Variable``, ``Role``,
``VariableKind``) are not exported here, where they would read like
TensorFlow's own: import them from ``tofu_tf.ir``.
"""

from typing import TYPE_CHECKING

from tofu_tf.errors import InfeasibleBudgetError, TofuError

__version__ = "0.1.0"

# name -> (module, attribute), imported at the first access of tofu_tf.<name>.
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

if TYPE_CHECKING:       # the same names, for type checkers and IDEs (tests/test_imports.py keeps them in step)
    from tofu_tf.plan import Plan
    from tofu_tf.plan_check import PlanError
    from tofu_tf.search import UnsupportedOpError, plan_graph, plan_model
    from tofu_tf.semantics import coverage, register_op
    from tofu_tf.strategies.export import one_device_copy
    from tofu_tf.strategies.tofu_strategy import TofuStrategy
    from tofu_tf.tf.capture import DynamicShapeError, capture_training_step
    from tofu_tf.tf.variables import DTensorExportError


def __getattr__(name):
    if name in _LAZY:
        import importlib
        module_name, attr = _LAZY[name]
        return getattr(importlib.import_module(module_name), attr)
    raise AttributeError(f"module 'tofu_tf' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))


__all__ = ["TofuError", "InfeasibleBudgetError", *_LAZY]
