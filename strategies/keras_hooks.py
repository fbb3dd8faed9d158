"""What TofuStrategy needs from a Keras training loop, kept in one module.

Keras hands the strategy a step function (``strategy.run(step, args)``), not
the model. Planning needs the model, its loss and optimizer, so the model is
found in the step function's closure (tf-keras ``fit``/``evaluate``/
``predict`` close over it; Keras 3 binds it as ``self``). A Keras upgrade that
changes this touches only this file.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import sys
import types

import tensorflow as tf

from tofu_tf.strategies import export as export_lib
from tofu_tf.tf import keras_adapter

_MAX_DEPTH = 4


@dataclasses.dataclass(frozen=True)
class StepInputs:
    """The features and labels of one step, as Keras passes them to the step function."""

    features: object
    labels: object | None


def find_model(step_fn, *, strict: bool = False):
    """The Keras model a step function trains, or None: where the function reaches several
    (a task model and its backbone), the one holding all the others' weights. Where none
    holds all (two models trained side by side), the first found, or with ``strict`` (the
    step is about to be planned from it) an error."""
    models = _reachable(step_fn, _is_model)
    if not models:
        return None
    outermost = max(models, key=lambda m: len(m.weights))
    held = {id(w) for w in outermost.weights}
    if all({id(w) for w in m.weights} <= held for m in models):
        return outermost
    if not strict:
        return models[0]
    names = ", ".join(sorted(m.name for m in models))
    raise keras_adapter.UnsupportedModelError(
        f"the function passed to strategy.run trains several models ({names}), and TofuStrategy plans one: "
        "give each model its own TofuStrategy, or plan one model that holds them all.")


def find_optimizer(step_fn):
    """The optimizer a custom loop's step function applies its gradients with, or None."""
    optimizers = _reachable(step_fn, _is_optimizer)
    if len(optimizers) > 1:
        raise keras_adapter.UnsupportedModelError(
            f"the function passed to strategy.run reaches {len(optimizers)} optimizers, and TofuStrategy plans "
            "a step with one: plan the model explicitly with strategy.plan_model(model, batch_size=..., "
            "loss=..., optimizer=...).")
    return optimizers[0] if optimizers else None


_KERAS_STEPS = frozenset({"train_step", "test_step", "predict_step"})


def runs_keras_step(step_fn, model) -> bool:
    """Whether ``step_fn`` runs ``model``'s own train/test/predict step: Keras' step functions
    (``fit``, ``train_on_batch``) and the strategy's (``tofu_tf.strategies.step_functions``) call the
    model's bound ``train_step``; a custom loop runs its own code."""
    function = getattr(step_fn, "__func__", step_fn)
    function = getattr(function, "_python_function", function)
    if str(getattr(function, "__module__", "")).startswith(_KERAS_MODULES):
        return True

    def model_step(obj) -> bool:
        return getattr(obj, "__self__", None) is model and getattr(obj, "__name__", None) in _KERAS_STEPS
    return bool(_reachable(step_fn, model_step))


def find_model_in_stack(max_frames: int = 12):
    """The Keras model whose fit/evaluate/predict is distributing a dataset, or None.

    tf-keras distributes the dataset (``strategy.experimental_distribute_dataset``)
    before it builds the step function, from its DataHandler, which holds the
    model in a local variable; Keras 3 from its epoch iterator, inside ``fit``. The
    plan must exist by then because the batches are laid out on the planned mesh.
    Only Keras' own frames count: a model in the user's script (a custom training
    loop distributing its dataset) says nothing about what the loop trains.
    """
    for frame in _calling_frames(max_frames):
        if not str(frame.f_globals.get("__name__", "")).startswith(_KERAS_TRAINING_FRAMES):
            continue
        for name in ("model", "self"):
            candidate = frame.f_locals.get(name)
            if candidate is not None and _is_model(candidate):
                return candidate
    return None


_KERAS_MODULES = ("tf_keras.", "keras.", "keras_hub.")
# Keras' training machinery, where fit/evaluate/predict hold the model: tf-keras's engine
# (DataHandler, train_on_batch), Keras 3's trainers, keras-hub's task models. Not all of
# ``tf_keras``: its distribution test harness (``tf_keras.src.distribute``) holds a local
# ``model`` too, while it distributes a dataset for another (a loaded SavedModel).
_KERAS_TRAINING_FRAMES = ("tf_keras.src.engine.", "keras.src.trainers.", "keras.src.backend.", "keras_hub.")


def _calling_frames(max_frames: int):
    """The frames that called the function iterating this, innermost first."""
    frame = inspect.currentframe().f_back
    try:
        for _ in range(max_frames):
            frame = frame.f_back
            if frame is None:
                return
            yield frame
    finally:
        del frame


def _is_model(obj) -> bool:
    # Not ``inputs``: a subclassed Keras 3 model has no such attribute.
    # Looked up on the class: an unbuilt tf-keras model's trainable_variables raises ValueError
    # ("Weights for model 'linear_model' have not yet been created"), which hasattr lets through.
    kind = type(obj)
    return hasattr(kind, "train_step") and hasattr(kind, "trainable_variables") and callable(getattr(kind, "fit", None))


def _is_optimizer(obj) -> bool:
    kind = type(obj)
    return (callable(getattr(kind, "apply_gradients", None)) and callable(getattr(kind, "get_config", None))
            and any(str(base.__module__).startswith(_KERAS_MODULES) for base in kind.__mro__))


def _reachable(step_fn, wanted) -> list:
    """The objects ``wanted`` accepts that ``step_fn`` reaches, in the order found.

    What a step function can touch: its bound object (and that object's attributes: a
    loop class holding ``self.model``), a wrapped or traced function's Python function,
    its closure cells, and the module globals its code names (TF's tutorial keeps
    ``model`` and ``optimizer`` at module level). Found objects are not searched further.
    """
    found, seen = [], set()

    def visit(obj, depth):
        if obj is None or id(obj) in seen or depth > _MAX_DEPTH or isinstance(obj, types.ModuleType):
            return
        seen.add(id(obj))
        if wanted(obj):
            found.append(obj)
            return
        if _is_model(obj) or _is_optimizer(obj):
            return
        for candidate in _neighbours(obj):
            visit(candidate, depth + 1)

    visit(step_fn, 0)
    return found


def _neighbours(obj):
    yield getattr(obj, "__self__", None)
    yield getattr(obj, "__wrapped__", None)
    yield getattr(obj, "_python_function", None)
    yield getattr(obj, "__func__", None)
    for cell in getattr(obj, "__closure__", None) or ():
        try:
            yield cell.cell_contents
        except ValueError:  # an empty cell
            continue
    code = getattr(obj, "__code__", None)
    module_globals = getattr(obj, "__globals__", None)
    if code is not None and module_globals is not None:
        for name in _names_used(code):
            yield module_globals.get(name)
    elif not callable(obj) and hasattr(obj, "__dict__") and not isinstance(obj, type):
        yield from list(vars(obj).values())        # a loop object: self.model, self.optimizer


def _names_used(code) -> list[str]:
    names = list(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):        # a nested function or comprehension
            names.extend(_names_used(const))
    return names


def split_step_data(args) -> StepInputs:
    """Keras calls the step with ``(data,)``; data is ``x``, ``(x,)``, ``(x, y)`` or ``(x, y, w)``,
    and ``x`` keeps its structure (a dict of inputs stays a dict)."""
    data = args[0] if len(args) == 1 else args
    if isinstance(data, tuple):
        features = data[0]
        labels = data[1] if len(data) > 1 else None
    else:
        features, labels = data, None
    return StepInputs(features=features, labels=labels)


def backing_variable(variable):
    """The tf.Variable behind a Keras variable (Keras 3 wraps one in ``.value``)."""
    inner = getattr(variable, "value", None)
    return inner if isinstance(inner, tf.Variable) else variable


def compiled_loss(model):
    """The loss the model was compiled with (what capture traces), or None."""
    return getattr(model, "loss", None)


@dataclasses.dataclass(frozen=True)
class Transformation:
    """One change TofuStrategy made to a layer so DTensor can expand it."""

    layer: str
    change: str
    reason: str


def prepare_for_dtensor(model) -> list[Transformation]:
    """Rewrite the layers DTensor cannot expand as written, without changing their math.

    * BatchNormalization / LayerNormalization: tf-keras runs them through
      ``FusedBatchNormV3``, which DTensor has no layout propagation for; the
      unfused formulation (moments + batch_normalization) computes the same.
    * LSTM / GRU: Keras runs the recurrence as a ``While`` loop over a
      TensorList, which DTensor cannot expand; with a static sequence length
      the loop is unrolled (``unroll=True``), the same cell applied per step.
    * Dropout (and SpatialDropout, and the dropout of LSTM/GRU/SimpleRNN
      cells): tf-keras draws masks with a stateful random op, which DTensor
      refuses; ``step_seeded_dropout`` draws them statelessly, seeded by the
      optimizer's step count (a compiled model's).
    Sparse (Embedding) gradients are densified in the variables instead
    (``tofu_tf.tf.variables.TofuVariable.scatter_add``). And the model's SavedModel
    exports are made from a one-device copy (``tofu_tf.strategies.export``): one traced on
    the mesh holds DTensor ops no one-device runtime can run.
    """
    changes = []
    step = getattr(getattr(model, "optimizer", None), "iterations", None)
    paths = layer_paths(model)
    wrapped_steps = _wrapped_timesteps([layer for _, layer in paths])
    for path, layer in paths:
        kind = type(layer).__name__
        if getattr(layer, "fused", False) is True and "BatchNormalization" in kind:
            _unfuse_batch_norm(layer)
            changes.append(Transformation(path, "fused=False", "DTensor cannot expand FusedBatchNormV3"))
        if getattr(layer, "_fused", False) is True and "LayerNormalization" in kind:
            layer._fused = False  # pylint: disable=protected-access
            changes.append(Transformation(path, "fused=False", "DTensor cannot expand FusedBatchNormV3"))
        if kind in ("AveragePooling2D", "AvgPool2D") and _non_overlapping(layer):
            layer.call = types.MethodType(_mean_pool_2d, layer)
            changes.append(Transformation(path, "pooling as reshape+mean",
                                          "DTensor cannot expand AvgPoolGrad"))
        if hasattr(layer, "unroll") and hasattr(layer, "cell") and not layer.unroll:
            _refuse_unrollable(path, layer)
            _unroll(layer, wrapped_steps[id(layer)] if id(layer) in wrapped_steps else _timesteps(layer))
            changes.append(Transformation(path, "unroll=True",
                                          "DTensor cannot expand the TensorList ops of a While loop"))
        generator = getattr(layer, "_random_generator", None)
        draws_masks = "Dropout" in kind or hasattr(layer, "recurrent_dropout")  # Dropout layers, RNN cells
        if draws_masks and hasattr(generator, "dropout") and step is not None \
                and type(generator).__name__ != "StepSeededDropout":
            layer._random_generator = step_seeded_dropout(generator, step)  # pylint: disable=protected-access
            changes.append(Transformation(path, "stateless dropout seeded per step",
                                          "DTensor refuses stateful random ops (RandomUniform)"))
    if export_lib.install(model):
        changes.append(Transformation(model.name, "SavedModel export from a one-device copy",
                                      "a SavedModel traced on the mesh holds Relayout ops and DTensor variables, "
                                      "which one device and TF Serving cannot run"))
    return changes


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


def update_moving_averages(optimizer) -> bool:
    """Make a tf-keras optimizer with ``use_ema=True`` keep its moving averages under DTensor.

    tf-keras applies gradients on its DTensor path (the one a strategy's optimizer
    takes) through the base class, which never updates the averages; ``fit`` still
    ends by overwriting every weight with its average, so the whole run was lost:
    the model returned to its initial weights (measured). After the base update this
    runs what tf-keras' distributed path runs after it: each average moves toward its
    weight, and every ``ema_overwrite_frequency`` steps the weights take the averages.
    True when it changed the optimizer.
    """
    if (not getattr(optimizer, "use_ema", False) or not type(optimizer).__module__.startswith("tf_keras")
            or getattr(optimizer, "_tofu_updates_averages", False)):
        return False
    apply = optimizer._internal_apply_gradients  # pylint: disable=protected-access

    def apply_then_average(grads_and_vars):
        if not optimizer._run_with_dtensor:                # pylint: disable=protected-access
            return apply(grads_and_vars)                   # the distributed path averages itself
        grads_and_vars = list(grads_and_vars)
        step = optimizer.iterations + 1                    # read before this step's increment, as tf-keras does
        iteration = apply(grads_and_vars)
        weights = [variable for _, variable in grads_and_vars]
        optimizer._update_model_variables_moving_average(weights)  # pylint: disable=protected-access
        if optimizer.ema_overwrite_frequency:
            # The averages are read here, not inside the cond's branch: a read in the
            # branch's graph does not see this step's write (DTensor orders it first).
            averages = [tf.identity(_moving_average(optimizer, weight)) for weight in weights]

            def overwrite():
                for weight, average in zip(weights, averages):
                    weight.assign(average)
            tf.cond(tf.equal(step % optimizer.ema_overwrite_frequency, 0), overwrite, lambda: None)
        return iteration

    optimizer._internal_apply_gradients = apply_then_average  # pylint: disable=protected-access
    optimizer._tofu_updates_averages = True  # pylint: disable=protected-access
    return True


def relayout_gradients(optimizer) -> bool:
    """Make ``optimizer`` take each dense gradient in its variable's layout.

    DTensor's layout propagation is a fixed point over producers and consumers; where
    it does not converge it locks what it has, and a kernel gradient's ``Sum`` over
    the batch can be asked for an output split on another dim than its input (Gemma's
    MLP kernels under a Megatron plan: input split on the kernel's rows, the optimizer's
    update asking for its columns). DTensor's reduce expander only splits further
    (``EmitAllScatter ... was not more sharded than the original_layout``), so the first
    step fails. An explicit relayout to the variable's layout between the gradient and
    the update ends the chain of requests there: the ``Sum`` keeps the layout its input
    gives, and the relayout converts it (an identity where the layouts already agree).
    Installed on the optimizer instance, so custom training loops that call
    ``apply_gradients`` themselves get it too. True when it changed the optimizer.
    """
    if optimizer is None or getattr(optimizer, "_tofu_relayouts_gradients", False):
        return False
    from tensorflow.experimental import dtensor

    def relaid(gradient, variable):
        layout = getattr(backing_variable(variable), "layout", None)
        if layout is None or not isinstance(gradient, tf.Tensor):   # None, IndexedSlices, before the plan
            return gradient
        return dtensor.relayout(gradient, layout)

    module = type(optimizer).__module__
    if module.startswith("keras") and hasattr(optimizer, "apply"):        # Keras 3: apply_gradients calls apply
        apply = optimizer.apply

        def apply_in_variable_layouts(grads, trainable_variables=None):
            grads = list(grads)
            # apply(grads) on a built optimizer updates the variables it was built for, in order.
            variables = trainable_variables if trainable_variables is not None \
                else optimizer._trainable_variables  # pylint: disable=protected-access
            if variables is not None and len(variables) == len(grads):
                grads = [relaid(g, v) for g, v in zip(grads, variables)]
            return apply(grads, trainable_variables)
        optimizer.apply = apply_in_variable_layouts
    elif module.startswith("tf_keras") and hasattr(optimizer, "apply_gradients"):
        apply_gradients = optimizer.apply_gradients

        def apply_gradients_in_variable_layouts(grads_and_vars, *args, **kwargs):
            pairs = [(relaid(keras_adapter.legacy_dense_gradient(optimizer, g, v), v), v) for g, v in grads_and_vars]
            return apply_gradients(pairs, *args, **kwargs)
        optimizer.apply_gradients = apply_gradients_in_variable_layouts
    else:
        return False
    optimizer._tofu_relayouts_gradients = True  # pylint: disable=protected-access
    return True


def summarize_unplanned_weights() -> None:
    """Let tf-keras ``model.summary()`` run before the plan exists.

    Under a strategy with a mesh, tf-keras ends the summary with the weights' per-device
    sizes by sharding spec, and divides by their sum: with every weight still waiting
    for its layout (no DTensor variable yet) that sum is 0 and ``summary()`` raised
    ZeroDivisionError, the first thing many scripts call after ``compile``. Then
    the summary says when the layouts are chosen instead; once they are, tf-keras'
    own lines. Installed once per process, once tf-keras is imported (a Keras 3 user
    does not pay its import); other models' summaries are unchanged.
    """
    if "tf_keras" not in sys.modules:
        return
    from tf_keras.src.utils import layer_utils
    original = layer_utils.print_dtensor_variable_summary
    if getattr(original, "_tofu_wrapped", False):
        return

    def print_dtensor_variable_summary(model, print_fn, line_length):
        unplanned = not any(isinstance(w, tf.experimental.dtensor.DVariable) for w in model.weights)
        if not (unplanned and type(getattr(model, "distribute_strategy", None)).__name__ == "TofuStrategy"):
            return original(model, print_fn, line_length)
        print_fn("Layouts: none yet; TofuStrategy plans them at the first fit/evaluate/predict "
                 "(or strategy.plan_model)")
        print_fn("_" * line_length)
        return None

    print_dtensor_variable_summary._tofu_wrapped = True
    layer_utils.print_dtensor_variable_summary = print_dtensor_variable_summary


def _moving_average(optimizer, weight):
    # pylint: disable=protected-access
    return optimizer._model_variables_moving_average[optimizer._index_dict[optimizer._var_key(weight)]]


def step_seeded_dropout(generator, step):
    """A replacement for a tf-keras Dropout's random generator: ``StepSeededDropout``."""
    return _step_seeded_dropout_class()(generator, step)


@functools.lru_cache(maxsize=None)
def _step_seeded_dropout_class():
    from tf_keras.src import backend  # the generator tf-keras layers hold; imported when a model has one

    class StepSeededDropout(backend.RandomGenerator):
        """A tf-keras Dropout's mask, drawn by a stateless op seeded per training step.

        tf-keras draws the mask with a stateful op (``RandomUniform``), which DTensor
        refuses. This draws it with ``stateless_dropout`` from (the layer's seed, the
        optimizer's step count, the call's place in the traced step): a new mask every
        step and for every call of a shared layer, from an op DTensor lays out like any
        other. Under a sharded layout DTensor folds each device's coordinates into the
        seed, so the masks are not one device's masks; they are independent draws at
        the layer's rate all the same. It keeps the replaced generator's type, so the
        layer's config (and a model saved from it) is unchanged.
        """

        def __init__(self, replaced, step):
            super().__init__(replaced._create_seed(replaced._seed), rng_type=replaced._rng_type)  # pylint: disable=protected-access
            self._read_step = lambda: step  # a closure: the step is not a tracked child of the layer
            self.calls = 0

        def _maybe_init(self):
            self._built = True  # no generator state: the seed is all this needs

        def dropout(self, inputs, rate, noise_shape=None):
            self.calls += 1
            seed = tf.stack([tf.constant(self._seed, tf.int64), tf.cast(self._read_step(), tf.int64)])
            seed = tf.random.experimental.stateless_fold_in(seed, self.calls)
            return tf.nn.experimental.stateless_dropout(inputs, rate, seed=seed, noise_shape=noise_shape)

    return StepSeededDropout


def _unfuse_batch_norm(layer) -> None:
    """Switch a BatchNormalization to its unfused ops, keeping the fused kernel's
    moving-variance update: the fused op averages the *unbiased* batch
    variance (Bessel's n/(n-1)) into ``moving_variance``, the unfused path the
    biased one, which would drift by about 1/n per step."""
    layer.fused = False
    moments, assign = layer._moments, layer._assign_moving_average  # pylint: disable=protected-access
    counts = {}

    def counting_moments(inputs, reduction_axes, keep_dims, mask=None):
        counts["n"] = tf.cast(tf.reduce_prod(tf.gather(tf.shape(inputs), reduction_axes)), inputs.dtype)
        return moments(inputs, reduction_axes, keep_dims, mask=mask)

    def bessel_assign(variable, value, momentum, inputs_size):
        if variable is layer.moving_variance and "n" in counts:
            n = tf.cast(counts["n"], value.dtype)
            value = value * n / tf.maximum(n - 1.0, 1.0)
        return assign(variable, value, momentum, inputs_size)

    layer._moments = counting_moments  # pylint: disable=protected-access
    layer._assign_moving_average = bessel_assign  # pylint: disable=protected-access


def _non_overlapping(layer) -> bool:
    return (tuple(layer.pool_size) == tuple(layer.strides) and layer.padding == "valid"
            and layer.data_format == "channels_last")


def _mean_pool_2d(layer, inputs):
    """Non-overlapping VALID average pooling, written with ops DTensor expands."""
    ph, pw = layer.pool_size
    _, height, width, channels = inputs.shape
    rows, cols = height // ph, width // pw
    x = inputs[:, : rows * ph, : cols * pw, :]
    x = tf.reshape(x, [-1, rows, ph, cols, pw, channels])
    return tf.reduce_mean(x, axis=[2, 4])


def _refuse_unrollable(path: str, layer) -> None:
    """tf-keras' convolutional RNNs (ConvLSTM1D/2D/3D) run their recurrence as a ``While``
    loop over TensorLists, which DTensor cannot expand, and cannot be unrolled: their
    ``call`` never passes ``unroll`` on. Refused before the first step, not left to fail
    inside DTensor with its own text."""
    if any(cls.__name__ == "ConvRNN" and cls.__module__.startswith("tf_keras.") for cls in type(layer).__mro__):
        raise keras_adapter.UnsupportedModelError(
            f"layer {path!r} ({type(layer).__name__}) runs its recurrence as a While loop over TensorLists, "
            "which DTensor cannot partition, and tf-keras' convolutional RNNs cannot be unrolled "
            "(unroll=True is refused by the layer). Use Keras 3's "
            f"keras.layers.{type(layer).__name__} (it unrolls with a static sequence length), or apply the "
            "convolution per step (keras.layers.TimeDistributed) before an LSTM; or train this model "
            "without TofuStrategy.")


def _unroll(layer, timesteps) -> None:
    if timesteps is None:
        raise ValueError(
            f"recurrent layer {layer.name!r} has no static sequence length, so TofuStrategy cannot "
            "unroll it for DTensor. Give the model a fixed input shape, e.g. keras.Input((timesteps, features)).")
    _config_reports_user_value(layer, "unroll", layer.unroll)
    layer.unroll = True
    if hasattr(layer, "_could_use_gpu_kernel"):
        layer._could_use_gpu_kernel = False  # pylint: disable=protected-access


def _config_reports_user_value(layer, key: str, value) -> None:
    """Keep ``layer.get_config()[key]`` at the user's ``value`` after the strategy changes it.

    A rewrite for DTensor (an RNN's ``unroll``) is how the strategy runs the layer, not
    what the user built: a saved model (a ``.keras`` file, a SavedModel's metadata, the
    one-device copy ``tofu_tf.strategies.export`` rebuilds from the config) must say what one
    device would, or a model loaded from it would run differently (an unrolled loop
    takes only its static sequence length).
    """
    get_config = layer.get_config

    def user_config():
        config = get_config()
        if key in config:
            config[key] = value
        return config
    layer.get_config = user_config


def _timesteps(layer) -> int | None:
    """A sequence layer's static number of steps (dim 1 of its input), or None."""
    try:
        inputs = layer.input  # the symbolic input of a functional model's layer
        if isinstance(inputs, (list, tuple)):  # Keras 3 lists a mask passed along (Embedding(mask_zero=True))
            inputs = inputs[0]
        return inputs.shape[1]
    except (AttributeError, ValueError):
        spec = layer.input_spec
        spec = spec[0] if isinstance(spec, (list, tuple)) else spec
        return spec.shape[1] if spec is not None and getattr(spec, "shape", None) else None


def _wrapped_timesteps(layers) -> dict[int, int | None]:
    """Steps of the recurrent layers a wrapper runs (Bidirectional's forward and backward
    layers), by id: called inside the wrapper, they have no symbolic input of their own."""
    steps = {}
    for layer in layers:
        inner = [getattr(layer, name, None) for name in ("forward_layer", "backward_layer")]
        for wrapped in (w for w in inner if w is not None):
            steps[id(wrapped)] = _timesteps(layer)
    return steps


def relayout_layer_inputs(model, kernel_specs, batch_axis, mesh) -> list[str]:
    """Give each sharded Dense and EinsumDense layer and each convolution its input in the layout
    the plan priced. ``kernel_specs(kernel)``: the kernel's sharding specs as it is computed with
    (None where no split needs a hint).

    DTensor propagates activation layouts op by op from whatever reaches it, and
    some expanders refuse a mismatch instead of converting. A Dense layer whose
    kernel rows are split on one mesh axis, fed an output split on another: the
    MatMul expander refuses the contraction; its input goes to (batch on the
    plan's batch axis, features on the kernel's row axis). An EinsumDense layer
    (keras-hub's attention projections) likewise: each input dim its equation
    contracts with the kernel goes to the kernel's axis for that dim, the leading
    dim to the batch axis where the kernel does not use it. A convolution fed an
    input with split channels (a Conv1D after a feature-split Embedding): the
    convolution expander refuses it; the lowering target runs convolutions
    batch-split or replicated (``tofu_tf.search.targets``), so its input goes to
    (batch on the batch axis, nothing else split). Either way the conversion is
    the one the plan priced, made explicit.
    """
    from tensorflow.experimental import dtensor

    hinted = []
    for path, layer in layer_paths(model):
        if getattr(layer, "_tofu_hinted", False):
            continue
        contraction = _einsum_contraction(layer, kernel_specs) if type(layer).__name__ == "EinsumDense" else None
        if contraction is not None:
            hinted_call = _relayout_einsum_input(layer.call, contraction, batch_axis, mesh, dtensor)
        else:
            feature_axis = _input_feature_axis(layer, kernel_specs, dtensor)
            if feature_axis is None:
                continue
            hinted_call = _relayout_first_argument(layer.call, feature_axis, batch_axis, mesh, dtensor)
        if type(layer).__name__ in _CONVOLUTIONS:
            hinted_call = _relayout_output_gradient(hinted_call, batch_axis, mesh, dtensor)
        layer.call = types.MethodType(hinted_call, layer)
        layer._tofu_hinted = True  # pylint: disable=protected-access
        hinted.append(path)
    return hinted


_CONVOLUTIONS = frozenset({"Conv1D", "Conv2D", "Conv3D", "DepthwiseConv1D", "DepthwiseConv2D", "SeparableConv1D",
                           "SeparableConv2D", "Conv1DTranspose", "Conv2DTranspose", "Conv3DTranspose"})


def _input_feature_axis(layer, kernel_specs, dtensor):
    """The mesh axis (or UNSHARDED) the layer's input features must be on; None: no hint."""
    kind = type(layer).__name__
    if kind in _CONVOLUTIONS:
        return dtensor.UNSHARDED
    kernel = getattr(layer, "kernel", None) if kind == "Dense" else None
    specs = kernel_specs(kernel) if kernel is not None else None
    if not specs or specs[0] in (None, dtensor.UNSHARDED):
        return None
    return specs[0]


def _einsum_contraction(layer, kernel_specs):
    """For a Dense or EinsumDense layer whose kernel is split: its equation's input, kernel and
    output letters (Dense: ``...i,ij->...j``, the leading letters filled in at call time), the
    kernel's specs, and the axes it uses. None for any other layer, a replicated kernel, or an
    equation with an ellipsis."""
    kind = type(layer).__name__
    if kind not in ("Dense", "EinsumDense") or getattr(layer, "kernel", None) is None:
        return None
    if kind == "Dense":
        inputs, kernel_letters, outputs = "...i", "ij", "...j"
    else:
        equation = str(getattr(layer, "equation", ""))
        if "." in equation or "," not in equation or "->" not in equation:
            return None
        (inputs, kernel_letters), outputs = equation.split("->")[0].split(","), equation.split("->")[1]
    specs = kernel_specs(layer.kernel)
    if not specs or len(specs) != len(kernel_letters) or all(a in (None, "unsharded") for a in specs):
        return None
    return inputs, kernel_letters, outputs, tuple(specs)


def _letters(pattern: str, rank: int) -> str:
    """``pattern``'s letters for a tensor of ``rank`` dims (Dense's ``...`` filled in)."""
    return "abcdefgh"[:rank - len(pattern) + 3] + pattern[3:] if pattern.startswith("...") else pattern


def _contraction_spec(letters, kernel_letters, specs, shape, batch_axis, mesh, dtensor):
    """Each dim on the kernel's axis for its letter, the leading dim on the batch axis (where the
    kernel does not use that axis and it divides the batch), the rest unsplit."""
    used = {a for a in specs if a not in (None, "unsharded")}
    spec = [dtensor.UNSHARDED] * len(letters)
    for i, letter in enumerate(letters):
        if letter in kernel_letters and specs[kernel_letters.index(letter)] not in (None, "unsharded"):
            spec[i] = specs[kernel_letters.index(letter)]
    if spec[0] == dtensor.UNSHARDED and batch_axis is not None and batch_axis not in used and len(letters) > 1 \
            and shape[0] is not None and shape[0] % mesh.dim_size(batch_axis) == 0:
        spec[0] = batch_axis
    return spec


def _relayout_einsum_input(call, contraction, batch_axis, mesh, dtensor):
    """``call`` with its input relaid out as the kernel contracts it, and its output's gradient
    as the kernel produces it (the backward contraction, dX = dY . W^T, meets the same refusal)."""
    inputs_pattern, kernel_letters, outputs_pattern, specs = contraction

    def hinted_call(self, inputs, *args, **kwargs):
        del self
        letters = _letters(inputs_pattern, inputs.shape.rank)
        if inputs.shape.rank != len(letters):
            return call(inputs, *args, **kwargs)
        spec = _contraction_spec(letters, kernel_letters, specs, inputs.shape, batch_axis, mesh, dtensor)
        outputs = call(dtensor.relayout(inputs, dtensor.Layout(spec, mesh)), *args, **kwargs)
        if not isinstance(outputs, tf.Tensor) or outputs.shape.rank is None:
            return outputs
        out_letters = _letters(outputs_pattern, outputs.shape.rank)
        if len(out_letters) != outputs.shape.rank:
            return outputs
        layout = dtensor.Layout(_contraction_spec(out_letters, kernel_letters, specs, outputs.shape, batch_axis,
                                                  mesh, dtensor), mesh)

        @tf.custom_gradient
        def identity(x):
            return tf.identity(x), lambda dy: dtensor.relayout(tf.convert_to_tensor(dy), layout)
        return identity(outputs)
    return hinted_call


def _batch_spec(shape, batch_axis, mesh, dtensor) -> list:
    """Batch dim on the batch axis when it divides, every other dim unsplit."""
    spec = [dtensor.UNSHARDED] * shape.rank
    if batch_axis is not None and shape.rank > 1 and shape[0] is not None \
            and shape[0] % mesh.dim_size(batch_axis) == 0:
        spec[0] = batch_axis
    return spec


def _relayout_output_gradient(call, batch_axis, mesh, dtensor):
    """``call`` whose output's gradient arrives batch-split or replicated.

    DTensor's layout propagation carries a feature split of later layers back
    through reshapes into the gradient of a convolution's output (a ViT's patch
    embedding), and DTensor's Conv2DBackpropFilter expander refuses any layout but
    batch-parallel ones. The target prices that gradient batch-split or
    replicated; the relayout is that conversion, made explicit."""
    def with_gradient_relaid(*args, **kwargs):
        outputs = call(*args, **kwargs)
        if not isinstance(outputs, tf.Tensor) or outputs.shape.rank is None:
            return outputs
        layout = dtensor.Layout(_batch_spec(outputs.shape, batch_axis, mesh, dtensor), mesh)

        @tf.custom_gradient
        def identity(x):
            return tf.identity(x), lambda dy: dtensor.relayout(tf.convert_to_tensor(dy), layout)
        return identity(outputs)
    return with_gradient_relaid


def _relayout_first_argument(call, row_axis, batch_axis, mesh, dtensor):
    def hinted_call(self, inputs, *args, **kwargs):
        del self
        rank = inputs.shape.rank
        spec = [dtensor.UNSHARDED] * rank
        spec[-1] = row_axis
        if batch_axis is not None and batch_axis != row_axis and rank > 1 \
                and inputs.shape[0] is not None and inputs.shape[0] % mesh.dim_size(batch_axis) == 0:
            spec[0] = batch_axis            # a batch the axis does not divide runs replicated
        return call(dtensor.relayout(inputs, dtensor.Layout(spec, mesh)), *args, **kwargs)
    return hinted_call
