"""Plan: JSON round trip, versioning, the summary table."""

import json

import pytest

from tofu_tf.cost.memory import MemoryReport
from tofu_tf.plan import CommCost, Method, Plan, PlanVersionError


def _plan() -> Plan:
    return Plan(
        method=Method.TOFU, mesh_axes=(("batch", 2), ("model", 4)),
        variable_layouts={"d/kernel": (None, "model"), "Adam/m/d/kernel": (None, "model")},
        input_layouts={"x:0": ("batch", None)}, tensor_layouts={"mm:0": ("batch", "model")},
        partial_tensors={"g:0": ("batch",)}, op_strategies={"mm": ("i", "j")},
        comm_by_collective={"all-reduce": CommCost(1024.0, 1e-5)},
        comm_by_layer={"d": CommCost(1024.0, 1e-5)},
        memory=MemoryReport(4096, 1024, 2048, 512, 512, "mm", (("Adam/m/d/kernel", 1024),)),
        search_seconds=0.5, hardware="h100-nvlink", memory_budget_bytes=8192, notes=("a note",))


def test_json_round_trip_is_exact():
    plan = _plan()
    again = Plan.from_json(plan.to_json())
    assert again == plan
    assert again.mesh_shape == {"batch": 2, "model": 4} and list(again.mesh_shape) == ["batch", "model"]
    assert again.comm_bytes == 1024.0 and again.peak_memory_bytes == 4096 and again.method is Method.TOFU


def test_other_versions_are_refused_with_a_remedy():
    data = json.loads(_plan().to_json())
    data["version"] = 0
    with pytest.raises(PlanVersionError, match="version 0.*Plan the model again"):
        Plan.from_dict(data)


def test_plan_is_frozen():
    with pytest.raises(AttributeError):
        _plan().search_seconds = 1.0


def test_summary_is_a_table():
    text = _plan().summary()
    assert "batch=2 x model=4" in text and "all-reduce" in text and "d/kernel" in text
    assert "(-, model)" in text and "note: a note" in text
