"""The changes the strategy makes to its model's layers, so DTensor can expand them.

Each function changes layers of the model it is given and returns what it changed as
``Applied`` records of the registered changes (``tofu_tf.tf.compat.registry``):

* ``batch_norm_unfused``, ``layer_norm_unfused``, ``normalization_centered``: tf-keras runs
  BatchNormalization and LayerNormalization through ``FusedBatchNormV3``, which DTensor has no
  layout propagation for; the unfused formulation (moments + batch_normalization, the mean
  subtracted first as the fused kernel does) computes the same (``tofu_tf.tf.compat.normalization``).
* ``batch_norm_global_moments``: tf-keras computes a BatchNormalization's statistics per replica
  group under a strategy with a mesh; the strategy's layers compute them over the batch as one
  device does, with one device's ops (``tofu_tf.tf.compat.normalization``).
* ``average_pool_as_mean``: non-overlapping average pooling as reshape + mean (no ``AvgPoolGrad``).
* ``average_pool_as_window_sum``: the other average pooling (overlapping windows, ``"same"``
  padding) as a sum of strided slices over each window's count (``tofu_tf.tf.compat.windows``).
* ``depthwise_as_grouped_conv``: depthwise and separable convolutions as grouped convolutions
  (``tofu_tf.tf.compat.depthwise``: no ``DepthwiseConv2dNativeBackpropFilter``).
* ``rnn_unrolled``: Keras runs a recurrence as a ``While`` loop over a TensorList, which
  DTensor cannot expand; with a static sequence length the loop is unrolled (``unroll=True``),
  the same cell applied per step.
* ``dropout_step_seeded``: tf-keras draws Dropout masks (SpatialDropout's, and LSTM/GRU/SimpleRNN
  cells' dropout) with a stateful random op, which DTensor refuses; ``step_seeded_dropout``
  draws them statelessly, seeded by the optimizer's step count (a compiled model's) and the
  call's place in the traced step, the same masks whatever the plan (``random_draws``).
* ``input_relayout_hints``: once the plan exists, sharded Dense layers and convolutions take
  their input in the layout the plan priced (``relayout_layer_inputs``).
* ``statistics_input_relayout``: once the plan exists, a tf-keras BatchNormalization whose batch
  statistics the plan computes whole takes its moments' input replicated
  (``relayout_statistics_inputs``).

None changes the layer's math. Sparse (Embedding) gradients are densified in the variables
instead (``tofu_tf.tf.variables.TofuVariable.scatter_add``).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import types
import weakref

import tensorflow as tf

from tofu_tf.tf import keras_adapter
from tofu_tf.tf.compat import depthwise, normalization, windows
from tofu_tf.tf.compat.registry import Applied, change


def prepare_layers(model) -> list[Applied]:
    """Rewrite the layers of ``model`` DTensor cannot expand as written (the module docstring's
    list), without changing their math; what was changed, layer by layer."""
    changes = []
    step = getattr(getattr(model, "optimizer", None), "iterations", None)
    paths = keras_adapter.layer_paths(model)
    wrapped_steps = _wrapped_timesteps([layer for _, layer in paths])
    for path, layer in paths:
        kind = type(layer).__name__
        if getattr(layer, "fused", False) is True and "BatchNormalization" in kind:
            normalization.unfuse_batch_norm(layer)
            changes.append(Applied(change("batch_norm_unfused"), path, "fused=False"))
            normalization.center_normalization(layer)
            changes.append(Applied(change("normalization_centered"), path, "the mean subtracted first"))
        if ("BatchNormalization" in kind and type(layer).__module__.startswith("tf_keras")
                and normalization.compute_global_moments(layer)):
            changes.append(Applied(change("batch_norm_global_moments"), path, "moments over the whole batch"))
        if getattr(layer, "_fused", False) is True and "LayerNormalization" in kind:
            layer._fused = False  # pylint: disable=protected-access
            changes.append(Applied(change("layer_norm_unfused"), path, "fused=False"))
            normalization.center_normalization(layer)
            changes.append(Applied(change("normalization_centered"), path, "the mean subtracted first"))
        if kind in ("AveragePooling2D", "AvgPool2D") and _non_overlapping(layer):
            layer.call = types.MethodType(_mean_pool_2d, layer)
            changes.append(Applied(change("average_pool_as_mean"), path, "pooling as reshape+mean"))
        elif (window_sum := windows.rewrite_average_pool(path, layer)) is not None:
            changes.append(window_sum)
        grouped = depthwise.rewrite_depthwise(path, layer)
        if grouped is not None:
            changes.append(grouped)
        if hasattr(layer, "unroll") and hasattr(layer, "cell") and not layer.unroll:
            _refuse_unrollable(path, layer)
            _unroll(layer, wrapped_steps[id(layer)] if id(layer) in wrapped_steps else _timesteps(layer))
            changes.append(Applied(change("rnn_unrolled"), path, "unroll=True"))
        generator = getattr(layer, "_random_generator", None)
        draws_masks = "Dropout" in kind or hasattr(layer, "recurrent_dropout")  # Dropout layers, RNN cells
        if draws_masks and hasattr(generator, "dropout") and step is not None \
                and type(generator).__name__ != "StepSeededDropout":
            layer._random_generator = step_seeded_dropout(generator, step)  # pylint: disable=protected-access
            changes.append(Applied(change("dropout_step_seeded"), path, "stateless dropout seeded per step"))
    return changes


def step_seeded_dropout(generator, step):
    """A replacement for a tf-keras Dropout's random generator: ``StepSeededDropout``."""
    return _step_seeded_dropout_class()(generator, step)


def same_masks_in_copy(model, copy, step) -> list[Applied]:
    """Give ``copy`` (a one-device copy of ``model``, ``TofuStrategy.check_numerics``'s) the
    masks ``model`` draws under the strategy: each of its layers whose counterpart in ``model``
    draws step-seeded masks draws them too, from the same seed and ``step`` (the copy's
    optimizer step count, which starts where the model's is). On one device the mask is drawn
    whole, as the strategy draws it unsplit, so both sides drop the same units."""
    changes = []
    for (path, layer), (_, twin) in zip(keras_adapter.layer_paths(model), keras_adapter.layer_paths(copy)):
        generator = getattr(layer, "_random_generator", None)
        if type(generator).__name__ == "StepSeededDropout" and hasattr(getattr(twin, "_random_generator", None), "dropout"):
            twin._random_generator = step_seeded_dropout(generator, step)  # pylint: disable=protected-access
            changes.append(Applied(change("dropout_step_seeded"), path, "the copy's masks seeded as the model's"))
    return changes


@functools.lru_cache(maxsize=None)
def _step_seeded_dropout_class():
    from tf_keras.src import backend  # the generator tf-keras layers hold; imported when a model has one

    class StepSeededDropout(backend.RandomGenerator):
        """A tf-keras Dropout's mask, drawn by a stateless op seeded per training step.

        tf-keras draws the mask with a stateful op (``RandomUniform``), which DTensor
        refuses. This draws it with ``stateless_dropout`` from (the layer's seed, the
        optimizer's step count, the call's place in the traced step): a new mask every
        step and for every call of a shared layer, from an op DTensor lays out like any
        other; in a strategy step its noise is drawn unsplit (the change
        "stateless_draws_replicated"), so the masks are the same whatever the plan and the
        device count. They are not a plain tf-keras run's masks (a stateful stream) and
        cannot be. The call's place counts the calls within one traced graph: counted
        over the generator's life it depended on how often the step had been traced (a
        planning capture, a retrace), so the same step drew other masks. It keeps the
        replaced generator's type, so the layer's config (and a model saved from it) is unchanged.
        """

        def __init__(self, replaced, step):
            super().__init__(replaced._create_seed(replaced._seed), rng_type=replaced._rng_type)  # pylint: disable=protected-access
            self._read_step = lambda: step  # a closure: the step is not a tracked child of the layer
            self._calls = weakref.WeakKeyDictionary()   # graph -> calls traced into it

        def _maybe_init(self):
            self._built = True  # no generator state: the seed is all this needs

        def _next_call(self) -> int:
            graph = tf.compat.v1.get_default_graph()
            self._calls[graph] = self._calls.get(graph, 0) + 1
            return self._calls[graph]

        def dropout(self, inputs, rate, noise_shape=None):
            seed = tf.stack([tf.constant(self._seed, tf.int64), tf.cast(self._read_step(), tf.int64)])
            seed = tf.random.experimental.stateless_fold_in(seed, self._next_call())
            return tf.nn.experimental.stateless_dropout(inputs, rate, seed=seed, noise_shape=noise_shape)

    return StepSeededDropout


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


def relayout_layer_inputs(model, kernel_specs, batch_axis, mesh) -> list[Applied]:
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
    dim to the batch axis where the kernel does not use it, and its output's
    gradient to the layout the kernel produces. A convolution fed an
    input with split channels (a Conv1D after a feature-split Embedding): the
    convolution expander refuses it; the lowering target runs convolutions
    batch-split or replicated (``tofu_tf.search.targets``), so its input goes to
    (batch on the batch axis, nothing else split). Either way the conversion is
    the one the plan priced, made explicit. The change "input_relayout_hints", one record per layer.
    """
    from tensorflow.experimental import dtensor

    hinted = []
    for path, layer in keras_adapter.layer_paths(model):
        if getattr(layer, "_tofu_hinted", False):
            continue
        contraction = _einsum_contraction(layer, kernel_specs) if type(layer).__name__ == "EinsumDense" else None
        if contraction is not None:
            hinted_call = _relayout_einsum_input(layer.call, contraction, batch_axis, mesh, dtensor)
            detail = f"input and output gradient as the kernel {contraction[3]} contracts ({layer.equation})"
        else:
            feature_axis = _input_feature_axis(layer, kernel_specs, dtensor)
            if feature_axis is None:
                continue
            hinted_call = _relayout_first_argument(layer.call, feature_axis, batch_axis, mesh, dtensor)
            if type(layer).__name__ in _CONVOLUTIONS:
                hinted_call = _relayout_output_gradient(hinted_call, batch_axis, mesh, dtensor)
            detail = "input batch-split or replicated, output gradient too" \
                if type(layer).__name__ in _CONVOLUTIONS else f"input features on {feature_axis!r}"
        layer.call = types.MethodType(hinted_call, layer)
        layer._tofu_hinted = True  # pylint: disable=protected-access
        hinted.append(Applied(change("input_relayout_hints"), path, detail))
    return hinted


def relayout_statistics_inputs(model, op_strategies, mesh) -> list[Applied]:
    """Give each tf-keras BatchNormalization whose batch statistics the plan computes whole (its
    ``moments/mean`` op "replicate" on every mesh axis) its moments' input replicated.

    The plan may gather a normalization's input once and compute the mean and variance on every
    device rather than all-reduce two partial sums: on a link that charges its latency per
    collective (the CPU profile) one gather is the cheaper step. The lowering pins layouts at
    layer inputs only, and inside the layer DTensor carries the input's batch split into the
    moments and all-reduces their partial sums: not the plan. The relayout makes the gather the
    plan priced explicit; the normalization itself still reads the input as it comes. The
    change "statistics_input_relayout", one record per layer.

    A layer's op is found by the layer's path from the model (the step's ops are named by the
    name scopes of the calls that made them, the model's name first), never by the layer's name
    alone: a name repeats wherever blocks name their layers alike (Model Garden's ResNet: every
    residual block's ``batch_normalization``), and a layer's default name counts the layers the
    process made before, so matching names alone made what runs depend on the process's history."""
    from tensorflow.experimental import dtensor

    hinted = []
    for path, layer in keras_adapter.layer_paths(model):
        if type(layer).__module__.split(".")[0] != "tf_keras" or not hasattr(layer, "_moments") \
                or getattr(layer, "_tofu_statistics_hinted", False):
            continue
        found = _ops_of(op_strategies, f"{model.name}/{path}/moments/mean")
        if len(found) != 1 or any(strategy != "replicate" for strategy in op_strategies[found[0]]):
            continue
        moments = layer._moments  # pylint: disable=protected-access

        def replicated_moments(inputs, reduction_axes, keep_dims, mask=None, moments=moments):
            whole = dtensor.relayout(inputs, dtensor.Layout.replicated(mesh, rank=inputs.shape.rank))
            return moments(whole, reduction_axes, keep_dims, mask=mask)
        layer._moments = replicated_moments  # pylint: disable=protected-access
        layer._tofu_statistics_hinted = True  # pylint: disable=protected-access
        hinted.append(Applied(change("statistics_input_relayout"), path, "batch statistics from the input replicated"))
    return hinted


def _ops_of(op_strategies, scoped_name) -> list[str]:
    """The ops of the plan named ``scoped_name``, under whatever scopes enclose the model's call
    (a loop's body, a train step's)."""
    return [name for name in op_strategies if name == scoped_name or name.endswith("/" + scoped_name)]


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
    """For an EinsumDense layer whose kernel is split: its equation's input, kernel and output
    letters and the kernel's specs. None for a replicated kernel or an equation with an ellipsis."""
    equation = str(getattr(layer, "equation", ""))
    if getattr(layer, "kernel", None) is None or "." in equation or "," not in equation or "->" not in equation:
        return None
    (inputs, kernel_letters), outputs = equation.split("->")[0].split(","), equation.split("->")[1]
    specs = kernel_specs(layer.kernel)
    if not specs or len(specs) != len(kernel_letters) or all(a in (None, "unsharded") for a in specs):
        return None
    return inputs, kernel_letters, outputs, tuple(specs)


_BATCH_WHOLE = contextvars.ContextVar("tofu_batch_whole", default=False)


@contextlib.contextmanager
def batch_whole():
    """Within it, the layer-input hints split no batch: they keep only the kernel's axes.

    For programs whose batch the plan does not lay out: keras-hub's decoding loop (its prompts go
    replicated, ``tofu_tf.strategies.generation``) makes tensors of a dynamic batch size, and a
    hint splitting one over the batch axis is a slice DTensor cannot make ("requires slice on
    input axis 0 which is dynamic") or a gather of it it cannot size."""
    token = _BATCH_WHOLE.set(True)
    try:
        yield
    finally:
        _BATCH_WHOLE.reset(token)


def _batch_axis_now(batch_axis):
    return None if _BATCH_WHOLE.get() else batch_axis


def _contraction_spec(letters, kernel_letters, specs, shape, batch_axis, mesh, dtensor):
    """Each dim on the kernel's axis for its letter, the leading dim on the batch axis (where the
    kernel does not use that axis and it divides the batch), the rest unsplit."""
    used = {a for a in specs if a not in (None, "unsharded")}
    spec = [dtensor.UNSHARDED] * len(letters)
    for i, letter in enumerate(letters):
        if letter in kernel_letters and specs[kernel_letters.index(letter)] not in (None, "unsharded"):
            spec[i] = specs[kernel_letters.index(letter)]
    batch_axis = _batch_axis_now(batch_axis)
    if spec[0] == dtensor.UNSHARDED and batch_axis is not None and batch_axis not in used and len(letters) > 1 \
            and shape[0] is not None and shape[0] % mesh.dim_size(batch_axis) == 0:
        spec[0] = batch_axis
    return spec


def _relayout_einsum_input(call, contraction, batch_axis, mesh, dtensor):
    """``call`` with its input relaid out as the kernel contracts it, and its output's gradient
    as the kernel produces it (the backward contraction, dX = dY . W^T, meets the same refusal)."""
    letters, kernel_letters, out_letters, specs = contraction

    def hinted_call(self, inputs, *args, **kwargs):
        del self
        if inputs.shape.rank != len(letters):
            return call(inputs, *args, **kwargs)
        spec = _contraction_spec(letters, kernel_letters, specs, inputs.shape, batch_axis, mesh, dtensor)
        outputs = call(dtensor.relayout(inputs, dtensor.Layout(spec, mesh)), *args, **kwargs)
        if not isinstance(outputs, tf.Tensor) or outputs.shape.rank != len(out_letters):
            return outputs
        return _gradient_in(outputs, dtensor.Layout(
            _contraction_spec(out_letters, kernel_letters, specs, outputs.shape, batch_axis, mesh, dtensor), mesh),
            dtensor)
    return hinted_call


def _gradient_in(outputs, layout, dtensor):
    """``outputs`` unchanged, its gradient relaid out to ``layout`` on the way back."""
    @tf.custom_gradient
    def identity(x):
        return tf.identity(x), lambda dy: dtensor.relayout(tf.convert_to_tensor(dy), layout)
    return identity(outputs)


def _batch_spec(shape, batch_axis, mesh, dtensor) -> list:
    """Batch dim on the batch axis when it divides, every other dim unsplit."""
    spec = [dtensor.UNSHARDED] * shape.rank
    batch_axis = _batch_axis_now(batch_axis)
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
        return _gradient_in(outputs, dtensor.Layout(_batch_spec(outputs.shape, batch_axis, mesh, dtensor), mesh),
                            dtensor)
    return with_gradient_relaid


def _relayout_first_argument(call, row_axis, batch_axis, mesh, dtensor):
    def hinted_call(self, inputs, *args, **kwargs):
        del self
        rank = inputs.shape.rank
        spec = [dtensor.UNSHARDED] * rank
        spec[-1] = row_axis
        batch = _batch_axis_now(batch_axis)
        if batch is not None and batch != row_axis and rank > 1 \
                and inputs.shape[0] is not None and inputs.shape[0] % mesh.dim_size(batch) == 0:
            spec[0] = batch                 # a batch the axis does not divide runs replicated
        return call(dtensor.relayout(inputs, dtensor.Layout(spec, mesh)), *args, **kwargs)
    return hinted_call
