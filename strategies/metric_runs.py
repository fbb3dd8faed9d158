"""A Keras metric passed to ``strategy.run`` eagerly, run as a ``tf.function`` where DTensor compiles it.

tf-keras's tests, and custom loops, update a metric through the strategy eagerly:
``strategy.run(metric, args=(labels, predictions))`` or ``strategy.run(metric.update_state, ...)``.
A metric's update combines constants of its own (the thresholds of Precision and Recall),
ordinary host tensors, with the batch, which is on the mesh; DTensor's eager ops refuse a
host tensor beside a DTensor unless it is a scalar (``Tile got a regular tensor``), and
MirroredStrategy's replicas never meet the question. Traced, the same constants are part of
one DTensor program, which lays them out replicated. Keras writes metric updates to be traced
(it traces them inside its own steps).

Some metrics trace into an op DTensor has no layout propagation for (``Size``, in the
thresholds search of PrecisionAtRecall and its kin), which they do not run eagerly. DTensor
refuses such a program when it compiles it, before any of it runs, so that first call is
repeated eagerly, and the metric's method runs eagerly from then on (logged once). Each metric
and method keeps its function while the metric lives.
"""

from __future__ import annotations

import inspect
import weakref

import tensorflow as tf
from absl import logging

_KERAS_MODULES = ("tf_keras.", "keras.")

# The runners of a metric's methods, by metric (weakly).
_RUNNERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def metric_as_function(fn):
    """``fn`` run as a ``tf.function`` when it is a Keras metric or one of its methods (else
    ``fn`` itself): see the module's docstring."""
    target = _autograph_target(fn)
    if is_metric(target):
        metric, function = target, type(target).__call__
    elif inspect.ismethod(target) and is_metric(target.__self__):
        metric, function = target.__self__, target.__func__
    else:
        return fn
    runners = _RUNNERS.setdefault(metric, {})
    if function not in runners:
        runners[function] = _Runner(metric, function)
    return runners[function]


def is_metric(obj) -> bool:
    kind = type(obj)
    return (callable(getattr(kind, "update_state", None)) and callable(getattr(kind, "result", None))
            and callable(getattr(kind, "reset_state", None))
            and any(str(base.__module__).startswith(_KERAS_MODULES) for base in kind.__mro__))


def _autograph_target(fn):
    """What ``strategy.run`` wrapped for autograph (``autograph.tf_convert``): the function
    (``__wrapped__``), or a callable object, which its wrapper holds in its closure."""
    fn = inspect.unwrap(fn, stop=inspect.ismethod)        # a metric's method: keep it bound
    if inspect.ismethod(fn) or not hasattr(fn, "autograph_info__"):
        return fn
    held = [cell.cell_contents for cell in fn.__closure__ or () if callable(cell.cell_contents)]
    return held[0] if len(held) == 1 else fn


class _Runner:
    """One method of one metric: a ``tf.function`` until DTensor refuses to compile it, then eager.
    It holds the metric weakly (it is kept in a dict keyed weakly by the metric)."""

    def __init__(self, metric, function):
        self._metric = weakref.ref(metric)
        self._method = function
        def traced(*args, **kwargs):       # an update's graph result is an Operation: None instead
            result = function(self._metric(), *args, **kwargs)
            return tf.nest.map_structure(lambda value: None if isinstance(value, tf.Operation) else value, result)
        self._function = tf.function(traced)
        self._compiled = False

    def __call__(self, *args, **kwargs):
        if self._function is None:
            return self._method(self._metric(), *args, **kwargs)
        if self._compiled:
            return self._function(*args, **kwargs)
        try:
            result = self._function(*args, **kwargs)
        except (tf.errors.UnknownError, tf.errors.UnimplementedError) as error:
            # DTensor refused the program while compiling it: nothing of it ran.
            logging.info("TofuStrategy: %s.%s runs eagerly under strategy.run: DTensor cannot compile it as a "
                         "function (%s)", type(self._metric()).__name__, self._method.__name__,
                         str(error).split("\n")[0][:200])
            self._function = None
            return self._method(self._metric(), *args, **kwargs)
        self._compiled = True
        return result
