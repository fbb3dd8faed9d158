"""Trace a Keras training step into the planner's IR, without running it.

Capture builds the step ``forward -> loss -> gradients -> optimizer update`` as
a ``tf.function`` concrete graph and translates that graph into
``tofu_tf.ir.Graph``. It owns three decisions:

* Nothing model-sized is allocated. Optimizer slots are created while tracing
  under a variable creator that returns ``UninitializedVariable``s: handles
  with a shape and dtype but no buffer. The user's optimizer is never built;
  a fresh one with the same configuration is traced instead.
* Function calls (``PartitionedCall``/``StatefulPartitionedCall``) are inlined
  so the planner sees one flat graph. Loops (``While``, as run by Keras
  LSTM/GRU) are kept as one op whose ``body`` is an IR graph of its own; the
  trip count of a Keras recurrence is static, but the body is what a planner
  reasons about, so it is not unrolled here.
* Sparse gradients (``IndexedSlices`` from an Embedding) are made dense,
  because that is what TofuStrategy trains with (DTensor cannot expand the
  sparse update); the IR describes the step that will run.
* The optimizer's update is traced once per weight shape and copied into the
  IR for the other weights of that shape (``update_stamps``): tracing it for
  every weight was most of capture's time.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
from typing import Mapping

import numpy as np
import tensorflow as tf
from absl import logging
from tensorflow.python.framework import function_def_to_graph
from tensorflow.python.ops import resource_variable_ops

from tofu_tf import ir
from tofu_tf.search import targets
from tofu_tf.tf import keras_adapter, update_stamps
from tofu_tf.tf.compat import keras_ops as compat_keras_ops
from tofu_tf.tf.compat import legacy_dense

_CALL_OPS = frozenset({"PartitionedCall", "StatefulPartitionedCall"})
_SHAPE_KEEPING = frozenset({"Identity", "StopGradient", "Snapshot"})
_LOOP_OPS = frozenset({"While", "StatelessWhile"})
_CONST_MAX_ELEMENTS = 64
# Outputs that are backend scratch space, not values of the model: their size
# depends on the kernel chosen at run time (empty on CPU), so they are recorded
# as zero-byte scalars rather than failing the static-shape check.
# (Outputs 3 and 4, the reserve spaces, are the batch mean and variance on CPU
# and are read by the gradient: they are values.)
_WORKSPACE_OUTPUTS = {
    "FusedBatchNormV3": frozenset({5}),
}
_WORKSPACE_PASSTHROUGH = frozenset({"ZerosLike", "Identity"})
_SKIPPED_ATTRS = frozenset({"_class", "_read_only_resource_inputs", "_has_manual_control_dependencies"})


DynamicShapeError = keras_adapter.DynamicShapeError

_PY_FUNCTIONS = ("EagerPyFunc", "PyFunc", "PyFuncStateless")
_PY_FUNCTION_HINT = (
    "It comes from tf.py_function / tf.numpy_function: TensorFlow cannot see inside a Python function, "
    "so the shape of its result (and of its gradient, another Python function) is unknown, and DTensor "
    "cannot run a Python function in any layout either. Write the layer with TensorFlow ops.")


@dataclasses.dataclass(frozen=True)
class _TraceResult:
    """What tracing produced, before translation: the graph and the Python-side
    knowledge that links its tensors to variables."""

    graph: tf.Graph
    input_names: tuple[str, ...]
    # (id of the graph holding the tensor, tensor name) -> weight path: a custom loop's step may
    # compute its gradients inside a tf.function of its own, which translation inlines.
    gradient_names: Mapping[tuple[int, str], str]
    handle_paths: Mapping[int, str]            # id(eager handle) -> variable path
    variables: Mapping[str, ir.Variable]
    stamps: tuple[update_stamps.UpdateStamp, ...] = ()   # updates to copy rather than traced


def capture_training_step(model, *, batch_size: int, loss, optimizer, labels: tf.TensorSpec | None = None,
                          features=None, trace_each_update: bool = False) -> ir.Graph:
    """Trace ``model``'s training step at ``batch_size`` into tofu_tf's IR, without running it.

    The planner works from what one step computes: the forward pass, the loss, the
    gradients and the optimizer's update, with the static shape of every tensor and the
    Keras layer of every op. This traces that step as ``fit`` would run it. The optimizer
    traced is a fresh one of the same configuration, whose slots are handles that allocate
    nothing, so the model's weights and the user's optimizer are left as they are.

    Args:
        model: A built Keras model, tf-keras or Keras 3.
        batch_size: The global batch size of one step; every shape is traced at it.
        loss: What ``model.compile`` takes as its loss: a name or a loss object.
        optimizer: What ``model.compile`` takes as its optimizer: a name or an optimizer.
        labels: A ``tf.TensorSpec`` of one batch's labels, to replace the inferred one
            (class ids for a loss named sparse, else the model output's shape).
        features: ``tf.TensorSpec``s (or tensors) of one batch's inputs, in the structure the
            model is called with: needed for a subclassed model without a build shape, and
            for declared inputs that leave a dimension open (``Input(shape=(None,))``).
        trace_each_update: Whether to trace the optimizer's update for every weight instead
            of once per weight shape: slower, and the IR is the same up to op names.

    Returns:
        The step's ``tofu_tf.ir.Graph``: its ops, its tensors with their roles and shapes,
        and its variables by Keras path (optimizer slots included), for ``plan_graph``,
        ``coverage`` and ``tofu_tf.pipeline``.

    Raises:
        ValueError: ``batch_size`` is not a positive int or differs from the one the model's
            ``Input`` fixes, or a model input is a scalar.
        tofu_tf.tf.keras_adapter.UnsupportedModelError: ``model`` is not a Keras model, is
            not built, or its step cannot be traced.
        tofu_tf.DynamicShapeError: A tensor of the step has a dimension unknown at trace
            time; give the model a fixed input shape, or pass ``features``.

    Example:
        >>> import tofu_tf
        >>> from tofu_tf import models
        >>> graph = tofu_tf.capture_training_step(models.mlp(), batch_size=32, optimizer="adam",
        ...                                       loss="sparse_categorical_crossentropy")
        >>> graph.batch_size, graph.framework
        (32, 'tf_keras')
    """
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    framework = keras_adapter.framework_of(model)
    with keras_adapter.recording_layer_scopes(framework, model) as layers, _as_the_step_runs():
        traced = _trace(model, framework, batch_size, loss, optimizer, labels, features,
                        stamp_updates=not trace_each_update)
    return _translated(traced, layers, batch_size, framework)


def capture_step_function(step_fn, arg_specs, *, model, optimizer, trace_each_update: bool = False) -> ir.Graph:
    """Trace a custom training loop's step function (what it passes to ``strategy.run``) into IR.

    A custom loop trains what its own function computes: its loss, its tape, its metric
    updates, its optimizer's ``apply_gradients``. Planning that needs the function as it
    will run, not a step rebuilt from a compiled loss. ``step_fn`` is traced on
    ``arg_specs`` (``tf.TensorSpec``s in the structure of the arguments ``run`` passes it,
    the batch first in every leaf) as ``capture_training_step`` traces a Keras step: new
    variables are handles without a buffer, and ``optimizer``'s ``apply_gradients`` (and
    Keras 3's ``apply``) is redirected, for the trace only, to a fresh optimizer of the
    same configuration, so the user's optimizer is never built with capture's handles. The
    gradients handed to it name the weights they update. ``model`` is the Keras model
    whose weights the function trains; the user's optimizer is left untouched. ``optimizer``
    may be a list: a step that trains parts of the model with optimizers of their own (a GAN's
    ``train_step``: the discriminator's and the generator's) has each redirected to its own copy,
    and the IR holds every update.
    """
    framework = keras_adapter.framework_of(model)
    batch_size = _leading_dim(arg_specs)
    with keras_adapter.recording_layer_scopes(framework, model) as layers, _as_the_step_runs():
        traced = _trace_step_function(step_fn, arg_specs, model, framework, optimizer,
                                      stamp_updates=not trace_each_update)
    return _translated(traced, layers, batch_size, framework)


def _as_the_step_runs():
    """Keras 3's ops traced as a TofuStrategy step traces them (``compat.keras_ops``: ``top_k``'s
    gradient by comparison, ``one_hot`` as an equality, ``split``, ``roll`` and ``slice_update`` as
    slices and selects), so the plan prices the ops DTensor runs. Traced with the originals, a
    router's ``top_k`` gradient was a ``ScatterNd`` partial over the batch, priced as a
    reduce-scatter that never ran (keras-hub Mixtral, ``bench/executed.py``). The step's other
    rewrites (``TofuStrategy._step_rewrites``) are not applied here: most need the plan's mesh,
    which capture comes before."""
    return compat_keras_ops.dtensor_expandable_ops()


def _translated(traced: "_TraceResult", layers, batch_size: int, framework: str) -> ir.Graph:
    graph = _Translator(traced, layers).translate()
    graph = dataclasses.replace(graph, batch_size=batch_size, framework=framework)
    _check_static_shapes(graph)
    logging.debug("captured %s", graph.summary())
    return graph


def _tensor_key(tensor) -> tuple[int, str]:
    return id(tensor.graph), tensor.name


def _leading_dim(arg_specs) -> int:
    """The batch size of a step's arguments: the first dim of their first tensor spec."""
    for spec in tf.nest.flatten(arg_specs):
        if isinstance(spec, tf.TensorSpec) and spec.shape.rank and spec.shape[0] is not None:
            return int(spec.shape[0])
    raise DynamicShapeError(
        "the step function's arguments hold no tensor with a known first (batch) dimension: tofu_tf plans "
        "a step from the static shapes of the batch it is given.")


# -- tracing -------------------------------------------------------------------

def _uninitialized_creator(next_creator, **kwargs):
    """Create variables as shape-and-dtype-only handles (no buffer allocated)."""
    del next_creator
    initial_value = kwargs.get("initial_value")
    shape = kwargs.get("shape")
    dtype = kwargs.get("dtype")
    if not callable(initial_value) and not hasattr(initial_value, "dtype"):
        initial_value = tf.convert_to_tensor(initial_value)  # a Python number: Adafactor's tf.Variable(0)
    if shape is None:
        shape = getattr(initial_value, "shape", None)
    if shape is None and callable(initial_value):
        initial_value = initial_value()  # an initializer without a known shape must run
        shape = initial_value.shape
    if dtype is None:
        dtype = initial_value.dtype
    return resource_variable_ops.UninitializedVariable(
        shape=shape, dtype=dtype, name=kwargs.get("name"), trainable=kwargs.get("trainable", False))


def _trace(model, framework, batch_size, loss, optimizer, labels, features, *, stamp_updates=True) -> _TraceResult:
    loss_fn = keras_adapter.get_loss(framework, loss)
    x_specs = keras_adapter.input_specs(model, batch_size, features)
    y_spec = labels if labels is not None else keras_adapter.label_spec(model, loss, batch_size, x_specs)
    y_spec = tf.TensorSpec(y_spec.shape, y_spec.dtype, name="labels")
    trainable = keras_adapter.trainable_variables(model)
    weight_names = keras_adapter.weight_paths(model)
    gradient_box: dict[tuple[int, str], str] = {}

    def step_with(opt, scaling):
        def train_step(x, y):
            with tf.variable_creator_scope(_uninitialized_creator), _tapes_recording():
                with tf.GradientTape() as tape:
                    prediction = model(x, training=True)
                    step_loss = loss_fn(y, prediction)
                    extra = keras_adapter.regularization_losses(model)
                    if extra:
                        step_loss = step_loss + tf.add_n(extra)
                    scaled_loss = step_loss if scaling is None else scaling.scale_loss(step_loss)
                grads = tape.gradient(scaled_loss, trainable)
                if scaling is not None:
                    grads = scaling.unscale_gradients(grads)
                grads = [_dense_gradient(g, deduplicated) for g in grads]
                for var, grad in zip(trainable, grads):
                    if grad is not None:
                        gradient_box[_tensor_key(grad)] = weight_names[id(keras_adapter.tf_variable(var))]
                if trainable:       # a fully frozen model: Keras' train_step skips the update, so does the trace
                    keras_adapter.apply_gradients_for_capture(opt, zip(grads, trainable))
            return step_loss
        return train_step

    # Without AutoGraph first; with it (as Keras traces) only when the model branches or
    # loops on a tensor in Python. Each attempt gets its own fresh optimizer.
    for autograph in (False, True):
        gradient_box.clear()
        opt = keras_adapter.fresh_optimizer(framework, optimizer)
        scaling = keras_adapter.loss_scaling(framework, opt)
        legacy_dense.unfuse_dense_updates(opt if scaling is None else scaling.inner)   # as the user's will be
        deduplicated = keras_adapter.deduplicates_sparse_gradients(opt if scaling is None else scaling.inner)
        opt = keras_adapter.trace_updates_inline(opt if scaling is None else scaling.inner)
        concrete, slots, stamps = _trace_once(step_with(opt, scaling), opt, framework, (x_specs, y_spec),
                                              autograph=autograph, weights=trainable, stamp_updates=stamp_updates)
        if concrete is not None:
            break

    variables, handle_paths = _collect_variables(model, opt, slots, gradient_box, weight_names)
    input_names = tuple(t.name for t in concrete.graph.inputs[: len(tf.nest.flatten(x_specs)) + 1])
    return _TraceResult(concrete.graph, input_names, gradient_box, handle_paths, variables, tuple(stamps))


def _dense_gradient(gradient, deduplicated: bool):
    """A sparse gradient (``IndexedSlices``) as the dense tensor the strategy trains with. One an
    optimizer deduplicates (``keras_adapter.deduplicates_sparse_gradients``) is summed by an op
    named so that the planner keeps its rows whole (``targets.DEDUPLICATED_SPARSE_GRADIENT``), as
    DTensor runs the ``Unique`` before it: the rows split over the batch are gathered."""
    if not isinstance(gradient, tf.IndexedSlices):
        return gradient
    if not deduplicated:
        return tf.convert_to_tensor(gradient)
    return tf.math.unsorted_segment_sum(gradient.values, gradient.indices, gradient.dense_shape[0],
                                        name=targets.DEDUPLICATED_SPARSE_GRADIENT)


def _trace_step_function(step_fn, arg_specs, model, framework, optimizer, *, stamp_updates) -> _TraceResult:
    """Trace a user's step function with each of its optimizers' updates redirected to a fresh copy.

    ``optimizer`` is one optimizer or a sequence of them: a step may train parts of the model with
    optimizers of their own (a GAN's discriminator and generator), each applying its gradients."""
    optimizers = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
    trainable = keras_adapter.trainable_variables(model)
    weight_names = keras_adapter.weight_paths(model)
    gradient_box: dict[tuple[int, str], str] = {}

    def update_for(opt):
        scaling = keras_adapter.loss_scaling(framework, opt)
        # The loop unscales its gradients itself (as a LossScaleOptimizer's users do); what
        # its update does to each weight is the wrapped optimizer's.
        update = keras_adapter.trace_updates_inline(opt if scaling is None else scaling.inner)

        deduplicated = keras_adapter.deduplicates_sparse_gradients(opt if scaling is None else scaling.inner)

        def apply(grads_and_vars):
            dense = []
            for grad, var in grads_and_vars:
                grad = _dense_gradient(grad, deduplicated)
                path = weight_names.get(id(keras_adapter.tf_variable(var)))
                if grad is not None and path is not None:
                    gradient_box[_tensor_key(grad)] = path
                dense.append((grad, var))
            return keras_adapter.apply_gradients_for_capture(update, dense)
        return update, apply

    def step_with(updates_and_applies):
        def traced_step(*args):
            with tf.variable_creator_scope(_uninitialized_creator), _tapes_recording(), \
                    contextlib.ExitStack() as redirected:
                for user_optimizer, (_, apply) in zip(optimizers, updates_and_applies):
                    redirected.enter_context(keras_adapter.redirected_updates(user_optimizer, apply))
                return step_fn(*args)
        return traced_step

    for autograph in (False, True):
        gradient_box.clear()
        updates_and_applies = [update_for(_unfused(keras_adapter.fresh_optimizer(framework, opt))) for opt in optimizers]
        updates = [update for update, _ in updates_and_applies]
        concrete, slots, stamps = _trace_once(step_with(updates_and_applies), updates, framework, arg_specs,
                                              autograph=autograph, weights=trainable, stamp_updates=stamp_updates)
        if concrete is not None:
            break
    if not gradient_box:
        names = " or ".join(f"{type(opt).__name__}.apply_gradients" for opt in optimizers)
        raise keras_adapter.UnsupportedModelError(
            f"the step function passed to strategy.run applied no gradient of {model.name}'s weights through "
            f"{names}: TofuStrategy plans the step that trains the model. "
            "Plan it explicitly with strategy.plan_model(model, batch_size=..., loss=..., optimizer=...).")
    variables, handle_paths = _collect_variables(model, updates, slots, gradient_box, weight_names)
    input_names = tuple(t.name for t in concrete.graph.inputs[: len(tf.nest.flatten(arg_specs))])
    return _TraceResult(concrete.graph, input_names, gradient_box, handle_paths, variables, tuple(stamps))


@contextlib.contextmanager
def _tapes_recording():
    """Gradient tapes record, even where the caller of capture stopped them.

    TofuStrategy plans a custom loop at its first ``strategy.run``, which is often inside
    the loop's own ``tf.function`` while it is traced; capture then runs under
    ``tf.init_scope()`` (its graph and the variables it makes must not become part of the
    user's function), and ``init_scope`` stops every gradient tape on the thread, the
    traced step's own ``GradientTape`` included: it would record nothing and every
    gradient would be None. TF-private (``pywrap_tfe``, as ``tf.init_scope`` itself
    stops and restarts the tapes).
    """
    from tensorflow.python import pywrap_tfe  # pylint: disable=import-outside-toplevel
    stopped = pywrap_tfe.TFE_Py_TapeSetIsStopped()
    if stopped:
        pywrap_tfe.TFE_Py_TapeSetRestartOnThread()
    try:
        yield
    finally:
        if stopped:
            pywrap_tfe.TFE_Py_TapeSetStopOnThread()


def _trace_once(train_step, opt, framework, arg_specs, *, autograph, weights, stamp_updates):
    """Trace ``train_step`` once; ``(None, None, None)`` when tracing without AutoGraph
    fails, e.g. because the model branches or loops on a tensor in Python.

    Capture only needs the ops of one step, and AutoGraph's source conversion of
    every function the step calls is about a third of capture's time (0.2-0.3 s of
    CPU on a 4-layer MLP): most models need none of it, so capture tries first
    without, and only a model that needs it pays for it.

    ``stamp_updates`` traces the optimizer's update once per shape of the trainable
    ``weights`` (``update_stamps``); otherwise every update is traced.
    """
    opts = list(opt) if isinstance(opt, (list, tuple)) else [opt]
    weight_variables = [keras_adapter.tf_variable(w) for w in weights]
    with contextlib.ExitStack() as recording:
        slot_lists, recorders = [], []
        for each in opts:       # each optimizer's slots and updates recorded on its own
            slots = recording.enter_context(keras_adapter.recording_slots(each, defer_zeros=framework == "tf_keras"))
            recorder = update_stamps.UpdateRecorder(each, weight_variables, slots)
            recording.enter_context(recorder.recording(enabled=stamp_updates))
            slot_lists.append(slots)
            recorders.append(recorder)
        try:
            concrete = tf.function(train_step, autograph=autograph).get_concrete_function(*arg_specs)
        except Exception as error:  # pylint: disable=broad-except
            # Tensors used as Python bools or ints fail in many ways (OperatorNotAllowedInGraphError,
            # TypeError from range(tensor), ...); a real error fails the AutoGraph trace again.
            if autograph:
                raise
            logging.debug("capture: tracing again with AutoGraph after %s: %s", type(error).__name__, error)
            return None, None, None
    return concrete, [s for slots in slot_lists for s in slots], [s for r in recorders for s in r.stamps]


def _collect_variables(model, opt, slots, gradient_box, weight_names):
    """The step's variables by unique name (``keras_adapter.UniquePaths``): weights as
    ``model.weights`` names them, slots and other optimizer state in creation order,
    as the strategy names the real optimizer's when it makes them."""
    grad_of = {path: name for (_, name), path in gradient_box.items()}
    variables: dict[str, ir.Variable] = {}
    handle_paths: dict[int, str] = {}
    optimizer_names = keras_adapter.UniquePaths()

    def add(var, kind, path, **extra):
        tf_var = keras_adapter.tf_variable(var)
        if id(tf_var.handle) in handle_paths:
            return                                   # listed twice (a slot among the optimizer's variables)
        variables[path] = ir.Variable(
            path=path, shape=tuple(int(d) for d in tf_var.shape), dtype=tf_var.dtype.name,
            kind=kind, **extra)
        handle_paths[id(tf_var.handle)] = path

    trainable_ids = {id(keras_adapter.tf_variable(v)) for v in keras_adapter.trainable_variables(model)}
    for var in keras_adapter.model_variables(model):
        tf_var = keras_adapter.tf_variable(var)
        path = weight_names[id(tf_var)]
        add(var, ir.VariableKind.WEIGHT, path, trainable=id(tf_var) in trainable_ids, gradient=grad_of.get(path))
    slot_ids = set()
    for record in slots:
        slot_ids.add(id(record.slot))
        add(record.slot, ir.VariableKind.OPTIMIZER_SLOT, optimizer_names.name(record.slot),
            slot_of=weight_names[id(record.weight)], slot_name=record.slot_name)
    for var in [v for each in (opt if isinstance(opt, (list, tuple)) else [opt])
                for v in keras_adapter.optimizer_variables(each)]:
        if id(var) not in slot_ids:
            kind = ir.VariableKind.OPTIMIZER_STATE if var.shape.rank == 0 else ir.VariableKind.OPTIMIZER_SLOT
            add(var, kind, f"optimizer/{optimizer_names.name(var)}")
    return variables, handle_paths


# -- translation ---------------------------------------------------------------

class _Translator:
    """Walks a traced FuncGraph (inlining calls) and builds IR ops and tensors."""

    def __init__(self, traced: _TraceResult, layers: keras_adapter.LayerScopes):
        self._traced = traced
        self._layers = layers
        self._ops: list[ir.Op] = []
        self._tensors: dict[str, ir.Tensor] = {}
        self._alias: dict[str, str] = {}
        self._handle_paths: dict[str, str] = {}
        self._handle_of_path: dict[str, str] = {}
        self._slot_paths = {(v.slot_of, v.slot_name): v.path for v in traced.variables.values() if v.slot_of}
        self._workspace: set[str] = set()
        self._gradients: dict[str, str] = {}       # IR tensor name -> the weight it is the gradient of
        # traced op index -> how many IR ops precede it, before / after the stamps placed there
        self._before_stamps: dict[int, int] = {}
        self._after_stamps: dict[int, int] = {}

    def translate(self) -> ir.Graph:
        graph = self._traced.graph
        self._link_captured_handles(graph)
        inputs = set(self._traced.input_names)
        stamps_at = collections.defaultdict(list)
        for stamp in self._traced.stamps:
            stamps_at[stamp.at].append(stamp)
        operations = graph.get_operations()
        for index, op in enumerate(operations):
            self._place_stamps(index, stamps_at.get(index, ()))
            if op.type == "Placeholder" and op.outputs[0].name not in inputs:
                if op.outputs[0].dtype != tf.resource:
                    self._add_captured_value(op)
                continue  # a captured variable handle: tensors refer to it by path
            self._add_op(op, prefix="", graph=graph)
        self._place_stamps(len(operations), stamps_at.get(len(operations), ()))
        tensors = self._with_consumers()
        variables = dict(self._traced.variables)
        lost = set(self._traced.gradient_names.values()) - set(self._gradients.values())
        if lost:
            raise keras_adapter.UnsupportedModelError(
                f"capture traced the gradients of {len(lost)} weights (e.g. {sorted(lost)[0]!r}) and cannot find them "
                "in the step's graph; plan the model with strategy.plan_model(...) or tofu_tf.plan_model(...).")
        for name, path in self._gradients.items():
            resolved = self._resolve("", name)
            tensors[resolved] = dataclasses.replace(tensors[resolved], role=ir.Role.GRADIENT, variable_path=path)
            variables[path] = dataclasses.replace(variables[path], gradient=resolved)
        return ir.Graph(ops=tuple(self._ops), tensors=tensors, variables=variables)

    def _add_captured_value(self, op) -> None:
        """An eager tensor the step captured as an input (a layer's own table made at build, over
        TensorFlow's size for embedding it as a constant): a constant of the step, as it is to
        the strategy, which puts it on the mesh replicated (``tofu_tf.tf.mesh_captures``). Left
        out, its consumers saw an operand of no shape."""
        tensor = op.outputs[0]
        self._ops.append(ir.Op(name=op.name, type="Const", inputs=(), outputs=(tensor.name,), attrs={},
                               layer=self._layers.layer_of(op.name)))
        self._tensors[tensor.name] = self._tensor(tensor, tensor.name, op.name, op, ())

    def _link_captured_handles(self, graph) -> None:
        """Name every captured handle: by its variable's path, or, for a handle
        of a variable capture did not collect (e.g. a learning-rate variable an
        optimizer keeps outside ``optimizer.variables``), by ``captured/<name>``."""
        for external, internal in graph.captures:
            path = self._traced.handle_paths.get(id(external))
            if path is None and internal.dtype == tf.resource:
                path = f"captured/{internal.op.name}"
            if path is not None:
                self._handle_paths[internal.name] = path
                self._handle_of_path.setdefault(path, internal.name)

    # optimizer updates copied from a traced one
    def _place_stamps(self, index: int, stamps) -> None:
        self._before_stamps[index] = len(self._ops)
        for stamp in stamps:
            self._stamp(stamp)
        self._after_stamps[index] = len(self._ops)

    def _stamp(self, stamp: update_stamps.UpdateStamp) -> None:
        template = stamp.template
        template_ops = self._ops[self._after_stamps[template.start]:self._before_stamps[template.end]]
        paths = self._traced.handle_paths
        source, weight = paths[template.weight_handle], paths[stamp.weight_handle]
        renamed_paths = {source: weight}
        renamed_paths.update({path: self._slot_paths[(weight, name)] for (owner, name), path in self._slot_paths.items()
                              if owner == source})
        inputs = {self._resolve("", template.gradient): self._resolve("", stamp.gradient)}
        for op in template_ops:
            for name in op.inputs:
                tensor = self._tensors.get(name)
                if tensor is not None and tensor.role is ir.Role.RESOURCE and tensor.variable_path in renamed_paths:
                    inputs[name] = self._handle_tensor(renamed_paths[tensor.variable_path])
        ops, tensors = update_stamps.stamp(template_ops, self._tensors, weight=weight, inputs=inputs,
                                           paths=renamed_paths)
        self._ops.extend(ops)
        self._tensors.update((t.name, t) for t in tensors)

    def _handle_tensor(self, path: str) -> str:
        """The resource tensor naming variable ``path``: its captured handle, or,
        for a variable only a stamped update uses (a slot), one made for it."""
        if path in self._handle_of_path:
            return self._resolve("", self._handle_of_path[path])
        name = f"{update_stamps.STAMP_SCOPE}/{path}/resource:0"
        self._tensors[name] = ir.Tensor(name=name, shape=(), dtype="resource", role=ir.Role.RESOURCE,
                                        producer="", variable_path=path)
        return name

    # ops
    def _add_op(self, op, *, prefix: str, graph) -> None:
        if op.type in _CALL_OPS:
            self._inline_call(op, prefix=prefix, graph=graph)
            return
        name = prefix + op.name
        inputs = tuple(self._resolve(prefix, t.name) for t in op.inputs)
        outputs = tuple(prefix + t.name for t in op.outputs)
        body = None
        if op.type in _LOOP_OPS:
            body = _loop_body(op, graph, self._layers)
        self._ops.append(ir.Op(
            name=name, type=op.type, inputs=inputs, outputs=outputs,
            attrs=_attrs(op), layer=self._layers.layer_of(name), body=body))
        workspace = _WORKSPACE_OUTPUTS.get(op.type, frozenset())
        if op.type in _WORKSPACE_PASSTHROUGH and inputs and inputs[0] in self._workspace:
            workspace = frozenset({0})
        self._note_gradients(graph, op.outputs, outputs)
        bound = _index_length_bound(op)
        for index, (tensor, out_name) in enumerate(zip(op.outputs, outputs)):
            if bound is not None and tensor.shape.rank == 1 and tensor.shape[0] is None:
                folded = (_folded_value(op, index, [self._tensors.get(i) for i in inputs])
                          if op.type in _FOLDED_SHAPE_OPS else None)
                self._tensors[out_name] = ir.Tensor(
                    name=out_name, shape=(bound if folded is None else len(folded),), dtype=tensor.dtype.name,
                    role=ir.Role.SCALAR, producer=name, const_value=folded)
            elif index in workspace:
                self._workspace.add(out_name)
                self._tensors[out_name] = ir.Tensor(name=out_name, shape=(), dtype=tensor.dtype.name,
                                                    role=ir.Role.SCALAR, producer=name)
            else:
                self._tensors[out_name] = self._tensor(tensor, out_name, name, op, inputs)

    def _inline_call(self, op, *, prefix: str, graph) -> None:
        """Splice a called function's ops in place of the call, renaming its
        inputs to the caller's tensors and the call's outputs to its results."""
        func_graph = _function_graph(graph, op.get_attr("f").name,
                                     [self._call_shape(prefix, t) for t in op.inputs],
                                     [self._read_shape(prefix, t) for t in op.inputs])
        inner_prefix = prefix + op.name + "/"
        for placeholder, outer in zip(func_graph.inputs, op.inputs):
            self._alias[inner_prefix + placeholder.name] = self._resolve(prefix, outer.name)
        for inner_op in func_graph.get_operations():
            if inner_op.type == "Placeholder":
                continue
            self._add_op(inner_op, prefix=inner_prefix, graph=func_graph)
        for index, result in enumerate(func_graph.outputs):
            self._alias[prefix + op.outputs[index].name] = self._resolve(inner_prefix, result.name)
        self._note_gradients(graph, op.outputs, [prefix + t.name for t in op.outputs])

    def _call_shape(self, prefix: str, tensor) -> tf.TensorShape:
        """The shape a call's argument has in the step: TF's, or where a specialized function
        computed it (a loaded model's intermediates, handed to its backward function), the IR's."""
        known = self._tensors.get(self._resolve(prefix, tensor.name))
        if (not tensor.shape.is_fully_defined() and known is not None and known.shape is not None
                and all(d is not None for d in known.shape)):
            return tf.TensorShape(known.shape)
        return tensor.shape

    def _read_shape(self, prefix: str, tensor) -> tuple | None:
        """The shape of the variable a call's resource argument is the handle of, if known."""
        if tensor.dtype != tf.resource:
            return None
        known = self._tensors.get(self._resolve(prefix, tensor.name))
        variable = self._traced.variables.get(known.variable_path) if known is not None else None
        return None if variable is None else tuple(variable.shape)

    def _note_gradients(self, graph, tensors, names) -> None:
        """Which of an op's outputs (``names`` in the IR) are gradients handed to the optimizer."""
        for tensor, name in zip(tensors, names):
            path = self._traced.gradient_names.get((id(graph), tensor.name))
            if path is not None:
                self._gradients[name] = path

    def _resolve(self, prefix: str, name: str) -> str:
        full = prefix + name
        while full in self._alias:
            full = self._alias[full]
        if full not in self._tensors and full in self._handle_paths:
            self._tensors[full] = ir.Tensor(name=full, shape=(), dtype="resource", role=ir.Role.RESOURCE,
                                            producer="", variable_path=self._handle_paths[full])
        return full

    # tensors
    def _tensor(self, tensor, name: str, producer: str, op, inputs: tuple[str, ...]) -> ir.Tensor:
        shape = tuple(tensor.shape.as_list()) if tensor.shape.rank is not None else None
        dtype = tensor.dtype.name
        variable = self._variable_of(op, inputs)
        if (shape is None or None in shape) and variable in self._traced.variables:
            # A read in a function imported for the call's shapes (a loaded model's): its handle
            # argument carries no variable shape there, the variable has one.
            shape = tuple(self._traced.variables[variable].shape)
        elif (shape is None or None in shape) and op.type in _SHAPE_KEEPING and inputs:
            # In such a function, the result of a call it makes has no shape to TF; the IR has it.
            source = self._tensors.get(inputs[0])
            if source is not None and source.shape is not None and None not in source.shape:
                shape = source.shape
        role = self._role(tensor, name, op, shape, dtype, variable)
        const_value = _const_value(tensor, shape)
        if const_value is None and op.type in _FOLDED_SHAPE_OPS:
            const_value = _folded_value(op, tensor.value_index, [self._tensors.get(i) for i in inputs])
        return ir.Tensor(
            name=name, shape=shape if shape is not None else (None,), dtype=dtype, role=role,
            producer=producer, variable_path=variable if role in _VARIABLE_ROLES else None,
            const_value=const_value)

    def _variable_of(self, op, inputs) -> str | None:
        if op.type == "ReadVariableOp" and inputs:
            source = self._tensors.get(inputs[0])
            return source.variable_path if source is not None else self._handle_paths.get(inputs[0])
        return None

    def _role(self, tensor, name, op, shape, dtype, variable) -> ir.Role:
        if name in self._traced.input_names:
            return ir.Role.INPUT
        if dtype == "resource":
            return ir.Role.RESOURCE
        if variable is not None and variable in self._traced.variables:
            kind = self._traced.variables[variable].kind
            return {ir.VariableKind.WEIGHT: ir.Role.WEIGHT,
                    ir.VariableKind.OPTIMIZER_SLOT: ir.Role.OPTIMIZER_SLOT}.get(kind, ir.Role.SCALAR)
        if shape == () or ir.dtype_size(dtype) == 0:
            return ir.Role.SCALAR
        return ir.Role.ACTIVATION

    def _with_consumers(self) -> dict[str, ir.Tensor]:
        consumers: dict[str, list[str]] = {name: [] for name in self._tensors}
        for op in self._ops:
            for name in op.inputs:
                consumers.setdefault(name, []).append(op.name)
        return {name: dataclasses.replace(t, consumers=tuple(consumers[name]))
                for name, t in self._tensors.items()}


_VARIABLE_ROLES = frozenset({ir.Role.WEIGHT, ir.Role.OPTIMIZER_SLOT, ir.Role.GRADIENT, ir.Role.RESOURCE, ir.Role.SCALAR})


def _function_graph(graph, function_name: str, input_shapes=None, read_shapes=None):
    """The FuncGraph of a function called from ``graph`` (searching enclosing graphs).

    A function traced for other shapes than the call passes (a model loaded from a SavedModel
    calls functions traced for any batch size: ``(None, 3)``) is imported again from its
    definition for the call's ``input_shapes``, so that TensorFlow's shape inference gives its
    ops the static shapes the step runs them with."""
    current = graph
    while current is not None:
        function = current._get_function(function_name)  # pylint: disable=protected-access
        if function is not None:
            inner = getattr(function, "graph", None)
            if inner is not None and not _less_static(inner.inputs, input_shapes):
                return inner
            definition = function.cached_definition
            if input_shapes is not None and len(input_shapes) != len(definition.signature.input_arg):
                input_shapes = None
            if input_shapes is not None:          # the arguments' recorded shapes would override the call's
                definition = _for_call_shapes(definition, read_shapes or [None] * len(input_shapes))
            specialized = function_def_to_graph.function_def_to_graph(definition, input_shapes=input_shapes)
            specialized.outer_graph = current           # its own calls are found where the original's are
            return specialized
        current = getattr(current, "outer_graph", None)
    raise KeyError(f"function {function_name!r} called in the step is not in its graph library")


def _for_call_shapes(definition, read_shapes):
    """A copy of a FunctionDef for import at a call's shapes: without its arguments' recorded
    ``_output_shapes`` (they would override the call's), and with the shape of the variable
    each read of a handle argument returns (``read_shapes``, by argument), which the import's
    shape inference cannot see through a bare handle (the reads, and all that follows,
    would be of unknown shape)."""
    copy = type(definition)()
    copy.CopyFrom(definition)
    for index in copy.arg_attr:
        attrs = copy.arg_attr[index].attr
        if "_output_shapes" in attrs:
            del attrs["_output_shapes"]
    reads = {arg.name: shape for arg, shape in zip(copy.signature.input_arg, read_shapes) if shape is not None}
    for node in copy.node_def:
        if node.op == "ReadVariableOp" and node.input and node.input[0].split(":")[0] in reads:
            shapes = node.attr["_output_shapes"].list.shape
            del shapes[:]
            shapes.add().CopyFrom(tf.TensorShape(reads[node.input[0].split(":")[0]]).as_proto())
    return copy


def _less_static(placeholders, input_shapes) -> bool:
    """Whether a function's inputs leave a dimension open that the call fixes."""
    if input_shapes is None or len(placeholders) != len(input_shapes):
        return False
    return any(not inner.shape.is_fully_defined() and outer.is_fully_defined()
               for inner, outer in zip(placeholders, input_shapes))


# Ops whose integer outputs list dimensions: their length depends only on
# static shapes (at most the rank), not on data, but TF leaves it unknown.
_INDEX_VECTOR_OPS = frozenset({"BroadcastGradientArgs"})


def _index_length_bound(op) -> int | None:
    """An upper bound (the largest input rank) on the length of a dimension-index output."""
    if op.type not in _INDEX_VECTOR_OPS:
        return None
    lengths = [t.shape[0] for t in op.inputs if t.shape.rank == 1 and t.shape[0] is not None]
    return max(lengths) if lengths else None


def _loop_body(op, graph, layers) -> ir.Graph:
    """Translate a loop's body into its own IR graph (its inputs are the loop variables)."""
    body = _function_graph(graph, op.get_attr("body").name)
    placeholders = tuple(t.name for t in body.inputs)
    traced = _TraceResult(body, placeholders, {}, {}, {})
    translator = _Translator(traced, layers)
    return translator.translate()


def _attrs(op) -> dict:
    out = {}
    for key in op.node_def.attr:
        if key in _SKIPPED_ATTRS:
            continue
        value = _attr_value(op.node_def.attr[key])
        if value is not None:
            out[key] = value
    return out


def _attr_value(attr):
    kind = attr.WhichOneof("value")
    if kind is None:
        return None
    if kind == "list":
        lst = attr.list
        for field in ("i", "f", "b", "s"):
            values = getattr(lst, field)
            if values:
                return tuple(v.decode() if isinstance(v, bytes) else v for v in values)
        if lst.type:
            return tuple(tf.as_dtype(t).name for t in lst.type)
        if lst.shape:
            return tuple(_shape_value(s) for s in lst.shape)
        return ()
    if kind in ("i", "f", "b"):
        return getattr(attr, kind)
    if kind == "s":
        return attr.s.decode(errors="replace")
    if kind == "type":
        return tf.as_dtype(attr.type).name
    if kind == "shape":
        return _shape_value(attr.shape)
    if kind == "func":
        return attr.func.name
    if kind == "tensor":
        elements = 1
        for dim in attr.tensor.tensor_shape.dim:
            elements *= max(dim.size, 0)
        if elements > _CONST_MAX_ELEMENTS:
            return None  # never decode a large constant: it is data, not a semantic attribute
        return _small_tensor_value(tf.make_ndarray(attr.tensor))
    return None


def _shape_value(shape_proto):
    if shape_proto.unknown_rank:
        return None
    return tuple(d.size if d.size >= 0 else None for d in shape_proto.dim)


def _small_tensor_value(array: np.ndarray):
    if array.size > _CONST_MAX_ELEMENTS or array.dtype.kind not in "biuf":
        return None
    if array.ndim == 0:
        return array.item()
    return tuple(np.asarray(array).reshape(-1).tolist())


def _const_value(tensor, shape):
    if shape is None or any(d is None for d in shape) or int(np.prod(shape)) > _CONST_MAX_ELEMENTS:
        return None
    if tensor.dtype.is_floating and tensor.op.type != "Const":
        return None
    if not (tensor.dtype.is_integer or tensor.dtype.is_floating or tensor.dtype.is_bool):
        return None
    try:
        value = tf.get_static_value(tensor)
    except Exception:  # constant folding is best effort; a non-constant is simply None
        return None
    return None if value is None else _small_tensor_value(np.asarray(value))


# Integer ops of shapes that ``tf.get_static_value`` leaves unknown, though their inputs are
# known: a gradient's reduction axes (``BroadcastGradientArgs`` of two sliced static shapes:
# BatchMatMulV2's and broadcasting ops' gradients) and a transpose's inverse permutation
# (Transpose's gradient). Unknown, they left the ops reading them one strategy only: whole
# (every Sum over a batched einsum's gradient and every transposed gradient of keras-hub's
# attention all-gathered its batch under data parallelism, which DTensor does not do).
_FOLDED_SHAPE_OPS = frozenset({"StridedSlice", "BroadcastGradientArgs", "InvertPermutation"})


def _folded_value(op, index: int, inputs: list):
    """Output ``index`` of ``op`` (one of ``_FOLDED_SHAPE_OPS``), computed by TF's own kernel
    from its inputs' known values (``inputs``: their IR tensors); None if one is unknown."""
    if any(t is None or t.const_value is None or None in t.shape for t in inputs):
        return None
    values = [np.asarray(t.const_value, dtype=t.dtype).reshape(t.shape) for t in inputs]
    with tf.init_scope():            # eagerly, outside the graph being read
        if op.type == "InvertPermutation":
            outputs = [tf.raw_ops.InvertPermutation(x=values[0])]
        elif op.type == "BroadcastGradientArgs":
            outputs = tf.raw_ops.BroadcastGradientArgs(s0=values[0], s1=values[1])
        else:
            masks = {name: op.get_attr(name) for name in (
                "begin_mask", "end_mask", "ellipsis_mask", "new_axis_mask", "shrink_axis_mask")}
            outputs = [tf.raw_ops.StridedSlice(input=values[0], begin=values[1], end=values[2], strides=values[3],
                                               **masks)]
        value = np.asarray(outputs[index])
    return None if value.size > _CONST_MAX_ELEMENTS else _small_tensor_value(value)


def _check_static_shapes(graph: ir.Graph) -> None:
    for tensor in graph.tensors.values():
        if any(d is None for d in tensor.shape):
            op = next((o for o in graph.ops if o.name == tensor.producer), None)
            raise DynamicShapeError(
                f"tensor {tensor.name!r} (from op {op.type if op else '?'} in layer "
                f"{op.layer if op else None!r}) has shape {tensor.shape} with an unknown dimension. "
                + (_PY_FUNCTION_HINT if op is not None and op.type in _PY_FUNCTIONS else
                   "tofu_tf plans static shapes: give the model a fixed input shape "
                   "(keras.Input(shape=...)) and pass batch_size, and avoid ops whose output size "
                   "depends on data."))


def _unfused(optimizer):
    """``optimizer`` (capture's copy) with the dense update the strategy gives the user's
    (``tofu_tf.tf.compat.legacy_dense``)."""
    legacy_dense.unfuse_dense_updates(optimizer)
    return optimizer
