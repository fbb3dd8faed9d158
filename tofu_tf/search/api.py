"""``plan_graph`` and ``plan_model``: pick a mesh shape and layouts for a training step.

This module owns the outer loop: which mesh shapes to try (every ordered
factorization of the device count, or the one the user fixed), which method
solves each axis (Tofu's DP, the ILP, or a baseline restriction of the same
problem) in the roles the target allows (``targets.AxisRole``: under DTensor
each axis is solved as a batch axis and as a model axis, the cheaper kept), the
memory budget (a Lagrange multiplier bisected until the exact liveness peak
fits), and turning the winner into a ``Plan``. It never prices anything itself:
``tofu_tf.cost.evaluate`` does.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import time
from typing import Callable, Mapping, Sequence

from tofu_tf import ir
from tofu_tf.cost.evaluate import StepCost, StepPricer, op_work_seconds
from tofu_tf.cost.hardware import H100_NVLINK, HardwareProfile, profile
from tofu_tf.cost.memory import Liveness
from tofu_tf.errors import InfeasibleBudgetError
from tofu_tf.mesh import MeshSpec, ordered_factorizations
from tofu_tf.plan import CommCost, Method, Objective, Plan, format_bytes
from tofu_tf.search import baselines, tofu_dp
from tofu_tf.search.coarsen import GraphIndex, StrategyProvider
from tofu_tf.search.problem import TIE_PENALTY, AxisDecision, AxisProblem, ProblemBuilder
from tofu_tf.search.progress import SearchProgress
from tofu_tf.search.targets import (AxisRole, Target, as_target, axis_roles, check_lowerable, pinned_variables,
                                    restrict_provider, unsplit_variable_dims)
from tofu_tf.semantics.strategy import REPLICATED

_MEMORY_LAMBDA = 1.0        # seconds per byte: memory dominates any communication time
_BISECTION_STEPS = 8


@dataclasses.dataclass(frozen=True)
class _Candidate:
    mesh: MeshSpec
    decisions: tuple[AxisDecision, ...]
    cost: StepCost
    exact: bool

    def key(self, objective: Objective) -> tuple:
        if objective is Objective.MEMORY:
            return (self.cost.memory.peak_bytes, self.cost.step_seconds)
        if objective is Objective.COMM:
            return (self.cost.comm_seconds, self.cost.memory.peak_bytes)
        return (self.cost.step_seconds, self.cost.memory.peak_bytes)


def plan_graph(graph: ir.Graph, *, num_devices: int, memory_budget_bytes: int | None = None,
               method: str | Method = "tofu", hardware: HardwareProfile | str = H100_NVLINK,
               mesh_shape=None, objective: str | Objective = Objective.TIME,
               strategy_provider: StrategyProvider | None = None, time_limit_s: float = 60.0,
               max_states: int = tofu_dp.DEFAULT_MAX_STATES, target: str | Target = Target.DTENSOR) -> Plan:
    """Plan ``graph`` for ``num_devices`` devices.

    ``method``: "tofu" (recursive DP), "ilp" (the same problems as integer
    programs, HiGHS, ``time_limit_s`` per axis), "data_parallel" or "megatron".
    "tofu" also hands HiGHS (``time_limit_s``) an axis problem too wide for exact
    elimination, such as an unrolled RNN's (``tofu_dp.solve_axis``).
    ``memory_budget_bytes`` defaults to the hardware's device memory.
    ``mesh_shape`` fixes the mesh (dict name -> size, or a tuple of sizes).
    ``objective``: "time" (modeled step seconds: communication + compute), "comm"
    (communication only) or "memory" (peak bytes). ``target``: "dtensor" keeps
    only what DTensor can lower (``tofu_tf.search.targets``) and raises
    ``UnsupportedOpError`` for a graph with ops DTensor runs in no layout;
    "ideal" searches Tofu's whole space.
    """
    with _collector_paused():
        return _plan_graph(graph, num_devices, memory_budget_bytes, method, hardware, mesh_shape, objective,
                           strategy_provider, time_limit_s, max_states, target)


@contextlib.contextmanager
def _collector_paused():
    """Pause CPython's cyclic garbage collector for the search, and restore it after.

    The search allocates hundreds of thousands of small acyclic objects (options, edges,
    tables); every few thousand allocations the collector rescans everything alive,
    including the whole graph IR, which cost about a third of GPT-48's planning time.
    Nothing the search builds relies on cycle collection; reference counting frees it."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _plan_graph(graph, num_devices, memory_budget_bytes, method, hardware, mesh_shape, objective,
                strategy_provider, time_limit_s, max_states, target) -> Plan:
    start = time.perf_counter()
    method, objective, hardware = Method(method), Objective(objective), profile(hardware)
    target = as_target(target)
    check_lowerable(graph, target)
    budget = hardware.memory_bytes if memory_budget_bytes is None else int(memory_budget_bytes)
    provider = restrict_provider(strategy_provider or _default_provider(), target, graph)
    work = op_work_seconds(graph, hardware)
    liveness = Liveness(graph)
    index = GraphIndex(graph, provider, pinned=pinned_variables(graph, target),
                       unsplit_dims=unsplit_variable_dims(graph, target),
                       work={} if objective is Objective.COMM else work, liveness=liveness)
    meshes, restrict = _meshes_and_restriction(method, index, num_devices, mesh_shape)
    solver = _solver(method, max_states, time_limit_s)
    first_pass = len({mesh.sizes[: k + 1] for mesh in meshes for k in range(len(mesh.axes))})
    roles = (AxisRole.ANY,) if restrict is not None else axis_roles(target)   # a baseline fixes its own pattern
    search = _Search(index, liveness, hardware, solver, restrict, work, SearchProgress(first_pass), roles)
    if method in (Method.DATA_PARALLEL, Method.MEGATRON):
        best = min((search.solve(m, 0.0) for m in meshes), key=lambda c: c.key(objective))  # fixed patterns
    else:
        best = search.best_under_budget(meshes, budget, objective)
    return _to_plan(best, graph, method, objective, hardware, memory_budget_bytes,
                    time.perf_counter() - start, search, target, user_names=isinstance(mesh_shape, Mapping))


def plan_model(model, *, num_devices: int, batch_size: int, loss="sparse_categorical_crossentropy",
               optimizer="adam", memory_budget_bytes: int | None = None, method: str | Method = "tofu",
               **kwargs) -> Plan:
    """Capture ``model``'s training step (TF, imported here) and plan it with ``plan_graph``."""
    from tofu_tf.tf.capture import capture_training_step  # lazy: the planner core is TF-free
    graph = capture_training_step(model, batch_size=batch_size, loss=loss, optimizer=optimizer)
    return plan_graph(graph, num_devices=num_devices, memory_budget_bytes=memory_budget_bytes,
                      method=method, **kwargs)


def _default_provider() -> StrategyProvider:
    try:
        from tofu_tf.semantics import strategies
    except ImportError as error:
        raise ImportError(
            "tofu_tf.semantics.strategies is not available; pass strategy_provider=... to plan_graph") from error
    return strategies


def _meshes_and_restriction(method: Method, index: GraphIndex, n: int, mesh_shape):
    if method in (Method.DATA_PARALLEL, Method.MEGATRON) and mesh_shape is not None \
            and MeshSpec.from_user_input(mesh_shape).sizes != (n,):
        raise ValueError(f"method={method.value!r} plans its own one-axis mesh of {n} devices, and mesh_shape "
                         f"{MeshSpec.from_user_input(mesh_shape).text()} asks for another: drop mesh_shape, or "
                         "plan with method='tofu' on that mesh.")
    if method is Method.DATA_PARALLEL:
        return [MeshSpec((("batch", n),))], baselines.data_parallel_restriction(index, n)
    if method is Method.MEGATRON:
        return [MeshSpec((("model", n),))], baselines.megatron_restriction(index, n)
    if mesh_shape is not None:
        mesh = MeshSpec.from_user_input(mesh_shape)
        if mesh.num_devices != n:
            raise ValueError(f"mesh_shape {mesh.text()} has {mesh.num_devices} devices, not num_devices={n}")
        return [mesh], None
    return [MeshSpec(tuple((f"a{i}", s) for i, s in enumerate(sizes))) for sizes in ordered_factorizations(n)], None


@dataclasses.dataclass(frozen=True)
class _AxisSolver:
    """How the search solves an axis problem, in two steps, so that a problem elimination
    cannot solve (too wide: T5's batch role, an unrolled RNN) is solved last, knowing the
    objective it must beat.

    ``exact(problem, lam)``: the optimum where elimination finds it, else None.
    ``rest(problem, lam, beat)``: a solution of any problem, or None where it proves that
    no solution's objective is below ``beat`` (the axis keeps the other role's)."""

    exact: Callable[[AxisProblem, float], tofu_dp.AxisSolution | None]
    rest: Callable[[AxisProblem, float, float], tofu_dp.AxisSolution | None]


def _solver(method: Method, max_states: int, time_limit_s: float) -> _AxisSolver:
    if method is Method.ILP:
        from tofu_tf.search import ilp
        return _AxisSolver(exact=lambda problem, lam: None,
                           rest=lambda problem, lam, beat: ilp.solve_axis(problem, lam, time_limit_s=time_limit_s))
    return _AxisSolver(exact=tofu_dp.solve_by_elimination,
                       rest=functools.partial(_solve_too_wide, max_states=max_states, time_limit_s=time_limit_s))


# How far above the objective to beat a relaxation's bound must be to drop a problem: a
# tie (both roles of a tiny model replicate everything) is solved, and the role order decides.
_PRUNE_MARGIN = 1e-6


def _solve_too_wide(problem: AxisProblem, lam: float, beat: float, *, max_states: int, time_limit_s: float):
    """A problem too wide for elimination: its linear relaxation first (``ilp.solve_relaxation``),
    which drops it when its bound exceeds ``beat`` and solves it when integral; else HiGHS'
    integer program (``time_limit_s``) and the capped cut DP (``tofu_dp.solve_too_wide``)."""
    from tofu_tf.search import ilp
    relaxation = ilp.solve_relaxation(problem, lam)
    if relaxation is not None:
        if relaxation.bound > beat * (1 + _PRUNE_MARGIN) + 1e-15:
            return None
        if relaxation.integral is not None:
            return relaxation.integral

    def integer_program(problem, lam):
        try:
            return ilp.solve_axis(problem, lam, time_limit_s=time_limit_s)
        except ilp.ILPError:
            return None
    return tofu_dp.solve_too_wide(problem, lam, max_states=max_states, too_wide=integer_program)


@dataclasses.dataclass(frozen=True)
class _Solved:
    """A mesh's decisions, whether every axis was proved optimal, and a lower bound on the
    plan's priced objective: the last axis's modeled seconds. On the last axis no later
    axis shrinks a conversion, so its communication is exactly the plan's communication on
    that axis, and its compute term is the plan's compute (objective "time"; none under
    "comm"); earlier axes only add communication."""

    decisions: tuple[AxisDecision, ...]
    exact: bool
    bound: float


class _Search:
    """Solves mesh shapes axis by axis, sharing solved prefixes between shapes, and prices
    only the meshes whose lower bound does not already lose to a priced plan that fits."""

    def __init__(self, index: GraphIndex, liveness: Liveness, hardware: HardwareProfile,
                 solver: _AxisSolver, restrict, work, progress: SearchProgress,
                 roles: Sequence[AxisRole] = (AxisRole.ANY,)):
        self.index, self.liveness, self.hardware, self.work = index, liveness, hardware, work
        self.progress, self.roles = progress, tuple(roles)
        self.pricer = StepPricer(index.graph, liveness)
        self.solver, self.restrict = solver, restrict
        self._prefixes: dict[tuple, _Solved] = {}
        self.solves = 0
        self.priced = 0
        self.pruned = 0
        self.proved = True

    def decide(self, mesh: MeshSpec, lam: float) -> _Solved:
        solved = _Solved((), True, 0.0)
        for k in range(len(mesh.axes)):
            key = (mesh.sizes[: k + 1], mesh.num_devices, lam)
            if key not in self._prefixes:
                problem, solution = self._solve_axis(mesh, k, solved.decisions, lam)
                seconds = problem.time(solution.choice)
                self._prefixes[key] = _Solved(solved.decisions + (AxisDecision.of(problem, solution.choice, mesh.sizes[k]),),
                                              solved.exact and solution.exact,
                                              seconds if seconds < TIE_PENALTY else 0.0)
            solved = self._prefixes[key]
        self.proved = self.proved and solved.exact
        return solved

    def _solve_axis(self, mesh: MeshSpec, k: int, prior: tuple[AxisDecision, ...], lam: float):
        """Axis ``k``'s problem and solution: under each role the target allows, the
        one of least objective (``targets.axis_roles``; on a tie, the earlier role).
        Problems elimination solves go first; a wider one then only has to beat them."""
        link = self.hardware.axis_link(mesh, k)
        started = time.perf_counter()
        problems = []
        for role in self.roles:
            builder = ProblemBuilder(self.index, prior, mesh.sizes[k], link, self.restrict, role)
            if builder.can_build():
                problems.append(builder.build())
        solutions = [self.solver.exact(problem, lam) for problem in problems]
        for i, problem in enumerate(problems):
            if solutions[i] is None:
                beat = min((other.objective(found.choice, lam) for other, found in zip(problems, solutions)
                            if found is not None), default=float("inf"))
                solutions[i] = self.solver.rest(problem, lam, beat)
        self.solves += len(problems)
        _, best = min((problem.objective(solution.choice, lam), i)
                      for i, (problem, solution) in enumerate(zip(problems, solutions)) if solution is not None)
        problem, solution = problems[best], solutions[best]
        self.progress.axis_solved(mesh.text(), k, len(mesh.axes), mesh.sizes[k], len(problem.nodes),
                                  solution.exact, time.perf_counter() - started)
        return problem, solution

    def price(self, mesh: MeshSpec, solved: _Solved) -> _Candidate:
        var_splits = _zip_tables([d.var_splits for d in solved.decisions])
        cost = self.pricer.price_axes(mesh, self.hardware, [d.op_strategies for d in solved.decisions], var_splits,
                                      work_seconds=self.work)
        self.priced += 1
        return _Candidate(mesh, solved.decisions, cost, solved.exact)

    def solve(self, mesh: MeshSpec, lam: float) -> _Candidate:
        return self.price(mesh, self.decide(mesh, lam))

    def candidates(self, meshes: Sequence[MeshSpec], lam: float, budget: int,
                   objective: Objective) -> list[_Candidate]:
        """The priced plans of ``meshes`` at ``lam``, cheapest bound first, leaving out meshes
        whose bound exceeds the best fitting plan's objective (they cannot be picked). Under
        the memory objective (peak first) every mesh is priced."""
        solved = [(mesh, self.decide(mesh, lam)) for mesh in meshes]
        if objective is Objective.MEMORY:
            return [self.price(mesh, s) for mesh, s in solved]
        out, best = [], float("inf")
        for mesh, s in sorted(solved, key=lambda item: item[1].bound):
            if s.bound > best * (1 + 1e-9):
                self.pruned += 1
                continue
            candidate = self.price(mesh, s)
            out.append(candidate)
            if candidate.cost.memory.peak_bytes <= budget:
                best = min(best, candidate.key(objective)[0])
        return out

    def best_under_budget(self, meshes: Sequence[MeshSpec], budget: int, objective: Objective) -> _Candidate:
        first_lam = _MEMORY_LAMBDA if objective is Objective.MEMORY else 0.0
        fitting = self._fitting(self.candidates(meshes, first_lam, budget, objective), budget)
        if fitting or objective is Objective.MEMORY:
            return self._pick(fitting, budget, objective, meshes)
        leanest = self.candidates(meshes, _MEMORY_LAMBDA, budget, objective)
        if not self._fitting(leanest, budget):
            self._raise_infeasible(leanest, budget)
        return self._pick(self._fitting(leanest, budget) + self._bisect(meshes, budget, objective), budget,
                          objective, meshes)

    def _bisect(self, meshes, budget, objective) -> list[_Candidate]:
        """Lagrangian search: the smallest multiplier (least communication) that still fits."""
        found: list[_Candidate] = []
        lo, hi = 1e-16, _MEMORY_LAMBDA
        for _ in range(_BISECTION_STEPS * 2):
            mid = (lo * hi) ** 0.5
            fits = self._fitting(self.candidates(meshes, mid, budget, objective), budget)
            found += fits
            lo, hi = (lo, mid) if fits else (mid, hi)
            if hi / lo < 1.5:
                break
        return found

    @staticmethod
    def _fitting(candidates, budget) -> list[_Candidate]:
        return [c for c in candidates if c.cost.memory.peak_bytes <= budget]

    def _pick(self, fitting, budget, objective, meshes) -> _Candidate:
        if not fitting:
            self._raise_infeasible([self.solve(m, _MEMORY_LAMBDA) for m in meshes], budget)
        return min(fitting, key=lambda c: c.key(objective))

    @staticmethod
    def _raise_infeasible(leanest: Sequence[_Candidate], budget: int) -> None:
        best = min(leanest, key=lambda c: c.cost.memory.peak_bytes)
        memory = best.cost.memory
        top = ", ".join(f"{name} {format_bytes(size)}" for name, size in memory.top_contributors[:5])
        raise InfeasibleBudgetError(
            f"no plan fits the memory budget of {format_bytes(budget)} per device: the best achievable "
            f"peak is {format_bytes(memory.peak_bytes)} (mesh {best.mesh.text()}; weights "
            f"{format_bytes(memory.weight_bytes)}, optimizer slots {format_bytes(memory.optimizer_slot_bytes)}, "
            f"gradients {format_bytes(memory.gradient_bytes_at_peak)}, activations "
            f"{format_bytes(memory.activation_bytes_at_peak)}). Largest contributors: {top}. "
            "Use more devices, a smaller batch, or a larger budget.")


def _merge(decisions: Sequence[AxisDecision]):
    """Per op its strategy on every axis, per variable its split on every axis. Every
    axis lists the same ops in the same order (the problem's node order), so the
    per-axis tables are zipped, not looked up."""
    if not decisions:
        return {}, {}
    return _zip_tables([d.op_strategies for d in decisions]), _zip_tables([d.var_splits for d in decisions])


def _zip_tables(tables: Sequence[Mapping]) -> dict:
    keys = list(tables[0])
    if all(list(t) == keys for t in tables[1:]):
        return dict(zip(keys, zip(*(t.values() for t in tables))))
    return {key: tuple(t[key] for t in tables) for key in keys}


# -- the Plan ------------------------------------------------------------------

def _axis_names(candidate: _Candidate, index: GraphIndex, method: Method, user_names: bool) -> tuple[str, ...]:
    """The plan's mesh axis names: the user's where ``mesh_shape`` named them; else by what
    each axis splits: ``batch`` for the first that splits the batch inputs, ``model``,
    ``model1``, ... for the others."""
    if user_names or method in (Method.DATA_PARALLEL, Method.MEGATRON):
        return candidate.mesh.names
    names, models = [], 0
    for decision in candidate.decisions:
        batch = index.input_ops and all(decision.op_strategies[i].outputs[0].dim == 0 for i in index.input_ops)
        if batch and "batch" not in names:
            names.append("batch")
        else:
            names.append("model" if models == 0 else f"model{models}")
            models += 1
    return tuple(names)


def _layout(splits, names, rank) -> tuple:
    layout = [None] * rank
    for split, name in zip(splits, names):
        if split.dim is not None:
            layout[split.dim] = name
    return tuple(layout)


def _to_plan(best: _Candidate, graph: ir.Graph, method: Method, objective: Objective,
             hardware: HardwareProfile, budget, seconds: float, search: _Search, target: Target,
             user_names: bool = False) -> Plan:
    names = _axis_names(best, search.index, method, user_names)
    op_strategies, var_splits = _merge(best.decisions)
    # Every tensor's layout is its producer's output split on each axis. Strategies are shared
    # objects (one per op signature and split), so layouts repeat: they are made once per
    # (identity of the producer's strategies, output, rank) -- all alive here.
    made_by, aliases, whole = search.pricer.made_by, search.pricer.aliases, (REPLICATED,) * len(names)
    tensor_layouts, partial = {}, {}
    seen: dict[tuple, tuple] = {}
    resource, dtype_bytes = ir.Role.RESOURCE, ir.DTYPE_BYTES
    for name, tensor in graph.tensors.items():
        if tensor.role is resource or dtype_bytes.get(tensor.dtype, 0) == 0:
            continue
        op_name, index = made_by.get(aliases.get(name, name), (None, 0))
        strategies = op_strategies.get(op_name)
        key = (None if strategies is None else tuple(map(id, strategies)), index, tensor.rank)
        found = seen.get(key)
        if found is None:
            splits = whole if strategies is None else tuple(
                s.outputs[index] if index < len(s.outputs) else REPLICATED for s in strategies)
            found = seen[key] = (_layout(splits, names, tensor.rank),
                                 tuple(n for s, n in zip(splits, names) if s.partial is not None))
        tensor_layouts[name], axes = found
        if axes:
            partial[name] = axes
    variable_layouts = {path: _layout(var_splits.get(path, ()), names, len(var.shape))
                        for path, var in graph.variables.items()}
    inputs = {graph.ops[search.index.position[i]].outputs[0]: tensor_layouts[graph.ops[search.index.position[i]].outputs[0]]
              for i in search.index.input_ops}
    cost = best.cost
    return Plan(
        method=method, mesh_axes=tuple(zip(names, best.mesh.sizes)),
        variable_layouts=variable_layouts, input_layouts=inputs, tensor_layouts=tensor_layouts,
        partial_tensors=partial,
        op_strategies={op: tuple(s.name for s in strategies) for op, strategies in op_strategies.items()},
        comm_by_collective={k: CommCost(*v) for k, v in cost.by_collective.items()},
        comm_by_layer={k: CommCost(*v) for k, v in cost.by_layer.items()},
        memory=cost.memory, search_seconds=seconds, hardware=hardware.name, objective=objective,
        memory_budget_bytes=budget, proved_optimal=(best.exact if method is Method.ILP else None),
        notes=_notes(graph, best.mesh, variable_layouts), compute_seconds=cost.compute_seconds,
        target=target.value)


def _notes(graph: ir.Graph, mesh: MeshSpec, variable_layouts) -> tuple[str, ...]:
    """Variables no mesh axis could split because no dim divides (DTensor needs even division)."""
    notes = []
    for path, layout in variable_layouts.items():
        shape = graph.variables[path].shape
        if not shape or any(a is not None for a in layout):
            continue
        for name, size in mesh.axes:
            if size > 1 and all(d % size for d in shape):
                notes.append(f"{path} {tuple(shape)}: no dim divides mesh axis size {size}; kept replicated")
                break
    if len(notes) > 20:
        notes = notes[:20] + [f"... and {len(notes) - 20} more such variables"]
    return tuple(notes)
