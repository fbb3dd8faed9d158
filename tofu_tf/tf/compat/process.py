"""The changes tofu_tf makes to attributes every thread and model shares.

* ``layer_scopes_recorded``: Keras 3's ``name_scope.__enter__``, on the class, while a step
  is captured; only the capturing thread records (``recording_keras3_scopes``).
* ``handle_debug_name``: TensorFlow's ``gen_resource_variable_ops.var_handle_op``, while a
  ``TofuVariable`` is made; only the creating thread's handles are renamed
  (``one_handle_debug_name``).
* ``dtensor_all_reduces_uncombined``: DTensor's all-reduce combining pass, off (its
  environment switch) from the first pipelined TofuStrategy on (``uncombine_all_reduces``).
* ``summary_before_plan``: tf-keras's ``print_dtensor_variable_summary``, while a
  ``TofuStrategy`` is alive (``hold_summary_printer``); the original is back once the last
  strategy is garbage-collected.

How each is installed and taken back is ``tofu_tf.tf.compat.patching``'s; what each is for,
``tofu_tf.tf.compat.registry``'s entry of the same name.
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Callable, Iterator

import tensorflow as tf

from tofu_tf.tf.compat import patching
from tofu_tf.tf.compat.registry import change


def _keras3_name_scope():
    from keras.src.backend.tensorflow import core
    return core.name_scope, "__enter__"


_LAYER_SCOPES = patching.ThreadScopedPatch(change("layer_scopes_recorded"), _keras3_name_scope)


@contextlib.contextmanager
def recording_keras3_scopes(record: Callable[[object, str], None]) -> Iterator[None]:
    """While active, ``record(caller, scope_path)`` runs on this thread each time a Keras 3
    ``name_scope`` is entered: the object that opened it (a layer) and the full scope path
    it opened. Other threads enter their scopes as Keras does."""
    def enter(original, scope):
        result = original(scope)
        record(scope.caller, tf.compat.v1.get_default_graph().get_name_scope())
        return result

    with _LAYER_SCOPES.active(enter):
        yield


# DTensor reads this switch when it first builds its compiler passes, so it must be set before
# the process's first DTensor program (dtensor_mlir_passes_internal.cc).
COMBINE_ALL_REDUCES_ENV = "DTENSOR_ENABLE_COMBINE_ALL_REDUCES_OPTIMIZATION"


def uncombine_all_reduces() -> bool:
    """Switch DTensor's all-reduce combining pass off for this process (the change
    "dtensor_all_reduces_uncombined"), unless the user set the switch; True when it set it.

    The pass merges several all-reduces into one and slices the results apart, and the slices
    carry no layout: where such a slice is a result of the function (the gradients a pipeline
    stage's backward function returns, LayerNormalization's among them), DTensor refuses to
    compile it ("missing result layout attribute for function"). A whole-model step consumes
    its gradients inside one function and never meets this. The pass saves collective launches;
    the sums are the same."""
    if COMBINE_ALL_REDUCES_ENV in os.environ:
        return False
    os.environ[COMBINE_ALL_REDUCES_ENV] = "0"
    return True


def _var_handle_op():
    from tensorflow.python.ops import gen_resource_variable_ops
    return gen_resource_variable_ops, "var_handle_op"


_HANDLE_NAMES = patching.ThreadScopedPatch(change("handle_debug_name"), _var_handle_op)


@contextlib.contextmanager
def one_handle_debug_name(debug_name: str) -> Iterator[None]:
    """Variable handles this thread makes while this is active carry ``debug_name``.

    TF-private: ``var_handle_op`` is called by keyword (``debug_name=``) from
    ``resource_variable_ops``; ``tests/test_variables.py`` checks that the handle still
    carries the name, so a TF upgrade that calls it otherwise fails there.
    """
    def renamed(original, *args, **kwargs):
        if "debug_name" in kwargs:
            kwargs["debug_name"] = debug_name
        return original(*args, **kwargs)

    with _HANDLE_NAMES.active(renamed):
        yield


def _tf_keras_layer_utils():
    if "tf_keras" not in sys.modules:        # a Keras 3 user does not pay tf-keras's import
        return None
    from tf_keras.src.utils import layer_utils
    return layer_utils, "print_dtensor_variable_summary"


def _summary_saying_when_layouts_come(original: Callable) -> Callable:
    def print_dtensor_variable_summary(model, print_fn, line_length):
        unplanned = not any(isinstance(w, tf.experimental.dtensor.DVariable) for w in model.weights)
        if not (unplanned and type(getattr(model, "distribute_strategy", None)).__name__ == "TofuStrategy"):
            return original(model, print_fn, line_length)
        print_fn("Layouts: none yet; TofuStrategy plans them at the first fit/evaluate/predict "
                 "(or strategy.plan_model)")
        print_fn("_" * line_length)
        return None
    return print_dtensor_variable_summary


SUMMARY_PRINTER = patching.HeldPatch(change("summary_before_plan"), _tf_keras_layer_utils,
                                     _summary_saying_when_layouts_come)


def hold_summary_printer(strategy) -> None:
    """Let tf-keras ``model.summary()`` run before ``strategy`` plans, while ``strategy`` is alive.

    Under a strategy with a mesh, tf-keras ends the summary with the weights' per-device
    sizes by sharding spec, and divides by their sum: with every weight still waiting for
    its layout that sum is 0 and ``summary()`` raised ZeroDivisionError, the first thing
    many scripts call after ``compile``. The replacement says when the layouts are chosen
    instead; once they are, tf-keras's own lines; other models' summaries are unchanged.
    Installed once tf-keras is imported (``SUMMARY_PRINTER.refresh()``, called as the
    strategy's variables are made, catches an import after the strategy was made).
    """
    SUMMARY_PRINTER.hold(strategy)
