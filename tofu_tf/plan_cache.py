"""Plans kept between runs, so the same search is never waited for twice.

A plan is a pure function of the captured step, the device count, the hardware
profile, every planning option, the op descriptions and the planner's own code.
This module owns the fingerprint of those and a directory of plan files named
by it: ``$TOFU_PLAN_CACHE``, else ``$XDG_CACHE_HOME/tofu_tf/plans``, else
``~/.cache/tofu_tf/plans``. Each file is the plan's own JSON, so a cached plan
can also be handed to ``TofuStrategy(plan=path)``.

The planner's code is part of the fingerprint (a hash of the planner core's
source files, with ``PLAN_VERSION`` and the IR version): a plan made by another
planner could differ, and a stale plan that still reads would be trained on
silently. A file that does not read as a plan (cut short, edited, another
version) is reported with a warning and planned again. A custom
``strategy_provider`` cannot be fingerprinted, so such a plan is not cached.

``cached_plan_graph`` is ``plan_graph`` through the cache; it owns no search.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import inspect
import json
import os
import pathlib
import tempfile

from absl import logging

from tofu_tf import ir
from tofu_tf.cost.hardware import profile
from tofu_tf.mesh import MeshSpec
from tofu_tf.plan import PLAN_VERSION, Method, Objective, Plan
from tofu_tf.plan_check import PlanError

CACHE_ENV = "TOFU_PLAN_CACHE"
# The modules whose code decides a plan; their source is hashed into every key.
_PLANNER_SOURCES = ("ir.py", "mesh.py", "plan.py", "cost", "search", "semantics")


@dataclasses.dataclass(frozen=True)
class CachedPlan:
    """A plan, the file it is kept in, and whether it came from that file."""

    plan: Plan
    path: pathlib.Path | None
    from_cache: bool


_OFF = ("off", "0", "false", "no")


def cache_disabled() -> bool:
    """Whether ``$TOFU_PLAN_CACHE`` turns the default cache off (``off``, ``0``, ``false``, ``no``):
    what a test session or a shared machine sets instead of passing ``plan_cache=False``."""
    return os.environ.get(CACHE_ENV, "").strip().lower() in _OFF


def default_cache_dir() -> pathlib.Path:
    """Where plans are kept when no directory is given."""
    if os.environ.get(CACHE_ENV):
        return pathlib.Path(os.environ[CACHE_ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "tofu_tf" / "plans"


def _plan_graph_defaults() -> dict:
    from tofu_tf.search.api import plan_graph
    return {name: p.default for name, p in inspect.signature(plan_graph).parameters.items()
            if p.kind is inspect.Parameter.KEYWORD_ONLY}


def planning_options(**options) -> dict:
    """Every ``plan_graph`` option, defaults filled in and values in one canonical JSON form,
    so that an option given as its default, or a profile given by name, keys the same plan."""
    defaults = _plan_graph_defaults()
    unknown = sorted(set(options) - set(defaults))
    if unknown:
        raise TypeError(f"plan_graph has no option {', '.join(map(repr, unknown))}; its options are "
                        f"{', '.join(sorted(defaults))}")
    given = {**defaults, **options}
    if given["num_devices"] is inspect.Parameter.empty:
        raise TypeError("num_devices is required: the number of devices to plan for")
    canonical = {name: value for name, value in given.items() if name != "strategy_provider"}
    canonical["method"] = Method(given["method"]).value
    canonical["objective"] = Objective(given["objective"]).value
    canonical["target"] = getattr(given["target"], "value", given["target"])
    canonical["hardware"] = dataclasses.asdict(profile(given["hardware"]))
    mesh = given["mesh_shape"]
    canonical["mesh_shape"] = None if mesh is None else [list(a) for a in MeshSpec.from_user_input(mesh).axes]
    if canonical["memory_budget_bytes"] is not None:
        canonical["memory_budget_bytes"] = int(canonical["memory_budget_bytes"])
    return canonical


def fingerprint(graph: ir.Graph, **options) -> str:
    """The cache key of ``plan_graph(graph, **options)``: a SHA-256 hex digest."""
    digest = hashlib.sha256()
    for part in (_planner_digest(), _planned_graph_text(graph), json.dumps(planning_options(**options), sort_keys=True),
                 json.dumps(_custom_descriptions(graph))):
        digest.update(part.encode())
        digest.update(b"\0")
    return digest.hexdigest()


def _planned_graph_text(graph: ir.Graph) -> str:
    """The graph's JSON without TensorFlow's private op attributes (``_gradient_op_type``
    carries a per-process counter): the same model captured twice in one process keys
    the same plan. No planner module reads a private attribute."""
    data = graph.to_dict()
    _drop_private_attrs(data)
    return json.dumps(data, sort_keys=True)     # attribute order varies between traces


def _drop_private_attrs(data: dict) -> None:
    for op in data["ops"]:
        op["attrs"] = {name: value for name, value in op["attrs"].items() if not name.startswith("_")}
        if op.get("body") is not None:
            _drop_private_attrs(op["body"])


@functools.cache
def _planner_digest() -> str:
    root = pathlib.Path(__file__).parent
    digest = hashlib.sha256(f"plan {PLAN_VERSION} ir {ir.IR_VERSION}".encode())
    for name in _PLANNER_SOURCES:
        path = root / name
        for source in sorted(path.rglob("*.py")) if path.is_dir() else [path]:
            digest.update(str(source.relative_to(root)).encode())
            digest.update(source.read_bytes())
    return digest.hexdigest()


def _custom_descriptions(graph: ir.Graph) -> list[str]:
    """The descriptions of the graph's ops that a user registered: they decide the plan as
    much as the graph does, and live outside the planner's source."""
    from tofu_tf.semantics import Family, default_registry
    registry = default_registry()
    custom = set(registry.op_types(Family.CUSTOM))
    return [f"{op.type}: {registry.describe(op, graph)}" for op in graph.ops if op.type in custom]


class PlanCache:
    """A directory of plan files named by their fingerprint."""

    def __init__(self, directory: str | os.PathLike | None = None):
        self.directory = pathlib.Path(directory) if directory is not None else default_cache_dir()

    def path(self, key: str) -> pathlib.Path:
        return self.directory / f"{key}.json"

    def load(self, key: str) -> Plan | None:
        """The plan kept under ``key``; None when there is none, or when the file does not read
        as a plan (it is then removed, with a warning saying why, and the caller plans again)."""
        path = self.path(key)
        try:
            return Plan.from_file(path)
        except FileNotFoundError:
            return None
        except (PlanError, OSError, UnicodeDecodeError) as error:
            logging.warning("tofu_tf plan cache: ignoring %s, which does not read as a plan (%s); planning "
                            "again and replacing it.", path, str(error).splitlines()[0])
            path.unlink(missing_ok=True)
            return None

    def store(self, key: str, plan: Plan) -> pathlib.Path:
        """Write ``plan`` under ``key`` whole or not at all (a run stopped mid-write leaves no
        half file that a later run would have to throw away)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.path(key)
        handle, temporary = tempfile.mkstemp(dir=self.directory, prefix=f".{key[:16]}.", suffix=".tmp")
        try:
            with os.fdopen(handle, "w", encoding="utf-8") as out:
                out.write(plan.to_json(indent=1))
            os.replace(temporary, path)
        except BaseException:
            pathlib.Path(temporary).unlink(missing_ok=True)
            raise
        return path


def plan_with_cache(graph: ir.Graph, *, cache: PlanCache | None = None, **options) -> CachedPlan:
    """``plan_graph(graph, **options)``, taken from ``cache`` when it holds that plan, else
    planned and kept there. Logs which, with the file's path."""
    from tofu_tf.search import plan_graph
    if options.get("strategy_provider") is not None:
        logging.warning("tofu_tf plan cache: a custom strategy_provider cannot be fingerprinted; "
                        "planning without the cache.")
        return CachedPlan(plan_graph(graph, **options), None, False)
    cache = cache if cache is not None else PlanCache()
    key = fingerprint(graph, **options)
    plan = cache.load(key)
    if plan is not None:
        logging.info("tofu_tf plan cache: plan taken from %s (no search).", cache.path(key))
        return CachedPlan(plan, cache.path(key), True)
    plan = plan_graph(graph, **options)
    path = cache.store(key, plan)
    logging.info("tofu_tf plan cache: plan searched in %.2f s and kept in %s.", plan.search_seconds, path)
    return CachedPlan(plan, path, False)


def cached_plan_graph(graph: ir.Graph, *, cache_dir: str | os.PathLike | None = None, **options) -> Plan:
    """``plan_graph`` through the plan cache in ``cache_dir`` (default: ``default_cache_dir()``)."""
    return plan_with_cache(graph, cache=PlanCache(cache_dir), **options).plan
