"""Which op types tofu_tf can describe, and the per-op entry points of the
semantics layer.

This module owns the ``Registry`` object (op type -> description builder), the
one default registry (built by ``default_registry()`` on first use, never by
import side effects), ``register_op`` for custom ops, and the lookups the
search calls for every op: ``describe(op, graph)`` and
``strategies(op, graph, num_parts)``. Both are cached per op *view* (type,
attributes, shapes, small constant inputs; ``tofu_tf.semantics.view``) and
number of parts, so a 20k-op graph of repeated layers costs a few hundred
derivations.

An op type the registry does not know, or whose description cannot be built
for the op at hand, is described conservatively as replicated -- never
silently: a warning is logged once per op type and ``coverage()`` names it.

``Family`` (the tag every registered op type carries) is defined in the leaf
module ``tofu_tf.semantics.family``, which the builtin descriptions import
too; ``registry.Family`` still names it.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Callable

from absl import logging

from tofu_tf import ir
from tofu_tf.errors import TofuError
from tofu_tf.semantics import derive as _derive
from tofu_tf.semantics.family import Family
from tofu_tf.semantics.language import Description, DescriptionError, replicated
from tofu_tf.semantics.ops import register_builtin_ops
from tofu_tf.semantics.strategy import OpStrategy
from tofu_tf.semantics.tdl import Program, trace
from tofu_tf.semantics.view import OpView, view_key


Builder = Callable[[OpView], "Program | Description | Callable"]


@dataclasses.dataclass(frozen=True)
class OpSemantics:
    """One registered op type: ``build`` makes its description from an op view;
    ``summary`` is the one-line TDL a person reads (docs, ``explain``)."""

    op_type: str
    build: Builder
    family: Family = Family.CUSTOM
    summary: str = ""


class DuplicateOpError(TofuError, ValueError):
    """An op type was registered twice in one registry."""


class _Status(enum.Enum):
    DESCRIBED = "described"
    UNKNOWN = "unknown"   # no description registered for the op type
    FAILED = "failed"     # the registered builder could not describe this op


@dataclasses.dataclass(frozen=True)
class _Entry:
    description: Description
    status: _Status
    problem: str = ""


class Registry:
    """Op type -> description builder, with caches of descriptions and
    strategies per op view. Build one with ``Registry()`` and fill it with
    ``register_builtin_ops(registry)`` and ``register``; most code uses
    ``default_registry()``."""

    def __init__(self):
        self._ops: dict[str, OpSemantics] = {}
        self._entries: dict[tuple, _Entry] = {}
        self._strategies: dict[tuple, tuple[OpStrategy, ...]] = {}
        self._warned: set[str] = set()

    # -- registration -------------------------------------------------------------
    def register(self, op_type: str, description=None, *, family: Family = Family.CUSTOM,
                 summary: str = "", replace: bool = False):
        """Register ``op_type``. ``description`` is a program (``lambda a, b:
        lambda i, j: ...`` or a ``Program``), used for every op of the type.
        Without it, returns a decorator for a *builder*: a function of an
        ``OpView`` returning the program (or a ``Description``) for that op,
        so attributes and shapes can shape the description."""
        if description is None:
            def decorator(build: Builder) -> Builder:
                self.add(OpSemantics(op_type, build, family, summary or _first_line(build)), replace=replace)
                return build
            return decorator
        if not callable(description) and not isinstance(description, Program):
            raise TypeError(f"the description of {op_type!r} must be a program (a lambda over the op's inputs) "
                            f"or a Program, got {type(description).__name__}")
        program = description
        self.add(OpSemantics(op_type, lambda view: program, family, summary), replace=replace)
        return description

    def add(self, semantics: OpSemantics, *, replace: bool = False) -> None:
        if not isinstance(semantics.op_type, str) or not semantics.op_type:
            raise ValueError(f"op type must be a non-empty string, got {semantics.op_type!r}")
        old = self._ops.get(semantics.op_type)
        if old is not None and not replace:
            raise DuplicateOpError(
                f"op type {semantics.op_type!r} is already registered (family {old.family.value}); "
                "pass replace=True to override it, or register into a fresh Registry()")
        self._ops[semantics.op_type] = semantics
        self._entries.clear()
        self._strategies.clear()
        self._warned.discard(semantics.op_type)

    # -- queries ----------------------------------------------------------------
    def __contains__(self, op_type: str) -> bool:
        return op_type in self._ops

    def __len__(self) -> int:
        return len(self._ops)

    def op_types(self, family: Family | None = None) -> tuple[str, ...]:
        return tuple(sorted(t for t, s in self._ops.items() if family is None or s.family is family))

    def get(self, op_type: str) -> OpSemantics | None:
        return self._ops.get(op_type)

    def describe(self, op: ir.Op, graph: ir.Graph) -> Description:
        """The description of ``op`` (replicated when unknown or undescribable)."""
        return self._entry(view_key(op, graph)).description

    def describe_view(self, view: OpView) -> Description:
        return self._entry(_key_of(view)).description

    def strategies(self, op: ir.Op, graph: ir.Graph, num_parts: int) -> list[OpStrategy]:
        """Legal strategies of ``op`` on an axis of ``num_parts`` devices, replicate-all first."""
        key = view_key(op, graph)
        cache_key = (key, num_parts)
        found = self._strategies.get(cache_key)
        if found is None:
            found = _derive.derive(self._entry(key).description, num_parts)
            self._strategies[cache_key] = found
        return list(found)

    def strategies_for_view(self, view: OpView, num_parts: int) -> list[OpStrategy]:
        return list(_derive.derive(self.describe_view(view), num_parts))

    def status(self, op: ir.Op, graph: ir.Graph) -> tuple[str, str]:
        """``("described" | "unknown" | "failed", problem)`` for one op."""
        entry = self._entry(view_key(op, graph))
        return entry.status.value, entry.problem

    # -- internals --------------------------------------------------------------
    def _entry(self, key: tuple) -> _Entry:
        entry = self._entries.get(key)
        if entry is None:
            entry = self._build(OpView(*key))
            self._entries[key] = entry
        return entry

    def _build(self, view: OpView) -> _Entry:
        semantics = self._ops.get(view.type)
        if semantics is None:
            self._warn(view.type, f"tofu_tf has no semantics for op type {view.type!r}: ops of this type are "
                                  f"planned replicated. Describe it with tofu_tf.register_op({view.type!r}, ...)")
            return _Entry(_fallback(view, "unknown op type"), _Status.UNKNOWN, "no description registered")
        try:
            return _Entry(_describe(semantics, view), _Status.DESCRIBED)
        except DescriptionError as exc:
            self._warn(view.type, f"tofu_tf could not describe an op of type {view.type!r} ({exc}); "
                                  "it is planned replicated")
            return _Entry(_fallback(view, "description failed"), _Status.FAILED, str(exc))

    def _warn(self, op_type: str, message: str) -> None:
        if op_type not in self._warned:
            self._warned.add(op_type)
            logging.warning(message)


def _first_line(fn) -> str:
    doc = (getattr(fn, "__doc__", None) or "").strip()
    return doc.splitlines()[0] if doc else ""


def _key_of(view: OpView) -> tuple:
    """The cache key of a view: its fields in order, as ``view_key`` builds them."""
    return tuple(getattr(view, f.name) for f in dataclasses.fields(view))


def _fallback(view: OpView, reason: str) -> Description:
    return replicated(view.num_inputs, view.num_outputs, reason,
                      input_shapes=[s or () for s in view.input_shapes],
                      output_shapes=[s or () for s in view.output_shapes])


def _describe(semantics: OpSemantics, view: OpView) -> Description:
    built = semantics.build(view)
    if isinstance(built, Description):
        return built
    if any(s is None for s in view.output_shapes):
        raise DescriptionError(f"{view.type}: an output has an unknown shape")
    return trace(built, op=view.type, input_shapes=view.input_shapes, output_shapes=view.output_shapes,
                 variables=[view.is_variable(i) for i in range(view.num_inputs)])


# -- the default registry and module-level entry points ------------------------------

_default: Registry | None = None


def default_registry() -> Registry:
    """The registry ``register_op``, ``strategies`` and ``coverage`` use by
    default: every builtin op, built on first call."""
    global _default
    if _default is None:
        registry = Registry()
        register_builtin_ops(registry)
        _default = registry
    return _default


def register_op(op_type: str, description=None, *, family: Family = Family.CUSTOM, summary: str = "",
                replace: bool = False, registry: Registry | None = None):
    """Describe a custom op type, so that tofu_tf can partition it instead of replicating it.

    An op type without a description runs whole on every device (``coverage`` lists such
    ops). A description says what the op computes, as a program of Tofu's description
    language: a function of the op's inputs that returns a function of the output's indices
    (``Sum``, ``Max``, ... reduce over an index of their own). Every way to split the op
    over devices is derived from it; nothing is tabulated by hand.

    A description that does not fit an op (another number of inputs, an output of unknown
    shape) is not refused here: planning runs such an op replicated and logs a warning,
    once per op type.

    Args:
        op_type: The TF op type, as ``op.type`` names it in the step's graph.
        description: A program used for every op of the type (``lambda a, b: lambda i, j:
            ...``, or a ``Program``). Without it, ``register_op`` is a decorator for a
            builder: a function of the op (an ``OpView``, with its attributes and shapes)
            that returns the program for that op.
        family: The kind of computation (``Family``), which reports and docs group by.
        summary: The one-line form a person reads (``explain``, docs); by default a
            builder's first docstring line.
        replace: Whether to replace an existing description of ``op_type``, builtin ones
            included.
        registry: The registry to add to; None is the default registry, the one planning
            uses.

    Returns:
        ``description`` itself; without one, the decorator, which returns the builder itself.

    Raises:
        tofu_tf.semantics.DuplicateOpError: ``op_type`` is already registered and ``replace``
            is False.
        TypeError: ``description`` is neither a callable nor a ``Program``.
        ValueError: ``op_type`` is not a non-empty string.

    Example:
        >>> import tofu_tf
        >>> from tofu_tf.semantics import Sum
        >>> _ = tofu_tf.register_op(   # the scale inside the sum: k may be split, with a reduce
        ...     "MyScaledMatMul", lambda a, b, s: lambda i, j: Sum(lambda k: a[i, k] * b[k, j] * s[()]))
        >>> @tofu_tf.register_op("MyTransposedMatMul")
        ... def _(op):
        ...     if op.attr("transpose"):
        ...         return lambda a, b: lambda i, j: Sum(lambda k: a[k, i] * b[k, j])
        ...     return lambda a, b: lambda i, j: Sum(lambda k: a[i, k] * b[k, j])
    """
    target = registry if registry is not None else default_registry()
    return target.register(op_type, description, family=family, summary=summary, replace=replace)


def strategies(op: ir.Op, graph: ir.Graph, num_parts: int, registry: Registry | None = None) -> list[OpStrategy]:
    """Every legal way to split ``op`` (with its static shapes in ``graph``)
    over a mesh axis of ``num_parts`` devices; replicate-all first. Cached per
    (op type, shapes, attributes, constant inputs, num_parts).

    A split ``TensorSplit(dim=d)`` of a resource input refers to dim ``d`` of
    the variable the handle names."""
    return (registry if registry is not None else default_registry()).strategies(op, graph, num_parts)


def describe(op: ir.Op, graph: ir.Graph, registry: Registry | None = None) -> Description:
    """The description of ``op`` (its ``.text()`` is the one-line form)."""
    return (registry if registry is not None else default_registry()).describe(op, graph)


def explain(op: ir.Op, graph: ir.Graph, num_parts: int, registry: Registry | None = None) -> str:
    """A few lines a person reads: the op's description and its strategies."""
    registry = registry if registry is not None else default_registry()
    lines = [f"{op.name} ({op.type}): {registry.describe(op, graph).text()}"]
    lines += [f"  {s.text()}" for s in registry.strategies(op, graph, num_parts)]
    return "\n".join(lines)
