"""Keras' train, test and predict functions, one batch at a time, one program per input signature.

Keras builds each loop's function around a ``tf.data`` iterator read inside a
``tf.function`` that relaxes shapes on a second trace (``reduce_retracing``).
Under TofuStrategy the batches come from ``tofu_tf.strategies.batches`` instead: each
laid out on the mesh as it arrives, and not all of one shape (a partial last
batch, another sequence length, a batch replicated because the batch axis does
not divide it). So the functions installed here read the next batch in Python
and run it through a ``tf.function`` made for its signature (shapes, dtypes and
layouts), traced once and kept: no relaxed shapes, and a new signature is
traced once and logged. Each step runs Keras' own ``train_step`` /
``test_step`` / ``predict_step`` through ``strategy.run`` and Keras' own
reduction, as Keras' functions do; predictions come back assembled on the
host, as one device returns them.

This module touches Keras internals (the step counters of tf-keras, both
versions' ``reduce_per_replica``); a Keras upgrade that moves them changes
this file and ``tofu_tf.strategies.keras_hooks``.
"""

from __future__ import annotations

import itertools

import tensorflow as tf
from absl import logging
from tensorflow.dtensor.python import d_variable
from tensorflow.experimental import dtensor

from tofu_tf.strategies import batches as batches_lib
from tofu_tf.tf.compat import calls

_KINDS = ("train", "test", "predict")


def install(model, placer_of, *, optimize_graph: bool = True, explain=None, combined_of=None) -> bool:
    """Give ``model`` TofuStrategy's train, test and predict functions (both Keras
    versions). ``placer_of()`` returns the strategy's current ``BatchPlacer`` (the plan
    may come after this call); ``optimize_graph``: whether grappler optimizes the step
    programs (``tofu_tf.tf.compat.calls``); ``explain(error, model_name, kind)``: the error to raise
    instead of an error of a program's first call (its compilation), or None to raise that
    one (``tofu_tf.strategies.expansion_errors``); ``combined_of()``: the plan's
    ``all_reduces_combined`` once planned (False: the training step's program is compiled with
    its all-reduces one by one, ``calls.all_reduces_one_by_one``). True when it changed the
    model: the change "step_functions" (``tofu_tf.tf.compat.registry``)."""
    if getattr(model, "_tofu_step_functions", False):
        return False
    keras3 = not any(base.__module__.startswith("tf_keras") for base in type(model).__mro__)
    for kind in _KINDS:
        setattr(model, f"make_{kind}_function", _maker(model, kind, keras3, placer_of, optimize_graph, explain,
                                                       combined_of if kind == "train" else None))
        setattr(model, f"{kind}_function", None)
    model._tofu_step_functions = True  # pylint: disable=protected-access
    return True


def _maker(model, kind: str, keras3: bool, placer_of, optimize_graph: bool, explain, combined_of):
    attribute = f"{kind}_function"

    def make_function(force=False):
        current = getattr(model, attribute, None)
        if current is not None and getattr(current, "_tofu", False) and not force:
            return current
        steps = SignatureSteps(model.name, kind, _step_body(model, kind, keras3), placer_of,
                               eager=bool(getattr(model, "run_eagerly", False)), optimize_graph=optimize_graph,
                               explain=explain, combined_of=combined_of)
        if kind == "predict" and keras3:
            function = _keras3_predict_function(steps)
        else:
            function = _iterator_function(model, steps, keras3, gather=kind == "predict")
        function._tofu = True  # pylint: disable=protected-access
        function._tofu_steps = steps  # pylint: disable=protected-access
        setattr(model, attribute, function)
        return function
    return make_function


class SignatureSteps:
    """One step of one loop, as a ``tf.function`` per input signature."""

    def __init__(self, model_name: str, kind: str, body, placer_of, *, eager: bool = False,
                 optimize_graph: bool = True, explain=None, combined_of=None):
        self._model_name = model_name
        self._combined_of = combined_of
        self._explain = explain
        self._eager = eager                  # run_eagerly: op by op, as Keras would
        self._optimize_graph = optimize_graph
        self._kind = kind
        self._body = body
        self._placer_of = placer_of
        self._functions: dict = {}

    def __call__(self, data):
        if tf.executing_eagerly():
            data = batches_lib.place_batch(self._placer_of(), data)
        key = _signature(data)
        program = self._functions.get(key)
        if program is None:
            if self._functions:
                logging.info("TofuStrategy: %s %s step for a new input signature %s (signature %d; traced once, "
                             "weights keep their planned layouts)", self._model_name, self._kind,
                             _describe(data), len(self._functions) + 1)
            program = self._functions[key] = (self._body if self._eager or not tf.executing_eagerly()
                                               else _Program(self._body, data, self._optimize_graph, self._combined_of))
            if isinstance(program, _Program) and self._explain is not None:
                return self._first_call(program, data, key)
        return program(data)

    def _first_call(self, program, data, key):
        """A program's first call compiles it: DTensor's refusal then, explained (nothing ran)."""
        try:
            return program(data)
        except tf.errors.UnknownError as error:
            explained = self._explain(error, self._model_name, self._kind)
            if explained is None:
                raise
            del self._functions[key]
            logging.debug("TofuStrategy: DTensor's refusal in full:\n%s", error)
            raise explained from None

    @property
    def programs(self) -> list:
        """The compiled programs, one per input signature seen (in order)."""
        return list(self._functions.values())


# DTensor compiles a fully replicated int32/int64/float32 input with fewer elements than
# this into the program as a constant (tensorflow/dtensor/cc/small_constant_optimization.cc),
# and compiles the program again when the next call brings another value.
SMALL_CONSTANT_ELEMENTS = 64
_FOLDED_DTYPES = frozenset({"int32", "int64", "float32"})


def folded_by_dtensor(value) -> bool:
    """Whether DTensor would compile ``value``, passed to a function, in as a constant."""
    return (tf.is_tensor(value) and dtensor.is_dtensor(value) and value.dtype.name in _FOLDED_DTYPES
            and value.shape.num_elements() < SMALL_CONSTANT_ELEMENTS
            and dtensor.fetch_layout(value).is_fully_replicated())


class _Program:
    """A step's ``tf.function`` for one input signature, with the inputs DTensor would fold
    in as constants passed through variables instead.

    A classifier's labels are one int per sample: a batch of 8 replicated labels is such
    an input, so the second step, with other labels, compiled the whole step again
    (seconds). Each such input is written into a variable of its shape before the call
    and read inside the step; the write is a one-op program, and the step is compiled
    once. The variables hold what the inputs held, laid out the same.

    The program is called with grappler on or off as ``optimize_graph`` says
    (``tofu_tf.tf.compat.calls``), and a training step with its all-reduces one by one where
    ``combined_of()`` (the plan's ``all_reduces_combined``, made from the first batch before any
    step runs) says False: its first call compiles it."""

    def __init__(self, body, data, optimize_graph: bool = True, combined_of=None):
        self._optimize_graph = optimize_graph
        self._combined_of = combined_of
        leaves = tf.nest.flatten(data)
        self._structure = data
        self._holders = {i: d_variable.DVariable(leaf, trainable=False, name="tofu_step_input")
                         for i, leaf in enumerate(leaves) if folded_by_dtensor(leaf)}

        def run(passed):
            inputs = [self._holders[i].read_value() if i in self._holders else leaf for i, leaf in enumerate(passed)]
            return body(tf.nest.pack_sequence_as(self._structure, inputs))
        self._function = tf.function(run)

    @property
    def held_inputs(self) -> int:
        """How many inputs reach the step through a variable."""
        return len(self._holders)

    def __call__(self, data):
        leaves = tf.nest.flatten(data)
        for index, holder in self._holders.items():
            holder.assign(leaves[index])
        passed = [None if i in self._holders else leaf for i, leaf in enumerate(leaves)]
        with calls.step_call_options(self._optimize_graph):
            with calls.all_reduces_one_by_one(self._combined_of is not None and self._combined_of() is False):
                return self._function(passed)


def _signature(data):
    def leaf(value):
        if not tf.is_tensor(value):
            return ("python", repr(value))
        layout = dtensor.fetch_layout(value).to_string() if dtensor.is_dtensor(value) else None
        return (tuple(value.shape.as_list()), value.dtype.name, layout)
    return (str(tf.nest.map_structure(lambda _: 0, data)), tuple(leaf(v) for v in tf.nest.flatten(data)))


def _describe(data) -> str:
    return str(tf.nest.map_structure(lambda v: tuple(v.shape.as_list()) if tf.is_tensor(v) else v, data))


def _step_body(model, kind: str, keras3: bool):
    """What one step runs, as Keras' own function runs it (its step, its counter, its reduction)."""
    strategy = model.distribute_strategy
    step = getattr(model, f"{kind}_step")
    if keras3:
        from keras.src.backend.tensorflow import trainer as keras3_trainer
        reduction = "concat" if kind == "predict" else "auto"

        def keras3_body(data):
            outputs = strategy.run(step, args=(data,))
            return keras3_trainer.reduce_per_replica(outputs, strategy, reduction=reduction)
        return keras3_body

    from tf_keras.src.engine import training as tf_keras_training
    # pylint: disable=protected-access
    counter = getattr(model, f"_{kind}_counter")
    reduction = "concat" if kind == "predict" else model.distribute_reduction_method

    def run_step(data):
        outputs = step(data)
        with tf.control_dependencies(tf_keras_training._minimum_control_deps(outputs)):
            counter.assign_add(1)
        return outputs

    def tf_keras_body(data):
        outputs = strategy.run(run_step, args=(data,))
        return tf_keras_training.reduce_per_replica(outputs, strategy, reduction=reduction)
    return tf_keras_body


def _iterator_function(model, steps: SignatureSteps, keras3: bool, *, gather: bool):
    """``function(iterator)``: up to steps_per_execution batches; StopIteration when none is left
    (both Keras versions end an epoch of unknown length on it)."""

    def function(iterator):
        iterator = iter(iterator)           # Keras 3's train_on_batch passes a list of one batch
        outputs, gathered, ran = None, [], False
        for data in itertools.islice(iterator, _steps_per_execution(model, keras3)):
            outputs, ran = steps(data), True
            if gather:                      # predict returns every step's outputs, concatenated
                gathered.append(tf.nest.map_structure(batches_lib.to_host, outputs))
        if not ran:
            raise StopIteration
        if not gather:
            return outputs                  # train/test: the last step's logs, as Keras returns them
        if len(gathered) == 1:
            return gathered[0]
        return tf.nest.map_structure(lambda *parts: tf.concat(parts, axis=0), *gathered)
    return function


def _keras3_predict_function(steps: SignatureSteps):
    """Keras 3 hands predict's function a list of batches and concatenates what it returns."""

    def function(data):
        outputs = [tf.nest.map_structure(batches_lib.to_host, steps(batch)) for batch in data]
        if len(outputs) == 1:
            return outputs[0]
        return tf.nest.map_structure(lambda *parts: tf.concat(parts, axis=0), *outputs)
    return function


def _steps_per_execution(model, keras3: bool) -> int:
    if keras3:
        return int(getattr(model, "steps_per_execution", 1) or 1)
    variable = getattr(model, "_steps_per_execution", None)  # pylint: disable=protected-access
    return 1 if variable is None else int(variable.numpy())
