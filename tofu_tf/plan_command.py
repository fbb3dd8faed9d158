"""``tofu-plan``: plan a Keras model from the command line and show the plan.

    tofu-plan --model=tofu_tf.models:gpt --model_kwargs='{"num_layers": 2}' \\
        --num_devices=8 --batch_size=16 --compare=data_parallel,megatron \\
        --json=plan.json --html=plan.html --png=plan.png

This module owns the command: reading its flags, building the model from a
``MODULE:FUNCTION`` builder, capturing the training step, planning through the
plan cache (``tofu_tf.plan_cache``; ``--no_cache`` plans afresh), pricing the
baselines asked for beside it, printing the summary and writing the files
(``tofu_tf.plan_report``). It plans only: it lays out no device and trains
nothing, so it runs on a laptop for a cluster's mesh. With ``--measure`` it also
trains two steps under the plan on this machine's devices (virtual CPUs where the
GPUs are fewer) and shows what DTensor compiled beside the model
(``tofu_tf.executed``). Bad input (a builder that
cannot be found or fails, a budget no plan meets) ends in one line naming the
problem and the fix, and exit status 2.

Flags are defined when the command starts, not on import, so importing this
module leaves the process's flags alone.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import json
import os
import sys
import traceback
from typing import Mapping, TextIO

from absl import app, flags, logging

from tofu_tf.errors import TofuError
from tofu_tf.plan import Method, Plan

EXIT_BAD_INPUT = 2
_COMPARABLE = tuple(m.value for m in Method)


class CommandError(TofuError):
    """Input the command cannot plan from; the message names the problem and the fix."""


@dataclasses.dataclass(frozen=True)
class PlanRequest:
    """What one ``tofu-plan`` run plans and writes (the flags, read once)."""

    model: str
    model_kwargs: Mapping = dataclasses.field(default_factory=dict)
    num_devices: int = 8
    batch_size: int = 8
    loss: str = "sparse_categorical_crossentropy"
    optimizer: str = "adam"
    memory_budget_gib: float | None = None
    hardware: str = "h100-nvlink"
    method: str = "tofu"
    objective: str = "time"
    mesh: str | None = None
    compare: tuple[str, ...] = ()
    json_path: str | None = None
    html_path: str | None = None
    png_path: str | None = None
    use_cache: bool = True
    cache_dir: str | None = None
    measure: bool = False


@dataclasses.dataclass(frozen=True)
class PlanOutcome:
    """The plan, the plans priced beside it (a string: why a method gave none), whether
    the plan came from the cache, and the captured step it plans (the page lists its activations)."""

    plan: Plan
    comparison: Mapping[str, "Plan | str"]
    from_cache: bool
    graph: object


def define_flags(flag_values: flags.FlagValues = flags.FLAGS) -> None:
    flags.DEFINE_string("model", None, "MODULE:FUNCTION, a function returning a built Keras model with fixed "
                        "input shapes (e.g. tofu_tf.models:gpt). MODULE may be a .py file's path.",
                        flag_values=flag_values)
    flags.DEFINE_string("model_kwargs", "{}", "JSON object of keyword arguments for the builder.",
                        flag_values=flag_values)
    flags.DEFINE_integer("num_devices", 8, "Devices to plan for.", lower_bound=1, flag_values=flag_values)
    flags.DEFINE_integer("batch_size", 8, "Global batch size of a training step.", lower_bound=1,
                         flag_values=flag_values)
    flags.DEFINE_string("loss", "sparse_categorical_crossentropy", "Loss, as model.compile takes it by name.",
                        flag_values=flag_values)
    flags.DEFINE_string("optimizer", "adam", "Optimizer, as model.compile takes it by name.",
                        flag_values=flag_values)
    flags.DEFINE_float("memory_budget_gib", None, "Memory per device in GiB (default: the hardware's).",
                       flag_values=flag_values)
    flags.DEFINE_string("hardware", "h100-nvlink", "Hardware profile: h100-nvlink, h200-nvlink, pcie-gpu or "
                        "cpu-virtual.", flag_values=flag_values)
    flags.DEFINE_enum("method", "tofu", list(_COMPARABLE), "Search method.", flag_values=flag_values)
    flags.DEFINE_enum("objective", "time", ["time", "comm", "memory"], "What the search minimizes.",
                      flag_values=flag_values)
    flags.DEFINE_string("mesh", None, "Fix the mesh: sizes (2x4) or named axes (batch=2,model=4).",
                        flag_values=flag_values)
    flags.DEFINE_list("compare", [], "Methods to price beside the plan, e.g. data_parallel,megatron.",
                      flag_values=flag_values)
    flags.DEFINE_string("json", None, "Write the plan's JSON here.", flag_values=flag_values)
    flags.DEFINE_string("html", None, "Write the plan's page (one self-contained file) here.",
                        flag_values=flag_values)
    flags.DEFINE_string("png", None, "Write the memory and communication charts here (needs matplotlib).",
                        flag_values=flag_values)
    flags.DEFINE_boolean("no_cache", False, "Search afresh and leave the plan cache alone (by default a plan "
                         "the cache holds is taken from it, and a new one is kept there).", flag_values=flag_values)
    flags.DEFINE_string("cache_dir", None, "Plan cache directory (default: $TOFU_PLAN_CACHE, else the user's "
                        "cache directory).", flag_values=flag_values)
    _define_measure_flag(flag_values)


def _define_measure_flag(flag_values: flags.FlagValues) -> None:
    flags.DEFINE_boolean("measure", False, "Also train two steps under the plan here (virtual CPUs where the GPUs "
                         "are fewer) and show the collectives and state DTensor executed beside the modeled ones.",
                         flag_values=flag_values)


def request_from_flags(flag_values: flags.FlagValues = flags.FLAGS) -> PlanRequest:
    """The request the parsed flags describe; input that cannot be planned raises ``CommandError``."""
    f = flag_values
    if not f.model:
        raise CommandError("--model is required: MODULE:FUNCTION naming a function that returns a Keras "
                           "model, e.g. --model=tofu_tf.models:gpt.")
    try:
        kwargs = json.loads(f.model_kwargs)
    except json.JSONDecodeError as error:
        raise CommandError(f"--model_kwargs is not JSON ({error.msg} at column {error.colno}); pass an "
                           "object, e.g. --model_kwargs='{\"num_layers\": 2}'.") from None
    if not isinstance(kwargs, dict):
        raise CommandError(f"--model_kwargs is a JSON {type(kwargs).__name__}; pass an object of keyword "
                           "arguments, e.g. --model_kwargs='{\"num_layers\": 2}'.")
    unknown = [m for m in f.compare if m not in _COMPARABLE]
    if unknown:
        raise CommandError(f"--compare names {', '.join(unknown)}; the methods are {', '.join(_COMPARABLE)}.")
    return PlanRequest(
        model=f.model, model_kwargs=kwargs, num_devices=f.num_devices, batch_size=f.batch_size, loss=f.loss,
        optimizer=f.optimizer, memory_budget_gib=f.memory_budget_gib, hardware=f.hardware, method=f.method,
        objective=f.objective, mesh=f.mesh, compare=tuple(f.compare), json_path=f.json, html_path=f.html,
        png_path=f.png, use_cache=not f.no_cache, cache_dir=f.cache_dir, measure=f.measure)


# -- the model ------------------------------------------------------------------------------

def load_builder(spec: str):
    """The function ``MODULE:FUNCTION`` names; MODULE is a module name or a ``.py`` file."""
    module_name, _, function_name = spec.rpartition(":")
    if not module_name or not function_name:
        raise CommandError(f"--model={spec!r} is not MODULE:FUNCTION; e.g. --model=tofu_tf.models:gpt or "
                           "--model=my_models.py:build.")
    module = _import(module_name)
    builder = getattr(module, function_name, None)
    if not callable(builder):
        public = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        raise CommandError(f"module {module_name!r} has no function {function_name!r}; its functions are "
                           f"{', '.join(public[:12]) or 'none'}{' ...' if len(public) > 12 else ''}.")
    return builder


def _import(module_name: str):
    if module_name.endswith(".py"):
        if not os.path.isfile(module_name):
            raise CommandError(f"--model names the file {module_name!r}, which does not exist.")
        spec = importlib.util.spec_from_file_location(os.path.basename(module_name)[:-3], module_name)
        module = importlib.util.module_from_spec(spec)
        try:
            spec.loader.exec_module(module)
        except Exception as error:  # a user's file: whatever it raises is reported, not a traceback
            raise CommandError(f"running {module_name!r} failed: {type(error).__name__}: {error}") from error
        return module
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())    # a user's own module beside where they run the command
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if error.name and module_name.startswith(error.name):
            raise CommandError(f"no module named {module_name!r}: give an importable module (run from its "
                               "directory, or set PYTHONPATH) or a .py file's path.") from None
        raise CommandError(f"importing {module_name!r} failed: {error}") from error
    except Exception as error:
        raise CommandError(f"importing {module_name!r} failed: {type(error).__name__}: {error}") from error


def build_model(spec: str, kwargs: Mapping, *, fresh_names: bool = True):
    """The built Keras model ``spec``'s builder returns for ``kwargs``, named as in a fresh process
    (``fresh_names=False`` where the caller did that before entering a strategy's scope, which
    clearing Keras' session inside would leave)."""
    builder = load_builder(spec)
    if fresh_names:
        fresh_keras_names()
    try:
        model = builder(**kwargs)
    except Exception as error:
        raise CommandError(f"{spec}(**{dict(kwargs)!r}) failed: {type(error).__name__}: {error}. Fix "
                           "--model_kwargs or the builder.") from error
    if not (hasattr(model, "trainable_weights") and hasattr(model, "compile")):
        raise CommandError(f"{spec} returned a {type(model).__name__}, not a Keras model; a builder returns "
                           "a built keras.Model.")
    return model


def fresh_keras_names() -> None:
    """Reset the layer-name counters of every Keras module already imported. Keras numbers
    unnamed layers per process (dense_3), and op names, hence the captured graph and the
    cache key, carry them: a second run in one process must name as the first did."""
    for name in ("tf_keras", "keras"):
        module = sys.modules.get(name)
        if module is not None:
            module.backend.clear_session()


def parse_mesh(text: str | None):
    """``2x4`` or ``2,4`` -> (2, 4); ``batch=2,model=4`` -> {"batch": 2, "model": 4}."""
    if not text:
        return None
    try:
        if "=" in text:
            pairs = [part.split("=") for part in text.split(",")]
            return {name.strip(): int(size) for name, size in pairs}
        return tuple(int(size) for size in text.replace("x", ",").split(","))
    except ValueError:
        raise CommandError(f"--mesh={text!r} does not read; give sizes (2x4) or named axes "
                           "(batch=2,model=4).") from None


# -- planning ---------------------------------------------------------------------------------

def plan_request(request: PlanRequest) -> PlanOutcome:
    """Capture the model's step and plan it (through the cache unless told not to), with the
    methods of ``request.compare`` priced beside it."""
    from tofu_tf import plan_cache
    from tofu_tf.search import InfeasibleBudgetError, plan_graph
    from tofu_tf.search.baselines import BaselineNotApplicableError
    from tofu_tf.tf.capture import capture_training_step

    from tofu_tf.cost.hardware import profile
    mesh = parse_mesh(request.mesh)
    profile(request.hardware)      # an unknown profile is named before the model is built
    model = build_model(request.model, request.model_kwargs)
    graph = capture_training_step(model, batch_size=request.batch_size, loss=request.loss,
                                  optimizer=request.optimizer)
    budget = None if request.memory_budget_gib is None else int(request.memory_budget_gib * 2**30)
    cache = plan_cache.PlanCache(request.cache_dir) if request.use_cache else None

    def plan(method: str) -> tuple[Plan, bool]:
        options = dict(num_devices=request.num_devices, memory_budget_bytes=budget, method=method,
                       hardware=request.hardware, objective=request.objective,
                       mesh_shape=None if method in ("data_parallel", "megatron") else mesh)
        if cache is None:
            return plan_graph(graph, **options), False
        found = plan_cache.plan_with_cache(graph, cache=cache, **options)
        return found.plan, found.from_cache

    main, from_cache = plan(request.method)
    comparison: dict[str, Plan | str] = {}
    for method in request.compare:
        if method == request.method:
            continue
        try:
            comparison[method] = plan(method)[0]
        except (BaselineNotApplicableError, InfeasibleBudgetError) as error:
            comparison[method] = " ".join(str(error).split())      # said in the table; the plan stands
    return PlanOutcome(main, comparison, from_cache, graph)


def comparison_table(outcome: PlanOutcome) -> str:
    """The plan and the plans priced beside it, one row each, columns apart."""
    from tofu_tf.plan_report import budget_bytes
    rows = [("method", "mesh", "step ms", "comm MiB", "peak MiB", "fits")]
    for name, plan in {outcome.plan.method.value: outcome.plan, **outcome.comparison}.items():
        if isinstance(plan, str):
            rows.append((name, f"no plan: {plan}", "", "", "", ""))
            continue
        mesh = " x ".join(f"{n}={s}" for n, s in plan.mesh_axes) or "(1 device)"
        budget = budget_bytes(plan)
        fits = "-" if budget is None else ("yes" if plan.peak_memory_bytes <= budget else "no")
        rows.append((name, mesh, f"{plan.step_seconds * 1e3:.3f}", f"{plan.comm_bytes / 2**20:,.2f}",
                     f"{plan.peak_memory_bytes / 2**20:,.2f}", fits))
    name_width = max(len(r[0]) for r in rows)
    mesh_width = max(len(r[1]) for r in rows if not r[1].startswith("no plan: "))
    lines = []
    for name, mesh, *numbers in rows:
        if mesh.startswith("no plan: "):
            lines.append(f"  {name:<{name_width}}  {mesh}")
        else:
            *numbers, fits = numbers
            lines.append(f"  {name:<{name_width}}  {mesh:<{mesh_width}}  " + " ".join(f"{n:>12}" for n in numbers)
                         + f"  {fits:>4}")
    return "\n".join(lines)


def run(request: PlanRequest, out: TextIO = sys.stdout) -> PlanOutcome:
    """Plan ``request``, print what a person reads, and write the files it asks for."""
    from tofu_tf import plan_cache, plan_report
    if request.use_cache and request.cache_dir is None and plan_cache.cache_disabled():
        request = dataclasses.replace(request, use_cache=False)       # $TOFU_PLAN_CACHE=off
    outcome = plan_request(request)
    if request.measure:
        outcome = dataclasses.replace(outcome, plan=_measured(outcome.plan, request))
    plan = outcome.plan
    print(plan.summary(), file=out)
    if outcome.comparison:
        print("Side by side:", file=out)
        print(comparison_table(outcome), file=out)
    if request.use_cache:
        print("Plan taken from the plan cache (no search)." if outcome.from_cache
              else f"Plan searched in {plan.search_seconds:.2f} s and kept in the plan cache.", file=out)
    if request.json_path:
        with open(request.json_path, "w", encoding="utf-8") as handle:
            handle.write(plan.to_json(indent=1))
        print(f"Wrote {request.json_path}", file=out)
    if request.html_path:
        plan_report.write_html(plan, request.html_path, graph=outcome.graph, comparison=outcome.comparison,
                               title=f"tofu_tf plan: {request.model} on {request.num_devices} devices")
        print(f"Wrote {request.html_path}", file=out)
    if request.png_path:
        plan_report.write_png(plan, request.png_path, comparison=outcome.comparison)
        print(f"Wrote {request.png_path}", file=out)
    return outcome


def _measured(plan: Plan, request: PlanRequest) -> Plan:
    """``plan`` with what DTensor compiled for its step (``tofu_tf.executed.measure``)."""
    from tofu_tf import executed
    logging.info("Measuring: training %s two steps under the plan on %d devices ...", request.model,
                 request.num_devices)
    figures = executed.measure(plan, {"model": request.model, "model_kwargs": dict(request.model_kwargs),
                                      "batch_size": request.batch_size, "loss": request.loss,
                                      "optimizer": request.optimizer, "num_devices": request.num_devices})
    return dataclasses.replace(plan, executed=figures)


def _bad_input_errors() -> tuple[type[BaseException], ...]:
    from tofu_tf.executed import MeasurementError
    from tofu_tf.plan_check import PlanError
    from tofu_tf.plan_report import PlotUnavailableError
    from tofu_tf.search import InfeasibleBudgetError, UnsupportedOpError
    from tofu_tf.tf.capture import DynamicShapeError
    # ValueError: an unknown hardware profile, a mesh of the wrong device count, a loss
    # Keras does not know; OSError: an output path that cannot be written.
    return (CommandError, InfeasibleBudgetError, UnsupportedOpError, DynamicShapeError, PlanError,
            PlotUnavailableError, MeasurementError, ValueError, OSError)


def execute(flag_values: flags.FlagValues = flags.FLAGS, out: TextIO = sys.stdout, err: TextIO = sys.stderr) -> int:
    """Run the command the parsed ``flag_values`` describe; its exit status (0, or
    ``EXIT_BAD_INPUT`` after one line on ``err`` naming the problem and the fix)."""
    try:
        run(request_from_flags(flag_values), out)
    except _bad_input_errors() as error:
        logging.vlog(1, "".join(traceback.format_exception(error)))
        message = " ".join(line.strip() for line in str(error).splitlines() if line.strip())
        print(f"tofu-plan: error: {message}", file=err)
        return EXIT_BAD_INPUT
    return 0


def main(argv) -> int:
    if len(argv) > 1:
        print(f"tofu-plan: error: unexpected arguments {' '.join(argv[1:])}; every input is a --flag "
              "(tofu-plan --help).", file=sys.stderr)
        return EXIT_BAD_INPUT
    if not flags.FLAGS["verbosity"].present:
        # absl shows WARNING and above unless told otherwise; a long search's progress and
        # the cache's messages are INFO, and they are what a person waiting wants to see.
        logging.set_verbosity(logging.INFO)
    return execute()


def entry_point() -> None:
    """The ``tofu-plan`` console script."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    define_flags()
    app.run(main)


if __name__ == "__main__":
    entry_point()
