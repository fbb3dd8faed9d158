"""The per-axis decision problem the search solves, built from a coarsened graph.

This module owns *what is decided*: it turns an ``ir.Graph`` into decision
nodes, each with a list of options, and pairwise edges priced by the cost model.
It must not choose anything; ``tofu_dp`` and ``ilp`` solve the same problem.

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
* Every other op with bytes is a node whose options are its legal strategies
  (the semantics provider's list, minus splits DTensor forbids: a tensor dim
  already split by an earlier mesh axis, or a dim that does not divide).
* A node with a single option is fixed; its edges become unary costs.

Edge cost (axis ``k`` of size ``n``, tensor ``t`` from producer option ``a`` to
consumer option ``b``) is the collective of ``tofu_tf.cost.collectives`` for
``t``'s bytes after the splits the consumer already required on axes ``< k``
(Tofu's recursion: shapes shrink as axes are applied).

Node order (Tofu's coarsening of a forward op with its backward ops): every
backward op (``gradient_tape/...``, or anything computed from one) is anchored
to the forward op whose name scope its name repeats (``gradient_tape/m/d/MatMul_1``
-> ``m/d/MatMul``); gradient sums without such a name go with their earliest
producer. Nodes are sorted by their anchor's schedule position, a forward op
followed by its backward ops, so DP cuts follow the forward graph's cuts.

**Gradient ties.** A forward tensor :math:`y` (output of node ``Q``) and its
gradient :math:`dy` (made by a later backward node ``P``, consumed by ``Q``'s
backward ops ``C``) are tied, as Tofu ties a tensor to its gradient: ``dy`` is
produced split like ``y`` (or, when ``y`` is whole, whole or as partial sums --
``Q``'s options are doubled to say which). The ``P -> C`` edges are then priced
from ``Q``'s option (``Q`` precedes both) and an edge ``Q -> P`` forbids (with a
penalty of ``TIE_PENALTY`` seconds) any ``P`` option producing ``dy`` otherwise.
So a cut never holds a backward consumer's choice: its state is the forward
cut's.

**Compute.** Each option also carries the compute seconds of its ops
(``tofu_tf.cost.compute``): an op's work divided by the devices earlier axes
split it over, and by this axis's size unless the option replicates it. The
unary cost of an option is its communication plus its compute.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Mapping, Sequence

import numpy as np

from tofu_tf import ir
from tofu_tf.cost.collectives import transfer_seconds
from tofu_tf.cost.compute import is_split
from tofu_tf.cost.hardware import Link
from tofu_tf.cost.memory import ALIAS_OPS, Liveness, alias_map
from tofu_tf.semantics.strategy import REPLICATED, OpStrategy, Reduction, TensorSplit, replicate_all

P_SUM = TensorSplit(partial=Reduction.SUM)

StrategyProvider = Callable[[ir.Op, ir.Graph, int], Sequence[OpStrategy]]
TIE_PENALTY = 1e3   # seconds: larger than any step, so a broken gradient tie never wins
_GRADIENT_SCOPE = "gradient_tape/"

_READ_OPS = frozenset({"ReadVariableOp"})
_ASSIGN_OPS = frozenset({"AssignVariableOp", "AssignAddVariableOp", "AssignSubVariableOp"})
_INPUT_OPS = frozenset({"Placeholder"})
_NEVER_FREE = _READ_OPS | _ASSIGN_OPS | _INPUT_OPS | frozenset({"While", "StatelessWhile"})


def has_bytes(tensor: ir.Tensor) -> bool:
    return tensor.role is not ir.Role.RESOURCE and ir.dtype_size(tensor.dtype) > 0


def split_of(tensor: ir.Tensor, layout: TensorSplit) -> TensorSplit:
    """A variable-shaped tensor follows the layout; a scalar stays replicated."""
    return layout if tensor.rank else REPLICATED


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


@dataclasses.dataclass(frozen=True)
class AxisDecision:
    """What one mesh axis decided: a strategy per op, a split per variable and input."""

    size: int
    op_strategies: Mapping[str, OpStrategy]
    var_splits: Mapping[str, TensorSplit]


class GraphIndex:
    """Everything about a graph the per-axis problems share (built once per graph)."""

    def __init__(self, graph: ir.Graph, provider: StrategyProvider, *, pinned: frozenset[str] = frozenset(),
                 work: Mapping[str, float] | None = None, tie_gradients: bool = True):
        self.graph = graph
        self.provider = provider
        self.pinned = pinned               # weight paths that stay replicated (the lowering target's rule)
        self.work = dict(work or {})       # op -> compute seconds when not split
        self.ops = {op.name: op for op in graph.ops}
        self.position = {op.name: i for i, op in enumerate(graph.ops)}
        self.aliases = alias_map(graph)
        self.alias_ops = {op.name for op in graph.ops if op.type in ALIAS_OPS}
        self.free_ops = self._free_ops()
        self.groups, self.group_of_op = self._var_groups()
        self.input_ops = tuple(op.name for op in graph.ops if op.type in _INPUT_OPS and op.outputs)
        decided = self.free_ops | self.alias_ops | set(self.group_of_op) | set(self.input_ops)
        self.plain_ops = tuple(op.name for op in graph.ops
                               if op.name not in decided and self._byte_tensors(op))
        self._plain_set = frozenset(self.plain_ops)
        self.uses = self._uses()
        self.backward, self.anchor = self._anchors()
        self._order = self._node_order()
        self.order_of = {name: i for i, name in enumerate(self._order)}
        self.ties = self._ties() if tie_gradients else {}
        self.tied_outputs: dict[str, tuple[int, ...]] = {}
        for q, k in set(self.ties.values()):
            self.tied_outputs[q] = tuple(sorted(set(self.tied_outputs.get(q, ())) | {k}))
        self.peak_live = self._peak_live()
        self._strategy_cache: dict[tuple[str, int], tuple[OpStrategy, ...]] = {}

    # -- structure ---------------------------------------------------------------
    def source(self, name: str) -> str:
        return self.aliases.get(name, name)

    def _byte_tensors(self, op: ir.Op) -> list[str]:
        return [t for t in (*op.inputs, *op.outputs) if t in self.graph.tensors and has_bytes(self.graph.tensors[t])]

    def _free_ops(self) -> set[str]:
        free: set[str] = set()
        tensors = self.graph.tensors
        for op in self.graph.ops:
            if op.type in _NEVER_FREE or op.type in ALIAS_OPS or op.body is not None:
                continue
            producers = [tensors[t].producer for t in op.inputs if t in tensors and has_bytes(tensors[t])]
            if all(p in free for p in producers):
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
        for key in sorted(set(owner.values()), key=lambda k: list(graph.variables).index(k)):
            members = reads.get(key, []) + assigns.get(key, [])
            for name in members:
                group_of_op[name] = key
            folded = self._fold_update_chain(key, assigns.get(key, []), group_of_op)
            paths = tuple(p for p, o in owner.items() if o == key)
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
        work = [tensors[t].producer for a in assigns for t in self.ops[a].inputs[1:] if t in tensors]
        while work:
            name = work.pop()
            op = self.ops.get(self.source_op(name))
            if op is None or op.name in group_of_op or op.layer is not None or op.name in self.free_ops \
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
            for op in self.graph.ops:
                if op.type in ALIAS_OPS:
                    continue
                for t in op.inputs:
                    out.setdefault(self.source(t), []).append(op.name)
            self._consumer_cache = {k: tuple(v) for k, v in out.items()}
        return self._consumer_cache

    def owner(self, op_name: str) -> str | None:
        """The decision node an op belongs to (None for free and alias ops)."""
        if op_name in self.group_of_op:
            return "var:" + self.group_of_op[op_name]
        if op_name in self.free_ops or op_name in self.alias_ops or op_name not in self.ops:
            return None
        return op_name

    def _uses(self) -> tuple[tuple[str, int, str], ...]:
        """Every (consumer op, input index, source tensor) that moves bytes between nodes."""
        out = []
        tensors = self.graph.tensors
        for op in self.graph.ops:
            if self.owner(op.name) is None:
                continue
            for j, name in enumerate(op.inputs):
                source = self.source(name)
                tensor = tensors.get(source)
                if tensor is None or not has_bytes(tensor) or tensor.producer not in self.ops:
                    continue
                if self.owner(tensor.producer) is None:
                    continue
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
        scope_last: dict[str, int] = {}
        for op in graph.ops:
            if op.name not in backward:
                parts = op.name.split("/")
                for i in range(1, len(parts)):
                    scope_last["/".join(parts[:i])] = pos[op.name]
        anchor: dict[str, float] = {}
        for op in graph.ops:
            if op.name not in backward:
                anchor[op.name] = pos[op.name]
            elif op.name.startswith(_GRADIENT_SCOPE):
                parts = op.name[len(_GRADIENT_SCOPE):].split("/")
                for i in range(len(parts), 0, -1):
                    prefix = "/".join(parts[:i])
                    if prefix in self.ops and prefix not in backward:
                        anchor[op.name] = pos[prefix]
                        break
                    if prefix in scope_last:
                        anchor[op.name] = scope_last[prefix]
                        break
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

    def _node_key(self, node: str) -> tuple:
        consumers = self._consumers_through_aliases()
        if node.startswith("var:") or node in self.input_ops:
            producers = self.groups[node[4:]].reads if node.startswith("var:") else (node,)
            users = [self.anchor[c] for r in producers for t in self.ops[r].outputs for c in consumers.get(t, ())
                     if c in self.anchor and c not in self.group_of_op]
            return (min(users, default=0) - 0.5, 0, self.first_position(node))
        return (self.anchor[node], int(node in self.backward), self.position[node])

    def _node_order(self) -> tuple[str, ...]:
        names = list(self.input_ops) + ["var:" + k for k in self.groups] + list(self.plain_ops)
        return tuple(sorted(names, key=self._node_key))

    def node_names(self) -> list[str]:
        """Decision nodes in DP order: by anchor (forward op, then its backward ops)."""
        return list(self._order)

    def first_position(self, node: str) -> int:
        if node.startswith("var:"):
            group = self.groups[node[4:]]
            members = group.reads + group.assigns + group.folded
            return min((self.position[m] for m in members), default=0)
        return self.position[node]

    def _ties(self) -> dict[tuple[str, int], tuple[str, int]]:
        """(backward consumer, input index) -> (forward op, output index) whose gradient it reads."""
        tensors, order = self.graph.tensors, self.order_of
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

    def _peak_live(self) -> frozenset[str]:
        """Tensors alive at the peak of the unpartitioned step: the Lagrangian's memory proxy."""
        liveness = Liveness(self.graph)
        if not liveness.names:
            return frozenset()
        curve = liveness.live_curve(liveness.bytes_array({n: self.graph.tensors[n].num_bytes for n in liveness.names}))
        alive = liveness.live_at(int(np.argmax(curve)))
        return frozenset(liveness.names[i] for i in np.nonzero(alive)[0])

    # -- strategies --------------------------------------------------------------
    def strategies(self, op_name: str, n: int) -> tuple[OpStrategy, ...]:
        key = (op_name, n)
        if key not in self._strategy_cache:
            op = self.ops[op_name]
            found = tuple(self.provider(op, self.graph, n))
            rep = replicate_all(len(op.inputs), len(op.outputs))
            if not any(_same_splits(s, rep) for s in found):
                found = (rep,) + found
            self._strategy_cache[key] = found
        return self._strategy_cache[key]


def _grad_choices(strategy: OpStrategy, tied: Sequence[int]) -> list[tuple[tuple[int, TensorSplit], ...]]:
    """How the gradients of ``strategy``'s tied outputs may be produced: split like the
    output, or (output whole or partial) whole or as partial sums."""
    choices: list[tuple[tuple[int, TensorSplit], ...]] = [()]
    for k in tied:
        out = strategy.outputs[k] if k < len(strategy.outputs) else REPLICATED
        grads = [TensorSplit(out.dim)] if out.dim is not None else [REPLICATED, P_SUM]
        choices = [c + ((k, g),) for c in choices for g in grads]
    return choices


def _layer_scope(op: ir.Op) -> str:
    """The name scope of an op's innermost Keras layer, shared by its forward and
    gradient ops (``gradient_tape/m/block_3/query/...`` -> ``m/block_3/query``): layer
    names alone repeat across blocks (every attention has a ``query``)."""
    parts = op.name.split("/")
    if parts and parts[0] == "gradient_tape":
        parts = parts[1:]
    for i in range(len(parts) - 1, -1, -1):
        if parts[i] == op.layer:
            return "/".join(parts[: i + 1])
    return op.layer or ""


def _same_splits(a: OpStrategy, b: OpStrategy) -> bool:
    return a.inputs == b.inputs and a.outputs == b.outputs


# -- the per-axis problem ---------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Option:
    """One choice of a node: a strategy for each member op, a split per variable,
    the communication inside the node (seconds), its memory proxy (bytes), its
    compute seconds, and (for tied outputs) how the output's gradient is produced."""

    label: str
    strategies: Mapping[str, OpStrategy]
    var_splits: Mapping[str, TensorSplit]
    comm: float
    memory: float
    compute: float = 0.0
    grads: tuple[tuple[int, TensorSplit], ...] = ()

    def grad(self, output: int) -> TensorSplit:
        return dict(self.grads)[output]


@dataclasses.dataclass(frozen=True)
class Node:
    name: str
    options: tuple[Option, ...]


@dataclasses.dataclass(frozen=True)
class Edge:
    """Communication between two nodes (``u`` before ``v`` in DP order):
    ``cost[a, b]`` seconds when ``u`` takes option ``a`` and ``v`` option ``b``."""

    u: int
    v: int
    cost: np.ndarray


@dataclasses.dataclass(frozen=True)
class AxisProblem:
    nodes: tuple[Node, ...]
    edges: tuple[Edge, ...]
    unary: tuple[np.ndarray, ...]   # per node, per option: comm + compute seconds incl. edges to fixed nodes
    memory: tuple[np.ndarray, ...]  # per node, per option: memory proxy bytes

    def objective(self, choice: Sequence[int], lam: float) -> float:
        total = sum(self.unary[i][c] + lam * self.memory[i][c] for i, c in enumerate(choice))
        return float(total + sum(e.cost[choice[e.u], choice[e.v]] for e in self.edges))

    def time(self, choice: Sequence[int]) -> float:
        """Modeled seconds of this axis's choice: communication plus compute."""
        return self.objective(choice, 0.0)

    def compute(self, choice: Sequence[int]) -> float:
        return float(sum(self.nodes[i].options[c].compute for i, c in enumerate(choice)))

    def comm(self, choice: Sequence[int]) -> float:
        return self.time(choice) - self.compute(choice)


class ProblemBuilder:
    """Builds the problem of mesh axis ``len(prior)`` given the axes decided before it."""

    def __init__(self, index: GraphIndex, prior: Sequence[AxisDecision], n: int, link: Link,
                 restrict: Callable[[str, Option], bool] | None = None):
        self.index, self.prior, self.n, self.link = index, tuple(prior), n, link
        self.restrict = restrict
        self.tensors = index.graph.tensors

    def build(self) -> AxisProblem:
        names = self.index.node_names()
        nodes = [Node(name, tuple(self._options(name))) for name in names]
        position = {node.name: i for i, node in enumerate(nodes)}
        unary = [np.asarray([o.comm + o.compute for o in node.options], dtype=np.float64) for node in nodes]
        self._tied_done: set[str] = set()
        memory = [np.asarray([o.memory for o in node.options], dtype=np.float64) for node in nodes]
        pair_costs: dict[tuple[int, int], np.ndarray] = {}
        for consumer, j, source in self.index.uses:
            self._add_use(consumer, j, source, nodes, position, unary, pair_costs)
        edges = tuple(Edge(u, v, c) for (u, v), c in sorted(pair_costs.items()))
        return AxisProblem(tuple(nodes), edges, tuple(unary), tuple(memory))

    # options --------------------------------------------------------------------
    def _options(self, name: str) -> list[Option]:
        if name.startswith("var:"):
            options = self._var_options(self.index.groups[name[4:]])
        elif name in self.index.input_ops:
            options = self._input_options(name)
        else:
            options = self._op_options(name)
        if self.restrict is not None:
            kept = [o for o in options if self.restrict(name, o)]
            options = kept or options
        return options

    def _legal_splits(self, shape, used: set[int]) -> list[TensorSplit]:
        out = [REPLICATED]
        out += [TensorSplit(d) for d, extent in enumerate(shape) if d not in used and extent % self.n == 0]
        return out

    def _var_options(self, group: VarGroup) -> list[Option]:
        used = {d.var_splits[group.key].dim for d in self.prior} - {None}
        shrink = self._prior_factor(group.key)
        options = []
        splits = [REPLICATED] if group.key in self.index.pinned else self._legal_splits(group.shape, used)
        for split in splits:
            strategies = self._group_strategies(group, split)
            if strategies is None:
                continue
            per_device = group.nbytes / shrink / (self.n if split.dim is not None else 1)
            compute = sum(self._compute(op, strategy) for op, strategy in strategies.items())
            options.append(Option(split.text(), strategies, {p: split for p in group.paths}, 0.0, per_device,
                                  compute))
        return options

    def _compute(self, op_name: str, strategy: OpStrategy) -> float:
        """Seconds of ``op_name`` on one device: its work over the devices splitting it so far."""
        work = self.index.work.get(op_name, 0.0)
        if not work:
            return 0.0
        factor = self.n if is_split(strategy) else 1
        for d in self.prior:
            prev = d.op_strategies.get(op_name)
            if prev is not None and is_split(prev):
                factor *= d.size
        return work / factor

    def _group_strategies(self, group: VarGroup, split: TensorSplit) -> dict[str, OpStrategy] | None:
        out: dict[str, OpStrategy] = {}
        for name in group.reads:
            out[name] = OpStrategy("read", (REPLICATED,), (split,))
        for name in group.assigns:
            op = self.index.ops[name]
            out[name] = OpStrategy("assign", (REPLICATED,) + tuple(
                split_of(self.tensors[t], split) for t in op.inputs[1:]), ())
        for name in group.folded:
            op = self.index.ops[name]
            wanted = OpStrategy(
                "tied", tuple(split_of(self.tensors[t], split) if t in self.tensors else REPLICATED for t in op.inputs),
                tuple(split_of(self.tensors[t], split) for t in op.outputs))
            match = next((s for s in self.index.strategies(name, self.n) if _same_splits(s, wanted)), None)
            if match is None or not self._strategy_legal(name, match):
                return None
            out[name] = match
        return out

    def _input_options(self, name: str) -> list[Option]:
        op = self.index.ops[name]
        tensor = self.tensors[op.outputs[0]]
        used = {d.op_strategies[name].outputs[0].dim for d in self.prior} - {None}
        shrink = self._prior_factor(name, output=0)
        options = []
        for split in self._legal_splits(tensor.shape, used):
            per_device = tensor.num_bytes / shrink / (self.n if split.dim is not None else 1)
            strategy = OpStrategy("input", (), (split,) + (REPLICATED,) * (len(op.outputs) - 1))
            options.append(Option(split.text(), {name: strategy}, {}, 0.0, per_device))
        return options

    def _op_options(self, name: str) -> list[Option]:
        op = self.index.ops[name]
        options = []
        for strategy in self.index.strategies(name, self.n):
            if not self._strategy_legal(name, strategy):
                continue
            memory = 0.0
            for i, t in enumerate(op.outputs):
                if t in self.index.peak_live:
                    split = strategy.outputs[i] if i < len(strategy.outputs) else REPLICATED
                    memory += self.tensors[t].num_bytes / self._prior_factor(name, output=i) / (
                        self.n if split.dim is not None else 1)
            compute = self._compute(name, strategy)
            tied = self.index.tied_outputs.get(name, ())
            for grads in _grad_choices(strategy, tied):
                label = strategy.name + "".join(f"/d{k}={g.text()}" for k, g in grads if g.partial is not None)
                options.append(Option(label, {name: strategy}, {}, 0.0, memory, compute, grads))
        return options

    def _strategy_legal(self, name: str, strategy: OpStrategy) -> bool:
        """DTensor's rules: a dim split on an earlier axis is not split again; splits divide."""
        op = self.index.ops[name]
        for names, splits, side in ((op.inputs, strategy.inputs, "in"), (op.outputs, strategy.outputs, "out")):
            for i, (t, split) in enumerate(zip(names, splits)):
                if split.dim is None:
                    continue
                tensor = self.tensors.get(t)
                if tensor is None or split.dim >= tensor.rank or tensor.shape[split.dim] % self.n:
                    return False
                for d in self.prior:
                    prev = d.op_strategies.get(name)
                    if prev is not None and (prev.inputs if side == "in" else prev.outputs)[i].dim == split.dim:
                        return False
        return True

    def _prior_factor(self, name: str, *, output: int | None = None, input: int | None = None) -> int:
        """How much earlier axes already divide a variable group, or an op's input/output."""
        factor = 1
        for d in self.prior:
            if output is None and input is None:
                split = d.var_splits[name]
            else:
                strategy = d.op_strategies[name]
                split = strategy.outputs[output] if output is not None else strategy.inputs[input]
            if split.dim is not None:
                factor *= d.size
        return factor

    # edges ------------------------------------------------------------------------
    def _add_use(self, consumer, j, source, nodes, position, unary, pair_costs) -> None:
        tensor = self.tensors[source]
        producer = tensor.producer
        out_index = self.index.ops[producer].outputs.index(source)
        cu, pu = position[self.index.owner(consumer)], position[self.index.owner(producer)]
        nbytes = tensor.num_bytes / self._prior_factor(consumer, input=j)
        tie = self.index.ties.get((consumer, j))
        if tie is not None:
            forward, k = tie
            qu = position[forward]
            self._add_tie(qu, k, pu, producer, out_index, source, nodes, unary, pair_costs)
            src = [o.grad(k) for o in nodes[qu].options]
            pu = qu
        else:
            src = [o.strategies[producer].outputs[out_index] for o in nodes[pu].options]
        dst = [o.strategies[consumer].inputs[j] for o in nodes[cu].options]
        table = {(s, d): transfer_seconds(s, d, nbytes, self.n, self.link) for s in set(src) for d in set(dst)}
        cost = np.asarray([[table[s, d] for d in dst] for s in src], dtype=np.float64)
        self._add_matrix(cu, pu, cost, unary, pair_costs)

    def _add_tie(self, qu, k, pu, producer, out_index, source, nodes, unary, pair_costs) -> None:
        """Once per tied gradient: its producer must make it as the forward node's option says."""
        if source in self._tied_done:
            return
        self._tied_done.add(source)
        want = [o.grad(k) for o in nodes[qu].options]
        made = [o.strategies[producer].outputs[out_index] for o in nodes[pu].options]
        cost = np.asarray([[0.0 if w == m else TIE_PENALTY for m in made] for w in want], dtype=np.float64)
        self._add_matrix(pu, qu, cost, unary, pair_costs)

    @staticmethod
    def _add_matrix(cu, pu, cost, unary, pair_costs) -> None:
        """Add ``cost[producer option, consumer option]`` between two nodes (or to a unary)."""
        if cu == pu:
            unary[cu] += np.diagonal(cost)
        elif cost.shape[0] == 1:
            unary[cu] += cost[0]
        elif cost.shape[1] == 1:
            unary[pu] += cost[:, 0]
        else:
            u, v = (pu, cu) if pu < cu else (cu, pu)
            matrix = cost if pu < cu else cost.T
            if (u, v) in pair_costs:
                pair_costs[u, v] = pair_costs[u, v] + matrix
            else:
                pair_costs[u, v] = matrix
