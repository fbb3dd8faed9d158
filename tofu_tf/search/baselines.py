"""Hand-written baselines as restrictions of the same search problem.

* **data_parallel**: one ``batch`` axis over all devices; every batch input is
  split on dim 0, every variable replicated, every op that reads the batch must
  run split (none is computed redundantly) without splitting a weight it reads
  or a gradient it makes, and splitting a tensor that carries the batch only
  where it carries it (``GraphIndex.batch_dims``), so the completion is the
  batch split with gradient all-reduces: a BatchNormalization's moments are
  partial sums over the batch, not their input moved to a split of its
  channels. An op that reads nothing carrying the batch may also run whole:
  the reshapes after a kernel gradient's ``Sum`` over the batch, a
  normalization's per-channel statistics after their all-reduce, the loss after
  its mean. Data parallelism all-reduces the partial sum and computes on the
  reduced tensor on every device, as DTensor and MirroredStrategy run it;
  splitting such an op over the batch axis would price a redistribution of a
  tensor that no longer carries the batch (a reduce-scatter) and a gather after
  it, collectives DTensor never runs.
* **megatron**: one ``model`` axis; Dense kernels alternate column (split the
  output dim) and row (split the input dim) parallel; in Transformer blocks
  attention q/k/v are column-parallel (split heads) and the output projection
  row-parallel, the MLP's first Dense column- and second row-parallel (Shoeybi
  et al., 2019). Everything else is replicated; the DP fills in activations.

Expressing baselines as restrictions means they are priced by exactly the
cost model the search uses, so "tofu is never worse" is a statement about
plans, not about two cost models.
"""

from __future__ import annotations

from typing import Callable

from tofu_tf import ir
from tofu_tf.errors import TofuError
from tofu_tf.search.coarsen import GraphIndex, NodeId, NodeKind
from tofu_tf.search.problem import Option
from tofu_tf.semantics.strategy import REPLICATED, TensorSplit


class BaselineNotApplicableError(TofuError, ValueError):
    """The model does not have the structure a hand pattern needs."""


def data_parallel_restriction(index: GraphIndex, num_devices: int) -> Callable[[NodeId, Option], bool]:
    for name in index.input_ops:
        shape = index.graph.tensors[index.ops[name].outputs[0]].shape
        if not shape or shape[0] % num_devices:
            raise BaselineNotApplicableError(
                f"data_parallel needs the batch ({shape[0] if shape else 'scalar'} in input {name!r}) to divide "
                f"over {num_devices} devices; choose a batch size that is a multiple of {num_devices}")

    batch_dims = index.batch_dims(num_devices)

    def allowed(node: NodeId, option: Option) -> bool:
        if node.kind is NodeKind.VARIABLE:
            return option.var_split == REPLICATED
        if node.kind is NodeKind.INPUT:
            return option.label == "S0"
        if option.label == "replicate":
            return _reads_no_batch(index, node.name, batch_dims)
        return not _splits_state(index, node.name, option) and _splits_batch_where_it_is(
            index.ops[node.name], option, batch_dims)
    return allowed


def _splits_batch_where_it_is(op: ir.Op, option: Option, batch_dims) -> bool:
    """Whether an op option splits each input that carries the batch on a dim that carries it
    (an input not known to carry it may be split anywhere)."""
    for name, split in zip(op.inputs, option.strategies[0].inputs):
        carried = batch_dims.get(name)
        if split.dim is not None and carried and split.dim not in carried:
            return False
    return True


def _reads_no_batch(index: GraphIndex, op_name: str, batch_dims) -> bool:
    """Whether no input of an op carries the batch: what it reads was reduced over the batch
    (a kernel gradient after its ``Sum``, a moment after its mean: partial sums the option's
    replicated inputs all-reduce) or never held it (weights, optimizer state). Run whole, it
    computes on every device what data parallelism computes there. (An op that reads the
    batch, whole, would gather it.)"""
    return not any(batch_dims.get(name) for name in index.ops[op_name].inputs)


_STATE_ROLES = frozenset({ir.Role.WEIGHT, ir.Role.OPTIMIZER_SLOT, ir.Role.GRADIENT})


def _splits_state(index: GraphIndex, op_name: str, option: Option) -> bool:
    """Whether an op option shards a weight it reads or a gradient it makes (data
    parallelism keeps both whole: gradients are reduced from partial sums)."""
    op = index.ops[op_name]
    strategy = option.strategies[0]
    tensors = index.graph.tensors
    for names, splits in ((op.inputs, strategy.inputs), (op.outputs, strategy.outputs)):
        for name, split in zip(names, splits):
            source = tensors.get(index.source(name))
            if split.dim is not None and source is not None and source.role in _STATE_ROLES:
                return True
    return False


def megatron_layouts(graph: ir.Graph, num_devices: int) -> dict[str, TensorSplit]:
    """The hand pattern: variable path -> split on the ``model`` axis (absent = replicated)."""
    if any(v.path.endswith("recurrent_kernel") or len(v.shape) == 4 for v in graph.weights()):
        raise BaselineNotApplicableError(
            "megatron applies to chains of Dense layers and Transformer blocks; this model has "
            "convolution or recurrent kernels. Compare against data_parallel instead.")
    wanted: dict[str, TensorSplit] = {}
    dense_count = 0
    for var in graph.weights():
        layer, _, leaf = var.path.rpartition("/")
        if "attn/" in var.path or "attention" in layer:
            column = not layer.endswith("attention_output")
            wanted[var.path] = TensorSplit(1 if leaf == "kernel" else 0) if column else (
                TensorSplit(0) if leaf == "kernel" else REPLICATED)
        elif leaf == "kernel" and len(var.shape) == 2:
            column = layer.endswith("mlp_in") or (not layer.endswith("mlp_out") and dense_count % 2 == 0)
            dense_count += 1
            wanted[var.path] = TensorSplit(1 if column else 0)
            bias = f"{layer}/bias"
            if bias in graph.variables:
                wanted[bias] = TensorSplit(0) if column else REPLICATED
    return {path: _divisible(graph.variables[path].shape, split, num_devices) for path, split in wanted.items()}


def _divisible(shape, split: TensorSplit, n: int) -> TensorSplit:
    return split if split.dim is not None and shape[split.dim] % n == 0 else REPLICATED


def megatron_restriction(index: GraphIndex, num_devices: int) -> Callable[[NodeId, Option], bool]:
    wanted = megatron_layouts(index.graph, num_devices)

    def allowed(node: NodeId, option: Option) -> bool:
        if node.kind is NodeKind.VARIABLE:
            return option.var_split == wanted.get(node.name, REPLICATED)
        if node.kind is NodeKind.INPUT:
            return option.label == "R"
        return True
    return allowed
