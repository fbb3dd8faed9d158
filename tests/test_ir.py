"""The IR on hand-built graphs: no TensorFlow needed."""

import json

import pytest

from tofu_tf import ir


def _tiny_graph() -> ir.Graph:
    t = {
        "x:0": ir.Tensor("x:0", (4, 8), "float32", ir.Role.INPUT, "x", ("mm",)),
        "w:0": ir.Tensor("w:0", (8, 2), "float32", ir.Role.WEIGHT, "w", ("mm",), variable_path="d/kernel"),
        "mm:0": ir.Tensor("mm:0", (4, 2), "float32", ir.Role.ACTIVATION, "mm"),
        "axes:0": ir.Tensor("axes:0", (1,), "int32", ir.Role.ACTIVATION, "axes", const_value=(1,)),
        "g:0": ir.Tensor("g:0", (8, 2), "float32", ir.Role.GRADIENT, "g", variable_path="d/kernel"),
    }
    ops = (
        ir.Op("x", "Placeholder", (), ("x:0",), {"dtype": "float32", "shape": (4, 8)}),
        ir.Op("w", "ReadVariableOp", (), ("w:0",), layer="d"),
        ir.Op("mm", "MatMul", ("x:0", "w:0"), ("mm:0",), {"transpose_a": False, "transpose_b": False}, layer="d"),
        ir.Op("g", "MatMul", ("x:0", "mm:0"), ("g:0",), {"transpose_a": True}, layer="d"),
    )
    variables = {
        "d/kernel": ir.Variable("d/kernel", (8, 2), "float32", ir.VariableKind.WEIGHT, trainable=True, gradient="g:0"),
        "m/d/kernel": ir.Variable("m/d/kernel", (8, 2), "float32", ir.VariableKind.OPTIMIZER_SLOT,
                                  slot_of="d/kernel", slot_name="m"),
        "v/d/kernel": ir.Variable("v/d/kernel", (8, 2), "float32", ir.VariableKind.OPTIMIZER_SLOT,
                                  slot_of="d/kernel", slot_name="v"),
    }
    return ir.Graph(ops=ops, tensors=t, variables=variables, batch_size=4, framework="tf_keras")


def test_bytes_by_role_counts_each_variable_once():
    totals = _tiny_graph().bytes_by_role()
    assert totals == {"weight": 64, "gradient": 64, "optimizer_slot": 128, "activation": 32 + 4, "input": 128}


def test_json_round_trip_is_exact_and_versioned():
    graph = _tiny_graph()
    text = graph.to_json()
    assert ir.Graph.from_json(text) == graph
    data = json.loads(text)
    data["version"] = 999
    with pytest.raises(ValueError, match="version 999.*Capture the model again"):
        ir.Graph.from_dict(data)


def test_json_round_trip_keeps_loop_bodies():
    body = _tiny_graph()
    loop = ir.Op("loop", "While", ("x:0",), ("loop:0",), {"parallel_iterations": 32}, body=body)
    graph = ir.Graph(ops=(loop,), tensors={}, variables={})
    assert ir.Graph.from_json(graph.to_json()).ops[0].body == body
    assert graph.op_type_counts()["MatMul"] == 2


def test_summary_names_roles_and_op_types():
    text = _tiny_graph().summary()
    assert "optimizer_slot" in text and "MatMul" in text and "batch 4" in text


def test_slots_of_links_slots_to_their_weight():
    graph = _tiny_graph()
    assert sorted(v.slot_name for v in graph.slots_of("d/kernel")) == ["m", "v"]
    assert [w.path for w in graph.weights()] == ["d/kernel"]


def test_dtype_size_of_handles_is_zero():
    assert ir.dtype_size("resource") == 0 and ir.dtype_size("bfloat16") == 2
