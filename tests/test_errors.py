"""Every exception the package raises derives from ``tofu_tf.TofuError`` and keeps its
built-in base, so a script can catch the library's refusals apart from TensorFlow's."""

import importlib
import inspect
import pkgutil

import tofu_tf
import tofu_tf.strategies
from tofu_tf import TofuError


def _package_modules():
    for package in (tofu_tf, tofu_tf.strategies):
        yield package
        for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
            yield importlib.import_module(info.name)


def _exception_classes():
    for module in _package_modules():
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if issubclass(cls, BaseException) and cls.__module__ == module.__name__:
                yield cls


def test_every_exception_class_of_the_package_derives_from_tofu_error():
    classes = set(_exception_classes())
    assert len(classes) >= 25            # the walk reached the TF-facing modules and the strategies too
    assert sorted(cls.__qualname__ for cls in classes if not issubclass(cls, TofuError)) == []


def test_each_keeps_its_built_in_base_and_there_is_one_infeasible_budget_error():
    from tofu_tf.pipeline import InfeasibleBudgetError as pipeline_infeasible
    from tofu_tf.plan_check import PlanError
    from tofu_tf.search import InfeasibleBudgetError as search_infeasible
    from tofu_tf.strategies.tofu_strategy import PlanningError
    from tofu_tf.tf.keras_adapter import UnsupportedModelError
    assert search_infeasible is pipeline_infeasible is tofu_tf.InfeasibleBudgetError
    assert issubclass(tofu_tf.InfeasibleBudgetError, ValueError)
    assert issubclass(PlanError, ValueError) and issubclass(PlanningError, RuntimeError)
    assert issubclass(UnsupportedModelError, TypeError)
