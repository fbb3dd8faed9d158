"""Plan: JSON round trip, versioning, the summary table."""

import dataclasses
import json
import re

import pytest

from tofu_tf.cost.memory import MemoryReport
from tofu_tf.plan import CommCost, Method, Plan, PlanVersionError, read_plan
from tofu_tf.plan_check import PlanError


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


@pytest.mark.parametrize("combined, words", [(True, "all-reduces     combined, as DTensor does by default "
                                                    "(packing them: 2.000 ms)"),
                                             (False, "all-reduces     one by one"), (None, None)])
def test_how_the_step_runs_its_all_reduces_reads_back_and_is_shown(combined, words):
    plan = dataclasses.replace(_plan(), all_reduces_combined=combined, packing_seconds=2e-3 if combined else 0.0)
    again = Plan.from_json(plan.to_json())
    assert again == plan and again.all_reduces_combined is combined
    from tofu_tf import plan_report
    page = plan_report.html_fragment(plan)
    if words is None:
        assert "all-reduces " not in plan.summary() and "<th>all-reduces</th>" not in page
    else:
        assert words in plan.summary() and "<th>all-reduces</th>" in page
    with pytest.raises(PlanError, match="all_reduces_combined"):
        Plan.from_dict({**plan.to_dict(), "all_reduces_combined": "yes"})


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


# -- plan files as users hand them in: every problem named, in one error ----------------------

def _data() -> dict:
    return json.loads(_plan().to_json())


def _problems(data) -> tuple[str, ...]:
    with pytest.raises(PlanError) as caught:
        Plan.from_dict(data)
    return caught.value.problems


def test_missing_fields_are_named_not_a_bare_key_error():
    data = _data()
    del data["mesh_axes"], data["memory"]
    assert _problems(data) == ("missing field 'mesh_axes'", "missing field 'memory'")
    with pytest.raises(PlanError, match="(?s)plan JSON cannot be used \\(2 problems\\).*plan the model again"):
        Plan.from_dict(data)


def test_unknown_mesh_axis_names_the_field_the_variable_the_axis_and_the_mesh():
    data = _data()
    data["variable_layouts"]["d/kernel"] = [None, "modle"]
    assert _problems(data) == ("variable_layouts['d/kernel']: dim 1 names axis 'modle', which is not in mesh "
                               "(batch=2, model=4)",)


def test_an_extra_field_is_refused_with_the_fields_a_plan_has():
    data = _data()
    data["layouts"] = {"d/kernel": [None, "model"]}
    (problem,) = _problems(data)
    assert problem.startswith("unknown field 'layouts'; a plan's fields are version, method, mesh_axes")


def test_an_axis_splitting_two_dims_is_refused():
    data = _data()
    data["input_layouts"]["x:0"] = ["model", "model"]
    assert _problems(data) == ("input_layouts['x:0']: axis 'model' splits two dims of ('model', 'model'); DTensor "
                               "splits one dim per mesh axis",)


def test_every_problem_comes_in_one_error():
    data = _data()
    del data["hardware"]
    data["method"] = "magic"
    data["mesh_axes"] = [["batch", 2], ["model", 0]]
    data["variable_layouts"]["d/kernel"] = "model"
    data["comm_by_layer"] = {"d": [1.0]}
    data["memory"].pop("peak_bytes")
    problems = _problems(data)
    assert problems == (
        "missing field 'hardware'",
        "mesh_axes: axis 'model' has size 0; sizes are positive integers",
        "variable_layouts['d/kernel']: 'model' is not a layout; a layout is a list with one entry per tensor dim, "
        "each a mesh axis name or null",
        "method: 'magic' is not one of 'tofu', 'ilp', 'data_parallel', 'megatron'",
        "comm_by_layer: 'd': [1.0] is not a [bytes, seconds] pair",
        "memory: missing 'peak_bytes' (a memory report has peak_bytes, weight_bytes, optimizer_slot_bytes, "
        "gradient_bytes_at_peak, activation_bytes_at_peak, peak_op, top_contributors)")


def test_text_that_is_not_a_plan_object_is_refused():
    with pytest.raises(PlanError, match="plan JSON is not valid JSON: Expecting value at line 1 column 13"):
        Plan.from_json('{"version": }')
    with pytest.raises(PlanError, match="plan JSON is a list, not a plan"):
        Plan.from_json("[1, 2]")


def test_json_text_a_path_and_a_dict_read_as_the_plan(tmp_path):
    plan = _plan()
    path = tmp_path / "plan.json"
    path.write_text(plan.to_json())
    for given in (plan, plan.to_json(), str(path), path, plan.to_dict()):
        assert read_plan(given) == plan
    hand = HandLike({"model": 8}, {}, {})
    assert read_plan(hand) is hand


def test_a_file_names_itself_in_its_problems(tmp_path):
    path = tmp_path / "plan.json"
    data = _data()
    del data["mesh_axes"]
    path.write_text(json.dumps(data))
    with pytest.raises(PlanError, match=f"(?s)plan file '{re.escape(str(path))}' cannot be used.*'mesh_axes'"):
        read_plan(str(path))


def test_what_is_not_a_plan_is_refused_with_what_plan_takes(tmp_path):
    with pytest.raises(PlanError, match="neither plan JSON text .* nor the path of an existing file"):
        read_plan(str(tmp_path / "missing.json"))
    with pytest.raises(PlanError, match="plan= got a int, which has no mesh_shape, variable_layouts, input_layouts"):
        read_plan(3)


@dataclasses.dataclass(frozen=True)
class HandLike:
    mesh_shape: dict
    variable_layouts: dict
    input_layouts: dict


def _measured() -> Plan:
    from tofu_tf.executed import ExecutedFigures
    return dataclasses.replace(_plan(), executed=ExecutedFigures(
        collectives={"all-reduce": (3, 1024.0), "all-gather": (1, 512.0)}, lowered={"all-reduce": (1, 1536.0)},
        state_bytes=3072))


def test_measured_figures_read_back_and_stand_beside_the_model():
    plan = _measured()
    assert Plan.from_json(plan.to_json()) == plan
    assert "executed" not in _plan().to_dict()          # a plan not measured writes what it always wrote
    rows = {line.split()[0]: line.split() for line in plan.summary().splitlines()[1:]}
    assert rows["executed"][:2] == ["executed", "(measured)"]
    # kind: ops, executed MiB, modeled MiB, gap; an all-gather the plan did not price is a 100% gap
    assert rows["all-gather"][1:] == ["1", "0.000", "0.000", "100%"]
    assert rows["runs"][2:] == ["1", "0.001", "0.001", "33%"]       # 1536 executed against 1024 modeled
    assert rows["state/device"][1:] == ["0.003", "0.003", "0%"]     # weights + slots: 1024 + 2048


# Two gradients (8 and 16 floats) DTensor's combining pass wrote into one buffer of 1024 floats and
# all-reduced over 8 devices, as the lowered program's text has it (bench/executed.py's CNN).
_COMBINED = """\
      %outputs_60, %control_61 = tf_executor.island wraps "tf.Const"() <{value = dense<8> : tensor<i32>}> : () -> tensor<i32>
      %outputs_273, %control_274 = tf_executor.island wraps "tf.TensorStridedSliceUpdate"(%outputs_0, %outputs_116, %outputs_108, %outputs_68, %outputs_241) <{begin_mask = 0 : i64}> : (tensor<1024xf32>, tensor<1xi32>, tensor<1xi32>, tensor<1xi32>, tensor<8xf32>) -> tensor<1024xf32>
      %outputs_275, %control_276 = tf_executor.island wraps "tf.TensorStridedSliceUpdate"(%outputs_273, %outputs_108, %outputs_54, %outputs_68, %outputs_271) <{begin_mask = 0 : i64}> : (tensor<1024xf32>, tensor<1xi32>, tensor<1xi32>, tensor<1xi32>, tensor<16xf32>) -> tensor<1024xf32>
      %outputs_283, %control_284 = tf_executor.island(%control_258) wraps "tf.CollectiveReduceV2"(%outputs_275, %outputs_60, %outputs_281, %outputs_112) <{final_op = "Id", merge_op = "Add"}> : (tensor<1024xf32>, tensor<i32>, tensor<i32>, tensor<i32>) -> tensor<1024xf32>
      %outputs_285, %control_286 = tf_executor.island wraps "tf.CollectiveReduceV2"(%outputs_241, %outputs_60, %outputs_281, %outputs_113) <{final_op = "Id", merge_op = "Add"}> : (tensor<8xf32>, tensor<i32>, tensor<i32>, tensor<i32>) -> tensor<8xf32>
"""


def test_the_zeros_a_combined_all_reduce_is_padded_with_are_measured_apart():
    """DTensor pads a combined all-reduce's buffer to a multiple of 1024 elements: 1000 of these
    1024 floats are zeros, which the plan does not move; the all-reduce it did not combine has none."""
    from tofu_tf import executed
    from tofu_tf.cost.collectives import Collective, collective_cost
    from tofu_tf.cost.hardware import H100_NVLINK
    link = H100_NVLINK.intra_node
    ring = collective_cost(Collective.ALL_REDUCE, 1000 * 4, 8, link).bytes
    assert executed.combine_padding(_COMBINED, link) == pytest.approx(ring)
    lowered = executed.collectives(_COMBINED, executed.RUN_KINDS, link)
    assert lowered["all-reduce"][0] == 2
    figures = executed.ExecutedFigures({"all-reduce": (3, 32.0 * 2 * 7 / 8)}, lowered, 0,
                                       executed.combine_padding(_COMBINED, link))
    assert figures.lowered_payload_bytes == pytest.approx((8 + 16 + 8) * 4 * 2 * 7 / 8)
    assert executed.ExecutedFigures.from_dict(figures.to_dict()) == figures
    older = {key: value for key, value in figures.to_dict().items() if key != "lowered_padding"}
    assert executed.ExecutedFigures.from_dict(older).lowered_padding == 0.0     # measured before padding was read
    rows = {row[0]: row for row in executed.comparison_rows(figures, {"all-reduce": figures.lowered_payload_bytes}, 0)}
    assert rows["runs (lowered)"][2:] == (figures.lowered_payload_bytes, figures.lowered_payload_bytes, 0.0)
    assert rows["combine padding"][2] == pytest.approx(ring)


def test_measured_figures_that_do_not_read_are_named():
    data = _measured().to_dict()
    data["executed"]["lowered"] = {"all-reduce": [1]}
    with pytest.raises(PlanError, match="executed: lowered"):
        Plan.from_dict(data)
