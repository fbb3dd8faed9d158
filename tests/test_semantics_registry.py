"""The registry, custom ops and the coverage report, on hand-built IR graphs. No TensorFlow."""

import logging

import pytest

from tofu_tf import ir, semantics
from tofu_tf.semantics import Registry, Sum


def _graph(op_type="MatMul", attrs=None, extra_ops=()):
    """x[8,16] @ w[16,4] -> y, then ``extra_ops`` (type, input names) on y."""
    t = {
        "x:0": ir.Tensor("x:0", (8, 16), "float32", ir.Role.INPUT, "x"),
        "w:0": ir.Tensor("w:0", (16, 4), "float32", ir.Role.WEIGHT, "w", variable_path="d/kernel"),
        "y:0": ir.Tensor("y:0", (8, 4), "float32", ir.Role.ACTIVATION, "y"),
    }
    ops = [ir.Op("y", op_type, ("x:0", "w:0"), ("y:0",), attrs or {})]
    for n, (extra_type, inputs) in enumerate(extra_ops):
        name = f"extra{n}"
        t[f"{name}:0"] = ir.Tensor(f"{name}:0", (8, 4), "float32", ir.Role.ACTIVATION, name)
        ops.append(ir.Op(name, extra_type, inputs, (f"{name}:0",)))
    return ir.Graph(ops=tuple(ops), tensors=t)


def _fresh():
    registry = Registry()
    semantics.register_builtin_ops(registry)
    return registry


def test_strategies_of_an_op_in_a_graph():
    graph = _graph()
    names = [s.name for s in semantics.strategies(graph.ops[0], graph, 2)]
    assert names == ["replicate", "i", "j", "k(reduce)"]


def test_strategies_are_cached_per_view_and_parts():
    registry = _fresh()
    graph = _graph()
    first = registry.strategies(graph.ops[0], graph, 2)
    assert registry.strategies(graph.ops[0], graph, 2) == first
    assert len(registry.strategies(graph.ops[0], graph, 16)) == 2  # only k=16 divides


def test_duplicate_registration_is_refused_with_the_fix():
    registry = _fresh()
    with pytest.raises(semantics.DuplicateOpError, match=r"'MatMul' is already registered .*replace=True"):
        registry.register("MatMul", lambda a, b: lambda i, j: Sum(lambda k: a[i, k] * b[k, j]))
    with pytest.raises(semantics.DuplicateOpError):
        semantics.register_builtin_ops(registry)


def test_register_a_custom_op_with_a_program():
    registry = _fresh()
    registry.register("MyMatMul", lambda a, b: lambda i, j: Sum(lambda k: a[i, k] * b[k, j]))
    graph = _graph("MyMatMul")
    assert semantics.describe(graph.ops[0], graph, registry).text() == \
        "([i, k],[k, j])->([i, j]) {i=8, j=4, k=16} sum(k)"
    assert [s.name for s in registry.strategies(graph.ops[0], graph, 2)] == ["replicate", "i", "j", "k(reduce)"]
    assert registry.get("MyMatMul").family is semantics.Family.CUSTOM


def test_register_a_custom_op_with_a_builder_decorator_that_reads_attributes():
    registry = _fresh()

    @registry.register("MyMaybeTransposed")
    def _(op):
        """out[i, j] = sum_k a[i, k] * b[k, j] (b[j, k] when transposed)"""
        if op.attr("transpose_b"):
            return lambda a, b: lambda i, j: Sum(lambda k: a[i, k] * b[j, k])
        return lambda a, b: lambda i, j: Sum(lambda k: a[i, k] * b[k, j])

    graph = _graph("MyMaybeTransposed")
    assert registry.describe(graph.ops[0], graph).inputs[1].accesses[0][0].pure == "k"
    assert registry.get("MyMaybeTransposed").summary.startswith("out[i, j] = sum_k")


def test_registering_again_with_replace_clears_the_caches():
    registry = _fresh()
    graph = _graph("MyOp")
    assert registry.describe(graph.ops[0], graph).replicated == "unknown op type"
    registry.register("MyOp", lambda a, b: lambda i, j: Sum(lambda k: a[i, k] * b[k, j]))
    assert registry.describe(graph.ops[0], graph).replicated is None
    registry.register("MyOp", lambda a, b: lambda i, j: Sum(lambda k: a[i, k] * b[k, j]), replace=True)


def test_register_op_uses_the_default_registry():
    assert semantics.register_op is not None
    registry = _fresh()
    semantics.register_op("MyDefaultOp", lambda a, b: lambda i, j: Sum(lambda k: a[i, k] * b[k, j]),
                          registry=registry)
    assert "MyDefaultOp" in registry and "MyDefaultOp" not in semantics.default_registry()
    assert semantics.default_registry() is semantics.default_registry()


def test_a_description_that_cannot_be_built_falls_back_to_replicated():
    registry = _fresh()
    registry.register("Broken", lambda a: lambda i: a[i])  # the op has two inputs
    graph = _graph("Broken")
    assert registry.status(graph.ops[0], graph)[0] == "failed"
    assert registry.strategies(graph.ops[0], graph, 2) == [semantics.replicate_all(2, 1)]


def test_unknown_ops_are_replicated_and_warned_about_once(caplog):
    registry = _fresh()
    graph = _graph("MyMysteryOp", extra_ops=[("MyMysteryOp", ("y:0", "w:0"))])
    with caplog.at_level(logging.WARNING):
        for op in graph.ops:
            assert registry.strategies(op, graph, 2) == [semantics.replicate_all(2, 1)]
    warnings = [r for r in caplog.records if "MyMysteryOp" in r.getMessage()]
    assert len(warnings) == 1
    assert "register_op('MyMysteryOp'" in warnings[0].getMessage()


def test_coverage_names_every_unsupported_op_type_with_its_count():
    registry = _fresh()
    graph = _graph(extra_ops=[("MyMysteryOp", ("y:0", "w:0")), ("MyMysteryOp", ("y:0", "w:0")),
                              ("Relu", ("y:0",)), ("OtherUnknown", ("y:0",))])
    report = semantics.coverage(graph, registry)
    assert report.unsupported == {"MyMysteryOp": 2, "OtherUnknown": 1}
    assert report.counts == {"MatMul": 1, "MyMysteryOp": 2, "Relu": 1, "OtherUnknown": 1}
    assert (report.total, report.described, report.complete) == (5, 2, False)
    text = str(report)
    assert "2/5 ops of 4 types described" in text
    assert "MyMysteryOp" in text and "OtherUnknown" in text and "tofu_tf.register_op" in text


def test_coverage_reports_descriptions_that_failed_and_looks_inside_loop_bodies():
    registry = _fresh()
    registry.register("Broken", lambda a: lambda i: a[i])
    body = _graph("Broken")
    loop = ir.Op("loop", "While", ("x:0",), ("x:0",), body=body)
    graph = ir.Graph(ops=(loop,), tensors=body.tensors)
    report = semantics.coverage(graph, registry)
    assert report.counts == {"While": 1, "Broken": 1}
    assert report.unsupported == {"Broken": 1}
    assert "does not take 2 inputs" in report.problems["Broken"]


def test_a_complete_report_says_so():
    report = semantics.coverage(_graph(), _fresh())
    assert report.complete and "every op has a description" in str(report)


def test_explain_lists_the_description_and_strategies():
    graph = _graph()
    text = semantics.explain(graph.ops[0], graph, 2)
    assert text.splitlines()[0] == "y (MatMul): ([i, k],[k, j])->([i, j]) {i=8, j=4, k=16} sum(k)"
    assert "k(reduce): (S1,S0)->(partial(sum))" in text


def test_a_resource_input_is_described_by_its_variable():
    t = {
        "h:0": ir.Tensor("h:0", (), "resource", ir.Role.RESOURCE, "", variable_path="d/kernel"),
        "v:0": ir.Tensor("v:0", (16, 4), "float32", ir.Role.WEIGHT, "v", variable_path="d/kernel"),
        "u:0": ir.Tensor("u:0", (), "resource", ir.Role.RESOURCE, "", variable_path="nowhere"),
        "z:0": ir.Tensor("z:0", (), "float32", ir.Role.SCALAR, "z"),
    }
    variables = {"d/kernel": ir.Variable("d/kernel", (16, 4), "float32", ir.VariableKind.WEIGHT)}
    read = ir.Op("v", "ReadVariableOp", ("h:0",), ("v:0",))
    unknown = ir.Op("z", "ReadVariableOp", ("u:0",), ("z:0",))
    graph = ir.Graph(ops=(read, unknown), tensors=t, variables=variables)
    assert [s.text() for s in semantics.strategies(read, graph, 2)] == \
        ["replicate: (R)->(R)", "i: (S0)->(S0)", "j: (S1)->(S1)"]
    assert semantics.strategies(unknown, graph, 2) == [semantics.replicate_all(1, 1)]


def test_the_semantics_layer_imports_no_tensorflow():
    import subprocess
    import sys
    code = ("import sys, tofu_tf.semantics as s; s.default_registry(); "
            "assert 'tensorflow' not in sys.modules, 'tofu_tf.semantics imported TensorFlow'")
    root = __file__.rsplit("/tests/", 1)[0]
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root)
