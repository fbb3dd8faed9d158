"""``plan_graph`` and ``plan_model``: pick a mesh shape and layouts for a training step.

This module owns the outer loop: which mesh shapes to try (the ordered
factorizations of the device count that follow the hosts, all of them where no
plan fits there, or the one the user fixed), which method
solves each axis (Tofu's DP, the ILP, or a baseline restriction of the same
problem) in the roles the target allows (``targets.AxisRole``: under DTensor
each axis is solved as a batch axis and as a model axis, the cheaper kept), the
memory budget (a Lagrange multiplier bisected until the exact liveness peak
fits; then, for "tofu", per mesh and per subset of its axes a multiplier of its own,
the other axes at zero: ``_Search._refine``, and the winner's local repair under the
exact pricer: ``repair``), and turning the winner into a ``Plan``. It never prices anything itself:
``tofu_tf.cost.evaluate`` does.
"""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import functools
import gc
import itertools
import time
from typing import Callable, Mapping, Sequence

from absl import logging

from tofu_tf import ir
from tofu_tf.cost.collectives import Collective, collective_cost
from tofu_tf.cost.evaluate import StepCost, StepPricer, op_work_seconds
from tofu_tf.cost.hardware import H100_NVLINK, HardwareProfile, profile
from tofu_tf.cost.memory import Liveness
from tofu_tf.errors import InfeasibleBudgetError
from tofu_tf.mesh import LayoutError, MeshSpec, host_aligned_factorizations, ordered_factorizations
from tofu_tf.plan import CommCost, Method, Objective, Plan, format_bytes
from tofu_tf.search import baselines, pins, repair, tofu_dp
from tofu_tf.search.coarsen import GraphIndex, StrategyProvider
from tofu_tf.search.problem import TIE_PENALTY, AxisDecision, AxisOptions, AxisProblem, ProblemBuilder
from tofu_tf.search.progress import SearchProgress
from tofu_tf.search.targets import (AxisRole, Target, as_target, axis_roles, check_lowerable, pinned_variables,
                                    restrict_provider, unsplit_variable_dims)
from tofu_tf.semantics.strategy import REPLICATED

_MEMORY_LAMBDA = 1.0        # seconds per byte: memory dominates any communication time
_BISECTION_STEPS = 8
_REFINED_MESHES = 8         # meshes whose per-axis multipliers are refined under a budget (_Search._refine)
_REPAIRED_MESHES = 3        # meshes whose best plans are repaired under a budget (_Search._repaired_best)
_KEPT_PROBLEMS = 24         # axis problems kept for other multipliers (a problem does not depend on it)


@dataclasses.dataclass(frozen=True)
class _Candidate:
    mesh: MeshSpec
    decisions: tuple[AxisDecision, ...]
    cost: StepCost
    exact: bool
    path: tuple = ()     # per axis (role's problem, choice), as ``_Solved`` has it

    def key(self, objective: Objective) -> tuple:
        return _cost_key(self.cost, objective)


def _cost_key(cost: StepCost, objective: Objective) -> tuple:
    """What ``objective`` ranks plans by, ties broken by the other figure."""
    if objective is Objective.MEMORY:
        return (cost.memory.peak_bytes, cost.step_seconds)
    if objective is Objective.COMM:
        return (cost.comm_seconds, cost.memory.peak_bytes)
    return (cost.step_seconds, cost.memory.peak_bytes)


def plan_graph(graph: ir.Graph, *, num_devices: int, memory_budget_bytes: int | None = None,
               method: str | Method = "tofu", hardware: HardwareProfile | str = H100_NVLINK,
               mesh_shape=None, objective: str | Objective = Objective.TIME,
               strategy_provider: StrategyProvider | None = None, time_limit_s: float = 60.0,
               max_states: int = tofu_dp.DEFAULT_MAX_STATES, target: str | Target = Target.DTENSOR,
               pinned_layouts: Mapping[str, tuple] | None = None) -> Plan:
    """Choose a mesh shape and a layout for every tensor of a captured training step.

    The ordered factorizations of ``num_devices`` into mesh axes are tried (beyond one of
    ``hardware``'s hosts, those whose axes stay inside a host or span whole hosts, and all
    of them where none of those fits the budget: ``tofu_tf.mesh.host_aligned_factorizations``),
    or only ``mesh_shape``; each axis is solved in turn by ``method``, each candidate is priced by
    ``hardware``'s cost model, and the best by ``objective`` among those whose modeled peak
    memory per device fits the budget wins. Planning runs no step and needs no devices:
    the plan is what ``TofuStrategy`` lowers onto DTensor.

    Args:
        graph: The training step's IR, as ``tofu_tf.capture_training_step`` returns it.
        num_devices: How many devices the step is spread over.
        memory_budget_bytes: Peak bytes allowed per device; None takes ``hardware``'s device
            memory. The baselines keep their fixed pattern whatever its peak.
        method: "tofu" (Tofu's recursive dynamic program; an axis problem too wide for it,
            such as an unrolled RNN's, also goes to HiGHS for ``time_limit_s``), "ilp" (each
            axis as an integer program solved by HiGHS), or the baselines "data_parallel" and
            "megatron", each on its own one-axis mesh.
        hardware: A profile name ("h100-nvlink", "h200-nvlink", "pcie-gpu", "cpu-virtual") or
            a ``tofu_tf.cost.HardwareProfile``: its links and speed price communication and
            compute, its memory is the default budget.
        mesh_shape: The mesh to plan on instead of searching one: a dict axis name -> size
            (the plan keeps those names) or a tuple of sizes; the sizes multiply to
            ``num_devices``.
        objective: What the search minimizes within the budget: "time" (modeled step
            seconds, communication plus compute), "comm" (communication seconds only) or
            "memory" (peak bytes per device).
        strategy_provider: Replaces the partition strategies derived from the op
            descriptions (``tofu_tf.semantics.strategies``): a callable ``(op, graph,
            num_parts)`` returning the op's ``OpStrategy`` list.
        time_limit_s: Seconds HiGHS may spend on one axis problem.
        max_states: States the capped dynamic program keeps for an axis problem too wide for
            exact elimination, used when HiGHS proves no optimum.
        target: "dtensor" keeps only the layouts TF's DTensor can run
            (``tofu_tf.search.targets``); "ideal" searches Tofu's whole space, for comparison.
        pinned_layouts: Layouts fixed before the search, variable path -> per dim a mesh axis
            name or None (a layout map's entries, resolved to paths): each such weight, its
            optimizer slots with it, gets exactly that layout and the search decides the rest.
            Needs ``mesh_shape`` as a dict naming the axes the layouts use
            (``tofu_tf.search.pins``; ``PinError`` names every entry that cannot be kept).

    Returns:
        A ``tofu_tf.Plan``: the mesh axes, a layout for every variable, input and tensor, and
        the modeled cost (communication and compute per step, peak memory per device).

    Raises:
        tofu_tf.InfeasibleBudgetError: "tofu" or "ilp" found no plan whose modeled peak fits
            the budget; the message gives the leanest plan's peak and its largest contributors.
        tofu_tf.UnsupportedOpError: ``target`` is "dtensor" and the step holds ops DTensor
            runs in no layout (each is named, with a rewrite).
        tofu_tf.search.ilp.ILPError: ``method`` is "ilp" and HiGHS found no solution of an
            axis within ``time_limit_s``.
        tofu_tf.mesh.LayoutError: ``num_devices`` is not positive, or ``mesh_shape`` is not a
            dict or tuple of positive int sizes.
        ValueError: An unknown ``method``, ``objective``, ``hardware`` or ``target``; a
            ``mesh_shape`` of another device count, or one other than its own mesh for
            "data_parallel" and "megatron".

    Example:
        >>> import tofu_tf
        >>> from tofu_tf import models
        >>> graph = tofu_tf.capture_training_step(models.mlp(), batch_size=32, optimizer="adam",
        ...                                       loss="sparse_categorical_crossentropy")
        >>> tofu_tf.plan_graph(graph, num_devices=8, mesh_shape={"batch": 2, "model": 4}).mesh_shape
        {'batch': 2, 'model': 4}
        >>> tofu_tf.plan_graph(graph, num_devices=4, method="data_parallel").mesh_shape
        {'batch': 4}
    """
    if num_devices < 1:
        raise LayoutError(f"num_devices={num_devices!r}: a plan needs a positive number of devices")
    with _collector_paused():
        return _plan_graph(graph, num_devices, memory_budget_bytes, method, hardware, mesh_shape, objective,
                           strategy_provider, time_limit_s, max_states, target, pinned_layouts)


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
                strategy_provider, time_limit_s, max_states, target, pinned_layouts=None) -> Plan:
    start = time.perf_counter()
    method, objective, hardware = Method(method), Objective(objective), profile(hardware)
    target = as_target(target)
    check_lowerable(graph, target)
    budget = hardware.memory_bytes if memory_budget_bytes is None else int(memory_budget_bytes)
    provider = restrict_provider(strategy_provider or _default_provider(), target, graph)
    work = op_work_seconds(graph, hardware)
    liveness = Liveness(graph)
    # A table a layout map splits by rows is stored so and read whole (the lowering
    # all-gathers it at each read: ``tofu_tf.tf.lowering.Lowered.read_layouts``).
    unsplit = {path: dims for path, dims in unsplit_variable_dims(graph, target).items()
               if path not in (pinned_layouts or {})}
    index = GraphIndex(graph, provider, pinned=pinned_variables(graph, target), unsplit_dims=unsplit,
                       work={} if objective is Objective.COMM else work, liveness=liveness)
    meshes, restrict = _meshes_and_restriction(method, index, num_devices, mesh_shape, hardware)
    if pinned_layouts:
        if not isinstance(mesh_shape, Mapping) or method not in (Method.TOFU, Method.ILP):
            raise ValueError("pinned_layouts needs method 'tofu' or 'ilp' and mesh_shape as a dict naming the mesh "
                             "axes its layouts use, e.g. {'batch': 2, 'model': 4}")
        pins.check_pins(graph, pinned_layouts, meshes[0], replicated_only=pinned_variables(graph, target))
    solver = _solver(method, max_states, time_limit_s)
    first_pass = len({mesh.sizes[: k + 1] for mesh in meshes for k in range(len(mesh.axes))})
    roles = (AxisRole.ANY,) if restrict is not None else axis_roles(target)   # a baseline fixes its own pattern
    search = _Search(index, liveness, hardware, solver, restrict, work, SearchProgress(first_pass), roles,
                     pinned=pinned_layouts or {}, refine=method is Method.TOFU)
    if method in (Method.DATA_PARALLEL, Method.MEGATRON):
        best = min((search.solve(m, 0.0) for m in meshes), key=lambda c: c.key(objective))  # fixed patterns
    else:
        best, meshes = _best_aligned_first(search, meshes, budget, objective, num_devices, mesh_shape)
        if method is Method.TOFU and mesh_shape is None and not pinned_layouts and num_devices > 1:
            best = _not_worse_than_data_parallel(best, search, solver, num_devices, budget, objective)
    plan = _to_plan(best, graph, method, objective, hardware, memory_budget_bytes,
                    time.perf_counter() - start, search, target, user_names=isinstance(mesh_shape, Mapping))
    every = len(ordered_factorizations(num_devices))
    if mesh_shape is None and method in (Method.TOFU, Method.ILP) and len(meshes) < every:
        plan = dataclasses.replace(plan, notes=(
            f"searched {len(meshes)} of the {every} mesh shapes of {num_devices} devices: those whose axes stay "
            f"inside a host of {hardware.devices_per_node} or span whole hosts (pass mesh_shape= for another)",)
            + plan.notes)
    if pinned_layouts:
        pins.check_kept(pinned_layouts, plan.variable_layouts)
        plan = dataclasses.replace(plan, pinned_variables=tuple(pinned_layouts),
                                   notes=(f"{len(pinned_layouts)} variable layouts fixed by the layout map "
                                          f"(their optimizer slots follow)",) + plan.notes)
    return plan


def plan_model(model, *, num_devices: int, batch_size: int, loss="sparse_categorical_crossentropy",
               optimizer="adam", memory_budget_bytes: int | None = None, method: str | Method = "tofu",
               **kwargs) -> Plan:
    """Capture ``model``'s training step and plan it for ``num_devices`` devices.

    ``capture_training_step`` traces the step and ``plan_graph`` plans it. TensorFlow is
    imported here, on first use, so that the planner core stays TF-free. The step is traced,
    never run: the model's weights and the optimizer are left as they are.

    Args:
        model: A built Keras model, tf-keras or Keras 3.
        num_devices: How many devices the step is spread over.
        batch_size: The global batch size of one training step; every shape is planned at it.
        loss: What ``model.compile`` takes as its loss: a name or a loss object.
            Planning needs it to trace the backward pass.
        optimizer: What ``model.compile`` takes as its optimizer: a name or an optimizer;
            its slots count in the memory the plan must fit.
        memory_budget_bytes: Peak bytes allowed per device; None takes the hardware's device
            memory.
        method: "tofu", "ilp", "data_parallel" or "megatron" (see ``plan_graph``).
        **kwargs: The other options of ``plan_graph``: ``hardware``, ``mesh_shape``,
            ``objective``, ``strategy_provider``, ``time_limit_s``, ``max_states``,
            ``target``, ``pinned_layouts``.

    Returns:
        A ``tofu_tf.Plan``, to print (``summary``), save (``to_json``) or hand to
        ``TofuStrategy(plan=...)``.

    Raises:
        tofu_tf.tf.keras_adapter.UnsupportedModelError: ``model`` is not a Keras model, is
            not built, or its step cannot be traced.
        tofu_tf.DynamicShapeError: A tensor of the step has a dimension unknown at trace time.
        tofu_tf.InfeasibleBudgetError, tofu_tf.UnsupportedOpError, ValueError: As
            ``plan_graph`` raises them; ValueError also for a ``batch_size`` that is not a
            positive int, or not the one the model's ``Input`` fixes.

    Example:
        >>> import tf_keras as keras
        >>> import tofu_tf
        >>> model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(256, activation="relu"),
        ...                           keras.layers.Dense(10)])
        >>> plan = tofu_tf.plan_model(model, num_devices=8, batch_size=32)
        >>> plan.num_devices
        8
        >>> print(plan.summary())  # doctest: +ELLIPSIS
        Plan (tofu, objective time) on mesh ...
    """
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


def _best_aligned_first(search: "_Search", meshes: list[MeshSpec], budget: int, objective: Objective, n: int,
                        mesh_shape) -> tuple["_Candidate", list[MeshSpec]]:
    """The best plan over the host-aligned meshes; where none fits the budget, over every
    ordered factorization (a model that must split wider than a host, or across hosts in
    more ways), said in the log. Returns the plan and the meshes searched."""
    try:
        return search.best_under_budget(meshes, budget, objective), meshes
    except InfeasibleBudgetError:
        every = [] if mesh_shape is not None or n == 1 else [_mesh(sizes) for sizes in ordered_factorizations(n)]
        rest = [mesh for mesh in every if mesh not in meshes]
        if not rest:
            raise
        logging.info("tofu_tf planner: no plan over the %d meshes that follow the hosts fits %.2f GiB per device; "
                     "searching the other %d mesh shapes of %d devices", len(meshes), budget / 2**30, len(rest), n)
        return search.best_under_budget(meshes + rest, budget, objective), meshes + rest


def _not_worse_than_data_parallel(best: "_Candidate", search: "_Search", solver, n: int, budget: int,
                                  objective: Objective) -> "_Candidate":
    """``best``, or the data-parallel plan where the step's cost model ranks that one first and it fits.

    The axis problems price each collective alone; the step's price knows which ones DTensor runs
    as one (``tofu_tf.cost.combining``). Where many small all-reduces of the forward pass (a
    mixture-of-experts' router statistics) are independent, data parallelism runs them with the
    gradients' in one collective while the axis problem charged each its latency, and a search
    could return a sharded plan its own step price ranks behind data parallelism (keras-hub
    Mixtral on the CPU profile, measured slower too: bench/vs_mirrored.py). Pricing the
    data-parallel plan beside the search's costs one axis solve."""
    try:
        restrict = baselines.data_parallel_restriction(search.index, n)
    except baselines.BaselineNotApplicableError:
        return best
    data_parallel = _Search(search.index, search.liveness, search.hardware, solver, restrict, search.work,
                            SearchProgress(1, quiet_seconds=float("inf")), (AxisRole.ANY,),
                            pricer=search.pricer).solve(MeshSpec((("batch", n),)), 0.0)
    if data_parallel.cost.memory.peak_bytes <= budget and data_parallel.key(objective) < best.key(objective):
        logging.info("tofu_tf planner: data parallelism steps in %.3f ms, the search's best plan (mesh %s) in "
                     "%.3f ms: planning data parallelism", data_parallel.cost.step_seconds * 1e3,
                     best.mesh.text(), best.cost.step_seconds * 1e3)
        return data_parallel
    return best


def _mesh(sizes: tuple[int, ...]) -> MeshSpec:
    return MeshSpec(tuple((f"a{i}", s) for i, s in enumerate(sizes)))


def _meshes_and_restriction(method: Method, index: GraphIndex, n: int, mesh_shape, hardware: HardwareProfile):
    given = None if mesh_shape is None else MeshSpec.from_user_input(mesh_shape)
    if method in (Method.DATA_PARALLEL, Method.MEGATRON) and given is not None and given.sizes != (n,):
        raise ValueError(f"method={method.value!r} plans its own one-axis mesh of {n} devices, and mesh_shape "
                         f"{given.text()} asks for another: drop mesh_shape, or plan with method='tofu' on that mesh.")
    if method is Method.DATA_PARALLEL:
        return [MeshSpec((("batch", n),))], baselines.data_parallel_restriction(index, n)
    if method is Method.MEGATRON:
        return [MeshSpec((("model", n),))], baselines.megatron_restriction(index, n)
    if given is not None:
        if given.num_devices != n:
            raise ValueError(f"mesh_shape {given.text()} has {given.num_devices} devices, not num_devices={n}")
        return [given], None
    if n == 1:      # one device: nothing to split, one mesh of one axis (the step runs whole, as without a plan)
        return [MeshSpec((("batch", 1),))], None
    return [_mesh(sizes) for sizes in host_aligned_factorizations(n, hardware.devices_per_node)], None


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
    path: tuple = ()     # per axis (role's problem, choice): equal paths, equal decisions


class _Kept:
    """An axis problem (one per role) kept for other multipliers, with its solutions so far.

    The optimum of ``c(x) + lam * m(x)`` over a fixed set of ``x`` is concave in ``lam``
    (a minimum of lines), and each solution's objective is a line: a solution proved
    optimal at two multipliers is optimal at every multiplier between them. So where the
    nearest solved multipliers on either side gave the same proved solution, it is the
    answer without solving again."""

    def __init__(self, problems):
        self.problems = problems
        self._solved: list[tuple[float, tuple]] = []    # (lam, (problem, solution, role)), by lam

    def between(self, lam: float):
        position = bisect.bisect_left(self._solved, lam, key=lambda entry: entry[0])
        if position < len(self._solved) and self._solved[position][0] == lam:
            return self._solved[position][1]
        if 0 < position < len(self._solved):
            (_, low), (_, high) = self._solved[position - 1], self._solved[position]
            if low[2] == high[2] and low[1].exact and high[1].exact and low[1].choice == high[1].choice:
                return low
        return None

    def add(self, lam: float, found) -> None:
        bisect.insort(self._solved, (lam, found), key=lambda entry: entry[0])


class _Search:
    """Solves mesh shapes axis by axis, sharing solved prefixes between shapes, and prices
    only the meshes whose lower bound does not already lose to a priced plan that fits."""

    def __init__(self, index: GraphIndex, liveness: Liveness, hardware: HardwareProfile,
                 solver: _AxisSolver, restrict, work, progress: SearchProgress,
                 roles: Sequence[AxisRole] = (AxisRole.ANY,), pinned: Mapping[str, tuple] | None = None,
                 refine: bool = False, pricer: StepPricer | None = None):
        self.index, self.liveness, self.hardware, self.work = index, liveness, hardware, work
        self.refine = refine
        self.pinned = pinned or {}
        self.progress, self.roles = progress, tuple(roles)
        self.pricer = pricer or StepPricer(index.graph, liveness)
        self.solver, self.restrict = solver, restrict
        self._prefixes: dict[tuple, _Solved] = {}
        self._by_path: dict[tuple, _Solved] = {}
        self._problems: dict[tuple, _Kept] = {}
        self.keep_problems = False      # set once the budget needs more than one multiplier
        self.budget: int | None = None  # set where the budget binds: plans over it are kept per mesh
        self._misses: dict[MeshSpec, dict[tuple, _Candidate]] = {}
        self.solves = 0
        self.priced = 0
        self.pruned = 0
        self.proved = True

    def decide(self, mesh: MeshSpec, lam: float | tuple[float, ...]) -> _Solved:
        """``mesh``'s decisions axis by axis at multiplier ``lam``: one for every axis, or a
        tuple of one per axis (``_refine``)."""
        lams = lam if isinstance(lam, tuple) else (lam,) * len(mesh.axes)
        solved = _Solved((), True, 0.0)
        for k in range(len(mesh.axes)):
            key = (mesh.sizes[: k + 1], mesh.num_devices, lams[: k + 1])
            if key not in self._prefixes:
                problem, solution, role = self._solve_axis(mesh, k, solved, lams[k])
                path = solved.path + ((role, solution.choice),)
                same = self._by_path.get((mesh.sizes[: k + 1], mesh.num_devices, path))
                if same is None:
                    seconds = problem.time(solution.choice)
                    same = _Solved(solved.decisions + (AxisDecision.of(problem, solution.choice, mesh.sizes[k]),),
                                   solved.exact and solution.exact, seconds if seconds < TIE_PENALTY else 0.0, path)
                    self._by_path[mesh.sizes[: k + 1], mesh.num_devices, path] = same
                self._prefixes[key] = same
            solved = self._prefixes[key]
        self.proved = self.proved and solved.exact
        return solved

    def _solve_axis(self, mesh: MeshSpec, k: int, solved: _Solved, lam: float):
        """Axis ``k``'s problem, solution and role (its index among the roles' problems):
        under each role the target allows, the one of least objective
        (``targets.axis_roles``; on a tie, the earlier role). Problems elimination solves
        go first; a wider one then only has to beat them."""
        started = time.perf_counter()
        key = (mesh.sizes[: k + 1], mesh.names[k], mesh.num_devices, solved.path)
        kept = self._problems.get(key)
        if kept is None:
            kept = _Kept(self._build_axis(mesh, k, solved.decisions))
            if self.keep_problems:
                if len(self._problems) >= _KEPT_PROBLEMS:
                    del self._problems[next(iter(self._problems))]
                self._problems[key] = kept
        between = kept.between(lam)
        if between is not None:
            return between
        problems = kept.problems
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
        kept.add(lam, (problem, solution, best))
        return problem, solution, best

    def _build_axis(self, mesh: MeshSpec, k: int, prior: tuple[AxisDecision, ...]) -> list[AxisProblem]:
        """Axis ``k``'s problem under each role the target allows, given the earlier axes'
        decisions: what it is does not depend on the multiplier."""
        link = self.hardware.axis_link(mesh, k)
        problems = []
        roles, restrict = self.roles, self.restrict
        if self.pinned:
            restrict = pins.both(restrict, pins.pin_restriction(self.index, self.pinned, mesh.names[k]))
            if AxisRole.MODEL in roles and any(mesh.names[k] in layout for layout in self.pinned.values()):
                roles = (AxisRole.MODEL,)   # it splits pinned weights, so (on DTensor) not the batch
        options = AxisOptions(self.index, prior, mesh.sizes[k])     # what the roles' problems share
        for role in roles:
            builder = ProblemBuilder(self.index, prior, mesh.sizes[k], link, restrict, role, options)
            if builder.can_build():
                problems.append(builder.build())
        return problems

    def price(self, mesh: MeshSpec, solved: _Solved) -> _Candidate:
        var_splits = _zip_tables([d.var_splits for d in solved.decisions])
        cost = self.pricer.price_axes(mesh, self.hardware, [d.op_strategies for d in solved.decisions], var_splits,
                                      work_seconds=self.work)
        self.priced += 1
        candidate = _Candidate(mesh, solved.decisions, cost, solved.exact, solved.path)
        if self.budget is not None and cost.memory.peak_bytes > self.budget and \
                len(solved.path) == len(mesh.axes):
            misses = self._misses.setdefault(mesh, {})
            misses.setdefault(solved.path, candidate)
        return candidate

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
        self.keep_problems = True       # the problems repeat at other multipliers from here
        self.budget = budget
        leanest = self.candidates(meshes, _MEMORY_LAMBDA, budget, objective)
        if not self._fitting(leanest, budget):
            self._raise_infeasible(leanest, budget)
        fitting = self._fitting(leanest, budget) + self._bisect(meshes, budget, objective)
        if not self.refine:
            return self._pick(fitting, budget, objective, meshes)
        fitting += self._refine(meshes, budget, objective, fitting)
        if not fitting:
            return self._pick(fitting, budget, objective, meshes)      # raises, naming the leanest plan
        return self._repaired_best(fitting, budget, objective)

    def _repaired_best(self, fitting: Sequence[_Candidate], budget: int, objective: Objective) -> _Candidate:
        """The best fitting plan of each of the ``_REPAIRED_MESHES`` meshes whose plans are
        best, repaired (``_repair``, all within one ``repair.Allowance``); the best of them
        wins. A mesh that lost by a little may gain more from its repair (the tiny GPT at half
        its free peak: 4 x 2 lost to 2 x 2 x 2 by 7%, and wins once both are repaired)."""
        per_mesh: dict[MeshSpec, _Candidate] = {}
        for candidate in sorted(fitting, key=lambda c: c.key(objective)):
            per_mesh.setdefault(candidate.mesh, candidate)
        allowance = repair.Allowance.for_ops(len(self.index.graph.ops))
        repaired = [self._repair(c, budget, objective, allowance) for c in list(per_mesh.values())[:_REPAIRED_MESHES]]
        return min(repaired, key=lambda c: c.key(objective))

    def _repair(self, best: _Candidate, budget: int, objective: Objective,
                allowance: repair.Allowance) -> _Candidate:
        """``best`` improved by moves priced exactly (``repair``): what the per-axis problems
        and one multiplier per axis cannot see under a budget."""
        if objective is Objective.MEMORY or len(best.path) != len(best.mesh.axes):
            return best
        mesh = best.mesh
        # The plan that fits nothing nearest the budget among those faster than ``best``: its
        # differences from ``best`` are moves too (``repair.repair``'s ``toward``).
        faster = [c for c in self._misses.get(mesh, {}).values() if c.key(objective) < best.key(objective)]
        toward = min(faster, key=lambda c: c.cost.memory.peak_bytes, default=None)
        tolerance = [collective_cost(Collective.ALL_REDUCE, 0.0, size, self.hardware.axis_link(mesh, k)).seconds
                     for k, size in enumerate(mesh.sizes)]

        def price(decisions):
            return self.price(mesh, _Solved(tuple(decisions), False, 0.0)).cost

        def better(new, old) -> bool:
            return new.memory.peak_bytes <= budget and _cost_key(new, objective) < _cost_key(old, objective)

        built: dict = {}
        repaired = repair.repair(self._axis_choices(best, built), best.decisions, best.cost, price, better, tolerance,
                                 toward=None if toward is None else self._axis_choices(toward, built),
                                 allowance=allowance)
        if not repaired.moves:
            return best
        logging.info("tofu_tf planner: %d local moves took the budgeted plan on mesh %s from %.4f ms to %.4f ms",
                     repaired.moves, mesh.text(), best.cost.step_seconds * 1e3, repaired.cost.step_seconds * 1e3)
        path = tuple((axis.role, axis.choice) for axis in repaired.axes)
        return _Candidate(mesh, repaired.decisions, repaired.cost, False, path)

    def _axis_choices(self, candidate: _Candidate, built: dict) -> list[repair.AxisChoice]:
        """Per axis of ``candidate`` its problem and choice. Equal earlier decisions give the
        same problem object: the one the search kept, else one built once into ``built``."""
        mesh, axes = candidate.mesh, []
        for k, (role, choice) in enumerate(candidate.path):
            key = (mesh.sizes[: k + 1], mesh.names[k], mesh.num_devices, candidate.path[:k])
            kept = self._problems.get(key)
            if kept is not None:
                problems = kept.problems
            else:
                problems = built.get(key)
                if problems is None:
                    problems = built[key] = self._build_axis(mesh, k, candidate.decisions[:k])
            axes.append(repair.AxisChoice(problems[role], tuple(choice), mesh.sizes[k], role))
        return axes

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

    def _refine(self, meshes, budget, objective, fitting) -> list[_Candidate]:
        """Per mesh and per subset of its axes, the smallest multiplier that fits with the
        other axes solved at zero (communication and compute only), by bisection (on a mesh
        of more than three axes, only subsets leaving out at most one axis; at most
        ``_REFINED_MESHES`` meshes, those with the best fitting plans first).

        One multiplier for all meshes and all axes (``_bisect``) stops at the smallest one
        with which *some* mesh fits; a mesh that needs a larger one, or whose best plan
        spends memory on one axis and none on another, is then only seen at the multipliers
        that bisection happened to try (on the 2-layer GPT at half its free peak the mesh
        4 x 2 got 0.287 ms from the multipliers bisection tried, 0.235 ms with its second
        axis at zero: ``tests/test_search_budget.py``). Meshes whose zero-multiplier bound already loses to the best fitting plan
        are skipped, and within a bisection a multiplier whose bound loses is not priced
        (larger ones cost more time still, so the search goes lower)."""
        if objective is Objective.MEMORY:
            return []
        best = min((c.key(objective)[0] for c in fitting), default=float("inf"))
        found: list[_Candidate] = []
        for mesh in self._to_refine(meshes, fitting, objective):
            if self.decide(mesh, 0.0).bound > best * (1 + 1e-9):
                self.pruned += 1
                continue
            for mask in itertools.product((0.0, 1.0), repeat=len(mesh.axes)):
                if any(mask) and (len(mask) <= 3 or mask.count(0.0) <= 1):
                    fits = self._bisect_mesh(mesh, mask, budget, objective, best)
                    found += fits
                    best = min([best] + [c.key(objective)[0] for c in fits])
        return found

    @staticmethod
    def _to_refine(meshes, fitting, objective) -> list[MeshSpec]:
        """The meshes ``_refine`` bisects: at most ``_REFINED_MESHES``, those with the best
        fitting plans so far first, then the rest in their order."""
        best: dict[MeshSpec, float] = {}
        for c in fitting:
            best[c.mesh] = min(best.get(c.mesh, float("inf")), c.key(objective)[0])
        ranked = sorted(range(len(meshes)), key=lambda i: (best.get(meshes[i], float("inf")), i))
        return [meshes[i] for i in ranked[:_REFINED_MESHES]]

    def _bisect_mesh(self, mesh, mask, budget, objective, best) -> list[_Candidate]:
        """``_refine``'s bisection of one mesh, its multiplier on the axes ``mask`` marks."""
        def at(lam):
            return tuple(lam * m for m in mask)
        top = self.price(mesh, self.decide(mesh, at(_MEMORY_LAMBDA)))
        if top.cost.memory.peak_bytes > budget:
            return []
        found, lo, hi = [top], 1e-16, _MEMORY_LAMBDA
        for _ in range(_BISECTION_STEPS * 2):
            if hi / lo < 1.5:
                break
            mid = (lo * hi) ** 0.5
            solved = self.decide(mesh, at(mid))
            if solved.bound > best * (1 + 1e-9):
                self.pruned += 1
                hi = mid
                continue
            candidate = self.price(mesh, solved)
            if candidate.cost.memory.peak_bytes <= budget:
                found.append(candidate)
                best = min(best, candidate.key(objective)[0])
                hi = mid
            else:
                lo = mid
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
        target=target.value, all_reduces_combined=cost.all_reduces_combined,
        packing_seconds=cost.packing_seconds)


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
