"""Lowering targets: which of Tofu's strategies the backend that runs the plan can express.

``Target.IDEAL`` keeps every strategy the operator semantics derive (Tofu's
full space; the benches use it). ``Target.DTENSOR`` (the default) drops what
TF 2.21's DTensor SPMD expanders cannot lower, as checked on this project's
machines:

* convolutions (``Conv2D``, ``Conv2DBackpropInput``, ``Conv2DBackpropFilter``,
  ``DepthwiseConv2dNative`` and its backprops) run batch-split or replicated only:
  the filter stays whole and no other dim of the data tensors is split; so do the
  other ops of a convolution's layer (a Conv1D's bias add on 3-D tensors), and the
  weights they read stay replicated. In a
  graph with convolutions, 4-D activations are split on the batch dim only and
  weights read by ops on 4-D tensors (BatchNorm's scale and offset) stay
  replicated: DTensor propagates a channel split back into the convolution.
  It also carries a later layer's feature split back through reshapes into the
  gradient of a convolution's output (a ViT's patch embedding), and its
  ``Conv2DBackpropFilter`` expander refuses that gradient in any layout but a
  batch-parallel one; the strategy relays it out as priced
  (``tofu_tf.tf.compat.layers.relayout_layer_inputs``);
* ``Split``/``SplitV`` never split the dim they cut along;
* ``Pack``/``Unpack`` never split the dim they stack along;
* variables read by an LSTM/GRU cell (ops whose Keras layer is an LSTM or GRU
  layer or cell) stay replicated: a split kernel propagates into the unrolled
  input and DTensor's Unpack expander mis-shapes it;
* a mesh axis splits the batch or the weights, never both (``AxisRole``): on a
  *batch* axis every batch input is split on dim 0 and no variable is split, on
  a *model* axis no batch input is split; the search solves each axis both ways
  and keeps the cheaper. Two reasons. The lowering lays every batch input out by
  one batch axis (``tofu_tf.tf.lowering.Lowered.batch_layout``), so a plan that
  splits some inputs and not others is not what runs. And DTensor's layout
  propagation is a fixed-point iteration that merges what producers and
  consumers ask for; where one op's operands carry the same mesh axis on
  different dims (the batch split of the data meets the feature split of a
  weight's output) it oscillates, gives up after its step limit, clears the
  changing layouts and locks the rest. The result can ask a reduction (``Sum``,
  ``Mean``, ...) for an output less split than its input, and DTensor's reduce
  expander only splits further (``EmitAllScatter ... was not more sharded than
  the original_layout``): the first step fails at an RMSNorm scale's gradient
  (Gemma, Llama, Mistral) or a LayerNorm's mean (GPT-2). The same weight layouts
  train with the batch whole on their axis. On a model axis no op splits a dim that
  carries the batch (``GraphIndex.batch_dims``): with the batch inputs whole,
  nothing DTensor propagates from asks for that split, so the op would run whole,
  and pricing it as a free local slice and a divided work priced a data
  parallelism that never ran;
* a table that a gather reads by rows (an Embedding) is never split on its rows
  (``unsplit_variable_dims``): DTensor's ResourceGather refuses a sharded dim 0
  ("DTensor does not support sharded 0th dimension for the resource tensor"),
  and a plan that priced split rows ran with whole rows (the lowering unsplit
  them), its activations split otherwise than priced.

Some of DTensor's expanders are broken for every layout, so no plan can route
around them; ``check_lowerable`` refuses such a graph before its first step,
naming the op, its Keras layer and what to write instead. Each entry has a
minimal DTensor reproducer in ``tests/test_dtensor_expanders.py``:

* ``StridedSlice`` with a new axis before axes its spec leaves implicit
  (``t[None]``, ``t[:, None]`` on a matrix, ``t[None, ...]``): DTensor's forward
  layout inference reads the layout of an implicit axis at its output position,
  not its input position. After a new axis that is another dim's layout (one
  mesh axis can land on two dims), or past the end of the input's layout: an
  out-of-bounds read, a segfault or an error whose text is garbage bytes, in
  every layout, replicated included. Spelling every axis (``t[None, :, :]``)
  or ``tf.expand_dims`` lowers correctly. TofuStrategy's variables spell the
  axes themselves (``tofu_tf.tf.variables``), so a position table written
  ``x + table[None]`` trains, and so do the tensor slices of a model the strategy
  prepared, while its call runs (``tofu_tf.tf.compat.slices``: keras-hub XLNet's
  segment matrix); a tensor sliced so elsewhere is refused.
* ops DTensor cannot run even replicated (``NO_LAYOUT_PROPAGATION``): not a list
  written here but derived by probing one-op DTensor programs of every op type the
  semantics registry describes and of the programs the keras-hub sweep met, replicated
  and batch-split, in child processes (``tofu_tf.search.dtensor_support``, regenerated by
  ``bench/dtensor_support.py``; ``tests/test_dtensor_support.py`` probes again and fails
  when TensorFlow changes an outcome). In TF 2.21: the linear algebra of
  ``tf.linalg.svd``, ``det``, ``inv``, ``eigh``, ``solve``, the matrix band/diagonal ops,
  ``cumprod``, ``bincount``, Python functions (``tf.py_function``, ``tf.numpy_function``),
  a ``tf.scan``/``TensorArray``'s ``TensorListStack``, a depthwise convolution's gradients,
  an int8 ``BatchMatMulV3``, the softplus and softsign gradients, ``MirrorPad``,
  ``ArgMin``, stateful random ops, and the fused updates of some of tf-keras's legacy
  optimizers (Adam with amsgrad, the proximal ones; Adadelta's, Adamax's, Ftrl's and
  momentum RMSprop's the strategy computes in elementwise ops,
  ``tofu_tf.tf.compat.legacy_dense``). The legacy SGD, Adam, Adagrad and centered RMSprop updates
  (``ResourceApplyKerasMomentum``, ``ResourceApplyAdam``, ``ResourceApplyAdagradV2``,
  ``ResourceApplyCenteredRMSProp``) run, each with its weight and slots in one layout
  (``tofu_tf.tf.lowering.dtensor_natural``). An op DTensor runs replicated but not in the
  batch-split layout the planner gives it (``REPLICATED_ONLY``; none in TF 2.21) is
  planned replicated. The ops TofuStrategy's own layer changes remove from Keras' layers
  (``STRATEGY_REWRITES``) are refused only in the strategy's own check, after those changes.

Either is refused only when it computes on the step's data: DTensor folds an op
on constants (a causal mask's ``band_part``) before it expands anything, while its
result is small (``tf.eye(40)`` folded, ``tf.eye(48)``, 9 KiB, did not, TF 2.21). The ops of
``ENROLLED_REPLICATED`` (``MatrixDiagV3``, a ``tf.eye``) are not refused: TofuStrategy has
DTensor run them replicated, on constants or not, and the planner keeps them replicated.

Not a plan matter, and handled where it arises: DTensor's MatMul expander
refuses operands whose contracted dims are split on different mesh axes
("Contracting dimension for matmul has sharding dimension a for the left input
and b for the right input") instead of relaying one out; a plan that moves a
feature dim from one axis to another before a Dense layer gets that relayout
from the strategy (``relayout_layer_inputs``), as does an ``EinsumDense``
layer's input (its contracted dims to the kernel's axes); other contractions
(attention's own einsums) do not. Likewise, DTensor cannot relayout a
tensor whose size depends on the data (splitting one leaves each shard with no
rows; gathering one aborts the process). An Embedding's deduplicated sparse
gradient is such a tensor; ``TofuVariable.sparse_read`` lays its gradient out
like the table before the rows are deduplicated, so none is needed. And
where propagation gives up inside a backward pass with weights split
Megatron-style (Gemma's MLP: a kernel gradient's ``Sum`` over the batch asked
for the kernel's column split while its input carries the row split), the
reduce expander refuses as above; every dense gradient reaches the optimizer
through an explicit relayout to its variable's layout
(``tofu_tf.tf.compat.optimizers.relayout_gradients``), which ends the requests
there.

The search applies a target as a wrapper around the strategy provider, a set of
variables pinned to replication, the dims of others no axis splits and the roles
an axis may take; it imports no TensorFlow.
"""

from __future__ import annotations

import dataclasses
import enum
import re
from typing import Iterator, Sequence

from tofu_tf import ir
from tofu_tf.errors import TofuError
from tofu_tf.search import dtensor_support
from tofu_tf.semantics.strategy import OpStrategy

CONV_OPS = frozenset({
    "Conv2D", "Conv2DBackpropInput", "Conv2DBackpropFilter", "Conv3D", "DepthwiseConv2dNative",
    "DepthwiseConv2dNativeBackpropInput", "DepthwiseConv2dNativeBackpropFilter"})
# Where the filter sits: ("in", index) or ("out", index).
_FILTER = {"Conv2D": ("in", 1), "Conv3D": ("in", 1), "DepthwiseConv2dNative": ("in", 1),
           "Conv2DBackpropInput": ("in", 1), "DepthwiseConv2dNativeBackpropInput": ("in", 1),
           "Conv2DBackpropFilter": ("out", 0), "DepthwiseConv2dNativeBackpropFilter": ("out", 0)}
_RECURRENT_LAYER = re.compile(r"(^|[^a-z])(lstm|gru)", re.IGNORECASE)


class Target(enum.Enum):
    DTENSOR = "dtensor"
    IDEAL = "ideal"


# Op types TF's DTensor cannot run even replicated, derived by probing one-op programs
# (``tofu_tf.search.dtensor_support``, regenerated by ``bench/dtensor_support.py``):
# no layout propagation, another refusal, a wrong value or a crash.
# Op types DTensor has no layout propagation for, which it runs whole on every device once enrolled
# in its replicated expansion (its switch DTENSOR_ENABLE_REPLICATED_SPMD_AS_DEFAULT_<TF.OP>, the change
# dtensor_replicated_ops): TofuStrategy enrolls them before it compiles a step holding one
# (``tofu_tf.tf.compat.decoding.enroll_step_ops``), and the planner keeps them replicated, priced so.
# MatrixDiagV3: ``tf.eye`` / ``keras.ops.eye`` (keras-hub Qwen3.5's gated delta rule adds an eye of
# its chunk size, 64), which DTensor folds only while the result is small (an eye of 40 folded, one
# of 48 did not, TF 2.21). ``tests/test_dtensor_support.py`` probes both sides of the switch.
ENROLLED_REPLICATED = frozenset({"MatrixDiagV3"})
NO_LAYOUT_PROPAGATION = dtensor_support.load().refused_in_every_layout() - ENROLLED_REPLICATED
# Op types DTensor runs replicated but not batch-split: the planner keeps them replicated.
REPLICATED_ONLY = dtensor_support.load().refused_when_batch_split() | ENROLLED_REPLICATED
# The op capture names a sparse gradient's sum by when the optimizer deduplicates its rows with
# ``tf.unique`` (tf-keras' optimizers): DTensor runs that Unique on the whole index vector, so the
# segment sum reads its rows whole; the planner keeps them so, and prices their gather.
DEDUPLICATED_SPARSE_GRADIENT = "deduplicated_sparse_gradient"
_DEDUPLICATED = re.compile(r"(^|/)" + DEDUPLICATED_SPARSE_GRADIENT + r"(_\d+)?$")
# Op types TofuStrategy's layer changes take out of Keras' own layers before it plans
# (``tofu_tf.tf.compat.layers``): fused normalizations (batch_norm_unfused, layer_norm_unfused),
# AvgPoolGrad (average_pool_as_mean, average_pool_as_window_sum), an RNN's TensorList loop
# (rnn_unrolled), tf-keras' stateful dropout (dropout_step_seeded), depthwise convolutions
# (depthwise_as_grouped_conv), Keras 3's and tf-keras's dilated convolutions' SpaceToBatchND (dilated_conv_in_conv2d).
# A step captured without the strategy (``plan_graph`` on a model of one's own) still holds
# them, and is planned as the strategy would run it; the strategy's own check is strict
# (``check_lowerable(..., exempt=frozenset())``): what remains there is a layer's own use.
STRATEGY_REWRITES = frozenset({
    "FusedBatchNorm", "FusedBatchNormV2", "FusedBatchNormV3", "FusedBatchNormGrad", "FusedBatchNormGradV2",
    "FusedBatchNormGradV3", "AvgPoolGrad", "TensorListStack", "RandomUniform", "RandomUniformInt",
    "RandomStandardNormal", "TruncatedNormal", "DepthwiseConv2dNativeBackpropFilter",
    "DepthwiseConv2dNativeBackpropInput", "SpaceToBatchND"})
# The fused updates of tf-keras's legacy optimizers that DTensor cannot run, by the optimizer
# that emits each (the new optimizer of the same name computes its update from plain ops).
_LEGACY_UPDATE_OF = {
    "ResourceApplyProximalGradientDescent": "ProximalGradientDescent", "ResourceApplyAdagrad": "Adagrad",
    "ResourceApplyProximalAdagrad": "ProximalAdagrad", "ResourceApplyAdaMax": "Adamax",
    "ResourceApplyAdadelta": "Adadelta", "ResourceApplyRMSProp": "RMSprop (with momentum)",
    "ResourceApplyFtrl": "Ftrl", "ResourceApplyFtrlV2": "Ftrl (with l2_shrinkage)",
    "ResourceApplyAdamWithAmsgrad": "Adam (amsgrad=True)"}
_PYTHON_FUNCTIONS = frozenset({"EagerPyFunc", "PyFunc", "PyFuncStateless"})
# What a user wrote to get each op (its forward or its gradient).
_WRITTEN_AS = {
    "Svd": "tf.linalg.svd", "MatrixDeterminant": "tf.linalg.det", "LogMatrixDeterminant": "tf.linalg.slogdet",
    "MatrixInverse": "tf.linalg.inv", "SelfAdjointEigV2": "tf.linalg.eigh", "MatrixSolve": "tf.linalg.solve",
    "MatrixTriangularSolve": "tf.linalg.triangular_solve", "MatrixBandPart": "tf.linalg.band_part",
    "MatrixDiagPartV3": "tf.linalg.diag_part", "MatrixDiagV3": "tf.linalg.diag",
    "MatrixSetDiagV3": "tf.linalg.set_diag", "Cumprod": "tf.math.cumprod", "DenseBincount": "tf.math.bincount",
    "EagerPyFunc": "tf.py_function", "PyFunc": "tf.numpy_function", "PyFuncStateless": "tf.numpy_function",
    "StridedSlice": "t[...]", "TensorListStack": "a tf.while_loop, tf.scan or tf.TensorArray",
    "DepthwiseConv2dNativeBackpropFilter": "a depthwise convolution (keras.ops.depthwise_conv, tf.nn.depthwise_conv2d)",
    "DepthwiseConv2dNativeBackpropInput": "a depthwise convolution (keras.ops.depthwise_conv, tf.nn.depthwise_conv2d)",
    "SpaceToBatchND": "a dilated convolution built by tf.nn (with_space_to_batch)",
    "BatchMatMulV3": "a matmul of int8 or mixed-dtype operands (an int8-quantized layer)",
    "SoftplusGrad": "the softplus activation", "SoftsignGrad": "the softsign activation",
    "MirrorPad": "tf.pad with mode REFLECT or SYMMETRIC", "EuclideanNorm": "tf.math.reduce_euclidean_norm",
    "ArgMin": "tf.argmin", "FusedBatchNormV3": "a fused batch normalization",
    "ExtractImagePatches": "tf.image.extract_patches"}
# Ops whose value is not known before the step even when their inputs are.
_UNFOLDED = re.compile(r"Random|Placeholder|VarHandle|ReadVariable|Variable")


class AxisRole(enum.Enum):
    """What one mesh axis may split (``tofu_tf.search.problem.ProblemBuilder``).

    ``ANY``: anything (the ideal target). ``BATCH``: every batch input on dim 0 and
    no variable. ``MODEL``: variables, and no batch input."""

    ANY = "any"
    BATCH = "batch"
    MODEL = "model"


def axis_roles(target: Target) -> tuple[AxisRole, ...]:
    """The roles the search tries for each mesh axis, keeping the cheaper: DTensor's
    layout propagation handles an axis that splits the batch or the weights, not both
    (this module's docstring says why)."""
    return (AxisRole.ANY,) if target is Target.IDEAL else (AxisRole.BATCH, AxisRole.MODEL)


class UnsupportedOpError(TofuError, ValueError):
    """The training step holds ops the target cannot run in any layout."""


@dataclasses.dataclass(frozen=True)
class Unlowerable:
    """An op the target cannot run in any layout, and what to write instead."""

    op: str
    type: str
    layer: str | None
    reason: str
    remedy: str

    def text(self) -> str:
        layer = f"Keras layer {self.layer!r}" if self.layer else "no Keras layer"
        written = f", from {_WRITTEN_AS[self.type]} or its gradient" if self.type in _WRITTEN_AS else ""
        return f"{self.type} {self.op!r} ({layer}{written}): {self.reason}; {self.remedy}"


def restrict_provider(provider, target: Target, graph: ir.Graph):
    """``provider`` without the strategies ``target`` cannot lower."""
    if target is Target.IDEAL:
        return provider
    has_conv = any(op.type in CONV_OPS for op in graph.ops)
    conv_layers = convolution_layers(graph)

    def lowerable(op: ir.Op, graph_: ir.Graph, n: int) -> list[OpStrategy]:
        return [s for s in provider(op, graph_, n)
                if dtensor_lowerable(op, graph_, s, has_conv=has_conv, conv_layers=conv_layers)]
    return lowerable


def convolution_layers(graph: ir.Graph) -> frozenset[str]:
    """The Keras layers that run a convolution (their ops' ``layer``)."""
    return frozenset(op.layer for op in graph.ops if op.type in CONV_OPS and op.layer)


def dtensor_lowerable(op: ir.Op, graph: ir.Graph, strategy: OpStrategy, *, has_conv: bool = False,
                      conv_layers: frozenset[str] = frozenset()) -> bool:
    """Whether DTensor (TF 2.21) can run ``op`` under ``strategy`` on one mesh axis.

    Every op of a convolution's layer runs batch-split or replicated, like the
    convolution: a Conv1D adds its bias and applies its activation to 3-D tensors
    after squeezing the convolution's output, and DTensor propagates a channel split
    there back into the convolution."""
    ins, outs = strategy.inputs, strategy.outputs
    if op.type in REPLICATED_ONLY:
        return all(s.replicated for s in (*ins, *outs))
    if op.type == "UnsortedSegmentSum" and _DEDUPLICATED.search(op.name):
        return len(ins) > 1 and ins[1].replicated        # the segment ids whole, so the rows they index
    if op.layer in conv_layers and op.type not in CONV_OPS:
        return all(s.dim in (None, 0) for s in (*ins, *outs))
    if op.type in CONV_OPS:
        side, index = _FILTER.get(op.type, ("in", 1))
        filt = (ins if side == "in" else outs)[index] if index < len(ins if side == "in" else outs) else None
        if filt is not None and filt.dim is not None:
            return False
        return all(s.dim in (None, 0) for s in (*ins, *outs))
    if has_conv:
        for names, splits in ((op.inputs, ins), (op.outputs, outs)):
            for name, split in zip(names, splits):
                tensor = graph.tensors.get(name)
                if split.dim not in (None, 0) and tensor is not None and tensor.rank == 4:
                    return False
    if op.type in ("Split", "SplitV"):
        axis_pos, x_pos = (0, 1) if op.type == "Split" else (2, 0)
        axis = _const_axis(graph, op, axis_pos, x_pos)
        if axis is None:
            return all(s.dim is None for s in (*ins, *outs))
        if x_pos < len(ins) and ins[x_pos].dim == axis:
            return False
        return all(s.dim != axis for s in outs)
    if op.type in ("Pack", "Unpack"):
        rank = _rank(graph, op.outputs[0] if op.type == "Pack" else op.inputs[0])
        if rank is None:
            return all(s.replicated for s in (*ins, *outs))
        axis = int(op.attrs.get("axis", 0)) % rank
        stacked = outs[:1] if op.type == "Pack" else ins[:1]
        if any(s.dim == axis for s in stacked):
            return False
    return True


def unlowerable_ops(graph: ir.Graph, target: Target, *,
                    exempt: frozenset[str] = STRATEGY_REWRITES) -> tuple[Unlowerable, ...]:
    """The ops of ``graph`` that ``target`` cannot run in any layout, one per op
    type and Keras layer (the list in this module's docstring), but for ``exempt`` op types."""
    if target is Target.IDEAL:
        return ()
    found: dict[tuple[str, str | None], Unlowerable] = {}
    for op in _unlowerable(graph):
        if op.type in exempt:
            continue
        found.setdefault((op.type, op.layer), op)
    return tuple(found.values())


def check_lowerable(graph: ir.Graph, target: Target, *, exempt: frozenset[str] = STRATEGY_REWRITES) -> None:
    """Raise ``UnsupportedOpError`` naming every op ``target`` cannot run, before any step does.

    ``exempt``: op types not refused (by default those TofuStrategy's layer changes remove
    from Keras' own layers, ``STRATEGY_REWRITES``; the strategy passes none)."""
    found = unlowerable_ops(graph, target, exempt=exempt)
    if found:
        lines = "\n".join(f"  * {u.text()}" for u in found)
        raise UnsupportedOpError(
            f"TF's DTensor cannot run {len(found)} op(s) of this training step in any layout, so no plan "
            f"can shard it:\n{lines}\nRewrite those ops as suggested, or train this model without "
            "TofuStrategy.")


def _unlowerable(graph: ir.Graph) -> Iterator[Unlowerable]:
    known = _known_before_the_step(graph)
    for op in graph.ops:
        if op.body is not None:
            yield from _unlowerable(op.body)
        if all(t in known for t in op.inputs):
            continue  # folded before DTensor expands anything
        if op.type in NO_LAYOUT_PROPAGATION:
            yield Unlowerable(op.name, op.type, op.layer, _refusal(op.type), _remedy(op.type))
        elif op.type == "StridedSlice" and _new_axis_shifts_implicit_axes(graph, op):
            yield Unlowerable(op.name, op.type, op.layer, "a new axis before axes the slice leaves implicit "
                              "(t[None] or t[:, None] on a matrix) crashes DTensor's StridedSlice expander "
                              "in every layout", "spell every axis (t[None, :, :]) or use tf.expand_dims")


def _refusal(op_type: str) -> str:
    """What DTensor does with ``op_type`` replicated, as probed (``dtensor_support``)."""
    outcome = dtensor_support.load().outcome(op_type)
    if outcome is None or outcome.outcome == "no_layout_propagation":
        return "DTensor has no layout propagation for it, not even replicated"
    if outcome.outcome == "crash":
        return "DTensor crashes the process on it, even replicated"
    if outcome.outcome == "wrong":
        return "DTensor computes it wrong, even replicated"
    return f"DTensor refuses it even replicated ({outcome.detail})"


_REMEDIES = {
    "TensorListStack": "unroll the loop in Python over a static length (TofuStrategy unrolls a Keras RNN layer and "
                       "a tf.scan of static length itself), or compute the recurrence outside the training step",
    "DepthwiseConv2dNativeBackpropFilter": "use keras.layers.DepthwiseConv2D or SeparableConv2D, or "
                                           "keras.ops.depthwise_conv (channels_last; TofuStrategy runs "
                                           "them as grouped convolutions, or as sums of strided slices where "
                                           "the device has no grouped gradients), or a grouped "
                                           "keras.layers.Conv2D (groups=channels)",
    "SpaceToBatchND": "use a Keras Conv2D (Keras 3 or tf-keras, stride 1, channels_last) or DepthwiseConv2D "
                      "with dilation_rate (TofuStrategy runs their dilation in the convolution itself)",
    "BatchMatMulV3": "train the float model and quantize it after training (int8 matmuls are for inference)",
    "SoftplusGrad": "write the activation with ops DTensor expands (tf.math.log1p(tf.exp(-abs(x))) + relu(x)) "
                    "or use another activation",
    "SoftsignGrad": "write the activation with ops DTensor expands (x / (1 + abs(x))) or use another activation",
    "MirrorPad": "pad with zeros (tf.pad mode CONSTANT) or concatenate slices",
    "FusedBatchNormV3": "use keras.layers.BatchNormalization (TofuStrategy runs it unfused)",
    "AvgPoolGrad": "use keras.layers.AveragePooling2D (channels_last: TofuStrategy runs it as a mean or a sum "
                   "of strided slices) or a mean",
    "RandomUniform": "draw with a stateless op (tf.random.stateless_uniform, Keras 3 seed generators)",
}
_REMEDIES["DepthwiseConv2dNativeBackpropInput"] = _REMEDIES["DepthwiseConv2dNativeBackpropFilter"]
for _grad in ("FusedBatchNorm", "FusedBatchNormV2", "FusedBatchNormGrad", "FusedBatchNormGradV2",
              "FusedBatchNormGradV3"):
    _REMEDIES[_grad] = _REMEDIES["FusedBatchNormV3"]
for _draw in ("RandomUniformInt", "RandomStandardNormal", "TruncatedNormal"):
    _REMEDIES[_draw] = _REMEDIES["RandomUniform"]


def _remedy(op_type: str) -> str:
    if op_type in _REMEDIES:
        return _REMEDIES[op_type]
    if op_type in _LEGACY_UPDATE_OF:
        name = _LEGACY_UPDATE_OF[op_type]
        return (f"it is the fused update of tf_keras.optimizers.legacy.{name}; use the new optimizer, "
                f"tf_keras.optimizers.{name.split(' ')[0]} (tf-keras's default), whose update DTensor runs")
    if op_type in _PYTHON_FUNCTIONS:
        return ("write the layer with TensorFlow ops: a Python function runs outside the graph DTensor "
                "expands (and its gradient has no static shape)")
    return ("compute it outside the training step (in a callback) or with ops DTensor expands "
            "(matmul, Qr, Cholesky, elementwise ops)")


def _known_before_the_step(graph: ir.Graph) -> set[str]:
    """Tensors whose value is fixed before the step runs: constants and what pure
    ops compute from constants alone (DTensor folds them before expanding)."""
    known = {name for name, t in graph.tensors.items() if t.const_value is not None and not t.producer}
    for op in graph.ops:
        foldable = op.type == "Const" or (op.inputs and not _UNFOLDED.search(op.type)
                                           and all(t in known for t in op.inputs))
        if foldable:
            known.update(op.outputs)
    return known


def _new_axis_shifts_implicit_axes(graph: ir.Graph, op: ir.Op) -> bool:
    """Whether a StridedSlice leaves an input axis implicit (under an ellipsis or
    after the spec's end) after more new axes than shrunk ones: the axes where
    DTensor's forward layout inference (TF 2.21) reads the input's layout at the
    output position instead of the input position."""
    new = int(op.attrs.get("new_axis_mask", 0) or 0)
    rank = _rank(graph, op.inputs[0]) if op.inputs else None
    spec = graph.tensors.get(op.inputs[1]) if len(op.inputs) > 1 else None
    if not new or rank is None or spec is None or len(spec.shape) != 1:
        return bool(new)  # unknown spec or rank: assume the worst
    shrink = int(op.attrs.get("shrink_axis_mask", 0) or 0)
    ellipsis = int(op.attrs.get("ellipsis_mask", 0) or 0)
    tokens = spec.shape[0]
    bits = [1 << i for i in range(tokens)]
    named = sum(1 for b in bits if not b & new and (b & shrink or not b & ellipsis))
    shift, consumed, has_ellipsis = 0, 0, False
    for bit in bits:
        if bit & new:
            shift += 1
        elif bit & shrink:
            shift -= 1
            consumed += 1
        elif bit & ellipsis:
            has_ellipsis = True
            if rank - named > 0 and shift > 0:
                return True
            consumed += rank - named
        else:
            consumed += 1
    return not has_ellipsis and rank > consumed and shift > 0


def pinned_variables(graph: ir.Graph, target: Target) -> frozenset[str]:
    """Variables ``target`` needs replicated (weight paths; their slots follow)."""
    if target is Target.IDEAL:
        return frozenset()
    has_conv = any(op.type in CONV_OPS for op in graph.ops)
    conv_layers = convolution_layers(graph)
    pinned: set[str] = set()
    readers: dict[str, list[ir.Op]] = {}
    for op in graph.ops:
        for name in op.inputs:
            readers.setdefault(name, []).append(op)
    for op in graph.ops:
        if op.type != "ReadVariableOp" or not op.outputs:
            continue
        tensor = graph.tensors.get(op.outputs[0])
        if tensor is None or tensor.variable_path is None:
            continue
        users = _users_through_aliases(op.outputs[0], readers)
        if _is_recurrent(op) or any(_is_recurrent(u) for u in users):
            pinned.add(tensor.variable_path)
        elif has_conv and any(u.type in CONV_OPS or u.layer in conv_layers or _touches_rank4(u, graph)
                              for u in users):
            pinned.add(tensor.variable_path)
    return frozenset(pinned)


def unsplit_variable_dims(graph: ir.Graph, target: Target) -> dict[str, frozenset[int]]:
    """Per weight path, the dims ``target`` cannot split (its slots follow): the rows
    of a table a gather reads along dim 0 (an Embedding), which DTensor's gather
    expanders refuse to split."""
    if target is Target.IDEAL:
        return {}
    readers: dict[str, list[ir.Op]] = {}
    for op in graph.ops:
        for name in op.inputs:
            readers.setdefault(name, []).append(op)
    out: dict[str, frozenset[int]] = {}
    for op in graph.ops:
        if op.type == "ResourceGather" and op.inputs:     # tf-keras: a lookup on the variable's handle
            handle = graph.tensors.get(op.inputs[0])
            if handle is not None and handle.variable_path is not None:
                out[handle.variable_path] = frozenset({0})
        if op.type != "ReadVariableOp" or not op.outputs:
            continue
        tensor = graph.tensors.get(op.outputs[0])
        if tensor is None or tensor.variable_path is None or not tensor.rank:
            continue
        aliases = _aliases_of(op.outputs[0], readers)
        if any(_gathers_rows(u, aliases, graph) for u in _users_through_aliases(op.outputs[0], readers)):
            out[tensor.variable_path] = frozenset({0})
    return out


def _aliases_of(name: str, readers: dict[str, list[ir.Op]]) -> set[str]:
    """``name`` and the tensors that pass it on unchanged (Identity, IdentityN)."""
    out, work = {name}, [name]
    while work:
        for user in readers.get(work.pop(), ()):
            if user.type in ("Identity", "IdentityN"):
                fresh = [t for t in user.outputs if t not in out]
                out.update(fresh)
                work.extend(fresh)
    return out


def _gathers_rows(op: ir.Op, params: set[str], graph: ir.Graph) -> bool:
    """Whether ``op`` gathers rows (dim 0) of one of ``params`` (Keras 3: a GatherV2 on the read)."""
    if op.type != "GatherV2" or not op.inputs or op.inputs[0] not in params:
        return False
    axis = graph.tensors[op.inputs[2]].const_value if len(op.inputs) > 2 and op.inputs[2] in graph.tensors else 0
    return axis in (0, None) or (isinstance(axis, (tuple, list)) and tuple(axis) in ((0,), ()))


def _is_recurrent(op: ir.Op) -> bool:
    return op.layer is not None and bool(_RECURRENT_LAYER.search(op.layer)) or op.type in ("While", "StatelessWhile")


def _touches_rank4(op: ir.Op, graph: ir.Graph) -> bool:
    return any(graph.tensors[t].rank == 4 for t in (*op.inputs, *op.outputs) if t in graph.tensors)


def _users_through_aliases(name: str, readers: dict[str, list[ir.Op]]) -> list[ir.Op]:
    out, work, seen = [], [name], set()
    while work:
        current = work.pop()
        for user in readers.get(current, ()):
            if user.name in seen:
                continue
            seen.add(user.name)
            if user.type in ("Identity", "IdentityN", "Reshape", "ExpandDims", "Cast"):
                work.extend(user.outputs)
            out.append(user)
    return out


def _const_axis(graph: ir.Graph, op: ir.Op, axis_pos: int, x_pos: int) -> int | None:
    if axis_pos >= len(op.inputs) or x_pos >= len(op.inputs):
        return None
    value = graph.tensors[op.inputs[axis_pos]].const_value if op.inputs[axis_pos] in graph.tensors else None
    rank = _rank(graph, op.inputs[x_pos])
    if isinstance(value, (tuple, list)):
        value = value[0] if len(value) == 1 else None
    if not isinstance(value, int) or rank is None:
        return None
    return value % rank


def _rank(graph: ir.Graph, name: str) -> int | None:
    tensor = graph.tensors.get(name)
    return None if tensor is None else tensor.rank


def as_target(value: "Target | str") -> Target:
    try:
        return Target(value)
    except ValueError:
        raise ValueError(f"unknown target {value!r}; use 'dtensor' (what TF's DTensor can lower) "
                         "or 'ideal' (every strategy Tofu derives)") from None


__all__: Sequence[str] = ("Target", "AxisRole", "axis_roles", "restrict_provider", "dtensor_lowerable",
                          "pinned_variables", "unsplit_variable_dims", "as_target", "NO_LAYOUT_PROPAGATION", "ENROLLED_REPLICATED",
                          "REPLICATED_ONLY", "STRATEGY_REWRITES",
                          "UnsupportedOpError", "Unlowerable", "unlowerable_ops", "check_lowerable")
