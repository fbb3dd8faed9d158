"""The registry: every change tofu_tf makes to TensorFlow and Keras objects, as data.

Each ``Change`` says what it replaces, where that lives in the framework (``targets``:
attribute paths a test resolves in the installed packages, so an upgrade that renames one
fails there, naming the change), how far it reaches (``Scope``), when it is undone, why it
is needed, and which packages' tested releases it was checked on (``tofu_tf.versions.TESTED``).
``site`` names the module that makes the change; the module names the change back
(``change("...")``), and ``tests/test_compat.py`` checks both directions, and that
docs/compatibility.md lists every entry.

``CHANGES`` is a plain tuple: nothing registers itself at import. This module imports no
TensorFlow (resolving a target imports the framework module it names).
"""

from __future__ import annotations

import dataclasses
import enum
import importlib

from tofu_tf import versions


class Scope(enum.Enum):
    """How far a change reaches, which is also when it goes away."""

    LAYER = "per layer"                  # one layer of the strategy's model, for the model's life
    MODEL = "per model"                  # the strategy's model itself
    OPTIMIZER = "per optimizer"          # the model's (or a custom loop's) optimizer
    VARIABLE = "per variable"            # the variables the strategy creates
    CAPTURE = "during capture"           # while a step is traced for planning, then restored
    CREATION = "during variable creation"  # while one variable is made, on the calling thread only
    CALL = "during a step call"          # while a step program is called, on the calling thread only
    TRACE = "while a step is traced"     # while the function passed to strategy.run is traced, its graph/thread only
    MODEL_CALL = "during a model call"   # while the strategy's model is called (traced), on the calling thread only
    PROCESS = "process-wide"             # every model in the process, while a TofuStrategy is alive
    READ = "read only"                   # a private attribute read, nothing changed


@dataclasses.dataclass(frozen=True)
class Change:
    """One change to TensorFlow or Keras objects.

    Attributes:
        name: the change's identifier (``strategy.changes``, logs and docs name it so).
        replaces: what is replaced or set, in words (``BatchNormalization.fused, ._moments``).
        targets: the framework attributes involved, as ``"module:Attribute.path"``; each must
            resolve in the installed packages (``resolve``).
        scope: how far it reaches.
        undone: when (and whether) the original comes back.
        why: what fails without it.
        packages: the distributions whose tested releases (``versions.TESTED``) it was checked on.
        site: the module that makes it.
    """

    name: str
    replaces: str
    targets: tuple[str, ...]
    scope: Scope
    undone: str
    why: str
    packages: tuple[str, ...]
    site: str

    @property
    def checked_on(self) -> str:
        """The tested releases this change was checked on, ``"tf-keras>=2.21,<2.22"``."""
        return ", ".join(f"{package}{versions.TESTED[package]}" for package in self.packages)


@dataclasses.dataclass(frozen=True)
class Applied:
    """A change made to one object: ``change`` applied to ``target`` (a layer's path in its
    model, a model's or an optimizer's name), with the value it took (``detail``)."""

    change: Change
    target: str
    detail: str = ""

    def __str__(self) -> str:
        detail = f": {self.detail}" if self.detail else ""
        return f"{self.target}: {self.change.name}{detail} ({self.change.why})"


_LIFETIME = "never: it is how the strategy runs this object, for the object's life"
_CAPTURE_ONLY = "on exit of the capture, also on error"

CHANGES: tuple[Change, ...] = (
    # -- per layer: what DTensor cannot expand, rewritten without changing the math ---------------
    Change(
        name="batch_norm_unfused",
        replaces="tf-keras BatchNormalization: fused=False; _moments and _assign_moving_average wrapped",
        targets=("tf_keras.src.layers.normalization.batch_normalization:BatchNormalizationBase._moments",
                 "tf_keras.src.layers.normalization.batch_normalization:"
                 "BatchNormalizationBase._assign_moving_average"),
        scope=Scope.LAYER, undone=_LIFETIME,
        why="DTensor has no layout propagation for FusedBatchNormV3; the unfused ops compute the same, "
            "and the wrappers keep the fused kernel's Bessel-corrected moving variance",
        packages=("tensorflow", "tf-keras"), site="tofu_tf.tf.compat.normalization"),
    Change(
        name="layer_norm_unfused",
        replaces="tf-keras LayerNormalization: _fused=False",
        targets=("tf_keras.src.layers.normalization.layer_normalization:LayerNormalization._fused_can_be_used",),
        scope=Scope.LAYER, undone=_LIFETIME,
        why="tf-keras runs LayerNormalization through FusedBatchNormV3, which DTensor cannot expand",
        packages=("tensorflow", "tf-keras"), site="tofu_tf.tf.compat.layers"),
    Change(
        name="normalization_centered",
        replaces="an unfused tf-keras BatchNormalization's or LayerNormalization's call (on the instance), under "
                 "which tf.nn.batch_normalization (through tensorflow.compat.v2, on the calling thread) subtracts "
                 "the mean before scaling",
        targets=("tf_keras.layers:BatchNormalization.call", "tf_keras.layers:LayerNormalization.call",
                 "tensorflow.compat.v2.nn:batch_normalization"),
        scope=Scope.LAYER, undone=_LIFETIME,
        why="tf.nn.batch_normalization computes x * inv + (offset - mean * inv), which in float32 loses the "
            "digits of channels whose mean is large against their spread, where the fused kernel one device "
            "runs subtracts the mean first (NASNetMobile's gradients: 53% off float64's, against 4e-5)",
        packages=("tensorflow", "tf-keras"), site="tofu_tf.tf.compat.normalization"),
    Change(
        name="batch_norm_global_moments",
        replaces="a tf-keras BatchNormalization's call (not synchronized; on the instance), under which "
                 "tf_keras's running_with_dtensor_strategy (on the calling thread) reads False",
        targets=("tf_keras.layers:BatchNormalization.call",
                 "tf_keras.src.dtensor.utils:running_with_dtensor_strategy"),
        scope=Scope.LAYER, undone=_LIFETIME,
        why="tf-keras takes the strategy for DTensor's and computes the statistics per replica group: with its "
            "one replica the global batch's values, but through a reshape, a repeat and a mean of the repeat "
            "which DTensor runs as two all-reduces and two gradient sums more a layer than one device's ops, "
            "in one combined run more than the plan priced",
        packages=("tensorflow", "tf-keras"), site="tofu_tf.tf.compat.normalization"),
    Change(
        name="average_pool_as_mean",
        replaces="AveragePooling2D.call (non-overlapping, VALID, channels_last) as reshape + mean",
        targets=("tf_keras.layers:AveragePooling2D.call", "keras.layers:AveragePooling2D.call"),
        scope=Scope.LAYER, undone=_LIFETIME,
        why="DTensor has no layout propagation for AvgPoolGrad",
        packages=("tensorflow", "tf-keras", "keras"), site="tofu_tf.tf.compat.layers"),
    Change(
        name="average_pool_as_window_sum",
        replaces="AveragePooling2D.call (overlapping or SAME, channels_last) as a sum of the window's strided "
                 "slices of the zero-padded input over each window's count of input positions",
        targets=("tf_keras.layers:AveragePooling2D.call", "keras.layers:AveragePooling2D.call"),
        scope=Scope.LAYER, undone=_LIFETIME,
        why="DTensor has no layout propagation for AvgPoolGrad (InceptionV3's and NASNet's 3x3 stride-1 "
            "poolings were refused); Pad, StridedSlice and their gradients it lays out",
        packages=("tensorflow", "tf-keras", "keras"), site="tofu_tf.tf.compat.windows"),
    Change(
        name="depthwise_as_grouped_conv",
        replaces="DepthwiseConv1D/2D and SeparableConv1D/2D call (channels_last) with the depthwise "
                 "convolution as a grouped Conv2D (filter reshaped to (kh, kw, 1, C*m)); where this process has no "
                 "grouped-convolution gradients in the input's dtype (CPU float64), as a Conv2D with a "
                 "block-diagonal filter (up to 256 channels, undilated) or a sum of strided slices",
        targets=("tf_keras.layers:DepthwiseConv2D.call", "keras.layers:DepthwiseConv2D.call",
                 "tf_keras.layers:SeparableConv2D.call", "keras.layers:SeparableConv2D.call",
                 "tf_keras.layers:DepthwiseConv1D.call", "keras.layers:DepthwiseConv1D.call",
                 "tf_keras.layers:SeparableConv1D.call", "keras.layers:SeparableConv1D.call"),
        scope=Scope.LAYER, undone=_LIFETIME,
        why="DTensor has no layout propagation for DepthwiseConv2dNativeBackpropFilter/BackpropInput "
            "(nor SpaceToBatchND); a grouped Conv2D computes the same, bit for bit on one CPU",
        packages=("tensorflow", "tf-keras", "keras"), site="tofu_tf.tf.compat.depthwise"),
    Change(
        name="rnn_unrolled",
        replaces="RNN (LSTM, GRU, SimpleRNN, Keras 3 ConvLSTM): unroll=True, tf-keras "
                 "_could_use_gpu_kernel=False; get_config wrapped to report the user's unroll",
        targets=("tf_keras.layers:RNN.get_config", "keras.layers:RNN.get_config"),
        scope=Scope.LAYER, undone=_LIFETIME,
        why="Keras runs a recurrence as a While loop over TensorLists, which DTensor cannot expand",
        packages=("tensorflow", "tf-keras", "keras"), site="tofu_tf.tf.compat.layers"),
    Change(
        name="dropout_step_seeded",
        replaces="tf-keras Dropout's (and RNN cells') _random_generator, by a RandomGenerator "
                 "subclass drawing stateless masks seeded per step",
        targets=("tf_keras.src.backend:RandomGenerator.dropout", "tf_keras.src.backend:RandomGenerator._create_seed",
                 "tf_keras.src.backend:RandomGenerator._maybe_init"),
        scope=Scope.LAYER, undone=_LIFETIME,
        why="DTensor refuses tf-keras' stateful RandomUniform",
        packages=("tensorflow", "tf-keras"), site="tofu_tf.tf.compat.layers"),
    Change(
        name="input_relayout_hints",
        replaces="Dense (kernel rows split), EinsumDense (kernel split) and convolution layers' call, "
                 "relaying the input (and an EinsumDense's or a convolution's output gradient) to the "
                 "layout the plan priced",
        targets=("tf_keras.layers:Dense.call", "keras.layers:Dense.call", "tf_keras.layers:EinsumDense.call",
                 "keras.layers:EinsumDense.call", "tf_keras.layers:Conv2D.call", "keras.layers:Conv2D.call"),
        scope=Scope.LAYER, undone=_LIFETIME,
        why="DTensor's MatMul and convolution expanders refuse an input layout they could convert",
        packages=("tensorflow", "tf-keras", "keras"), site="tofu_tf.tf.compat.layers"),
    Change(
        name="statistics_input_relayout",
        replaces="a tf-keras BatchNormalization's _moments (on the instance, over the unfused path's own): its "
                 "input relaid replicated before the batch statistics, where the plan computes them whole",
        targets=("tf_keras.layers:BatchNormalization._moments",),
        scope=Scope.LAYER, undone=_LIFETIME,
        why="the lowering pins layouts at layer inputs only: inside the layer DTensor carried the batch split of "
            "its input into the moments and all-reduced their partial sums, where the plan (on a link that "
            "charges latency per collective) priced one gather of the input, so the step was not the plan "
            "(bench/executed.py: the CNN's 225.8 KiB all-gather modeled, none run)",
        packages=("tf-keras",), site="tofu_tf.tf.compat.layers"),
    # -- per model --------------------------------------------------------------------------------
    Change(
        name="step_functions",
        replaces="the model's make_train/test/predict_function and train/test/predict_function "
                 "(predictions assembled on the host)",
        targets=("tf_keras:Model.make_train_function", "tf_keras:Model.make_test_function",
                 "tf_keras:Model.make_predict_function", "keras:Model.make_train_function",
                 "keras:Model.make_test_function", "keras:Model.make_predict_function"),
        scope=Scope.MODEL, undone=_LIFETIME,
        why="DTensor's dataset re-batches with drop_remainder=True and Keras relaxes shapes on a "
            "second trace; the strategy lays each batch out as it comes and traces one program per signature",
        packages=("tensorflow", "tf-keras", "keras"), site="tofu_tf.strategies.step_functions"),
    Change(
        name="generate_function_placed",
        replaces="a keras-hub generating model's make_generate_function and generate_function (CausalLM, "
                 "Seq2SeqLM): the compiled decoding program called with its inputs on the mesh, tokens "
                 "assembled on the host; the sampler's state variables moved onto the mesh, replicated",
        targets=("keras_hub.src.models.causal_lm:CausalLM.make_generate_function",
                 "keras_hub.src.models.seq_2_seq_lm:Seq2SeqLM.make_generate_function",
                 "keras.src.backend.common.variables:Variable.value"),
        scope=Scope.MODEL, undone=_LIFETIME,
        why="keras-hub calls its own tf.function on host tensors outside strategy.run, and DTensor refuses a "
            "program mixing them with the model's DTensor variables ('got a regular tensor')",
        packages=("tensorflow", "keras", "keras-hub"), site="tofu_tf.strategies.generation"),
    Change(
        name="pipeline_step_functions",
        replaces="with TofuStrategy(pipeline=...): the model's make_train/test/predict_function and "
                 "train/test/predict_function, by functions running the pipeline's schedule",
        targets=("tf_keras:Model.make_train_function", "tf_keras:Model.make_test_function",
                 "tf_keras:Model.make_predict_function", "keras:Model.make_train_function",
                 "keras:Model.make_test_function", "keras:Model.make_predict_function"),
        scope=Scope.MODEL, undone=_LIFETIME,
        why="a pipelined step runs stages on different meshes, micro-batch by micro-batch, which one "
            "DTensor program (one mesh) cannot; the step runs eagerly from the host, one stage's ops at a time",
        packages=("tensorflow", "tf-keras", "keras"), site="tofu_tf.strategies.pipeline_runner"),
    Change(
        name="eager_model_calls",
        replaces="tf-keras and Keras 3 Model.__call__ (on the class): a TofuStrategy's model called eagerly outside "
                 "strategy.run with values is planned (first call), its inputs laid out on the mesh, its outputs "
                 "returned on the host with gradients back to the mesh",
        targets=("tf_keras:Model.__call__", "keras:Model.__call__"),
        scope=Scope.PROCESS, undone="when no TofuStrategy is alive any more",
        why="an eager training loop (GradientTape, no tf.function) computed on host copies of deferred weights: "
            "No gradients provided for any variable",
        packages=("tensorflow", "tf-keras", "keras"), site="tofu_tf.strategies.eager_calls"),
    Change(
        name="saved_function_captures_deferred",
        replaces="the captured variable handles of the restored concrete functions of a model tf-keras revived "
                 "from a SavedModel (RevivedLayer), as deferred captures reading each variable's handle at call "
                 "time (ConcreteFunction.set_external_captures)",
        targets=("tf_keras.src.saving.legacy.saved_model.load:RevivedLayer",
                 "tensorflow.python.saved_model.function_deserialization:RestoredFunction",
                 "tensorflow.python.eager.polymorphic_function.concrete_function:ConcreteFunction.set_external_captures"),
        scope=Scope.MODEL, undone=_LIFETIME,
        why="TF binds restored functions to the loaded variables' handles, which the plan replaces: a subclassed "
            "model loaded under the scope was refused (the step would read stale handles: 'In[1] is not a matrix')",
        packages=("tensorflow", "tf-keras"), site="tofu_tf.tf.compat.revived_functions"),
    Change(
        name="savedmodel_from_copy",
        replaces="the model's _trackable_children (SavedModel only), save and export; a tf-keras save's signatures "
                 "traced on the model, called with the copy's variables (ConcreteFunction.set_external_captures)",
        targets=("tf_keras:Model._trackable_children", "tf_keras:Model.save", "tf_keras:Model.export",
                 "keras:Model._trackable_children", "keras:Model.save", "keras:Model.export",
                 "tensorflow.python.eager.polymorphic_function.concrete_function:ConcreteFunction.set_external_captures"),
        scope=Scope.MODEL, undone=_LIFETIME,
        why="a SavedModel traced on the mesh holds Relayout ops and DTensor variables, which one device "
            "and TF Serving cannot run; it is made from a one-device copy",
        packages=("tensorflow", "tf-keras", "keras"), site="tofu_tf.strategies.export"),
    Change(
        name="new_axis_slices_spelled_out",
        replaces="the model's call, run under tensor_getitem_spelled_out (every layer it calls slices new axes "
                 "with every axis named: t[:, None] as t[:, None, :]), tensor_arrays_as_lists, scans_unrolled, "
                 "depthwise_op_as_grouped_conv and dilated_conv_in_conv2d",
        targets=("tf_keras:Model.call", "keras:Model.call"),
        scope=Scope.MODEL, undone=_LIFETIME,
        why="DTensor's StridedSlice layout inference reads the wrong axis for axes a spec leaves implicit after "
            "a new axis (a segfault or garbage, in every layout); keras-hub XLNet's segment matrix slices so",
        packages=("tensorflow", "tf-keras", "keras"), site="tofu_tf.tf.compat.slices"),
    # -- per optimizer ----------------------------------------------------------------------------
    Change(
        name="optimizer_adopted",
        replaces="a tf-keras optimizer made outside strategy.scope(): _distribution_strategy, "
                 "_run_with_dtensor, and its _iterations and learning-rate variables remade in _variables",
        targets=("tf_keras.src.optimizers.optimizer:Optimizer._create_iteration_variable",
                 "tf_keras.src.optimizers.optimizer:Optimizer._build_learning_rate"),
        scope=Scope.OPTIMIZER, undone=_LIFETIME,
        why="tf-keras records the strategy at construction: its updates went through the default "
            "strategy's merge_call (an error) and its step counter's increment was lost",
        packages=("tensorflow", "tf-keras"), site="tofu_tf.tf.compat.optimizers"),
    Change(
        name="slot_zeros_deferred",
        replaces="tf-keras optimizer's add_variable_from_reference, handing in DeferredZeros",
        targets=("tf_keras.optimizers:Optimizer.add_variable_from_reference",),
        scope=Scope.OPTIMIZER, undone=_LIFETIME,
        why="tf-keras builds each slot as tf.zeros(weight.shape), a full-size tensor on one device, "
            "before any layout is known",
        packages=("tensorflow", "tf-keras"), site="tofu_tf.tf.compat.optimizers"),
    Change(
        name="gradients_relaid",
        replaces="the optimizer's apply (Keras 3) / apply_gradients (tf-keras), relaying each dense "
                 "gradient to its variable's layout first",
        targets=("keras.optimizers:Optimizer.apply", "tf_keras.optimizers:Optimizer.apply_gradients",
                 "tf_keras.optimizers.legacy:Optimizer.apply_gradients"),
        scope=Scope.OPTIMIZER, undone=_LIFETIME,
        why="DTensor's layout propagation can ask a kernel gradient's Sum for a split its reduce "
            "expander refuses (EmitAllScatter ... not more sharded)",
        packages=("tensorflow", "tf-keras", "keras"), site="tofu_tf.tf.compat.optimizers"),
    Change(
        name="legacy_fused_updates_unfused",
        replaces="a tf-keras legacy Adadelta's, Adamax's, Ftrl's or RMSprop-with-momentum's _resource_apply_dense "
                 "(on the instance: the model's optimizer and capture's copy): its fused kernel's formula in "
                 "elementwise ops, each slot and the weight read once before the update and written once",
        targets=("tf_keras.src.optimizers.legacy.adadelta:Adadelta._resource_apply_dense",
                 "tf_keras.src.optimizers.legacy.adamax:Adamax._resource_apply_dense",
                 "tf_keras.src.optimizers.legacy.ftrl:Ftrl._resource_apply_dense",
                 "tf_keras.src.optimizers.legacy.rmsprop:RMSprop._resource_apply_dense",
                 "tf_keras.src.optimizers.legacy.optimizer_v2:OptimizerV2._fallback_apply_state"),
        scope=Scope.OPTIMIZER, undone="never: it is how the strategy runs that optimizer",
        why="DTensor has no layout propagation for ResourceApplyAdadelta, ResourceApplyAdaMax, ResourceApplyFtrl(V2) "
            "or ResourceApplyRMSProp, in any layout: a model compiled with one of these legacy optimizers was "
            "refused before its first step",
        packages=("tf-keras",), site="tofu_tf.tf.compat.legacy_dense"),
    Change(
        name="legacy_sparse_updates_dense",
        replaces="a legacy tf-keras optimizer's _resource_scatter_add/_resource_scatter_update (as assigns of "
                 "dense rows) and, for SGD and RMSprop with momentum, _resource_apply_sparse (its dense update, "
                 "the untouched rows of the weight and its slots put back), on the instance",
        targets=("tf_keras.src.optimizers.legacy.optimizer_v2:OptimizerV2._resource_scatter_add",
                 "tf_keras.src.optimizers.legacy.optimizer_v2:OptimizerV2._resource_scatter_update",
                 "tf_keras.src.optimizers.legacy.optimizer_v2:OptimizerV2._resource_apply_dense",
                 "tf_keras.optimizers.legacy:SGD._resource_apply_sparse",
                 "tf_keras.optimizers.legacy:RMSprop._resource_apply_sparse"),
        scope=Scope.OPTIMIZER, undone=_LIFETIME,
        why="DTensor runs neither ResourceScatterAdd/Update nor the fused sparse updates "
            "(ResourceSparseApplyKerasMomentum, ResourceSparseApplyRMSProp), and a densified gradient's "
            "update would move rows the sparse one leaves alone: an Embedding under legacy RMSprop was refused",
        packages=("tensorflow", "tf-keras"), site="tofu_tf.tf.compat.legacy_sparse"),
    Change(
        name="ema_after_update",
        replaces="a tf-keras use_ema optimizer's _internal_apply_gradients, updating the moving "
                 "averages after the base update",
        targets=("tf_keras.src.optimizers.optimizer:Optimizer._internal_apply_gradients",
                 "tf_keras.src.optimizers.optimizer:Optimizer._update_model_variables_moving_average",
                 "tf_keras.src.optimizers.optimizer:Optimizer._var_key"),
        scope=Scope.OPTIMIZER, undone=_LIFETIME,
        why="tf-keras' DTensor path never updates the averages, yet fit ends by writing them into "
            "the weights: the whole run was lost",
        packages=("tensorflow", "tf-keras"), site="tofu_tf.tf.compat.optimizers"),
    # -- during capture ---------------------------------------------------------------------------
    Change(
        name="layer_scopes_recorded",
        replaces="Keras 3 name_scope.__enter__ (on the class), recording which layer entered which scope",
        targets=("keras.src.backend.tensorflow.core:name_scope.__enter__",),
        scope=Scope.CAPTURE, undone="when the last capture in the process ends; other threads see the original",
        why="Keras 3 opens a layer's scope twice and TF uniquifies the second name: op names alone "
            "attribute ops to the wrong layer",
        packages=("keras",), site="tofu_tf.tf.compat.process"),
    Change(
        name="updates_redirected",
        replaces="a custom loop's optimizer's apply_gradients (and Keras 3 apply), on the instance",
        targets=("tf_keras.optimizers:Optimizer.apply_gradients", "keras.optimizers:Optimizer.apply"),
        scope=Scope.CAPTURE, undone=_CAPTURE_ONLY,
        why="building the user's optimizer in the trace would leave it holding capture's buffer-less handles",
        packages=("tf-keras", "keras"), site="tofu_tf.tf.keras_adapter"),
    Change(
        name="slots_recorded",
        replaces="capture's own optimizer copy's add_variable_from_reference (legacy: add_slot)",
        targets=("tf_keras.optimizers:Optimizer.add_variable_from_reference",
                 "keras.optimizers:Optimizer.add_variable_from_reference",
                 "tf_keras.optimizers.legacy:Optimizer.add_slot"),
        scope=Scope.CAPTURE, undone=_CAPTURE_ONLY,
        why="the one reliable link from an optimizer slot to the weight it tracks",
        packages=("tf-keras", "keras"), site="tofu_tf.tf.keras_adapter"),
    Change(
        name="update_step_stamped",
        replaces="capture's own optimizer copy's update_step",
        targets=("tf_keras.optimizers:Optimizer.update_step", "keras.optimizers:Optimizer.update_step"),
        scope=Scope.CAPTURE, undone=_CAPTURE_ONLY,
        why="each weight's update is traced once per shape and stamped for the others (capture time)",
        packages=("tf-keras", "keras"), site="tofu_tf.tf.update_stamps"),
    Change(
        name="loss_copy_marked",
        replaces="a copy of a compiled tf-keras Loss: _allow_sum_over_batch_size=True",
        targets=("tf_keras.losses:Loss._get_reduction",),
        scope=Scope.CAPTURE, undone="the copy is capture's; the user's Loss is untouched",
        why="tf-keras refuses an AUTO-reduction Loss under a strategy until compile's loss container "
            "marks it at the first step, after capture ran",
        packages=("tf-keras",), site="tofu_tf.tf.keras_adapter"),
    # -- variables --------------------------------------------------------------------------------
    Change(
        name="handle_debug_name",
        replaces="gen_resource_variable_ops.var_handle_op (module function): one debug_name for "
                 "every TofuVariable handle",
        targets=("tensorflow.python.ops.gen_resource_variable_ops:var_handle_op",),
        scope=Scope.CREATION, undone="when the last variable being made in the process is made; "
                                     "other threads see the original",
        why="DTensor caches an eager op's program by its attributes, and TF names a handle op after "
            "its variable: every variable compiled its own handle program",
        packages=("tensorflow",), site="tofu_tf.tf.compat.process"),
    Change(
        name="initializer_seed_pinned",
        replaces="nothing replaced: an unseeded tf-keras initializer's RandomGenerator._maybe_init called when "
                 "its variable is created without a value, choosing the seed its first call would choose",
        targets=("tf_keras.src.backend:RandomGenerator._maybe_init", "tf_keras.src.backend:RandomGenerator._create_seed"),
        scope=Scope.CREATION, undone="nothing to undo: the seed is the one the initializer's first call on one "
                                     "device takes (from keras.utils.set_random_seed's generator, else Python's random)",
        why="a variable TofuStrategy defers is initialized at a read or at the plan, in another order than one device "
            "creates it, so an unseeded initializer took another weight's seed (reading one kernel first changed "
            "every kernel's values)",
        packages=("tf-keras",), site="tofu_tf.tf.compat.initializer_seeds"),
    Change(
        name="seed_generator_state_pinned",
        replaces="a Keras 3 initializer seeded with a SeedGenerator, for the variable the strategy creates: a copy "
                 "whose seed replays the generator state taken (generator.next()) when the variable is created",
        targets=("keras.src.random.seed_generator:SeedGenerator.next",
                 "keras.src.random.seed_generator:draw_seed",
                 "keras.src.initializers.random_initializers:RandomInitializer"),
        scope=Scope.CREATION, undone="nothing to undo: the generator advances at the creation, as on one device; "
                                     "the copy lives in the variable's initial value until the plan draws it",
        why="a deferred variable is drawn at a read or at the plan, in another order than one device creates it: "
            "the variables sharing one SeedGenerator took each other's states (a split kernel 0.27 from one "
            "device's)",
        packages=("keras",), site="tofu_tf.tf.compat.initializer_seeds"),
    Change(
        name="uniform_draws_by_index",
        replaces="a tf-keras RandomUniform's or uniform VarianceScaling's generator.random_uniform, on that instance, "
                 "for one call that records its arguments and draws nothing; each shard of a weight split by its "
                 "first dimension drawn with StatelessRandomUniformV2 from the Philox counter at its flat offset",
        targets=("tf_keras.src.backend:RandomGenerator.random_uniform",
                 "tf_keras.src.backend:RandomGenerator.make_seed_for_stateless_op",
                 "tensorflow.python.ops.random_ops_util:get_key_counter_alg",
                 "tensorflow.python.ops.gen_stateless_random_ops_v2:stateless_random_uniform_v2"),
        scope=Scope.CREATION, undone="the recorder is deleted from the instance on exit of the call, also on error",
        why="a uniform draw under a split layout is another stream than one device's (DTensor folds each device's "
            "coordinates into the seed); drawn by global index, each device draws only its shard, one device's bits",
        packages=("tensorflow", "tf-keras"), site="tofu_tf.tf.compat.counter_draws"),
    Change(
        name="variable_reads_forward_writes",
        replaces="DVariable subclassed (TofuVariable: _read_variable_op, scatter_add); a DeferredVariable's "
                 "__class__ set to TofuVariable in place when the plan lays it out",
        targets=("tensorflow.dtensor.python.d_variable:DVariable",
                 "tensorflow.python.ops.resource_variable_ops:BaseResourceVariable._read_variable_op"),
        scope=Scope.VARIABLE, undone=_LIFETIME,
        why="DTensor reorders a variable's write and a later read in one step (a slot's first update "
            "was lost); layers and checkpoints keep the Python object they hold",
        packages=("tensorflow",), site="tofu_tf.tf.variables"),
    Change(
        name="step_all_reduces_one_by_one",
        replaces="the environment switch DTENSOR_ALLREDUCE_COMBINE_OPTIMIZATION_GROUP_SIZE, set to 1 while the "
                 "strategy calls a training step program whose plan runs its all-reduces one by one "
                 "(Plan.all_reduces_combined False), unless the user set it (read by DTensor at each compile)",
        targets=("tensorflow.dtensor.python.dtensor_device:DTensorDevice",),
        scope=Scope.CALL, undone="on return of the last such call, also on error; the switch is the process's, "
                                 "so a program another thread compiles meanwhile runs its all-reduces alone too",
        why="DTensor's all-reduce combining copies each all-reduce it combines into one buffer and out again; "
            "where the gradients are few and large (a 2 x 1024 MLP's data-parallel step on virtual CPUs) "
            "that copy costs more than the collective launches it saves",
        packages=("tensorflow",), site="tofu_tf.tf.compat.calls"),
    Change(
        name="step_graph_optimizations_off",
        replaces="the calling thread's FunctionCallOptions while a step program is called: grappler's "
                 "meta-optimizer disabled in the call's config_proto (CPU meshes, or graph_optimizations=False)",
        targets=("tensorflow.python.eager.context:Context.function_call_options",
                 "tensorflow.python.eager.context:FunctionCallOptions"),
        scope=Scope.CALL, undone="on return of the call, also on error; other threads and functions never see it",
        why="TensorFlow runs grappler on each device's part of a DTensor program; on virtual CPU devices, "
            "which share the host's cores, that was the largest part of a first step",
        packages=("tensorflow",), site="tofu_tf.tf.compat.calls"),
    Change(
        name="captured_tensors_on_mesh",
        replaces="the capture method of the FuncGraph being traced (on that instance): an eager tensor it would "
                 "take as a program input is captured as a replicated copy on the mesh",
        targets=("tensorflow.python.framework.func_graph:FuncGraph.capture",
                 "tensorflow.python.framework.ops:EagerTensor"),
        scope=Scope.TRACE, undone="when the function passed to strategy.run returns from its trace, also on error",
        why="a layer's own eager tensor (Swin's relative-position index) became a regular input of a program on "
            "the mesh, which DTensor refuses",
        packages=("tensorflow",), site="tofu_tf.tf.mesh_captures"),
    Change(
        name="slice_update_as_select",
        replaces="Keras 3's TensorFlow backend slice_update (the module function), written as "
                 "a select of the update padded to the input's shape at XLA's clamped starts, on the tracing "
                 "thread (a step's trace, "
                 "and a keras-hub decoding program's: tofu_tf.strategies.generation)",
        targets=("keras.src.backend.tensorflow.core:slice_update",),
        scope=Scope.TRACE, undone="when the function passed to strategy.run returns from its trace, or capture "
                                  "from tracing a step for planning (tofu_tf.tf.capture), also on error; other "
                                  "threads see the original",
        why="DTensor has no layout propagation for XlaDynamicUpdateSlice and it has no CPU kernel to fold it "
            "(Swin's shifted-window mask, keras-hub's key/value cache in generate)",
        packages=("tensorflow", "keras"), site="tofu_tf.tf.compat.keras_ops"),
    Change(
        name="roll_as_slices",
        replaces="Keras 3's TensorFlow backend roll (the module function), written as concatenated slices for "
                 "static shifts, on the tracing thread",
        targets=("keras.src.backend.tensorflow.numpy:roll",),
        scope=Scope.TRACE, undone="when the function passed to strategy.run returns from its trace, or capture "
                                  "from tracing a step for planning (tofu_tf.tf.capture), also on error; other "
                                  "threads see the original",
        why="DTensor has no layout propagation for Roll (Swin's shifted windows)",
        packages=("tensorflow", "keras"), site="tofu_tf.tf.compat.keras_ops"),
    Change(
        name="one_hot_as_equal",
        replaces="Keras 3's TensorFlow backend one_hot (the module function), written as an Equal of the "
                 "indices with range(depth), cast, on the tracing thread",
        targets=("keras.src.backend.tensorflow.nn:one_hot",),
        scope=Scope.TRACE, undone="when the function passed to strategy.run returns from its trace, or capture "
                                  "from tracing a step for planning (tofu_tf.tf.capture), also on error; other "
                                  "threads see the original",
        why="DTensor's OneHot expander mis-shapes its output when propagation splits the one-hot axis "
            "(keras-hub Qwen3-MoE's expert router, whose experts the plan splits)",
        packages=("tensorflow", "keras"), site="tofu_tf.tf.compat.keras_ops"),
    Change(
        name="top_k_gradient_by_comparison",
        replaces="Keras 3's TensorFlow backend top_k (the module function), its gradient computed by comparing the "
                 "indices with range(n) instead of TopKV2's ScatterNd, on the tracing thread",
        targets=("keras.src.backend.tensorflow.math:top_k",),
        scope=Scope.TRACE, undone="when the function passed to strategy.run returns from its trace, or capture "
                                  "from tracing a step for planning (tofu_tf.tf.capture), also on error; other "
                                  "threads see the original",
        why="DTensor's ScatterNd expander indexes a batch-split shard with global positions (keras-hub "
            "Qwen3.5-MoE's router gradient, data parallel)",
        packages=("tensorflow", "keras"), site="tofu_tf.tf.compat.keras_ops"),
    Change(
        name="split_as_slices",
        replaces="Keras 3's TensorFlow backend split (the module function), written as slices of the axis for "
                 "static sections, on the tracing thread",
        targets=("keras.src.backend.tensorflow.numpy:split",),
        scope=Scope.TRACE, undone="when the function passed to strategy.run returns from its trace, or capture "
                                  "from tracing a step for planning (tofu_tf.tf.capture), also on error; other "
                                  "threads see the original",
        why="DTensor's Split expander refuses an input split along its axis, which propagation gives it from "
            "the op before (keras-hub Qwen-MoE's expert bank on a batch x model mesh)",
        packages=("tensorflow", "keras"), site="tofu_tf.tf.compat.keras_ops"),
    Change(
        name="tensor_getitem_spelled_out",
        replaces="tf.Tensor.__getitem__ (on the class) while a prepared model's call runs: a spec with a new axis "
                 "names every axis",
        targets=("tensorflow.python.framework.tensor:Tensor.__getitem__",),
        scope=Scope.MODEL_CALL, undone="on return of the model's call, also on error; other threads see the original",
        why="the slices of new_axis_slices_spelled_out: a layer slices a tensor with TensorFlow's own __getitem__",
        packages=("tensorflow",), site="tofu_tf.tf.compat.slices"),
    Change(
        name="tensor_arrays_as_lists",
        replaces="tf.TensorArray.__init__ (on the class) while a prepared model's call runs: a TensorArray of "
                 "static size is TensorFlow's eager, list-backed implementation (subclassed: static indices only)",
        targets=("tensorflow.python.ops.tensor_array_ops:TensorArray.__init__",
                 "tensorflow.python.ops.tensor_array_ops:_EagerTensorArray"),
        scope=Scope.MODEL_CALL, undone="on return of the model's call, also on error; other threads see the original",
        why="a graph TensorArray is a TensorList, which DTensor cannot lay out even replicated; keras-hub RWKV-7 "
            "writes its unrolled recurrence's outputs into one",
        packages=("tensorflow",), site="tofu_tf.tf.compat.tensor_arrays"),
    Change(
        name="scans_unrolled",
        replaces="tensorflow.python.ops.functional_ops.scan (what tf.scan calls) while a prepared model's call "
                 "runs: a scan over a static number of elements as a Python loop and a stack",
        targets=("tensorflow.python.ops.functional_ops:scan",),
        scope=Scope.MODEL_CALL, undone="on return of the model's call, also on error; other threads see the original",
        why="a scan runs as a While loop over TensorLists, which DTensor cannot lay out even replicated",
        packages=("tensorflow",), site="tofu_tf.tf.compat.scans"),
    Change(
        name="depthwise_op_as_grouped_conv",
        replaces="Keras 3's TensorFlow backend depthwise_conv (the module function) while a prepared model's call "
                 "runs: channels_last, 1-D or 2-D, as depthwise_as_grouped_conv computes it",
        targets=("keras.src.backend.tensorflow.nn:depthwise_conv",),
        scope=Scope.MODEL_CALL, undone="on return of the model's call, also on error; other threads see the original",
        why="DTensor has no layout propagation for DepthwiseConv2dNativeBackpropFilter/BackpropInput; a layer "
            "calls keras.ops.depthwise_conv itself (keras-hub Qwen3.5's gated delta net)",
        packages=("tensorflow", "keras"), site="tofu_tf.tf.compat.depthwise"),
    Change(
        name="dilated_conv_in_conv2d",
        replaces="Keras 3's TensorFlow backend conv (the module function) and tf-keras Conv.convolution_op (on the "
                 "class) while a prepared model's call runs: a 1-D or 2-D channels_last stride-1 dilated "
                 "convolution as one Conv2D with dilations (a sum of strided slices times the filter where the dilated gradients "
                 "have no kernel in its dtype)",
        targets=("keras.src.backend.tensorflow.nn:conv", "tf_keras.src.layers.convolutional.base_conv:Conv.convolution_op"),
        scope=Scope.MODEL_CALL, undone="on return of the model's call, also on error; other threads see the original",
        why="tf.nn.convolution computes a dilated convolution off TPU through SpaceToBatchND, which DTensor has "
            "no layout propagation for (keras-hub DeepLabV3's atrous spatial pyramid pooling; a tf-keras "
            "Conv2D(dilation_rate=2); a causal dilated Conv1D)",
        packages=("tensorflow", "tf-keras", "keras"), site="tofu_tf.tf.compat.windows"),
    # -- process-wide ---------------------------------------------------------------------------
    Change(
        name="dtensor_all_reduces_uncombined",
        replaces="the environment switch DTENSOR_ENABLE_COMBINE_ALL_REDUCES_OPTIMIZATION, set to 0 when a "
                 "pipelined TofuStrategy is made and the user has not set it (read by the DTensor device "
                 "when it first compiles a program)",
        targets=("tensorflow.dtensor.python.dtensor_device:DTensorDevice",),
        scope=Scope.PROCESS, undone="never: DTensor reads the switch once, when it first compiles a program",
        why="DTensor's all-reduce combining leaves the gradients a pipeline stage's backward function "
            "returns without layouts, and DTensor then refuses to compile that function",
        packages=("tensorflow",), site="tofu_tf.tf.compat.process"),
    Change(
        name="dtensor_replicated_ops",
        replaces="the environment switches DTENSOR_ENABLE_REPLICATED_SPMD_AS_DEFAULT_<OP> for the ops of "
                 "tofu_tf.tf.compat.decoding.REPLICATED_OPS, set to 1 when a TofuStrategy first runs a decoding "
                 "program, and for those of tofu_tf.search.targets.ENROLLED_REPLICATED when it plans a step holding "
                 "one, where the user has not set them (read by DTensor at each compile)",
        targets=("tensorflow.dtensor.python.dtensor_device:DTensorDevice",),
        scope=Scope.PROCESS, undone="never: the switch only lets DTensor compile a program it refused",
        why="DTensor has no layout propagation for StatelessMultinomial (keras.random.categorical, the top-k "
            "sampler's draw) nor MatrixDiagV3 (a tf.eye too large to fold: keras-hub Qwen3.5's gated delta "
            "rule); enrolled, DTensor runs them replicated (one device's draws and values)",
        packages=("tensorflow",), site="tofu_tf.tf.compat.decoding"),
    Change(
        name="summary_before_plan",
        replaces="tf-keras layer_utils.print_dtensor_variable_summary (the module function)",
        targets=("tf_keras.src.utils.layer_utils:print_dtensor_variable_summary",),
        scope=Scope.PROCESS, undone="when no TofuStrategy is alive any more",
        why="tf-keras' summary() divides by the weights' per-device size, 0 while every weight waits "
            "for its layout (ZeroDivisionError); the replacement changes only a TofuStrategy's unplanned models",
        packages=("tf-keras",), site="tofu_tf.tf.compat.process"),
    Change(
        name="summaries_gathered",
        replaces="TensorBoard's summary functions scalar, histogram, image, audio and text (tensorboard.summary.v2, "
                 "which tf.summary's call) and tf.summary.write (tf.summary, tf.compat.v2.summary): a value on the "
                 "mesh, given eagerly, is assembled on the host first",
        targets=("tensorboard.summary.v2:scalar", "tensorboard.summary.v2:histogram", "tensorboard.summary.v2:image",
                 "tensorboard.summary.v2:audio", "tensorboard.summary.v2:text", "tensorflow._api.v2.summary:write",
                 "tensorflow._api.v2.compat.v2.summary:write"),
        scope=Scope.PROCESS, undone="when no TofuStrategy is alive any more",
        why="a summary computes eagerly on its value with regular tensors (a histogram's bucket edges), and "
            "DTensor refuses a weight on the mesh beside them: TensorBoard(histogram_freq=1) stopped fit",
        packages=("tensorflow", "tensorboard"), site="tofu_tf.tf.compat.summaries"),
    Change(
        name="keras3_numpy_gathered",
        replaces="Keras 3's keras.src.backend.convert_to_numpy (the module function, TensorFlow backend): a tensor "
                 "on the mesh is assembled on the host first",
        targets=("keras.src.backend:convert_to_numpy",),
        scope=Scope.PROCESS, undone="when no TofuStrategy is alive any more",
        why="numpy cannot copy a split DTensor off the mesh: Keras 3's TensorBoard(write_images=True) stopped fit",
        packages=("tensorflow", "keras"), site="tofu_tf.tf.compat.summaries"),
    Change(
        name="generate_before_plan",
        replaces="keras-hub CausalLM.make_generate_function (on the class): a model made in a TofuStrategy's scope "
                 "is handed to its strategy first, which wraps it (generate_function_placed) and plans it from "
                 "the first prompts",
        targets=("keras_hub.src.models.causal_lm:CausalLM.make_generate_function",),
        scope=Scope.PROCESS, undone="when no TofuStrategy is alive any more",
        why="a model built or loaded under the scope and asked to generate before any step decoded with "
            "variables the plan had not made yet (a reshape of a 0-element tensor in its first layer)",
        packages=("keras", "keras-hub"), site="tofu_tf.tf.compat.decoding"),
    Change(
        name="functions_called_on_the_mesh",
        replaces="TensorFlow's tf.function Function.__call__ (on the class): a function DTensor refuses for a host "
                 "tensor argument is called again with its tensor arguments laid out on a planned TofuStrategy's "
                 "mesh, its results assembled on the host",
        targets=("tensorflow.python.eager.polymorphic_function.polymorphic_function:Function.__call__",),
        scope=Scope.PROCESS, undone="when no TofuStrategy is alive any more",
        why="a tf.function of the user's or a library's (a serving function, an evaluation loop) called with host "
            "tensors on the strategy's DTensor variables failed ('got a regular tensor ... expecting a DTensor')",
        packages=("tensorflow",), site="tofu_tf.tf.compat.function_calls"),
    Change(
        name="distributed_batches_accepted",
        replaces="tf-keras data_adapter._is_distributed_dataset (the module function): a TofuStrategy's "
                 "distributed dataset (marked) is one too",
        targets=("tf_keras.src.engine.data_adapter:_is_distributed_dataset",),
        scope=Scope.PROCESS, undone="when no TofuStrategy is alive any more",
        why="fit given the strategy's own distributed dataset (strategy.experimental_distribute_dataset, "
            "distribute_datasets_from_function), as TensorFlow's guide feeds MirroredStrategy's, stopped with "
            "'Failed to find data adapter that can handle input'",
        packages=("tf-keras",), site="tofu_tf.tf.compat.distributed_inputs"),
    Change(
        name="function_told_of_variables",
        replaces="the list of created variables of a tf.function's first trace (Function._initialize's "
                 "variable_capturing_scope, read from its closure on the tracing graph's creator stack): a variable "
                 "TofuStrategy makes during that trace is appended to it",
        targets=("tensorflow.python.eager.polymorphic_function.polymorphic_function:Function._initialize",),
        scope=Scope.CREATION, undone="nothing to undo: the function records the variable as it records its own",
        why="TofuStrategy's creator never reaches the function's, so a function that built a layer in its first "
            "trace was not traced again and kept a trace that read the layer's variables before they existed "
            "(tf-keras's test_variable_run_argument applied no gradient, silently)",
        packages=("tensorflow",), site="tofu_tf.tf.compat.function_variables"),
    Change(
        name="keras3_initializer_read",
        replaces="nothing: reads the Keras variable (its _shape and _dtype) and the initializer in the "
                 "closure of Keras 3's initial-value lambda",
        targets=("keras.src.backend.tensorflow.core:Variable._initialize_with_initializer",),
        scope=Scope.READ, undone="nothing to undo",
        why="a deferred variable needs its shape and dtype without running the initializer (a full-size value)",
        packages=("keras",), site="tofu_tf.tf.keras_adapter"),
    Change(
        name="sparse_deduplication_read",
        replaces="nothing: reads whether a tf-keras optimizer deduplicates a sparse gradient's rows with tf.unique "
                 "(Optimizer._deduplicate_sparse_grad; whether a legacy optimizer keeps OptimizerV2's "
                 "_resource_apply_sparse_duplicate_indices)",
        targets=("tf_keras.src.optimizers.optimizer:Optimizer._deduplicate_sparse_grad",
                 "tf_keras.src.optimizers.legacy.optimizer_v2:OptimizerV2._resource_apply_sparse_duplicate_indices"),
        scope=Scope.READ, undone="nothing to undo",
        why="DTensor runs that Unique on the whole index vector and gathers the gradient's rows split over the "
            "batch; priced as an all-reduce of the dense gradient, the tf-keras GPT's 227.5 KiB of all-gathers a "
            "step were missing from its plan",
        packages=("tf-keras",), site="tofu_tf.tf.keras_adapter"),
    Change(
        name="int8_matmul_exact",
        replaces="Keras 3's TensorFlow-backend numpy.matmul and numpy.einsum (module functions), for int8 x int8 "
                 "operands only: computed in float32 (contraction <= 1024) or float64 and cast to int32",
        targets=("keras.src.backend.tensorflow.numpy:matmul", "keras.src.backend.tensorflow.numpy:einsum"),
        scope=Scope.CALL, undone="when the last strategy.run in the process returns; other threads see the original",
        why="Keras multiplies int8 by int8 with tf.matmul(output_type=int32), a BatchMatMulV3, which DTensor has "
            "no layout propagation for: a quantized model's predict failed; the float sums are exact integers",
        packages=("tensorflow", "keras"), site="tofu_tf.tf.compat.quantized"),
    Change(
        name="quantize_in_scope",
        replaces="the model's quantize (instance attribute), and each quantizable layer's quantize while it runs",
        targets=("keras.src.models.model:Model.quantize", "keras.src.layers.layer:Layer.quantize"),
        scope=Scope.MODEL, undone=_LIFETIME,
        why="quantize made its int8 kernels and scales as plain host variables beside the mesh's (out of the "
            "scope) or replicated (in it): they are made through the strategy, each int8 kernel in its float "
            "kernel's layout and its scale split with it; modes other than int8 are refused",
        packages=("keras",), site="tofu_tf.tf.compat.quantized"),
    Change(
        name="train_step_model_built",
        replaces="Model.built set to True on a model with no call of its own whose layers are all built (a GAN), "
                 "once it is planned from its own train_step",
        targets=("keras.src.backend.tensorflow.trainer:TensorFlowTrainer._maybe_symbolic_build",
                 "keras.src.trainers.trainer:Trainer._symbolic_build"),
        scope=Scope.MODEL, undone=_LIFETIME,
        why="under a distribution strategy Keras 3's fit builds an unbuilt model by calling it; a model with "
            "no call (keras.io's GAN) stopped there, where one device skips that build",
        packages=("keras",), site="tofu_tf.strategies.custom_steps"),
    Change(
        name="batch_concat_gathered",
        replaces="tf.concat (the tensorflow module's attribute), for floating-point tensors joined along "
                 "dimension 0 in a traced strategy step: inputs and result relaid replicated",
        targets=("tensorflow:concat",),
        scope=Scope.CALL, undone="when the last strategy.run in the process returns; other threads see the original",
        why="DTensor's concat expander refuses a concatenation along a split dimension: a GAN's "
            "tf.concat([generated, real], axis=0) of batch-split images failed its first step",
        packages=("tensorflow",), site="tofu_tf.tf.compat.batch_concat"),
    Change(
        name="stateless_draws_replicated",
        replaces="tf.random.stateless_normal, stateless_uniform, stateless_truncated_normal, stateless_categorical, "
                 "stateless_gamma, stateless_binomial and stateless_poisson (the tf.random module's attributes), "
                 "in a traced strategy step: the draw relaid replicated; tf.nn.experimental.stateless_dropout: "
                 "general_dropout with the same uniform noise drawn replicated; keras SeedGenerator.next: a "
                 "state made outside the scope moved onto the mesh, replicated, first",
        targets=tuple(f"tensorflow:random.{name}" for name in (
            "stateless_normal", "stateless_uniform", "stateless_truncated_normal", "stateless_categorical",
            "stateless_gamma", "stateless_binomial", "stateless_poisson")) + (
            "tensorflow:nn.experimental.stateless_dropout", "tensorflow:nn.experimental.general_dropout",
            "keras.src.random.seed_generator:SeedGenerator.next"),
        scope=Scope.CALL, undone="when the last strategy.run in the process returns; other threads see the original",
        why="DTensor folds each device's coordinates into the seed of a random op it lays out split: a "
            "custom train_step's latents (keras.io's GAN) were not the numbers one device draws from the seed, "
            "and a dropout mask depended on the plan and the device count; a SeedGenerator made outside the "
            "scope was advanced once per device",
        packages=("tensorflow", "keras"), site="tofu_tf.tf.compat.random_draws"),
    Change(
        name="custom_step_loss_marked",
        replaces="a tf-keras Loss a custom train_step's model holds as an attribute: _allow_sum_over_batch_size=True",
        targets=("tf_keras.losses:Loss._get_reduction",),
        scope=Scope.MODEL, undone=_LIFETIME,
        why="tf-keras refuses an AUTO-reduction Loss called under a strategy outside compile (a per-replica "
            "mean); TofuStrategy's step is one replica over the global batch, whose mean is one device's",
        packages=("tf-keras",), site="tofu_tf.strategies.custom_steps"),
    Change(
        name="restored_function_read",
        replaces="nothing: reads the concrete functions of a function tf.saved_model.load restored "
                 "(RestoredFunction.concrete_functions: their captured variables and ops)",
        targets=("tensorflow.python.saved_model.function_deserialization:RestoredFunction",),
        scope=Scope.READ, undone="nothing to undo",
        why="a loaded module's method reads variables off the mesh, which a DTensor program cannot read: "
            "strategy.run runs it once per device instead, and refuses it when it writes a variable",
        packages=("tensorflow",), site="tofu_tf.strategies.run_functions"),
    Change(
        name="while_body_graph_read",
        replaces="nothing: reads whether a graph being traced is a while loop's body (its class, "
                 "WhileBodyFuncGraph, in the chain of outer graphs)",
        targets=("tensorflow.python.ops.control_flow_v2_func_graphs:WhileBodyFuncGraph",),
        scope=Scope.READ, undone="nothing to undo",
        why="a batch taken in a loop the graph runs (Orbit's tf.range around strategy.run) must be read each "
            "iteration from a DTensor iterator, not captured once as an input of the function",
        packages=("tensorflow",), site="tofu_tf.strategies.traced_batches"),
)


def change(name: str) -> Change:
    """The registered change called ``name``.

    Raises:
        KeyError: no change has that name.
    """
    for entry in CHANGES:
        if entry.name == name:
            return entry
    raise KeyError(f"no registered change {name!r}: see tofu_tf.tf.compat.registry.CHANGES")


def resolve(target: str):
    """The object a target names, ``"module:Class.attribute"``, imported and looked up.

    Raises:
        ImportError, AttributeError: the installed packages have no such module or attribute.
    """
    module_name, _, path = target.partition(":")
    obj = importlib.import_module(module_name)
    for part in path.split(".") if path else ():
        obj = getattr(obj, part)
    return obj
