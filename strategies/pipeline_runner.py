"""Running a pipelined step: the schedule's actions from one controller, and Keras' step
functions that run them (``TofuStrategy(pipeline=...)``; the stages come from
``tofu_tf.strategies.pipelined``).

A step splits the batch into ``num_microbatches`` equal micro-batches and runs the
schedule's actions (``tofu_tf.pipeline.schedule.issue_order``) from one controller,
eagerly: a forward keeps its micro-batch's ``GradientTape`` (its activations) until that
micro-batch's backward, so a stage holds exactly the micro-batches the schedule has in
flight there, and ``PipelineRunner.inflight_peaks`` reports how many that was. An
activation, or its gradient, goes to the next stage gathered on the host and scattered
onto the next stage's devices: DTensor runs an op on one mesh at a time. Gradients are
summed over the micro-batches (sparse ones concatenated, as one device's batch would hold
them) and the optimizer applies them once. The loss of a micro-batch is scaled by
``1 / num_microbatches``, so for a loss averaged over samples the step is one device's
step on the whole batch; a layer with batch statistics (BatchNormalization) sees each
micro-batch alone, as in every pipeline system.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable

import numpy as np
import tensorflow as tf
from tensorflow.experimental import dtensor

from tofu_tf.pipeline import schedule as schedule_lib
from tofu_tf.strategies import batches as batches_lib
from tofu_tf.strategies.pipelined import PipelineError, PipelinePlan
from tofu_tf.tf import devices as devices_lib
from tofu_tf.tf import keras_adapter
from tofu_tf.tf import variables as variables_lib
from tofu_tf.tf.compat import calls
from tofu_tf.tf.compat import process as compat_process
from tofu_tf.tf.compat import random_draws


class HostPlacer:
    """Batches of a pipelined run stay on the host: the runner splits them into
    micro-batches and places each on the stage that reads it."""

    @staticmethod
    def place(value):
        if value is None or isinstance(value, tf.Variable):
            return value
        if tf.is_tensor(value) and dtensor.is_dtensor(value):
            return batches_lib.to_host(value)
        if tf.is_tensor(value) or isinstance(value, (np.ndarray, np.generic)):
            with tf.device(devices_lib.host_device()):
                return tf.identity(value) if tf.is_tensor(value) else tf.constant(value)
        return value


@dataclasses.dataclass
class _InFlight:
    tape: tf.GradientTape
    inputs: object            # what the stage read (watched, for stages after the first)
    target: object            # the scaled loss (last stage) or the stage's output


@dataclasses.dataclass
class _Step:
    """What one training step carries between the schedule's actions."""

    xs: list                  # micro-batches of the features, on the host
    ys: list
    ws: list
    scale: tf.Tensor          # 1 / num_microbatches
    micro: int
    stage_vars: list          # each stage's trainable variables
    totals: list              # each stage's gradient sums, variable by variable
    live: list                # micro-batches each stage holds now
    peaks: list               # ... and held at most
    received: dict = dataclasses.field(default_factory=dict)       # (stage, micro-batch) -> its input
    gradients_in: dict = dataclasses.field(default_factory=dict)   # (stage, micro-batch) -> output gradient
    flight: dict = dataclasses.field(default_factory=dict)         # (stage, micro-batch) -> _InFlight


class PipelineRunner:
    """Runs ``fit``'s, ``evaluate``'s and ``predict``'s steps of a pipelined model.

    Each stage's computation is a ``tf.function`` on its own mesh (DTensor lays out the
    constants a layer makes, a causal mask, only inside a function); the tape around the
    call keeps what its backward reads until that micro-batch's backward."""

    def __init__(self, model, plan: PipelinePlan, *, optimizer_scope: Callable[[], contextlib.AbstractContextManager],
                 optimize_graph: bool = True):
        self._model = model
        self._optimize_graph = optimize_graph      # grappler on the stages' programs (tofu_tf.tf.compat.calls)
        self._plan = plan
        self._keras3 = keras_adapter.framework_of(model) == "keras3"
        self._order = schedule_lib.issue_order(plan.num_stages, plan.num_microbatches, plan.schedule)
        self._placers = [batches_lib.BatchPlacer(stage.mesh, stage.lowered.batch_axis) for stage in plan.stages]
        self._optimizer_scope = optimizer_scope
        self._functions: dict = {}
        self.inflight_peaks: tuple[int, ...] = ()
        # Set by a benchmark: ``measure(stage, work)`` runs ``work`` and accounts the memory it
        # leaves and peaks at to ``stage`` (bench/pipeline_runs.py).
        self.memory_probe = None

    @property
    def plan(self) -> PipelinePlan:
        return self._plan

    # -- the stages' programs
    def _stage_function(self, index: int, training: bool, with_loss: bool):
        """Stage ``index``'s forward; with ``with_loss`` (the last stage) also the loss, scaled by
        ``scale``, and the metrics' updates, as the model's own step makes them."""
        key = (index, training, with_loss)
        function = self._functions.get(key)
        if function is None:
            stage_model, mesh = self._plan.stages[index].model, self._plan.stages[index].mesh
            # Random draws (dropout masks, keras.random) unsplit on the stage's mesh, as in a
            # whole-model step (``random_draws``): the masks do not depend on the stage's plan.
            if with_loss:
                def run(inputs, y, sample_weight, scale, micro):
                    with random_draws.draws_replicated(mesh):
                        output = stage_model(inputs, training=training)     # only the loss leaves: a second
                    return self._loss_and_metrics(y, output, sample_weight, micro, training) * scale  # output's
                                                                 # gradient would be zeros made off the mesh
            else:
                def run(inputs):
                    with random_draws.draws_replicated(mesh):
                        return stage_model(inputs, training=training)
            function = self._functions[key] = tf.function(run)
        return function

    def _loss_and_metrics(self, y, output, sample_weight, micro, training: bool):
        """A batch's loss as the model's ``train_step``/``test_step`` computes it, metrics updated."""
        model = self._model
        if self._keras3:      # Keras 3's steps track the loss themselves, in the metric named "loss"
            loss = model.compute_loss(x=None, y=y, y_pred=output, sample_weight=sample_weight, training=training)
            tracker = next((metric for metric in model.metrics if metric.name == "loss"), None)
            if tracker is not None:
                tracker.update_state(loss, sample_weight=micro)
        else:
            loss = model.compute_loss(None, y, output, sample_weight)
        model.compute_metrics(None, y, output, sample_weight)
        return loss

    # -- moving values between stages
    def _onto(self, stage: int, value, like=None):
        """``value`` (host or another stage's) on ``stage``'s devices: in ``like``'s layout, or
        with the batch split over the stage's batch axis."""
        host = batches_lib.to_host(value)
        if like is not None:
            return variables_lib.scatter_from_host(np.asarray(host), dtensor.fetch_layout(like))
        return self._placers[stage].place(host)

    def _on_stage(self, stage: int, tree):
        return None if tree is None else tf.nest.map_structure(lambda value: self._onto(stage, value), tree)

    @staticmethod
    def _split(tree, count: int) -> list:
        """``tree``'s tensors split into ``count`` equal parts along the batch dim."""
        if tree is None:
            return [None] * count
        leaves = tf.nest.flatten(tree)
        pieces = [tf.split(leaf, count) if tf.is_tensor(leaf) else [leaf] * count for leaf in leaves]
        return [tf.nest.pack_sequence_as(tree, [piece[i] for piece in pieces]) for i in range(count)]

    # -- the steps
    def train_step(self, data):
        with _explained_compile_errors(), calls.step_call_options(self._optimize_graph):
            return self._train_step(data)

    def test_step(self, data):
        with _explained_compile_errors(), calls.step_call_options(self._optimize_graph):
            return self._test_step(data)

    def predict_step(self, data):
        with _explained_compile_errors(), calls.step_call_options(self._optimize_graph):
            return self._predict_step(data)

    def _train_step(self, data):
        x, y, sample_weight = keras_adapter.keras_of(self._model).utils.unpack_x_y_sample_weight(data)
        plan = self._plan
        count = plan.num_microbatches
        batch = _leading_dim(x)
        if batch % count:
            raise PipelineError(f"a batch of {batch} samples does not split into {count} micro-batches: use a "
                                f"batch size divisible by {count} (drop_remainder=True for a dataset)")
        stage_vars = [stage.model.trainable_variables for stage in plan.stages]
        step = _Step(xs=self._split(x, count), ys=self._split(y, count), ws=self._split(sample_weight, count),
                     scale=tf.constant(1.0 / count), micro=batch // count, stage_vars=stage_vars,
                     totals=[[None] * len(variables) for variables in stage_vars],
                     live=[0] * plan.num_stages, peaks=[0] * plan.num_stages)
        for action in self._order:
            if action.pass_ is schedule_lib.Pass.FORWARD:
                self._forward_action(step, action.stage, action.microbatch)
            else:
                self._backward_action(step, action.stage, action.microbatch)
        self.inflight_peaks = tuple(step.peaks)
        pairs = [(grad, var) for variables, grads in zip(stage_vars, step.totals)
                 for var, grad in zip(variables, grads) if grad is not None]
        with self._optimizer_scope():
            self._model.optimizer.apply_gradients(pairs)
        self._count("train")
        return self._results()

    def _on(self, stage: int, work: Callable):
        """``work()``, which allocates on ``stage``'s devices only, measured by ``memory_probe``."""
        return work() if self.memory_probe is None else self.memory_probe.measure(stage, work)

    def _forward_action(self, step: "_Step", s: int, i: int) -> None:
        last = self._plan.num_stages - 1
        inputs = self._on(s, lambda: self._on_stage(0, step.xs[i])) if s == 0 else step.received.pop((s, i))

        def forward():
            tape = tf.GradientTape()
            with tape:
                if s > 0:
                    tape.watch(inputs)
                if s == last:
                    target = self._stage_function(s, True, True)(
                        inputs, self._on_stage(s, step.ys[i]), self._on_stage(s, step.ws[i]), step.scale, step.micro)
                else:
                    target = self._stage_function(s, True, False)(inputs)
            step.flight[(s, i)] = _InFlight(tape, inputs, target)
            return target
        target = self._on(s, forward)
        if s < last:
            step.received[(s + 1, i)] = self._on(s + 1, lambda: self._onto(s + 1, target))
        step.live[s] += 1
        step.peaks[s] = max(step.peaks[s], step.live[s])

    def _backward_action(self, step: "_Step", s: int, i: int) -> None:
        last = self._plan.num_stages - 1
        variables = step.stage_vars[s]

        def backward():
            held = step.flight.pop((s, i))
            sources = list(variables) + ([held.inputs] if s > 0 else [])
            grads = held.tape.gradient(held.target, sources,
                                       output_gradients=None if s == last else step.gradients_in.pop((s, i)))
            for k, grad in enumerate(grads[:len(variables)]):
                step.totals[s][k] = _accumulate(step.totals[s][k], grad)
            return grads[-1] if s > 0 else None
        sent = [self._on(s, backward)]          # the input's gradient, on this stage until sent
        step.live[s] -= 1
        if s > 0:
            like = step.flight[(s - 1, i)].target
            step.gradients_in[(s - 1, i)] = self._on(s - 1, lambda: self._onto(s - 1, sent[0], like=like))
        self._on(s, sent.clear)

    def _forward(self, x, *, through_last: bool = True):
        value = self._on_stage(0, x)
        stop = self._plan.num_stages if through_last else self._plan.num_stages - 1
        for index in range(stop):
            if index:
                value = self._onto(index, value)
            value = self._stage_function(index, False, False)(value)
        return value

    def _test_step(self, data):
        x, y, sample_weight = keras_adapter.keras_of(self._model).utils.unpack_x_y_sample_weight(data)
        last = self._plan.num_stages - 1
        value = self._forward(x, through_last=False)
        value = self._on_stage(0, x) if last == 0 else self._onto(last, value)
        self._stage_function(last, False, True)(value, self._on_stage(last, y), self._on_stage(last, sample_weight),
                                                tf.constant(1.0), _leading_dim(x))
        self._count("test")
        return self._results()

    def _predict_step(self, data):
        x, _, _ = keras_adapter.keras_of(self._model).utils.unpack_x_y_sample_weight(data)
        output = tf.nest.map_structure(batches_lib.to_host, self._forward(x))
        self._count("predict")
        return output

    # -- Keras' own bookkeeping
    def _count(self, kind: str) -> None:
        counter = None if self._keras3 else getattr(self._model, f"_{kind}_counter", None)
        if counter is not None:
            counter.assign_add(1)

    def _results(self):
        return {name: batches_lib.to_host(value) for name, value in self._model.get_metrics_result().items()}


@contextlib.contextmanager
def _explained_compile_errors():
    """DTensor's refusal of a stage function whose results its all-reduce combining left without
    layouts, as an error naming the fix (``compat.process.uncombine_all_reduces``)."""
    try:
        yield
    except tf.errors.UnknownError as error:
        if "missing result layout attribute" not in str(error):
            raise
        raise PipelineError(
            "DTensor combined the all-reduces of a pipeline stage's backward and cannot return their results: "
            f"its combining pass was on when this process compiled its first DTensor program. Make the pipelined "
            f"TofuStrategy before any other DTensor program runs, or set {compat_process.COMBINE_ALL_REDUCES_ENV}=0 "
            "in the environment before TensorFlow starts") from None


def _leading_dim(tree) -> int:
    for value in tf.nest.flatten(tree):
        if tf.is_tensor(value) and value.shape.rank:
            return int(value.shape[0])
    raise PipelineError("a pipelined step needs a batch tensor among its inputs")


def _accumulate(total, grad):
    """Sum of micro-batch gradients; sparse ones concatenated (the rows one device's batch
    gradient would hold, duplicates kept for the optimizer to combine as it does)."""
    if grad is None:
        return total
    if total is None:
        return grad
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(tf.concat([total.values, grad.values], 0),
                                tf.concat([total.indices, grad.indices], 0), total.dense_shape)
    return total + grad


# -- Keras' step functions -------------------------------------------------------------------

def install(model, runner_of: Callable[[], PipelineRunner]) -> bool:
    """Give ``model`` train, test and predict functions that run the pipeline (the change
    "pipeline_step_functions"). True when it changed the model."""
    from tofu_tf.strategies import step_functions

    if getattr(model, "_tofu_step_functions", False):
        return False
    keras3 = keras_adapter.framework_of(model) == "keras3"
    for kind in ("train", "test", "predict"):
        setattr(model, f"make_{kind}_function", _maker(model, kind, keras3, runner_of, step_functions))
        setattr(model, f"{kind}_function", None)
    model._tofu_step_functions = True  # pylint: disable=protected-access
    return True


def _maker(model, kind: str, keras3: bool, runner_of, step_functions):
    attribute = f"{kind}_function"

    def step(data):
        return getattr(runner_of(), f"{kind}_step")(data)

    def make_function(force=False):
        current = getattr(model, attribute, None)
        if current is not None and getattr(current, "_tofu", False) and not force:
            return current
        if kind == "predict" and keras3:
            function = step_functions._keras3_predict_function(step)  # pylint: disable=protected-access
        else:
            function = step_functions._iterator_function(  # pylint: disable=protected-access
                model, step, keras3, gather=kind == "predict")
        function._tofu = True  # pylint: disable=protected-access
        setattr(model, attribute, function)
        return function
    return make_function


__all__ = ["HostPlacer", "PipelineRunner", "install"]
