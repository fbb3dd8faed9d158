"""The per-axis decision problem: options per coarsened node, pairwise edge costs.

This module owns *what is decided on one mesh axis* given the axes decided
before it: it turns the nodes of a ``GraphIndex`` (``tofu_tf.search.coarsen``)
into options, and the uses between nodes into edges priced by the cost model.
It must not choose anything; ``tofu_dp``/``elimination`` and ``ilp`` solve the
same problem.

Edge cost (axis ``k`` of size ``n``, tensor ``t`` from producer option ``a`` to
consumer option ``b``) is the collective of ``tofu_tf.cost.collectives`` for
``t``'s bytes after the splits the consumer already required on axes ``< k``
(Tofu's recursion: shapes shrink as axes are applied).

**Compute.** Each option also carries the compute seconds of its ops
(``tofu_tf.cost.compute``): an op's work divided by the devices earlier axes
split it over, and by this axis's size unless the option replicates it. The
unary cost of an option is its communication plus its compute.

**Gradient ties** (see ``coarsen``): the use of a tied gradient is priced from
the forward node's option, and a tie edge forbids (``TIE_PENALTY`` seconds)
any producer option that makes the gradient otherwise.

**Repeated blocks.** Where the index found blocks of identical nodes
(``GraphIndex.run``), blocks whose nodes also had the same decisions on every
earlier axis get identical options, costs and internal edges: the first such
block is built, the others share its arrays (copy-on-write where an edge to
outside the block adds to a cost). ``AxisProblem.blocks`` says which blocks
share a template; the solver checks the arrays before folding them.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Mapping, NamedTuple, Sequence

import numpy as np

from tofu_tf import ir
from tofu_tf.cost.collectives import transfer_seconds
from tofu_tf.cost.compute import is_split
from tofu_tf.cost.hardware import Link
from tofu_tf.search.coarsen import P_SUM, GraphIndex, NodeId, NodeKind, TieEdge, Use, VarGroup
from tofu_tf.search.targets import AxisRole
from tofu_tf.semantics.strategy import REPLICATED, OpStrategy, TensorSplit

TIE_PENALTY = 1e3   # seconds: larger than any step, so a broken gradient tie never wins


@dataclasses.dataclass(frozen=True)
class AxisDecision:
    """What one mesh axis decided: a strategy per op, a split per variable and input."""

    size: int
    op_strategies: Mapping[str, OpStrategy]
    var_splits: Mapping[str, TensorSplit]
    block_keys: tuple | None = None   # per repeated block: (template, options chosen); equal keys, equal decisions

    @classmethod
    def of(cls, problem: "AxisProblem", choice: Sequence[int], size: int) -> "AxisDecision":
        """The decision ``choice`` (an option per node of ``problem``) makes. Every axis lists
        the ops in the problem's node order, so plans can zip the per-axis tables."""
        strategies, var_splits = {}, {}
        for node, option_index in zip(problem.nodes, choice):
            option = node.options[option_index]
            strategies.update(zip(node.members, option.strategies))
            if option.var_split is not None:
                var_splits.update(dict.fromkeys(node.paths, option.var_split))
        blocks = problem.blocks
        keys = None if blocks is None else tuple(
            (template, tuple(choice[start: start + blocks.period]))
            for template, start in zip(blocks.templates, blocks.starts()))
        return cls(size, strategies, var_splits, keys)


@dataclasses.dataclass(frozen=True)
class Option:
    """One choice of a node: a strategy per member op (in ``Node.members`` order), the
    weight's split (variable nodes), the communication inside the node (seconds), its
    memory proxy (bytes), its compute seconds, and (for tied outputs) how each output's
    gradient is produced. Options name no op, so identical blocks share them."""

    label: str
    strategies: tuple[OpStrategy, ...]
    var_split: TensorSplit | None
    comm: float
    memory: float
    compute: float = 0.0
    grads: tuple[tuple[int, TensorSplit], ...] = ()

    def grad(self, output: int) -> TensorSplit:
        for index, split in self.grads:
            if index == output:
                return split
        raise KeyError(output)


class Node(NamedTuple):
    """A decision node: its name (``str`` of its ``NodeId``: what people read; nothing in
    the search reads it back), its options, its member ops, the variable paths it lays out.
    (A named tuple: every axis problem makes one per node.)"""

    name: str
    options: tuple[Option, ...]
    members: tuple[str, ...] = ()
    paths: tuple[str, ...] = ()

    def strategies(self, option: int) -> dict[str, OpStrategy]:
        return dict(zip(self.members, self.options[option].strategies))

    def var_splits(self, option: int) -> dict[str, TensorSplit]:
        split = self.options[option].var_split
        return {} if split is None else {p: split for p in self.paths}


class Edge(NamedTuple):
    """Communication between two nodes (``u`` before ``v`` in DP order):
    ``cost[a, b]`` seconds when ``u`` takes option ``a`` and ``v`` option ``b``.
    (A named tuple: problems have tens of thousands of edges, built once per axis.)"""

    u: int
    v: int
    cost: np.ndarray


@dataclasses.dataclass(frozen=True)
class Blocks:
    """Equal-length blocks of consecutive nodes from ``start``; blocks with the same
    template id were built from the same template (a hint the solver verifies)."""

    start: int
    period: int
    templates: tuple[int, ...]

    @property
    def stop(self) -> int:
        return self.start + self.period * len(self.templates)

    def starts(self) -> range:
        return range(self.start, self.stop, self.period)

    def block_start(self, i: int) -> int | None:
        if self.start <= i < self.stop:
            return i - (i - self.start) % self.period
        return None


@dataclasses.dataclass(frozen=True)
class AxisProblem:
    nodes: tuple[Node, ...]
    edges: tuple[Edge, ...]
    unary: tuple[np.ndarray, ...]   # per node, per option: comm + compute seconds incl. edges to fixed nodes
    memory: tuple[np.ndarray, ...]  # per node, per option: memory proxy bytes
    blocks: Blocks | None = None

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

    @functools.cached_property
    def structure(self) -> tuple:
        """Option counts and edge endpoints: what a solver's work depends on apart from the
        costs. Problems of one search often share it (``elimination``, ``ilp`` reuse work)."""
        return (tuple(len(node.options) for node in self.nodes), tuple((e.u, e.v) for e in self.edges))


class AxisOptions:
    """The options of one mesh axis that do not depend on its role, made once for the
    problems of every role the axis is tried in: per op, its legal strategies with their
    options (memory and compute priced); per weight group and split, its option.

    They depend on the graph index, the decisions of the earlier axes and the axis size
    only, so the builders sharing one must agree on those (checked by identity)."""

    def __init__(self, index: GraphIndex, prior: Sequence[AxisDecision], n: int):
        self.index, self.prior, self.n = index, tuple(prior), n
        self.ops: dict[str, tuple[tuple[OpStrategy, tuple[Option, ...]], ...]] = {}
        self.var_splits: dict[tuple[str, TensorSplit], Option | None] = {}

    def serves(self, index: GraphIndex, prior: Sequence[AxisDecision], n: int) -> bool:
        return (index is self.index and n == self.n and len(prior) == len(self.prior)
                and all(a is b for a, b in zip(prior, self.prior)))


class ProblemBuilder:
    """Builds the problem of mesh axis ``len(prior)`` given the axes decided before it.

    ``restrict`` (``NodeId``, option) -> bool keeps a subset of options (the baselines);
    it may read names, so a restricted problem is built without sharing blocks.
    ``role`` (``tofu_tf.search.targets.AxisRole``) says what the axis may split: a
    batch axis splits every batch input on dim 0 and no variable, a model axis splits
    no batch input. It reads no names: blocks are still shared.
    ``options``: the ``AxisOptions`` the builders of this axis's other roles share."""

    def __init__(self, index: GraphIndex, prior: Sequence[AxisDecision], n: int, link: Link,
                 restrict: Callable[[NodeId, Option], bool] | None = None, role: AxisRole = AxisRole.ANY,
                 options: AxisOptions | None = None):
        self.index, self.prior, self.n, self.link = index, tuple(prior), n, link
        self.restrict, self.role = restrict, role
        self.tensors = index.graph.tensors
        # Transfer tables by (splits, bytes), shared by every axis problem of the graph with this
        # axis's size and link.
        self._matrices = index.matrix_cache.setdefault((n, link), {})
        self._bytes = index.tensor_bytes
        if options is None:
            options = AxisOptions(index, self.prior, n)
        elif not options.serves(index, self.prior, n):
            raise ValueError("AxisOptions of another axis: they hold one graph index, prior and size")
        self.axis_options = options

    def can_build(self) -> bool:
        """Whether the axis can take its role: a batch axis needs every batch input's
        dim 0 unsplit by earlier axes and divisible by the axis size."""
        if self.role is not AxisRole.BATCH:
            return True
        if not self.index.input_ops:
            return False
        return all(any(o.strategies[0].outputs[0].dim == 0 for o in self._input_options(name, role_filter=False))
                   for name in self.index.input_ops if self.tensors[self.index.ops[name].outputs[0]].rank)

    def build(self) -> AxisProblem:
        index = self.index
        run = index.run if self.restrict is None else None
        templates = self._templates(run) if run is not None else None
        copy_of = self._copy_sources(run, templates)
        nodes: list[Node] = []
        unary: list[np.ndarray] = []
        memory: list[np.ndarray] = []
        for i, node in enumerate(index.nodes):
            source = copy_of.get(i)
            options = tuple(self._options(node)) if source is None else nodes[source].options
            nodes.append(Node(str(node), options, index.members[node], index.paths[node]))
            if source is None:
                unary.append(np.asarray([o.comm + o.compute for o in options], dtype=np.float64))
                memory.append(np.asarray([o.memory for o in options], dtype=np.float64))
            else:
                unary.append(unary[source])     # replaced after the template's internal uses
                memory.append(memory[source])
        pair_costs: dict[tuple[int, int], np.ndarray] = {}
        for b in sorted(set(templates or ())):   # 1. inside each template block
            for tie in index.tie_edges_in_block.get(b, ()):
                self._add_tie(tie, nodes, unary, pair_costs, set())
            for use in index.uses_in_block.get(b, ()):
                self._add_use(use, nodes, unary, pair_costs, set())
        shared: set[int] = set()
        if run is not None:                      # 2. identical blocks share the template's arrays
            self._share_blocks(run, templates, copy_of, unary, pair_costs, shared)
        for tie, block in zip(index.tie_edges, index.tie_blocks):     # 3. everything else
            if run is None or block < 0:
                self._add_tie(tie, nodes, unary, pair_costs, shared)
        for use, block in zip(index.use_table, index.use_blocks):
            if run is None or block < 0:
                self._add_use(use, nodes, unary, pair_costs, shared)
        edges = tuple(Edge(u, v, c) for (u, v), c in sorted(pair_costs.items()))
        blocks = Blocks(run.start, run.period, tuple(templates)) if run is not None else None
        return AxisProblem(tuple(nodes), edges, tuple(unary), tuple(memory), blocks)

    # repeated blocks ----------------------------------------------------------------
    def _templates(self, run) -> list[int]:
        """Per block, the first block with the same decisions on every earlier axis."""
        first: dict[tuple, int] = {}
        out = []
        keyed = all(d.block_keys is not None and len(d.block_keys) == run.count for d in self.prior)
        for b in range(run.count):
            start = run.start + b * run.period
            if keyed:
                sig = tuple(d.block_keys[b] for d in self.prior)
            else:
                sig = tuple(self._prior_signature(self.index.nodes[i]) for i in range(start, start + run.period))
            out.append(first.setdefault(sig, b))
        return out

    def _prior_signature(self, node: NodeId) -> tuple:
        """What the earlier axes decided for ``node``: the weight's splits, or the op's strategies."""
        if node.kind is NodeKind.VARIABLE:
            return tuple(d.var_splits[node.name] for d in self.prior)
        return tuple(d.op_strategies[node.name] for d in self.prior)

    @staticmethod
    def _copy_sources(run, templates) -> dict[int, int]:
        if run is None:
            return {}
        out = {}
        for b, t in enumerate(templates):
            if t != b:
                delta = (b - t) * run.period
                start = run.start + b * run.period
                out.update({i: i - delta for i in range(start, start + run.period)})
        return out

    def _share_blocks(self, run, templates, copy_of, unary, pair_costs, shared) -> None:
        by_template: dict[int, list[tuple[int, int, np.ndarray]]] = {}
        for (u, v), cost in pair_costs.items():
            b = (u - run.start) // run.period if run.start <= u < run.stop else -1
            if b >= 0 and templates[b] == b:
                by_template.setdefault(b, []).append((u, v, cost))
        for b, t in enumerate(templates):
            if t == b:
                continue
            start, source = run.start + b * run.period, run.start + t * run.period
            unary[start: start + run.period] = unary[source: source + run.period]
            shared.update(range(start, start + run.period))
            shared.update(range(source, source + run.period))
            delta = start - source
            pair_costs.update({(u + delta, v + delta): cost for u, v, cost in by_template.get(t, ())})

    # options --------------------------------------------------------------------
    def _options(self, node: NodeId) -> list[Option]:
        if node.kind is NodeKind.VARIABLE:
            options = self._var_options(self.index.groups[node.name])
        elif node.kind is NodeKind.INPUT:
            options = self._input_options(node.name)
        else:
            options = self._op_options(node.name)
        if self.restrict is not None:
            kept = [o for o in options if self.restrict(node, o)]
            options = kept or options
        return options

    def _legal_splits(self, shape, used: set[int]) -> list[TensorSplit]:
        out = [REPLICATED]
        out += [TensorSplit(d) for d, extent in enumerate(shape) if d not in used and extent % self.n == 0]
        return out

    def _var_options(self, group: VarGroup) -> list[Option]:
        used = {d.var_splits[group.key].dim for d in self.prior} - {None}
        used |= self.index.unsplit_dims.get(group.key, frozenset())
        shrink = self._prior_factor(group.key)
        options = []
        pinned = group.key in self.index.pinned or self.role is AxisRole.BATCH
        splits = [REPLICATED] if pinned else self._legal_splits(group.shape, used)
        members = group.members
        made = self.axis_options.var_splits
        for split in splits:
            key = (group.key, split)
            if key not in made:
                made[key] = self._var_option(group, split, shrink, members)
            if made[key] is not None:
                options.append(made[key])
        return options

    def _var_option(self, group: VarGroup, split: TensorSplit, shrink: int, members) -> Option | None:
        strategies = self._group_strategies(group, split)
        if strategies is None:
            return None
        per_device = group.nbytes / shrink / (self.n if split.dim is not None else 1)
        compute = sum(self._compute(op, strategy) for op, strategy in strategies.items())
        return Option(split.text(), tuple(strategies[m] for m in members), split, 0.0, per_device, compute)

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
        """The group's member strategies under ``split`` (shared by every problem of this axis
        size: do not change them), or None if a folded update op cannot follow the split or
        an earlier axis already split the dim it would split."""
        out = self.index.group_strategies(group.key, split, self.n)
        if out is None or not all(self._strategy_legal(name, out[name]) for name in group.folded):
            return None
        return out

    def _input_options(self, name: str, *, role_filter: bool = True) -> list[Option]:
        op = self.index.ops[name]
        tensor = self.tensors[op.outputs[0]]
        used = {d.op_strategies[name].outputs[0].dim for d in self.prior} - {None}
        shrink = self._prior_factor(name, output=0)
        options = []
        splits = self._legal_splits(tensor.shape, used)
        if role_filter and self.role is AxisRole.BATCH and tensor.rank:
            splits = [s for s in splits if s.dim == 0]
        elif role_filter and self.role is AxisRole.MODEL:
            splits = [REPLICATED]
        for split in splits:
            per_device = tensor.num_bytes / shrink / (self.n if split.dim is not None else 1)
            strategy = OpStrategy("input", (), (split,) + (REPLICATED,) * (len(op.outputs) - 1))
            options.append(Option(split.text(), (strategy,), None, 0.0, per_device))
        return options

    def _op_options(self, name: str) -> list[Option]:
        made = self.axis_options.ops.get(name)
        if made is None:
            made = self.axis_options.ops[name] = self._legal_op_options(name)
        if self.role is not AxisRole.MODEL:
            return [option for _, options in made for option in options]
        op, batch_dims = self.index.ops[name], self.index.batch_dims(self.n)
        return [option for strategy, options in made if not _splits_the_batch(op, strategy, batch_dims)
                for option in options]

    def _legal_op_options(self, name: str) -> tuple[tuple[OpStrategy, tuple[Option, ...]], ...]:
        """Per strategy legal after the earlier axes, its options (any role's)."""
        op = self.index.ops[name]
        out = []
        for strategy in self.index.strategies(name, self.n):
            if not self._strategy_legal(name, strategy):
                continue
            options = []
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
                options.append(Option(label, (strategy,), None, 0.0, memory, compute, grads))
            out.append((strategy, tuple(options)))
        return tuple(out)

    def _strategy_legal(self, name: str, strategy: OpStrategy) -> bool:
        """DTensor's rules: a dim split on an earlier axis is not split again; splits divide.
        (A strategy that splits nothing -- every op's replicate-all -- breaks neither.)"""
        if not strategy.divides_work:
            return True
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
    def _add_use(self, use: Use, nodes, unary, pair_costs, shared) -> None:
        source = use.source
        nbytes = self._bytes.get(source)
        if nbytes is None:
            nbytes = self._bytes[source] = self.tensors[source].num_bytes
        nbytes = nbytes / self._prior_factor(use.consumer, input=use.j)
        if use.tie is not None:
            pu, k = use.tie
            src = tuple([o.grad(k) for o in nodes[pu].options])
        else:
            pu, member, out = use.producer_node, use.producer_member, use.out_index
            src = tuple([o.strategies[member].outputs[out] for o in nodes[pu].options])
        member, j = use.consumer_member, use.j
        dst = tuple([o.strategies[member].inputs[j] for o in nodes[use.consumer_node].options])
        gradient = self.link.combines_gradient_all_reduces and source in self.index.gradient_side
        self._add_matrix(use.consumer_node, pu, self._transfer_matrix(src, dst, nbytes, gradient), unary, pair_costs,
                         shared)

    def _transfer_matrix(self, src: tuple, dst: tuple, nbytes: float, gradient: bool = False) -> np.ndarray:
        key = (src, dst, nbytes, gradient)
        matrix = self._matrices.get(key)
        if matrix is None:
            table = {(s, d): transfer_seconds(s, d, nbytes, self.n, self.link, gradient=gradient)
                     for s in set(src) for d in set(dst)}
            matrix = np.asarray([[table[s, d] for d in dst] for s in src], dtype=np.float64)
            self._matrices[key] = matrix
        return matrix

    def _add_tie(self, tie: TieEdge, nodes, unary, pair_costs, shared) -> None:
        """A tied gradient's producer must make it as the forward node's option says."""
        want = [o.grad(tie.k) for o in nodes[tie.forward_node].options]
        made = [o.strategies[tie.producer_member].outputs[tie.out_index] for o in nodes[tie.producer_node].options]
        cost = np.asarray([[0.0 if w == m else TIE_PENALTY for m in made] for w in want], dtype=np.float64)
        self._add_matrix(tie.producer_node, tie.forward_node, cost, unary, pair_costs, shared)

    @staticmethod
    def _add_matrix(cu, pu, cost, unary, pair_costs, shared) -> None:
        """Add ``cost[producer option, consumer option]`` between two nodes (or to a unary).
        Arrays in ``shared`` belong to several blocks: they are copied before a change.
        A table of zeros (a scalar read whole by every option) changes nothing and is dropped."""
        if not cost.any():
            return
        if cost.shape[0] == 1 or cost.shape[1] == 1 or cu == pu:
            target = cu if (cu == pu or cost.shape[0] == 1) else pu
            add = np.diagonal(cost) if cu == pu else (cost[0] if cost.shape[0] == 1 else cost[:, 0])
            if target in shared:
                unary[target] = unary[target] + add
                shared.discard(target)
            else:
                unary[target] += add
            return
        u, v = (pu, cu) if pu < cu else (cu, pu)
        matrix = cost if pu < cu else cost.T
        if (u, v) in pair_costs:
            pair_costs[u, v] = pair_costs[u, v] + matrix
        else:
            pair_costs[u, v] = matrix


def _splits_the_batch(op, strategy: OpStrategy, batch_dims: Mapping[str, frozenset[int]]) -> bool:
    """Whether ``strategy`` splits a tensor of ``op`` on a dim that carries the batch. On a
    model axis the batch inputs are whole, and DTensor splits an activation only as its
    operands arrive split: such a split, priced as a free local slice, would run whole."""
    for names, splits in ((op.inputs, strategy.inputs), (op.outputs, strategy.outputs)):
        for name, split in zip(names, splits):
            if split.dim is not None and split.dim in batch_dims.get(name, ()):
                return True
    return False


def _grad_choices(strategy: OpStrategy, tied: Sequence[int]) -> list[tuple[tuple[int, TensorSplit], ...]]:
    """How the gradients of ``strategy``'s tied outputs may be produced: split like the
    output, or (output whole or partial) whole or as partial sums."""
    choices: list[tuple[tuple[int, TensorSplit], ...]] = [()]
    for k in tied:
        out = strategy.outputs[k] if k < len(strategy.outputs) else REPLICATED
        grads = [TensorSplit(out.dim)] if out.dim is not None else [REPLICATED, P_SUM]
        choices = [c + ((k, g),) for c in choices for g in grads]
    return choices
