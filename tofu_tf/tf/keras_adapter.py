"""What tofu_tf needs to know about a Keras model, in one place.

tf-keras (Keras 2) and Keras 3 name variables, build optimizers and create
optimizer slots differently. Everything capture and the strategy ask of a model
that depends on those differences lives here. Nothing here plans or lowers; it
only answers questions about a model and runs its forward pass. What it changes
(on capture's own copies, or on the user's optimizer for the time of a capture)
is registered in ``tofu_tf.tf.compat.registry`` under the names these functions
give; the changes the strategy makes to a model for training are in
``tofu_tf.tf.compat`` itself.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from typing import Callable, Iterator

import tensorflow as tf

from tofu_tf.errors import TofuError
from tofu_tf.tf.compat import process as compat_process


class UnsupportedModelError(TofuError, TypeError):
    """The object given as a model is not a Keras model tofu_tf can trace."""


@dataclasses.dataclass(frozen=True)
class SlotRecord:
    """An optimizer slot as it was created: the slot variable and the weight it tracks."""

    slot: tf.Variable
    weight: tf.Variable
    slot_name: str


def framework_of(model) -> str:
    """``"tf_keras"`` or ``"keras3"``, by the first class in the model's MRO that a Keras package
    defines (keras-hub's are Keras 3); raises for anything else. Packages, not name prefixes: a
    user's ``keras_models.py`` subclassing ``tf_keras.Model`` is tf-keras."""
    for base in type(model).__mro__:
        package = base.__module__.split(".", 1)[0]
        if package == "tf_keras":
            return "tf_keras"
        if package in ("keras", "keras_hub"):
            return "keras3"
    raise UnsupportedModelError(
        f"{type(model).__name__} is not a Keras model (tf_keras or Keras 3). "
        "Pass a keras.Model / tf_keras.Model instance.")


def keras_module(framework: str):
    if framework == "tf_keras":
        import tf_keras
        return tf_keras
    import keras
    return keras


def keras_of(model):
    """The Keras package (``tf_keras`` or ``keras``) ``model`` belongs to."""
    return keras_module(framework_of(model))


def variable_path(variable) -> str:
    """The Keras path of a variable: ``dense_1/kernel`` (tf-keras drops ``:0``;
    Keras 3 exposes ``.path``)."""
    path = getattr(variable, "path", None)
    if isinstance(path, str):
        return path
    name = variable.name
    return name[:-2] if name.endswith(":0") else name


class UniquePaths:
    """Unique, stable names for variables: each one's Keras path, and for a later
    variable whose path is taken by another, that path + ``#2``, ``#3``...

    Keras paths are not identifiers: keras-hub's T5 has two different variables at
    ``.../self_attention/embeddings`` (the encoder's and the decoder's relative
    attention bias). Names follow the order variables are named in, so naming the
    same list (``model.weights``) or the same creation order (an optimizer's slots)
    gives the same names in every run and in every process.
    """

    def __init__(self):
        self._by_variable: dict[int, str] = {}
        self._taken: dict[str, int] = {}

    def name(self, variable, path: str | None = None) -> str:
        key = id(tf_variable(variable))
        if key not in self._by_variable:
            path = path or variable_path(variable)
            count = self._taken.get(path, 0)
            self._taken[path] = count + 1
            self._by_variable[key] = path if count == 0 else f"{path}#{count + 1}"
        return self._by_variable[key]

    def by_id(self) -> dict[int, str]:
        """id(tf.Variable) -> name, for every variable named so far."""
        return dict(self._by_variable)


def backing_variable(variable):
    """The tf.Variable behind a Keras variable (Keras 3 wraps one in ``.value``)."""
    inner = getattr(variable, "value", None)
    return inner if isinstance(inner, tf.Variable) else variable


def layer_paths(model) -> list[tuple[str, object]]:
    """Every layer of ``model`` (recursively, in ``_flatten_layers``' order) with its path
    in the layer tree, ``block_0/attention/query``: what logs name a layer by.

    Names alone repeat: a MultiHeadAttention (tf-keras and Keras 3) names its projections
    query, key and value in every block, and nested models may reuse their layers' names.
    A layer reached through two parents keeps the first path.
    """
    found: dict[int, str] = {}

    def walk(layer, prefix):
        for child in layer._flatten_layers(include_self=False, recursive=False):  # pylint: disable=protected-access
            if id(child) not in found:
                found[id(child)] = prefix + child.name
                walk(child, found[id(child)] + "/")

    walk(model, "")
    layers = model._flatten_layers(include_self=False, recursive=True)  # pylint: disable=protected-access
    return [(found.get(id(layer), layer.name), layer) for layer in layers]


def weight_paths(model) -> dict[int, str]:
    """id(tf.Variable) -> unique name (``UniquePaths``) of each of ``model``'s weights."""
    names = UniquePaths()
    for variable in model_variables(model):
        names.name(variable)
    return names.by_id()


def tf_variable(variable) -> tf.Variable:
    """The tf.Variable behind a Keras variable (Keras 3 wraps one in ``.value``)."""
    if isinstance(variable, tf.Variable):
        return variable
    inner = getattr(variable, "value", None)
    if isinstance(inner, tf.Variable):
        return inner
    raise UnsupportedModelError(f"variable {variable_path(variable)!r} is not backed by a tf.Variable")


class DynamicShapeError(TofuError, ValueError):
    """A tensor of the step has a dimension unknown at trace time."""


def input_specs(model, batch_size: int, features=None):
    """The step's input specs, in the structure the model is called with, batch dim ``batch_size``.

    ``features`` are the specs of a real batch (``fit`` and the other loops hand the
    strategy the first one): they are planned as given, because the model's declared
    inputs often leave dimensions open (``keras.Input(shape=(None,))``, as every
    keras-hub backbone does) while each batch has static shapes. Without them, a
    functional or Sequential model's declared inputs are used (a dict of inputs stays
    a dict), and a subclassed model's build shape (taken as float32). Each spec is
    named after its input (``_input_names``), so the plan's input layouts say which
    input they lay out.
    """
    if not model.built:
        raise UnsupportedModelError(
            f"model {model.name!r} is not built: build it first, e.g. start it with keras.Input(shape=...), "
            "call model.build((None, ...)) or call it on one batch.")
    declared = model_inputs(model)
    if features is not None:
        structure, source = features, "batch"
    elif declared is not None:
        structure, source = declared, "model input"
    else:
        structure, source = [tf.TensorSpec(shape, tf.float32) for shape in _build_shapes(model)], "build shape"
    leaves = tf.nest.flatten(structure)
    declared_leaves = tf.nest.flatten(declared) if declared is not None else []
    names = _input_names(structure)
    specs = []
    aligned = len(declared_leaves) == len(leaves)
    for name, leaf, index in zip(names, leaves, range(len(leaves))):
        shape, dtype = list(tf.TensorShape(leaf.shape)), tf.as_dtype(leaf.dtype)
        shown = str(getattr(declared_leaves[index], "name", None) or name).split(":")[0] if aligned else name
        fixed = declared_leaves[index].shape[0] if aligned else None
        if fixed is not None and fixed != batch_size:
            raise ValueError(
                f"model input {shown!r} fixes the batch size to {fixed}, but batch_size={batch_size} was asked "
                f"for: pass batch_size={fixed} or rebuild the model's Input without batch_size.")
        if not shape:
            raise ValueError(f"model input {shown!r} is a scalar; a step's inputs need a batch dimension")
        if any(d is None for d in shape[1:]):
            raise DynamicShapeError(
                f"{source} {shown!r} has shape {tuple(shape)}: tofu_tf plans static shapes, and a dimension other "
                "than the batch is unknown. fit/evaluate/predict plan from the shapes of the batches they "
                "receive; to plan before them, pass the shapes of a batch: "
                "strategy.plan_model(model, batch_size=..., features=<a batch or its tf.TensorSpec>).")
        specs.append(tf.TensorSpec([batch_size] + shape[1:], dtype, name=name))
    if isinstance(structure, (list, tuple)) and len(specs) == 1:
        return specs[0]                      # a one-input model is called with the tensor itself
    return tf.nest.pack_sequence_as(structure, specs)


def model_inputs(model):
    """The symbolic inputs of a functional or Sequential model, in the structure it
    was defined with (a dict stays a dict); None for a subclassed model."""
    # pylint: disable=protected-access
    structure = getattr(model, "_inputs_struct", None)          # Keras 3 functional
    if structure is None:
        structure = getattr(model, "_nested_inputs", None)      # tf-keras functional
    if structure is None:
        structure = getattr(model, "inputs", None) or None      # a Keras 3 Sequential
    return structure


def _input_names(structure) -> list[str]:
    """One graph-safe, stable name per input leaf: its key path in a dict of inputs
    (``token_ids``), else ``x`` for a single input and ``x_0``, ``x_1``... for a list
    (Keras' generated input names, ``input_3``, depend on what the process built before)."""
    paths = _leaf_paths(structure)
    if not isinstance(structure, dict):
        paths = ["x" if not path else f"x_{path}" for path in paths]
    return [_graph_safe(path.replace("/", "_"), index) for index, path in enumerate(paths)]


def _leaf_paths(structure, prefix: str = "") -> list[str]:
    """The ``/``-joined paths of a structure's leaves, in ``tf.nest.flatten`` order (dicts by sorted key)."""
    if isinstance(structure, dict):
        return [p for key in sorted(structure) for p in _leaf_paths(structure[key], f"{prefix}{key}/")]
    if isinstance(structure, (list, tuple)):
        return [p for i, item in enumerate(structure) for p in _leaf_paths(item, f"{prefix}{i}/")]
    return [prefix.rstrip("/")]


def _graph_safe(name: str, index: int) -> str:
    safe = "".join(c if c.isalnum() or c in "_.-" else "_" for c in name)
    return safe if safe[:1].isalnum() else f"input_{index}_{safe}".rstrip("_")


def build_from_features(model, features) -> bool:
    """Build a model that is not built yet (a subclassed one) by tracing it on
    ``features`` (the specs of one batch), as its first call in ``fit`` would.

    The strategy plans before Keras' loop calls the model: tf-keras and Keras 3 lay
    the dataset out on the mesh first, and a subclassed model only creates its
    weights at its first call. The trace creates them (through the strategy's
    scope: no values yet) without computing anything. True when it built the model.
    """
    if _built(model):
        return False
    _traced_outputs(model, _one_input_unwrapped(features))
    return True


def build_from_step(model, step, arg_specs, optimizers) -> bool:
    """Build a model that is not built yet by tracing a custom loop's ``step`` on ``arg_specs``
    (a pair: the positional and keyword arguments' specs), as its first run would.

    A subclassed model made in ``strategy.scope()`` creates its weights at its first call, which
    in a custom loop is inside the step the strategy plans at its first ``run``: capture traced it
    with buffer-less handles for weights, which the optimizer refused ("Trying to create optimizer
    slot variable under the scope ... different from the scope used for the original variable")
    and no gradient named. Only the step knows which argument is the model's input, so it is
    traced once, nothing computed, each optimizer's update redirected to nothing (their state is
    made by the plan); the weights come from the strategy's scope. True when it built the model."""
    if _built(model):
        return False
    args, kwargs = arg_specs
    with contextlib.ExitStack() as redirected:
        for optimizer in optimizers:
            redirected.enter_context(redirected_updates(optimizer, lambda grads_and_vars: None))
        tf.function(lambda *a, **k: step(a, k)).get_concrete_function(*args, **kwargs)
    return bool(model.trainable_variables)


def _built(model) -> bool:
    """Built with its weights: a Keras 3 subclass's ``build()`` can leave its layers unbuilt."""
    return bool(model.built and model.trainable_variables)


def _traced_outputs(model, specs) -> list:
    """``model``'s outputs traced on input ``specs`` (a structure; nothing computed: an
    unbuilt model makes its weights on the way, as at its first call)."""
    forward = tf.function(lambda x: model(x, training=False), autograph=False)
    return tf.nest.flatten(forward.get_concrete_function(specs).structured_outputs)


def _one_input_unwrapped(structure):
    if isinstance(structure, (list, tuple)) and len(structure) == 1:
        return structure[0]
    return structure


def _build_shapes(model) -> list:
    """The input shapes a subclassed model was built with (tf-keras and Keras 3 keep them apart)."""
    shape = getattr(model, "_build_input_shape", None)                    # tf-keras
    if shape is None:
        shape = (getattr(model, "_build_shapes_dict", None) or {}).get("input_shape")  # Keras 3
    if shape is None:
        raise UnsupportedModelError(
            f"model {model.name!r} has no known inputs: start it with keras.Input(shape=...), call "
            "model.build((None, ...)), or let fit plan it from its first batch.")
    if isinstance(shape, dict):
        shape = list(shape.values())
    if isinstance(shape, (list, tuple)) and shape and isinstance(shape[0], (list, tuple, tf.TensorShape)):
        return [tf.TensorShape(s).as_list() for s in shape]
    return [tf.TensorShape(shape).as_list()]


def label_spec(model, loss, batch_size: int, x_specs) -> tf.TensorSpec:
    """The labels the loss expects: integer class ids for sparse losses, else
    a tensor shaped like the model output."""
    out_shape = _output_shape(model, x_specs)
    loss_name = loss if isinstance(loss, str) else getattr(loss, "name", None) or getattr(loss, "__name__", "")
    if "sparse" in str(loss_name).lower():
        return tf.TensorSpec([batch_size] + out_shape[1:-1], tf.int32)
    return tf.TensorSpec([batch_size] + out_shape[1:], tf.float32)


def _output_shape(model, x_specs) -> list:
    """The first output's shape: named by a functional model, traced for a subclassed one
    or when the declared output leaves a dimension open (a keras-hub LM's sequence)."""
    outputs = getattr(model, "outputs", None)
    if not outputs or any(d is None for d in list(outputs[0].shape)[1:]):
        outputs = _traced_outputs(model, x_specs)
    return list(outputs[0].shape)


def no_compiled_loss(y_true, y_pred):  # pylint: disable=unused-argument
    """The compiled loss of a model compiled without one, whose losses it adds itself
    (``model.add_loss``: tf-keras's distribute test's per-pixel weighted loss): zero, as Keras'
    loss container sums no loss; the step adds the model's own losses (``regularization_losses``)."""
    return tf.constant(0.0)


def is_sequence(value) -> bool:
    """Whether ``value`` is a list or tuple, or the ``ListWrapper`` tf.Module tracking gives a list
    assigned to a model's attribute (``model.optimizer`` compiled with a list: a WideDeepModel's)."""
    return isinstance(value, (list, tuple)) or type(value).__name__ == "ListWrapper"


def is_mapping(value) -> bool:
    """Whether ``value`` is a dict, or the ``DictWrapper`` tracking gives one (tf-keras's ``model.loss``)."""
    return isinstance(value, dict) or type(value).__name__ == "DictWrapper"


def compiled_without_loss(model) -> bool:
    """Whether ``model`` is compiled (it holds an optimizer) with no loss, training on the losses
    it adds itself (``add_loss``): Keras' step computes only those. tf-keras records no loss as
    an empty ``{}``, Keras 3 as None."""
    loss = getattr(model, "loss", None)
    no_loss = loss is None or (is_sequence(loss) or is_mapping(loss)) and len(loss) == 0
    return getattr(model, "optimizer", None) is not None and no_loss and bool(getattr(model, "losses", None))


def get_loss(framework: str, loss) -> Callable:
    """The loss capture traces: the compiled one, copied when it is a tf-keras ``Loss``.

    A tf-keras ``Loss`` with the default (AUTO) reduction refuses to run under a
    distribution strategy unless ``compile``'s loss container has marked it, which the
    container does at the model's first step; capture runs before that, inside the
    strategy's scope. The copy has the user's configuration and the container's mark;
    the user's object is left as it was. The change "loss_copy_marked".
    """
    if loss is no_compiled_loss:
        return loss
    if isinstance(loss, (dict, list, tuple)):
        raise ValueError(
            f"tofu_tf plans a training step with one loss, and this model was compiled with one loss "
            f"per output ({loss!r}). Compile it with a single loss (Keras applies it to every output "
            "and sums), or write one loss function that combines the outputs' losses.")
    loss = _as_loss_object(framework, keras_module(framework).losses.get(loss))
    if hasattr(loss, "_allow_sum_over_batch_size"):
        loss = copy.copy(loss)
        loss._allow_sum_over_batch_size = True  # pylint: disable=protected-access
    return loss


def _as_loss_object(framework: str, loss):
    """A tf-keras loss function (``"binary_crossentropy"``) wrapped as ``compile`` wraps it, in
    a ``LossFunctionWrapper``: the wrapper squeezes or expands the labels to the predictions'
    rank (labels ``(b,)`` for outputs ``(b, 1)``), which the bare function does not (a shape
    error while the step was captured). Keras 3 exports no such wrapper; its losses are kept."""
    if framework != "tf_keras" or not callable(loss):
        return loss
    from tf_keras.src import losses as tf_keras_losses
    if isinstance(loss, tf_keras_losses.Loss):
        return loss
    return tf_keras_losses.LossFunctionWrapper(loss, name=getattr(loss, "__name__", "loss"))


def fresh_optimizer(framework: str, optimizer):
    """A new, unbuilt optimizer with the user's configuration.

    Tracing builds an optimizer (it creates slots); doing that to the user's
    own optimizer would leave it holding capture-time placeholders.
    """
    if is_sequence(optimizer):
        names = ", ".join(type(o).__name__ for o in optimizer)
        raise UnsupportedModelError(
            f"the model is compiled with {len(optimizer)} optimizers ({names}; tf-keras's WideDeepModel "
            "takes one per sub-model), and this plans Keras' compiled step, which applies one. Under "
            "TofuStrategy, fit and strategy.plan_model(model, batch_size=..., features=<a batch as fit passes "
            "it>) plan the model's own train_step, which applies each; or compile it with a single optimizer.")
    optimizer = keras_module(framework).optimizers.get(optimizer)
    wrapped = getattr(optimizer, "optimizer", None)
    if type(optimizer).__name__ == "TFOptimizer" and wrapped is not None:
        raise UnsupportedModelError(
            f"the model is compiled with a TensorFlow 1 optimizer ({type(wrapped).__name__} from "
            "tf.compat.v1.train, which tf-keras wraps in a TFOptimizer), which has no config: TofuStrategy plans "
            "with a copy of the optimizer made from its config. Use a Keras optimizer (tf_keras.optimizers."
            "RMSprop, Adam, SGD, ... or their tf_keras.optimizers.legacy versions).")
    return optimizer.__class__.from_config(optimizer.get_config())


@dataclasses.dataclass(frozen=True)
class LossScaling:
    """What a loss-scale optimizer does around the optimizer it wraps, for capture."""

    inner: object                                  # the wrapped optimizer, whose update capture traces
    scale_loss: Callable                           # loss -> scaled loss
    unscale_gradients: Callable                    # gradients of the scaled loss -> true gradients


def loss_scaling(framework: str, optimizer) -> LossScaling | None:
    """How ``optimizer`` scales the loss, when it is a ``LossScaleOptimizer``; else None.

    ``compile`` wraps the optimizer in one under the "mixed_float16" policy (tf-keras
    and Keras 3). Its update runs the wrapped optimizer's inside a ``cond`` on the
    gradients being finite, which the IR keeps as one opaque op: every weight, slot
    and gradient an input of it, and the planner replicates them all. Capture traces
    what that branch runs (loss scaled, gradients unscaled, the wrapped optimizer's
    update), so the plan sees each weight's update; the step Keras runs still skips
    non-finite steps.
    """
    if framework == "tf_keras":
        import tf_keras
        if isinstance(optimizer, tf_keras.mixed_precision.LossScaleOptimizer):
            return LossScaling(optimizer.inner_optimizer, optimizer.get_scaled_loss,
                               optimizer.get_unscaled_gradients)
        return None
    import keras
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        scale = optimizer.initial_scale            # what an unbuilt wrapper scales by
        return LossScaling(optimizer.inner_optimizer, optimizer.scale_loss,
                           lambda grads: [None if g is None else g / scale for g in grads])
    return None


def trace_updates_inline(optimizer):
    """Trace ``optimizer``'s per-weight updates in the step's own graph.

    On GPUs tf-keras compiles each weight's update as an XLA function of its
    own; capture inlines function calls anyway, so the IR keeps the same ops,
    and updates traced inline can be traced once per weight shape
    (``update_stamps``). Only the capture's own copy of the optimizer is changed.
    """
    if getattr(optimizer, "jit_compile", False) and type(optimizer).__module__.startswith("tf_keras"):
        optimizer.jit_compile = False
    return optimizer


def fills_shards(initializer) -> bool:
    """Whether a tf-keras initializer fills a constant (Zeros, Ones): each device can fill its
    own shard under the layout and the values are one device's. A random initializer's draw
    under a split layout is another stream (DTensor folds each device's coordinates into the
    seed); those are drawn whole on the host instead (``tofu_tf.tf.variables.materialize``)."""
    import tf_keras
    kinds = tf_keras.initializers
    return isinstance(initializer, (kinds.Zeros, kinds.Ones))


class DeferredZeros:
    """A zeros initial value that knows its shape without being computed.

    tf-keras builds optimizers under ``tf.init_scope()``, so a plain
    ``tf.zeros(shape)`` there allocates a full slot eagerly. Handing this
    callable in instead lets a variable creator read shape and dtype and skip
    the allocation; calling it still gives real zeros.
    """

    def __init__(self, shape, dtype):
        self.shape = tf.TensorShape(shape)
        self.dtype = tf.as_dtype(dtype)

    def __call__(self):
        return tf.zeros(self.shape, self.dtype)


@contextlib.contextmanager
def recording_slots(optimizer, *, defer_zeros: bool = False) -> Iterator[list[SlotRecord]]:
    """Record which weight each optimizer slot is created for.

    Both Keras versions create slots through ``add_variable_from_reference``;
    wrapping it on this (capture-only) instance is the one reliable link from
    slot to weight. The change "slots_recorded".
    """
    records: list[SlotRecord] = []
    if is_legacy_optimizer(optimizer):
        with _recording_legacy_slots(optimizer, records):
            yield records
        return
    original = optimizer.add_variable_from_reference

    def wrapper(*args, **kwargs):
        reference, name = slot_reference_and_name(args, kwargs)
        if defer_zeros:
            defer_default_zeros(reference, args, kwargs)
        slot = original(*args, **kwargs)
        records.append(SlotRecord(slot=tf_variable(slot), weight=tf_variable(reference), slot_name=str(name)))
        return slot

    optimizer.add_variable_from_reference = wrapper
    try:
        yield records
    finally:
        del optimizer.add_variable_from_reference


def is_legacy_optimizer(optimizer) -> bool:
    """A tf-keras legacy optimizer (``tf_keras.optimizers.legacy``: ``OptimizerV2``), which makes
    its slots with ``add_slot`` and updates each weight with one fused op (``ResourceApplyAdam``)."""
    if optimizer is None or not type(optimizer).__module__.startswith("tf_keras"):
        return False
    import tf_keras
    return isinstance(optimizer, tf_keras.optimizers.legacy.Optimizer)


def deduplicates_sparse_gradients(optimizer) -> bool:
    """Whether ``optimizer`` sums a sparse gradient's duplicate rows with ``tf.unique`` before its
    update: tf-keras' optimizers (``Optimizer._deduplicate_sparse_grad``; a legacy one's
    ``_resource_apply_sparse_duplicate_indices``, which its SGD overrides to scatter the rows as
    they come). Keras 3's do not. DTensor runs ``Unique`` (its output's length depends on the
    data) on the whole index vector, so the rows a device holds are gathered first. The private
    read "sparse_deduplication_read"."""
    if optimizer is None or not type(optimizer).__module__.startswith("tf_keras"):
        return False
    if not is_legacy_optimizer(optimizer):
        return hasattr(optimizer, "_deduplicate_sparse_grad")
    from tf_keras.src.optimizers.legacy import optimizer_v2
    return (type(optimizer)._resource_apply_sparse_duplicate_indices  # pylint: disable=protected-access
            is optimizer_v2.OptimizerV2._resource_apply_sparse_duplicate_indices)  # pylint: disable=protected-access


def build_legacy_optimizer(optimizer, variables) -> None:
    """Make a legacy optimizer's state (step counter, hyperparameters, slots) as its first
    ``apply_gradients`` makes it: under its name scope, outside any function."""
    with tf.init_scope():
        optimizer.iterations               # pylint: disable=pointless-statement  (made on first read, unscoped)
    with tf.name_scope(optimizer._name), tf.init_scope():  # pylint: disable=protected-access
        optimizer._create_all_weights(list(variables))     # pylint: disable=protected-access


def apply_gradients_for_capture(optimizer, grads_and_vars):
    """``optimizer.apply_gradients(grads_and_vars)`` as capture traces it: one device's update.

    A legacy optimizer refuses to apply in cross-replica context, which is where capture
    traces under ``strategy.scope()`` (there is no replica to run in before the plan). Its
    ``apply_gradients`` then runs, for one device, exactly this: slots made, gradients
    transformed (clipping), each weight updated by ``_distributed_apply`` through the
    current strategy's ``extended.update``. Other optimizers apply as they are.
    """
    if not is_legacy_optimizer(optimizer):
        return optimizer.apply_gradients(grads_and_vars)
    # pylint: disable=protected-access
    grads_and_vars = [(g, v) for g, v in grads_and_vars if g is not None]
    var_list = [v for _, v in grads_and_vars]
    build_legacy_optimizer(optimizer, var_list)
    with tf.name_scope(optimizer._name):
        apply_state = optimizer._prepare(var_list)
        grads_and_vars = optimizer._transform_unaggregated_gradients(grads_and_vars)
        grads_and_vars = optimizer._transform_gradients(grads_and_vars)
        return optimizer._distributed_apply(tf.distribute.get_strategy(), grads_and_vars, apply_state, None)


_UNSET = object()


@contextlib.contextmanager
def redirected_updates(optimizer, apply: Callable) -> Iterator[None]:
    """While active, ``optimizer.apply_gradients(grads_and_vars)`` (and Keras 3's
    ``optimizer.apply(grads, variables)``) call ``apply(list_of_grad_var_pairs)`` instead.

    Capture traces a custom loop's step function as the user wrote it, and that function
    calls the user's optimizer; building that optimizer in a trace would leave it holding
    capture's buffer-less handles. The methods are replaced on this instance only (the
    strategy's own instance-level wrappers are kept and put back) and restored on exit.
    The change "updates_redirected".
    """
    names = ("apply_gradients", "apply") if hasattr(optimizer, "apply") and \
        not is_legacy_optimizer(optimizer) else ("apply_gradients",)
    saved = {name: optimizer.__dict__.get(name, _UNSET) for name in names}

    def apply_gradients(grads_and_vars, *args, **kwargs):
        del args, kwargs                     # name, experimental_aggregate_gradients: one device's update
        return apply(list(grads_and_vars))

    def apply_pairs(grads, trainable_variables=None):
        if trainable_variables is None:
            raise UnsupportedModelError(
                "optimizer.apply(grads) without its variables, in a step TofuStrategy plans: pass "
                "apply(grads, variables) or use apply_gradients(zip(grads, variables)).")
        return apply(list(zip(grads, trainable_variables)))

    optimizer.apply_gradients = apply_gradients
    if "apply" in names:
        optimizer.apply = apply_pairs
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is _UNSET:
                optimizer.__dict__.pop(name, None)
            else:
                optimizer.__dict__[name] = value


@contextlib.contextmanager
def _recording_legacy_slots(optimizer, records: list[SlotRecord]) -> Iterator[None]:
    """``recording_slots`` for a legacy optimizer: its slots come from ``add_slot(var, slot_name, ...)``.
    Their initial value is ``functools.partial(initializer, shape=..., dtype=...)``: a variable
    creator reads the shape from it without computing it."""
    original = optimizer.add_slot

    seen: set[int] = set()

    def wrapper(var, slot_name, *args, **kwargs):
        slot = original(var, slot_name, *args, **kwargs)      # returns the existing slot when asked again
        if id(slot) not in seen:
            seen.add(id(slot))
            records.append(SlotRecord(slot=tf_variable(slot), weight=tf_variable(var), slot_name=str(slot_name)))
        return slot

    optimizer.add_slot = wrapper
    try:
        yield
    finally:
        del optimizer.add_slot


def slot_reference_and_name(args, kwargs):
    # tf-keras calls add_variable_from_reference as (model_variable,
    # variable_name), Keras 3 as (reference_variable, name); positionally or by keyword.
    named = dict(zip(("reference", "name"), args))
    reference = named.get("reference", kwargs.get("model_variable", kwargs.get("reference_variable")))
    name = named.get("name", kwargs.get("variable_name", kwargs.get("name")))
    return reference, name


def defer_default_zeros(reference, args, kwargs) -> None:
    """Replace the default (zeros) initial value of a slot by a ``DeferredZeros``, in ``kwargs``."""
    if len(args) >= 4 or kwargs.get("initial_value") is not None:
        return
    shape = kwargs.get("shape") if len(args) < 3 else args[2]
    dtype = getattr(reference, "true_dtype", reference.dtype)
    kwargs["initial_value"] = DeferredZeros(reference.shape if shape is None else shape, dtype)


def keras3_shape_and_dtype(initial_value) -> tuple[tf.TensorShape, tf.DType] | None:
    """Shape and dtype of the Keras 3 variable that ``initial_value`` initializes, or None.

    Keras 3 (TensorFlow backend) creates its ``tf.Variable`` from
    ``lambda: initializer(self._shape, dtype=self._dtype)``; the closure holds
    the Keras variable, which knows shape and dtype without running the
    initializer (a full-size value) just to learn them.
    """
    call = keras3_initializer_call(initial_value)
    return None if call is None else (tf.TensorShape(call[1]), tf.as_dtype(call[2]))


def keras3_initializer_call(initial_value) -> tuple[object, tuple, str] | None:
    """``(initializer, shape, dtype)`` that the Keras 3 initial-value lambda ``initial_value``
    calls (``initializer(self._shape, dtype=self._dtype)``, its closure read: the private read
    "keras3_initializer_read"), or None for any other initial value."""
    cells = {}
    code = getattr(initial_value, "__code__", None)
    for name, cell in zip(code.co_freevars if code else (), getattr(initial_value, "__closure__", None) or ()):
        try:
            cells[name] = cell.cell_contents
        except ValueError:  # an empty cell
            continue
    variable = cells.get("self")
    if not type(variable).__module__.startswith("keras.") or not hasattr(variable, "_shape") \
            or not hasattr(variable, "_dtype"):
        return None
    return cells.get("initializer"), variable._shape, variable._dtype  # pylint: disable=protected-access


def optimizer_variables(optimizer) -> list[tf.Variable]:
    variables = optimizer.variables
    if callable(variables):                 # a legacy tf-keras optimizer's is a method
        variables = variables()
    return [tf_variable(v) for v in variables]


def model_variables(model) -> list:
    return list(model.weights)


def seed_states(model) -> list:
    """A Keras 3 model's ``SeedGenerator`` states (its Dropout's, its GaussianNoise's): variables
    of the model that are not weights, which each draw advances. tf-keras has none (its layers'
    generators hold a seed, no state)."""
    return [v for v in getattr(model, "variables", ()) if str(getattr(v, "path", "")).rsplit("/", 1)[-1]
            .startswith("seed_generator_state")]


def trainable_variables(model) -> list:
    return list(model.trainable_variables)


def regularization_losses(model) -> list:
    return list(model.losses)


class LayerScopes:
    """Which Keras layer made an op, read from the name scopes in the op's name.

    tf-keras opens a layer's scope once per call, under the layer's own name. Keras 3
    opens it twice (to build, then to call), and TF makes the second name unique:
    layer ``dense``'s ops sit in ``dense_1/``, and layer ``dense_1``'s in
    ``dense_1_2/``, so names alone attribute ops to the wrong layer or to none. For
    Keras 3 the scopes each layer actually entered are recorded while tracing.
    """

    def __init__(self, names: set[str]):
        self.names = names                                  # every layer's name
        self.entered: dict[tuple[str, ...], str] = {}       # scope path entered by a layer -> its name

    def layer_of(self, op_name: str) -> str | None:
        """The innermost layer whose scope contains the op (forward or gradient)."""
        parts = op_name.split("/")
        if not self.entered:
            return next((part for part in reversed(parts) if part in self.names), None)
        best, length = None, 0
        for start in range(len(parts)):
            for stop in range(start + length + 1, len(parts) + 1):
                layer = self.entered.get(tuple(parts[start:stop]))
                if layer is not None:
                    best, length = layer, stop - start
        return best


@contextlib.contextmanager
def recording_layer_scopes(framework: str, model) -> Iterator[LayerScopes]:
    """The layer scopes of ``model`` (see ``LayerScopes``), recorded meanwhile for Keras 3."""
    scopes = LayerScopes({layer.name for layer in model._flatten_layers(include_self=False, recursive=True)})
    if framework == "tf_keras":
        yield scopes
        return

    def record(caller, path):
        if getattr(caller, "name", None) in scopes.names:
            scopes.entered[tuple(path.split("/"))] = caller.name

    with compat_process.recording_keras3_scopes(record):     # the change "layer_scopes_recorded"
        yield scopes


def optimizer_built(optimizer) -> bool:
    """Whether ``optimizer`` has made its slots (Keras 3 ``built``, tf-keras ``_built``)."""
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    if is_legacy_optimizer(inner):              # makes its state at its first apply_gradients
        return bool(inner.variables())
    return bool(getattr(inner, "built", False) or getattr(inner, "_built", False))


def step_counters(model) -> list[tf.Variable]:
    """The model's own step counters, which each train step advances besides the
    optimizer's: tf-keras keeps one (``_train_counter``), Keras 3 none."""
    counter = getattr(model, "_train_counter", None)  # pylint: disable=protected-access
    return [counter] if isinstance(counter, tf.Variable) else []


def building_functional_model() -> bool:
    """Whether tf-keras is tracing a layer's call to build a functional model: it runs the call on
    placeholders in a scratch graph of its own (``Layer._infer_output_signature``: a ``FuncGraph``
    named "<layer>_scratch_graph"; "keras_graph", ``backend.get_graph()``, for a functional model's
    own metrics) to infer the output signature. Nothing traced there ever runs; a metric a layer
    adds in its call (``add_metric``) is updated there through the strategy's
    ``call_for_each_replica`` before any step exists."""
    if tf.executing_eagerly():
        return False
    name = getattr(tf.compat.v1.get_default_graph(), "name", None) or ""
    return name.endswith("_scratch_graph") or name == "keras_graph"
