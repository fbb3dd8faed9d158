"""Coarsening: the decision nodes of a training step, their order, and what repeats.

This module owns *which decisions exist*: it groups an ``ir.Graph``'s ops into
decision nodes, orders them, lists the uses (tensor moves) between nodes and
the gradient ties, and finds repeated blocks. Options and prices are built by
``tofu_tf.search.problem``; nothing here chooses or prices anything.

Coarsening (Tofu section 5, generalized):

* **Aliases** (``Identity``, ``IdentityN``) pass their input's layout through;
  they are not decisions.
* **Free values** (``Const`` and anything computed from constants only) are
  replicated and can be sliced locally into any layout at no cost.
* **Variable groups**: a weight, its optimizer slots, every read of them, every
  assign to them and the element-wise optimizer update chain between (ops
  outside any Keras layer whose tensors all have the weight's shape) form one
  node whose option is *the weight's layout*. This ties weight, slots and the
  gradient's consumer to one layout, as Tofu ties a tensor to its gradient.
* **Inputs** are nodes whose option is the batch tensor's layout.
* **Scalar reads** (reads of rank-0 variables: Adam's step count, hyperparameters)
  are whole on every device and cost nothing to move: not decisions.
* Every other op with bytes is a node whose options are its legal strategies
  (the semantics provider's list, minus splits DTensor forbids: a tensor dim
  already split by an earlier mesh axis, or a dim that does not divide).
* A node with a single option is fixed; its edges become unary costs.

Node order (Tofu's coarsening of a forward op with its backward ops): every
backward op (``gradient_tape/...``, or anything computed from one) is anchored
to the forward op whose name scope its name repeats (``gradient_tape/m/d/MatMul_1``
-> ``m/d/MatMul``); gradient sums without such a name go with their earliest
producer. Nodes are sorted by their anchor's schedule position, a forward op
followed by its backward ops, so cuts follow the forward graph's cuts.

**Gradient ties.** A forward tensor :math:`y` (output of node ``Q``) and its
gradient :math:`dy` (made by a later backward node ``P``, consumed by ``Q``'s
backward ops ``C``) are tied, as Tofu ties a tensor to its gradient: ``dy`` is
produced split like ``y`` (or, when ``y`` is whole, whole or as partial sums --
``Q``'s options are doubled to say which). The ``P -> C`` uses are then priced
from ``Q``'s option and a tie edge ``Q -> P`` forbids any ``P`` option
producing ``dy`` otherwise (``TieEdge``, one per tied gradient, from its first use).

**Repeated blocks** (``tofu_tf.search.fold``): ``GraphIndex.run`` names equal
blocks of consecutive nodes (a Transformer's layers), and each use and tie edge
records the block it lies inside (or -1), so a per-axis problem builds one
block and shares it.
"""

from __future__ import annotations

import dataclasses
import enum
import re
from typing import Callable, Mapping, NamedTuple, Sequence

import numpy as np

from tofu_tf import ir
from tofu_tf.cost.collectives import gradient_side
from tofu_tf.cost.memory import ALIAS_OPS, Liveness
from tofu_tf.search import fold
from tofu_tf.semantics.strategy import REPLICATED, OpStrategy, Reduction, TensorSplit, replicate_all
from tofu_tf.semantics.view import view_key

P_SUM = TensorSplit(partial=Reduction.SUM)

StrategyProvider = Callable[[ir.Op, ir.Graph, int], Sequence[OpStrategy]]
_GRADIENT_SCOPE = "gradient_tape/"

_READ_OPS = frozenset({"ReadVariableOp"})
_ASSIGN_OPS = frozenset({"AssignVariableOp", "AssignAddVariableOp", "AssignSubVariableOp"})
_INPUT_OPS = frozenset({"Placeholder"})
_NEVER_FREE = _READ_OPS | _ASSIGN_OPS | _INPUT_OPS | frozenset({"While", "StatelessWhile"})
_DIGITS = re.compile(r"\d+")


def has_bytes(tensor: ir.Tensor) -> bool:
    return tensor.role is not ir.Role.RESOURCE and ir.dtype_size(tensor.dtype) > 0


def tensors_with_bytes(graph: ir.Graph) -> frozenset[str]:
    """The names of the tensors ``has_bytes`` holds for (one pass; the index asks per op input)."""
    resource, sizes = ir.Role.RESOURCE, ir.DTYPE_BYTES
    return frozenset(name for name, t in graph.tensors.items() if t.role is not resource and sizes.get(t.dtype, 0) > 0)


def split_of(tensor: ir.Tensor, layout: TensorSplit) -> TensorSplit:
    """A variable-shaped tensor follows the layout; a scalar stays replicated."""
    return layout if tensor.rank else REPLICATED


class NodeKind(enum.Enum):
    """What a decision node decides (see the module docstring)."""

    VARIABLE = "var"   # a variable group: the layout of a weight and its slots
    INPUT = "input"    # a batch input (Placeholder): its layout
    OP = "op"          # any other op with bytes: its strategy


class NodeId(NamedTuple):
    """A decision node's id: its kind and the name that finds it in the graph.

    ``name`` is the group's key (the weight's variable path) for a ``VARIABLE`` node and
    the op's name otherwise. Code branches on ``kind`` and looks ``name`` up; it never
    parses text. ``str()`` gives the text people see (``Node.name`` of a problem, test
    messages): ``var:<path>`` for a variable group -- so a weight and an op of the same
    name stay apart -- and the op's name otherwise. (A named tuple: node ids are
    dictionary keys on every use of the graph.)"""

    kind: NodeKind
    name: str

    def __str__(self) -> str:
        return f"var:{self.name}" if self.kind is NodeKind.VARIABLE else self.name


@dataclasses.dataclass(frozen=True)
class VarGroup:
    """A weight with its slots, reads, assigns and folded update ops: one layout."""

    key: str
    paths: tuple[str, ...]
    shape: tuple[int, ...]
    nbytes: int
    reads: tuple[str, ...]
    assigns: tuple[str, ...]
    folded: tuple[str, ...]

    @property
    def members(self) -> tuple[str, ...]:
        """Every op the group's layout decides, in the order options list their strategies."""
        return self.reads + self.assigns + self.folded


class Use(NamedTuple):
    """Input ``j`` of op ``consumer`` reads ``source`` (made by another node's op).

    Positions are in node order; ``*_member`` index the op in its node's
    ``members``. ``tie`` is (forward node, output) when ``source`` is a tied
    gradient (the use is then priced from the forward node's option).
    (A named tuple: a graph has tens of thousands of uses, made once per graph.)"""

    consumer: str
    j: int
    source: str
    consumer_node: int
    consumer_member: int
    producer_node: int
    producer_member: int
    out_index: int
    tie: tuple[int, int] | None


class TieEdge(NamedTuple):
    """Gradient ``source`` (output ``out_index`` of a member of ``producer_node``) must
    be made as output ``k`` of ``forward_node``'s option says."""

    source: str
    producer_node: int
    producer_member: int
    out_index: int
    forward_node: int
    k: int


class GraphIndex:
    """Everything about a graph the per-axis problems share (built once per graph)."""

    def __init__(self, graph: ir.Graph, provider: StrategyProvider, *, pinned: frozenset[str] = frozenset(),
                 unsplit_dims: Mapping[str, frozenset[int]] | None = None,
                 work: Mapping[str, float] | None = None, tie_gradients: bool = True, fold_blocks: bool = True,
                 liveness: Liveness | None = None):
        self.graph = graph
        self.provider = provider
        self.pinned = pinned               # weight paths that stay replicated (the lowering target's rule)
        self.unsplit_dims = dict(unsplit_dims or {})   # weight path -> dims no axis splits (the same)
        self.work = dict(work or {})       # op -> compute seconds when not split
        self.ops = {op.name: op for op in graph.ops}
        self.position = {op.name: i for i, op in enumerate(graph.ops)}
        liveness = liveness or Liveness(graph)
        self.aliases = liveness.aliases
        self.alias_ops = {op.name for op in graph.ops if op.type in ALIAS_OPS}
        self._with_bytes = tensors_with_bytes(graph)
        self.free_ops = self._free_ops()
        self.groups, self.group_of_op = self._var_groups()
        self.input_ops = tuple(op.name for op in graph.ops if op.type in _INPUT_OPS and op.outputs)
        self.scalar_reads = frozenset(
            op.name for op in graph.ops if op.type in _READ_OPS and op.name not in self.group_of_op
            and op.outputs and op.outputs[0] in graph.tensors and graph.tensors[op.outputs[0]].rank == 0)
        decided = self.free_ops | self.alias_ops | set(self.group_of_op) | set(self.input_ops) | self.scalar_reads
        with_bytes = self._with_bytes
        self.plain_ops = tuple(op.name for op in graph.ops if op.name not in decided and not (
            with_bytes.isdisjoint(op.inputs) and with_bytes.isdisjoint(op.outputs)))
        self._plain_set = frozenset(self.plain_ops)
        self._owner = self._owners()
        self.uses = self._uses()
        self.backward, self.anchor = self._anchors()
        self.nodes = self._node_order()    # the decision nodes (NodeId) in DP order
        self.order_of = {node: i for i, node in enumerate(self.nodes)}
        self.ties = self._ties() if tie_gradients else {}
        self.tied_outputs: dict[str, tuple[int, ...]] = {}
        for q, k in set(self.ties.values()):
            self.tied_outputs[q] = tuple(sorted(set(self.tied_outputs.get(q, ())) | {k}))
        self.peak_live = self._peak_live(liveness)
        self._strategy_cache: dict[tuple[str, int], tuple[OpStrategy, ...]] = {}
        self._batch_dims_cache: dict[int, dict[str, frozenset[int]]] = {}
        self._tied_cache: dict[tuple, OpStrategy | None] = {}
        self._group_cache: dict[tuple, dict[str, OpStrategy] | None] = {}
        self.matrix_cache: dict[tuple, dict] = {}   # transfer tables: by (n, link), then by (splits, bytes)
        self.tensor_bytes: dict[str, int] = {}      # filled as problems ask
        self.gradient_side = gradient_side(graph)    # all-reduced together (``cost.collectives``)
        self.members, self.paths = self._members()
        self.use_table, self.tie_edges = self._use_table()
        self.run = fold.find_run(
            [self.node_signature(node) for node in self.nodes],
            [(use.consumer_node, use.producer_node) for use in self.use_table]) if fold_blocks else None
        self.use_blocks = (-1,) * len(self.use_table)   # per use: the block it lies inside, or -1
        self.tie_blocks = (-1,) * len(self.tie_edges)
        self.uses_in_block: dict[int, list[Use]] = {}
        self.tie_edges_in_block: dict[int, list[TieEdge]] = {}
        if self.run is not None:
            self._assign_blocks()

    # -- structure ---------------------------------------------------------------
    def source(self, name: str) -> str:
        return self.aliases.get(name, name)

    def _byte_tensors(self, op: ir.Op) -> list[str]:
        with_bytes = self._with_bytes
        return [t for t in (*op.inputs, *op.outputs) if t in with_bytes]

    def _free_ops(self) -> set[str]:
        free: set[str] = set()
        tensors, with_bytes = self.graph.tensors, self._with_bytes
        for op in self.graph.ops:
            if op.type in _NEVER_FREE or op.type in ALIAS_OPS or op.body is not None:
                continue
            if all(tensors[t].producer in free for t in op.inputs if t in with_bytes):
                free.add(op.name)
        return free

    def _var_groups(self):
        graph, tensors = self.graph, self.graph.tensors
        owner: dict[str, str] = {}
        for var in graph.variables.values():
            if var.kind is ir.VariableKind.WEIGHT:
                owner[var.path] = var.path
        for var in graph.variables.values():
            if var.slot_of in owner and var.shape == graph.variables[var.slot_of].shape:
                owner[var.path] = var.slot_of
            elif var.path not in owner and var.shape:
                owner[var.path] = var.path
        reads: dict[str, list[str]] = {}
        assigns: dict[str, list[str]] = {}
        for op in graph.ops:
            if op.type in _READ_OPS and op.outputs:
                path = tensors[op.outputs[0]].variable_path
                if path in owner:
                    reads.setdefault(owner[path], []).append(op.name)
            elif op.type in _ASSIGN_OPS and op.inputs and op.inputs[0] in tensors:
                path = tensors[op.inputs[0]].variable_path
                if path in owner:
                    assigns.setdefault(owner[path], []).append(op.name)
        group_of_op: dict[str, str] = {}
        groups: dict[str, VarGroup] = {}
        rank = {path: i for i, path in enumerate(graph.variables)}
        owned: dict[str, list[str]] = {}
        for path, key in owner.items():
            owned.setdefault(key, []).append(path)
        for key in sorted(owned, key=rank.__getitem__):
            members = reads.get(key, []) + assigns.get(key, [])
            for name in members:
                group_of_op[name] = key
            folded = self._fold_update_chain(key, assigns.get(key, []), group_of_op)
            paths = tuple(owned[key])
            groups[key] = VarGroup(
                key=key, paths=paths, shape=graph.variables[key].shape,
                nbytes=sum(graph.variables[p].num_bytes for p in paths),
                reads=tuple(reads.get(key, [])), assigns=tuple(assigns.get(key, [])), folded=tuple(folded))
        return groups, group_of_op

    def _fold_update_chain(self, key: str, assigns: list[str], group_of_op: dict[str, str]) -> list[str]:
        """Walk back from the assigns over element-wise optimizer ops of the weight's shape."""
        shape = self.graph.variables[key].shape
        tensors = self.graph.tensors
        consumers = self._consumers_through_aliases()
        folded: list[str] = []
        ops, free = self.ops, self.free_ops
        work = [tensors[t].producer for a in assigns for t in ops[a].inputs[1:] if t in tensors]
        while work:
            name = work.pop()
            op = ops.get(name)
            if op is not None and op.type in ALIAS_OPS:
                op = ops.get(self.source_op(name))
            if op is None or op.name in group_of_op or op.layer is not None or op.name in free \
                    or op.type in _NEVER_FREE or op.type in ALIAS_OPS or op.body is not None:
                continue
            tensors_of = [tensors[t] for t in self._byte_tensors(op)]
            if not tensors_of or any(t.rank and t.shape != shape for t in tensors_of):
                continue
            if any(c not in group_of_op for o in op.outputs for c in consumers.get(o, ())):
                continue
            group_of_op[op.name] = key
            folded.append(op.name)
            work.extend(tensors[t].producer for t in op.inputs if t in tensors)
        return folded

    def source_op(self, op_name: str) -> str:
        """Through an alias op, the op producing its input (for walking update chains)."""
        op = self.ops.get(op_name)
        while op is not None and op.type in ALIAS_OPS and op.inputs and op.inputs[0] in self.graph.tensors:
            op = self.ops.get(self.graph.tensors[op.inputs[0]].producer)
        return op.name if op is not None else op_name

    def _consumers_through_aliases(self) -> dict[str, tuple[str, ...]]:
        if not hasattr(self, "_consumer_cache"):
            out: dict[str, list[str]] = {}
            aliases = self.aliases
            for op in self.graph.ops:
                if op.type in ALIAS_OPS:
                    continue
                for t in op.inputs:
                    out.setdefault(aliases.get(t, t), []).append(op.name)
            self._consumer_cache = {k: tuple(v) for k, v in out.items()}
        return self._consumer_cache

    def owner(self, op_name: str) -> NodeId | None:
        """The decision node an op belongs to (None for free and alias ops, and reads of
        scalar variables: a rank-0 value is whole everywhere, and turning a whole value into
        any layout a consumer can ask of a scalar (whole, or partial) is free)."""
        return self._owner.get(op_name)

    def _owners(self) -> dict[str, NodeId]:
        """``owner`` of every op that has one (looked up per use: tens of thousands of times).
        An op that moves no bytes gets an ``OP`` owner too, though it is not a node: it has
        no uses, so nothing looks it up."""
        out = {}
        skip = self.free_ops | self.alias_ops | self.scalar_reads
        group_of_op, inputs = self.group_of_op, frozenset(self.input_ops)
        for op in self.graph.ops:
            name = op.name
            if name in group_of_op:
                out[name] = NodeId(NodeKind.VARIABLE, group_of_op[name])
            elif name in inputs:
                out[name] = NodeId(NodeKind.INPUT, name)
            elif name not in skip:
                out[name] = NodeId(NodeKind.OP, name)
        return out

    def _uses(self) -> tuple[tuple[str, int, str], ...]:
        """Every (consumer op, input index, source tensor) that moves bytes between nodes."""
        out = []
        tensors, aliases, owner, with_bytes = self.graph.tensors, self.aliases, self._owner, self._with_bytes
        for op in self.graph.ops:
            if op.name not in owner:
                continue
            for j, name in enumerate(op.inputs):
                source = aliases.get(name, name)
                if source in with_bytes and tensors[source].producer in owner:
                    out.append((op.name, j, source))
        return tuple(out)

    def _anchors(self) -> tuple[frozenset[str], dict[str, float]]:
        """Backward ops, and per op the schedule position of the forward op it belongs to."""
        graph, tensors, pos = self.graph, self.graph.tensors, self.position
        backward: set[str] = set()
        for op in graph.ops:
            if op.name in self.group_of_op:
                continue
            if op.name.startswith(_GRADIENT_SCOPE) or any(
                    tensors[t].producer in backward for t in op.inputs if t in tensors):
                backward.add(op.name)
        scope_last: dict[str, int] = {}    # every proper "/"-prefix of a forward op's name -> its last op
        for op in graph.ops:
            name = op.name
            if name not in backward:
                cut = name.find("/")
                while cut >= 0:
                    scope_last[name[:cut]] = pos[name]
                    cut = name.find("/", cut + 1)
        anchor: dict[str, float] = {}
        ops = self.ops
        for op in graph.ops:
            name = op.name
            if name not in backward:
                anchor[name] = pos[name]
            elif name.startswith(_GRADIENT_SCOPE):
                prefix = name[len(_GRADIENT_SCOPE):]     # then shorter and shorter "/"-prefixes
                while True:
                    if prefix in ops and prefix not in backward:
                        anchor[name] = pos[prefix]
                        break
                    if prefix in scope_last:
                        anchor[name] = scope_last[prefix]
                        break
                    cut = prefix.rfind("/")
                    if cut < 0:
                        break
                    prefix = prefix[:cut]
        for op in graph.ops:      # gradient sums: with their earliest backward producer
            if op.name in backward and op.name not in anchor:
                found = [anchor[tensors[t].producer] for t in op.inputs
                         if t in tensors and tensors[t].producer in backward and tensors[t].producer in anchor]
                if found:
                    anchor[op.name] = min(found)
        consumers = self._consumers_through_aliases()
        for op in reversed(graph.ops):
            if op.name not in anchor:
                found = [anchor[c] for t in op.outputs for c in consumers.get(t, ()) if c in anchor]
                anchor[op.name] = min(found) if found else pos[op.name]
        return frozenset(backward), anchor

    def _node_key(self, node: NodeId) -> tuple:
        """Variables and inputs go just before their first user; ops by anchor, forward first."""
        consumers = self._consumers_through_aliases()
        if node.kind is NodeKind.OP:
            return (self.anchor[node.name], int(node.name in self.backward), self.position[node.name])
        producers = self.groups[node.name].reads if node.kind is NodeKind.VARIABLE else (node.name,)
        users = [self.anchor[c] for r in producers for t in self.ops[r].outputs for c in consumers.get(t, ())
                 if c in self.anchor and c not in self.group_of_op]
        return (min(users, default=0) - 0.5, 0, self.first_position(node))

    def _node_order(self) -> tuple[NodeId, ...]:
        nodes = [NodeId(NodeKind.INPUT, name) for name in self.input_ops]
        nodes += [NodeId(NodeKind.VARIABLE, key) for key in self.groups]
        nodes += [NodeId(NodeKind.OP, name) for name in self.plain_ops]
        return tuple(sorted(nodes, key=self._node_key))

    def node_names(self) -> list[str]:
        """The decision nodes in DP order (by anchor: forward op, then its backward ops), as
        text: ``str`` of each of ``nodes``."""
        return [str(node) for node in self.nodes]

    def first_position(self, node: NodeId) -> int:
        """The schedule position of the node's first op."""
        if node.kind is NodeKind.VARIABLE:
            return min((self.position[m] for m in self.groups[node.name].members), default=0)
        return self.position[node.name]

    def _ties(self) -> dict[tuple[str, int], tuple[str, int]]:
        """(backward consumer, input index) -> (forward op, output index) whose gradient it reads."""
        tensors = self.graph.tensors
        order = {node.name: i for node, i in self.order_of.items() if node.kind is not NodeKind.VARIABLE}
        ties: dict[tuple[str, int], tuple[str, int]] = {}
        for consumer, j, source in self.uses:
            producer = tensors[source].producer
            if consumer not in self.backward or producer not in self.backward or consumer not in order:
                continue
            if producer not in order or order[producer] < order[consumer]:
                continue
            forward = self.graph.ops[int(self.anchor[consumer])]
            if forward.name not in self._plain_set or forward.name in self.backward or \
                    order[forward.name] >= order[consumer]:
                continue
            shape = tensors[source].shape
            for k, out in enumerate(forward.outputs):
                if out in tensors and tensors[out].shape == shape and has_bytes(tensors[out]) and tensors[out].rank:
                    ties[consumer, j] = (forward.name, k)
                    break
        return ties

    @staticmethod
    def _peak_live(liveness: Liveness) -> frozenset[str]:
        """Tensors alive at the peak of the unpartitioned step: the Lagrangian's memory proxy."""
        if not liveness.names:
            return frozenset()
        curve = liveness.live_curve(liveness.full_bytes)
        alive = liveness.live_at(int(np.argmax(curve)))
        return frozenset(liveness.names[i] for i in np.nonzero(alive)[0])

    # -- strategies --------------------------------------------------------------
    def group_strategies(self, key: str, split: TensorSplit, n: int) -> dict[str, OpStrategy] | None:
        """Per member op of variable group ``key`` when its weight is laid out as ``split`` on
        an axis of ``n`` devices: reads produce that layout, assigns write it, folded update
        ops take their tied strategy; None if a folded op has none. Nothing here depends on
        earlier axes, so it is made once per (group, split, n) and shared, read-only, by every
        axis problem of that size (each still checks the folded ops against its earlier axes)."""
        cache_key = (key, split, n)
        if cache_key in self._group_cache:
            return self._group_cache[cache_key]
        group, tensors = self.groups[key], self.graph.tensors
        out: dict[str, OpStrategy] | None = {}
        for name in group.reads:
            out[name] = OpStrategy("read", (REPLICATED,), (split,))
        for name in group.assigns:
            out[name] = OpStrategy("assign", (REPLICATED,) + tuple(
                split_of(tensors[t], split) for t in self.ops[name].inputs[1:]), ())
        for name in group.folded:
            match = self.tied_strategy(name, split, n)
            if match is None:
                out = None
                break
            out[name] = match
        self._group_cache[cache_key] = out
        return out

    def tied_strategy(self, op_name: str, split: TensorSplit, n: int) -> OpStrategy | None:
        """The strategy of a folded update op that lays every weight-shaped tensor out as
        ``split`` (scalars whole), or None if it has none."""
        key = (op_name, split, n)
        if key not in self._tied_cache:
            op, tensors = self.ops[op_name], self.graph.tensors
            wanted = OpStrategy(
                "tied", tuple(split_of(tensors[t], split) if t in tensors else REPLICATED for t in op.inputs),
                tuple(split_of(tensors[t], split) for t in op.outputs))
            self._tied_cache[key] = next((s for s in self.strategies(op_name, n) if same_splits(s, wanted)), None)
        return self._tied_cache[key]

    def batch_dims(self, n: int) -> dict[str, frozenset[int]]:
        """Per tensor, the dims that carry the batch: dim 0 of every batch input and, op by op,
        the dims a strategy splits in its outputs when every tensor it splits in its inputs that
        carries the batch is split on such a dim (made for axes of ``n`` devices, whose strategies
        it reads). An input the batch does not reach does not count against it: a batch tensor
        times a same-shaped tensor made from constants (an attention mask's select, a loss
        gradient's scale) carries the batch in its product; counted, it hid every tensor after
        such an op from the model axes' rule (``problem._splits_the_batch``)."""
        cached = self._batch_dims_cache.get(n)
        if cached is not None:
            return cached
        tensors = self.graph.tensors
        dims: dict[str, set[int]] = {}
        for name in self.input_ops:
            out = self.ops[name].outputs[0]
            if tensors[out].rank:
                dims[out] = {0}
        for op in self.graph.ops:
            if op.name in self.alias_ops:
                for t_in, t_out in zip(op.inputs, op.outputs):
                    if t_in in dims:
                        dims.setdefault(t_out, set()).update(dims[t_in])
                continue
            if op.name not in self._plain_set or not any(t in dims for t in op.inputs):
                continue
            for strategy in self.strategies(op.name, n):
                split = [(t, s.dim) for t, s in zip(op.inputs, strategy.inputs) if s.dim is not None and t in dims]
                if split and all(d in dims.get(t, ()) for t, d in split):
                    for t, s in zip(op.outputs, strategy.outputs):
                        if s.dim is not None:
                            dims.setdefault(t, set()).add(s.dim)
        out = {t: frozenset(d) for t, d in dims.items()}
        self._batch_dims_cache[n] = out
        return out

    def strategies(self, op_name: str, n: int) -> tuple[OpStrategy, ...]:
        key = (op_name, n)
        if key not in self._strategy_cache:
            op = self.ops[op_name]
            found = tuple(self.provider(op, self.graph, n))
            rep = replicate_all(len(op.inputs), len(op.outputs))
            if not any(same_splits(s, rep) for s in found):
                found = (rep,) + found
            self._strategy_cache[key] = found
        return self._strategy_cache[key]



    # -- node members, uses, blocks ------------------------------------------------
    def _members(self) -> tuple[dict[NodeId, tuple[str, ...]], dict[NodeId, tuple[str, ...]]]:
        """Per node, the ops whose strategies its options give, and the variables it lays out."""
        members, paths = {}, {}
        for node in self.nodes:
            if node.kind is NodeKind.VARIABLE:
                group = self.groups[node.name]
                members[node], paths[node] = group.members, group.paths
            else:
                members[node], paths[node] = (node.name,), ()
        return members, paths

    def node_signature(self, node: NodeId) -> tuple:
        """What the per-axis problem builder reads about ``node`` itself: nodes with equal
        signatures are interchangeable, which is what ``fold.find_run`` looks for.

        * op nodes: the op's view (type, attributes, input/output shapes and dtypes, small
          constant inputs -- what the operator semantics derive strategies from), its layer
          *kind* (the layer name without digits: lowering targets treat recurrent layers
          apart), its compute work, which outputs are alive at the memory peak, which
          outputs are gradient-tied, and whether it is a backward op;
        * variable nodes: the weight's shape and bytes, whether the target pins it, and the
          views and work of every member op (reads, assigns, folded update ops);
        * input nodes: the op's view.

        Strategy providers are assumed to depend on an op's view and layer kind only, as
        the operator registry does. Equal nodes get equal options whenever the earlier axes
        decided them alike (the problem builder checks that per block). Uses between nodes
        are not part of it: ``_assign_blocks`` checks them block by block."""
        graph = self.graph
        if node.kind is NodeKind.VARIABLE:
            group = self.groups[node.name]
            members = self.members[node]
            return ("var", group.shape, group.nbytes, group.key in self.pinned,
                    tuple(sorted(self.unsplit_dims.get(group.key, ()))), len(group.paths), len(group.reads),
                    len(group.assigns), tuple(view_key(self.ops[m], graph) for m in members),
                    tuple(self.work.get(m, 0.0) for m in members))
        op = self.ops[node.name]
        if node.kind is NodeKind.INPUT:
            return ("input", view_key(op, graph))
        return ("op", view_key(op, graph), _DIGITS.sub("", op.layer or ""), self.work.get(node.name, 0.0),
                tuple(t in self.peak_live for t in op.outputs), self.tied_outputs.get(node.name, ()),
                node.name in self.backward)

    def _use_table(self) -> tuple[tuple[Use, ...], tuple[TieEdge, ...]]:
        order, owner, ops, tensors, ties_of = self.order_of, self._owner, self.ops, self.graph.tensors, self.ties
        member_at = {m: i for ms in self.members.values() for i, m in enumerate(ms)}   # an op is in one node
        uses, ties, tied_to = [], [], {}
        for consumer, j, source in self.uses:
            producer = tensors[source].producer
            pnode = order[owner[producer]]
            out_index = ops[producer].outputs.index(source)
            tie = ties_of.get((consumer, j))
            tie_pos = None
            if tie is not None:
                forward, k = tie
                fnode = order[owner[forward]]    # the forward op is a node by itself (see _ties)
                if source not in tied_to:        # one tie edge per gradient: its first tied use's
                    tied_to[source] = tie
                    ties.append(TieEdge(source, pnode, member_at[producer], out_index, fnode, k))
                if tied_to[source] == tie:       # a use tied elsewhere is priced from the producer itself
                    tie_pos = (fnode, k)
            uses.append(Use(consumer, j, source, order[owner[consumer]], member_at[consumer], pnode,
                            member_at[producer], out_index, tie_pos))
        return tuple(uses), tuple(ties)

    def _assign_blocks(self) -> None:
        """Mark the uses and tie edges that lie inside one repeated block.

        A use counts as inside only if, in *every* block of the run, the use at the same
        place (consumer's position in the block, member, input) lies inside its block with
        the producer (and tie) at the same place: then the first block's edges are every
        block's edges. Others (a learning rate read by every block's update) are priced
        one by one."""
        uses = self._consistent(self.use_table, lambda u: u.consumer_node, lambda u, base: (
            u.consumer_member, u.j, u.producer_node - base, u.producer_member, u.out_index,
            None if u.tie is None else (u.tie[0] - base, u.tie[1])),
            lambda u: (u.consumer_node, u.producer_node) + ((u.tie[0],) if u.tie is not None else ()))
        ties = self._consistent(self.tie_edges, lambda t: t.producer_node, lambda t, base: (
            t.producer_member, t.out_index, t.forward_node - base, t.k), lambda t: (t.producer_node, t.forward_node))
        self.use_blocks, self.tie_blocks = tuple(uses), tuple(ties)
        for use, block in zip(self.use_table, uses):
            if block >= 0:
                self.uses_in_block.setdefault(block, []).append(use)
        for tie, block in zip(self.tie_edges, ties):
            if block >= 0:
                self.tie_edges_in_block.setdefault(block, []).append(tie)

    def _consistent(self, items, anchor, shape, ends) -> list[int]:
        """Per item, its block if it lies inside one and every block has it alike, else -1.
        (``Run.common_block`` of ``ends(item)``, written out: this runs once per use.)"""
        run = self.run
        start, period, stop = run.start, run.period, run.stop
        seen: dict[tuple, dict[int, tuple]] = {}
        where = []
        for item in items:
            positions = ends(item)
            block, key = -1, None
            if start <= positions[0] < stop:
                base = positions[0] - (positions[0] - start) % period
                if all(base <= p < base + period for p in positions[1:]):
                    block = (base - start) // period
                    form = shape(item, base)
                    key = (anchor(item) - base, form[:2])
                    seen.setdefault(key, {})[block] = form
            where.append((block, key))
        alike = {key for key, per in seen.items() if len(per) == run.count and len(set(per.values())) == 1}
        return [block if block >= 0 and key in alike else -1 for block, key in where]


def same_splits(a: OpStrategy, b: OpStrategy) -> bool:
    return a.inputs == b.inputs and a.outputs == b.outputs
