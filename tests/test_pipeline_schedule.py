"""The pipeline schedules' action order: every dependency respected, and each stage holds
the micro-batches the stage model prices (``inflight_microbatches``)."""

import pytest

from tofu_tf.pipeline import inflight_microbatches
from tofu_tf.pipeline.schedule import Action, Pass, issue_order, max_inflight, stage_actions

SHAPES = [(p, m) for p in range(1, 7) for m in range(1, 9)]


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize("num_stages,num_microbatches", SHAPES)
def test_the_order_runs_every_action_once_after_its_inputs(schedule, num_stages, num_microbatches):
    order = issue_order(num_stages, num_microbatches, schedule)
    assert len(order) == len(set(order)) == 2 * num_stages * num_microbatches
    position = {action: index for index, action in enumerate(order)}
    for action in order:
        s, i = action.stage, action.microbatch
        if action.pass_ is Pass.FORWARD and s > 0:
            assert position[Action(s - 1, Pass.FORWARD, i)] < position[action]
        if action.pass_ is Pass.BACKWARD:
            assert position[Action(s, Pass.FORWARD, i)] < position[action]
            if s < num_stages - 1:
                assert position[Action(s + 1, Pass.BACKWARD, i)] < position[action]
    for stage in range(num_stages):     # each stage keeps its own sequence
        assert [a for a in order if a.stage == stage] == list(stage_actions(stage, num_stages, num_microbatches,
                                                                              schedule))


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize("num_stages,num_microbatches", SHAPES)
def test_each_stage_holds_what_the_stage_model_prices(schedule, num_stages, num_microbatches):
    held = max_inflight(issue_order(num_stages, num_microbatches, schedule), num_stages)
    assert held == tuple(inflight_microbatches(r, num_stages, schedule, num_microbatches)
                         for r in range(num_stages))


def test_one_f_one_b_alternates_after_its_warm_up():
    actions = [str(a) for a in stage_actions(0, 2, 4, "1f1b")]
    assert actions == ["F0@0", "F1@0", "B0@0", "F2@0", "B1@0", "F3@0", "B2@0", "B3@0"]


def test_a_bad_shape_is_refused():
    with pytest.raises(ValueError, match="num_stages"):
        issue_order(0, 4, "1f1b")
    with pytest.raises(ValueError, match="schedule"):
        issue_order(2, 4, "zigzag")
