"""Ops around the computation: variables, shapes, generators, and ops that
simply run whole.

* Variables: a read or an update is element-wise on the variable's value
  (``&`` in the text form), so a variable splits like any tensor; a resource
  input's shape is the variable's.
* Fused optimizer updates (``ResourceApplyAdam`` and its kin, what tf-keras's
  legacy optimizers run): every variable they write and the gradient are read
  at the same element, the hyperparameters are scalars; so each written
  variable's element is a function of the same elements of the others.
* Shape ops read only static shapes (``~``): their inputs may have any layout
  and their outputs are metadata. Ops that compute index vectors from shape
  vectors (BroadcastGradientArgs; ConcatOffset, the begins of the slices that
  a concatenation's gradient cuts) are metadata in and out.
* Generators (a fed input, fill, random numbers) read nothing per element:
  every part makes its own block (random values are equal in distribution,
  not bit for bit; for a stateless generator the lowering must give each part
  its own counter, as DTensor does per shard).
* Constants, control flow (loops, conditionals), tensor lists (their variant
  handles have no shape in the IR) and no-ops are described as replicated:
  the ops inside a loop body are planned one by one.
"""

from __future__ import annotations

from tofu_tf.semantics.family import Family
from tofu_tf.semantics.language import MetaKind
from tofu_tf.semantics.ops._util import conservative, names
from tofu_tf.semantics.tdl import META_OUTPUT, Apply, Out, Position, Program, Update
from tofu_tf.semantics.view import OpView

REPLICATED = (
    "Const", "NoOp", "While", "StatelessWhile", "If", "StatelessIf", "Case", "StatelessCase",
    "EmptyTensorList", "TensorListFromTensor", "TensorListStack", "TensorListGetItem", "TensorListSetItem",
    "TensorListPushBack", "TensorListPopBack", "TensorListReserve", "TensorListLength",
    "TensorListElementShape", "TensorListResize", "TensorListConcatV2", "TensorListSplit",
)
GENERATORS = ("RandomUniform", "RandomStandardNormal", "TruncatedNormal", "RandomUniformInt",
              "StatelessRandomUniformV2", "StatelessRandomNormalV2", "StatelessTruncatedNormalV2")


def replicated_op(op: OpView):
    """runs whole on every device"""
    return conservative(op, "constant" if op.type == "Const" else "runs whole")


def read_variable(op: OpView):
    """out[i..] = var[i..]"""
    if op.input_shapes[0] is None:
        return conservative(op, "unknown variable")
    rank = len(op.input_shapes[0])
    return lambda var: Out(lambda *idx: var[idx], names(rank))


def assign(op: OpView):
    """var[i..] = value[i..] (AssignAdd: var[i..] + value[i..]; AssignSub: var[i..] - value[i..])"""
    if op.input_shapes[0] is None:
        return conservative(op, "unknown variable")
    rank = len(op.input_shapes[0])
    combine = {"AssignVariableOp": lambda old, new: new,
               "AssignAddVariableOp": lambda old, new: old + new,
               "AssignSubVariableOp": lambda old, new: old - new}[op.type]

    def program(var, value):
        if op.type == "AssignVariableOp":
            return (Update(var, lambda *idx: value[idx], names(rank)),)
        return (Update(var, lambda *idx: combine(var[idx], value[idx]), names(rank)),)
    return program


# Fused optimizer updates: the op type -> how many leading inputs are the variables it writes
# (the weight, then its slots). Every other input is the gradient (the weight's shape) or a
# scalar hyperparameter, as TF's raw_ops define them.
FUSED_UPDATES = {
    "ResourceApplyGradientDescent": 1, "ResourceApplyProximalGradientDescent": 1,
    "ResourceApplyKerasMomentum": 2, "ResourceApplyMomentum": 2, "ResourceApplyAdagrad": 2,
    "ResourceApplyAdagradV2": 2, "ResourceApplyProximalAdagrad": 2, "ResourceApplyAdam": 3,
    "ResourceApplyAdaMax": 3, "ResourceApplyAdadelta": 3, "ResourceApplyRMSProp": 3, "ResourceApplyFtrl": 3,
    "ResourceApplyFtrlV2": 3, "ResourceApplyCenteredRMSProp": 4, "ResourceApplyAdamWithAmsgrad": 4,
}


def fused_update(op: OpView):
    """var_k[i..] = f_k(var_0[i..], .., grad[i..], scalars[]) for each variable k it writes"""
    written = FUSED_UPDATES[op.type]
    shape = op.input_shapes[0]
    if shape is None or any(s is None for s in op.input_shapes):
        return conservative(op, "unknown variable shape")
    for position, other in enumerate(op.input_shapes):
        if other != shape and len(other) != 0:
            return conservative(op, f"input {position} is neither the variable's shape nor a scalar")
    rank = len(shape)
    op_type = op.type

    def program(*inputs):
        def value(position):
            def element(*idx):
                read = [x[idx] if len(x.shape) else x[()] for x in inputs]
                return Apply(f"{op_type}:{position}", *read)
            return element
        return tuple(Update(inputs[k], value(k), names(rank)) for k in range(written))
    return program


def var_handle(op: OpView):
    """var[i..] created (every part holds its block)"""
    if op.output_shapes[0] is None:
        return conservative(op, "unknown variable shape")
    rank = len(op.output_shapes[0])
    return Program(lambda: Out(lambda *idx: Apply("variable"), names(rank)), shape_attrs={"shape": 0})


def shape_op(op: OpView):
    """out = static shape of the inputs (any layout)"""
    if any(s is None for s in op.input_shapes):
        return conservative(op, "unknown input shape")

    def program(*xs):
        return (META_OUTPUT,) * op.num_outputs if op.num_outputs != 1 else META_OUTPUT
    return Program(program, shape_only=frozenset(range(op.num_inputs)))


def metadata_op(op: OpView):
    """out = a function of metadata inputs (shape vectors)"""
    return lambda *xs: (META_OUTPUT,) * op.num_outputs


def placeholder(op: OpView):
    """out[i..] fed from outside (every part receives its block)"""
    rank = len(op.output_shapes[0])
    return Program(lambda: Out(lambda *idx: Apply("fed"), names(rank)), shape_attrs={"shape": 0})


def random(op: OpView):
    """out[i..] = a random number (shape in input 0; every part draws its block)"""
    rank = len(op.output_shapes[0])
    stateless = op.type.startswith("Stateless")

    def program(shape, *rest):
        bounds = () if stateless else rest  # a stateless op's key, counter and algorithm are metadata
        return Out(lambda *idx: Apply(op.type, *(b[()] for b in bounds)), names(rank))
    return Program(program, meta={0: MetaKind.OUTPUT_SHAPE})


def range_(op: OpView):
    """out[i] = start + i * delta: the value is the global position"""
    return lambda start, limit, delta: lambda i: Position(i, args=(start[()], delta[()]))


def fill(op: OpView):
    """out[i..] = value[] (shape in input 0)"""
    rank = len(op.output_shapes[0])
    return Program(lambda dims, value: Out(lambda *idx: value[()], names(rank)), meta={0: MetaKind.OUTPUT_SHAPE})


def register(registry) -> None:
    for op_type in REPLICATED:
        registry.register(op_type, family=Family.REPLICATED)(replicated_op)
    registry.register("ReadVariableOp", family=Family.VARIABLE)(read_variable)
    for op_type in ("AssignVariableOp", "AssignAddVariableOp", "AssignSubVariableOp"):
        registry.register(op_type, family=Family.VARIABLE)(assign)
    registry.register("VarHandleOp", family=Family.VARIABLE)(var_handle)
    for op_type in FUSED_UPDATES:
        registry.register(op_type, family=Family.VARIABLE)(fused_update)
    registry.register("VarIsInitializedOp", family=Family.VARIABLE)(shape_op)
    registry.register("VariableShape", family=Family.SHAPE)(shape_op)
    for op_type in ("Shape", "ShapeN", "Size", "Rank"):
        registry.register(op_type, family=Family.SHAPE)(shape_op)
    for op_type in ("BroadcastGradientArgs", "ConcatOffset"):
        registry.register(op_type, family=Family.SHAPE)(metadata_op)
    registry.register("StatelessRandomGetKeyCounter", family=Family.GENERATOR)(metadata_op)
    registry.register("Placeholder", family=Family.GENERATOR)(placeholder)
    registry.register("Fill", family=Family.GENERATOR)(fill)
    registry.register("Range", family=Family.GENERATOR)(range_)
    for op_type in GENERATORS:
        registry.register(op_type, family=Family.GENERATOR)(random)
