"""Which ops of a graph tofu_tf can partition, and which it runs replicated.

This module owns ``coverage(graph)`` and its ``CoverageReport``: every op of
a training-step graph (loop bodies included) is looked up in a registry; op
types with no description, and ops whose description could not be built
(unknown shapes, unsupported attributes), fall back to replicated and are
named here with their counts -- the planner never drops an op silently.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Iterator, Mapping

from tofu_tf import ir
from tofu_tf.semantics.registry import Registry, default_registry


@dataclasses.dataclass(frozen=True)
class CoverageReport:
    """Op counts by type, split into described and unsupported.

    ``unsupported`` maps an op type to the number of its ops that are
    replicated for lack of a description; ``problems`` says why, per type.
    """

    counts: Mapping[str, int]
    unsupported: Mapping[str, int]
    problems: Mapping[str, str]
    registered: int

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    @property
    def described(self) -> int:
        return self.total - sum(self.unsupported.values())

    @property
    def complete(self) -> bool:
        return not self.unsupported

    def __str__(self) -> str:
        lines = [f"Operator coverage: {self.described}/{self.total} ops of {len(self.counts)} types described "
                 f"({self.registered} op types registered)"]
        if self.complete:
            lines.append("every op has a description")
        else:
            n = sum(self.unsupported.values())
            lines.append(f"{n} ops of {len(self.unsupported)} types are planned replicated (no description):")
            for op_type, count in sorted(self.unsupported.items(), key=lambda kv: (-kv[1], kv[0])):
                lines.append(f"  {op_type:<36}{count:>6}  {self.problems.get(op_type, '')}")
            lines.append("describe them with tofu_tf.register_op(op_type, description)")
        return "\n".join(lines)


def coverage(graph: ir.Graph, registry: Registry | None = None) -> CoverageReport:
    """Which ops of ``graph`` tofu_tf can partition, and which it must run replicated.

    Every op (loop bodies included) is looked up in ``registry``. An op type without a
    description, and an op its description cannot be built for (an unknown shape, an
    attribute the builder refuses), are planned replicated; the report names them with
    their counts, so that a model which shards less than expected can be explained, and
    fixed with ``register_op``. Each such op type is also logged once as a warning.

    Args:
        graph: A captured training step (``tofu_tf.capture_training_step``).
        registry: The registry to look the ops up in; None is the default one (the builtin
            ops and those added with ``register_op``).

    Returns:
        A ``CoverageReport``: op counts by type (``counts``), the ops planned replicated by
        type (``unsupported``) and why (``problems``). ``complete`` is True when every op
        has a description; ``str(report)`` is a table a person reads.

    Example:
        >>> import tofu_tf
        >>> from tofu_tf import models
        >>> graph = tofu_tf.capture_training_step(models.mlp(), batch_size=32, optimizer="adam",
        ...                                       loss="sparse_categorical_crossentropy")
        >>> report = tofu_tf.coverage(graph)
        >>> report.complete, report.described == report.total
        (True, True)
    """
    registry = registry if registry is not None else default_registry()
    counts: Counter = Counter()
    unsupported: Counter = Counter()
    problems: dict[str, str] = {}
    for op, owner in _walk(graph):
        counts[op.type] += 1
        status, problem = registry.status(op, owner)
        if status != "described":
            unsupported[op.type] += 1
            problems.setdefault(op.type, problem)
    return CoverageReport(dict(counts), dict(unsupported), problems, len(registry))


def _walk(graph: ir.Graph) -> Iterator[tuple[ir.Op, ir.Graph]]:
    for op in graph.ops:
        yield op, graph
        if op.body is not None:
            yield from _walk(op.body)
