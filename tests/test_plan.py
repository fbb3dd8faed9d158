"""Plan: JSON round trip, versioning, the summary table."""

import dataclasses
import json
import re

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


def test_summary_columns_never_run_together():
    """Long Keras 3 paths ran into the layout column, cut at 44 characters
    ("transformer_layer_0/self_attention/query/ker(-, -, -)"): the name column grows to
    the longest name, and a name past its limit keeps its distinctive tail."""
    block = "gpt2_backbone/transformer_layer_0/self_attention/query"
    very_long = "adam/" + "_".join(["transformer_layer_11_self_attention_attention_output"] * 2) + "_kernel_momentum"
    paths = [f"{block}/kernel", f"{block}/bias", "head/kernel", very_long]
    layouts = [(None, "model", None), ("model", None), (None, None), ("model", None)]
    layer = "gpt2_backbone/transformer_layer_0/self_attention/attention_output"
    plan = dataclasses.replace(_plan(), variable_layouts=dict(zip(paths, layouts)),
                               comm_by_layer={layer: CommCost(2.0**50, 1.0), "d": CommCost(1024.0, 1e-5)})
    lines = plan.summary().splitlines()
    start = lines.index(next(line for line in lines if line.lstrip().startswith("variable")))
    rows = [re.fullmatch(r"  (\S+) {2,}(\(.*\))", line) for line in lines[start + 1:start + 1 + len(paths)]]
    assert all(rows), lines[start:]
    assert [row.group(2) for row in rows] == [
        "(-, model, -)", "(model, -)", "(-, -)", "(model, -)"]
    assert [row.group(1) for row in rows[:3]] == paths[:3]
    cut = rows[3].group(1)
    assert cut.startswith("...") and very_long.endswith(cut[3:]) and cut.endswith("kernel_momentum")
    assert len({row.start(2) for row in rows}) == 1              # one layout column
    layer_row = next(line for line in lines if line.lstrip().startswith(layer))
    assert layer_row.split() == [layer, f"{2.0**30:,.1f}", "1000.000"]
