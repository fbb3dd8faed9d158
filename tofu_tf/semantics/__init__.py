"""Operator semantics: what each TF op computes, and every way to split it.

Tofu's key idea (Wang et al., EuroSys'19): partition strategies are not
hand-written tables but follow from a description of what an op computes.
This package owns that layer of tofu_tf: the description language
(``tdl``: index lambdas; ``language``: their frozen form and text), the
builtin descriptions (``ops``), strategy derivation (``derive``), the
registry of op types with its per-op caches (``registry``), the family tag
of an op type (``family``) and the coverage report (``coverage``). It works
on the IR only and imports no TensorFlow.

    from tofu_tf import semantics
    semantics.strategies(op, graph, num_parts=8)   # legal OpStrategy list, replicate-all first
    print(semantics.describe(op, graph))           # ([i, k],[k, j])->([i, j]) {i=8, j=16, k=8} sum(k)
    print(semantics.coverage(graph))               # which ops run replicated for lack of a description
"""

from tofu_tf.semantics.coverage import CoverageReport, coverage
from tofu_tf.semantics.derive import derive
from tofu_tf.semantics.family import Family
from tofu_tf.semantics.language import Description, DescriptionError, MetaKind, ReduceKind, Use
from tofu_tf.semantics.ops import register_builtin_ops
from tofu_tf.semantics.registry import (
    DuplicateOpError, OpSemantics, Registry, default_registry, describe, explain, register_op, strategies)
from tofu_tf.semantics.strategy import REPLICATED, OpStrategy, Reduction, TensorSplit, replicate_all
from tofu_tf.semantics.tdl import (
    META_OUTPUT, WORKSPACE_OUTPUT, Apply, Max, Mean, Min, Out, Position, Prod, Program, Select, Sum, Update,
    Where, trace)
from tofu_tf.semantics.view import OpView

__all__ = [
    "CoverageReport", "coverage", "derive", "Description", "DescriptionError", "MetaKind", "ReduceKind", "Use",
    "register_builtin_ops", "DuplicateOpError", "Family", "OpSemantics", "Registry", "default_registry",
    "describe", "explain", "register_op", "strategies", "REPLICATED", "OpStrategy", "Reduction", "TensorSplit",
    "replicate_all", "META_OUTPUT", "WORKSPACE_OUTPUT", "Apply", "Max", "Mean", "Min", "Out", "Position", "Prod",
    "Program", "Select", "Sum", "Update", "Where", "trace", "OpView",
]
