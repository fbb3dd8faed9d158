"""The order in which a pipeline's stages run their micro-batches, TensorFlow-free.

A training step of ``p`` stages and ``m`` micro-batches is ``2 p m`` actions: stage
``s`` runs the forward of micro-batch ``i`` (``F``), later its backward (``B``). A
schedule fixes each stage's own sequence of actions, which is what decides how many
micro-batches' activations a stage holds at once:

* GPipe (Huang et al., 2019): every forward, then every backward. Stage ``s``
  holds all ``m`` micro-batches before its first backward.
* 1F1B (PipeDream-Flush, Narayanan et al., 2021): stage ``s`` runs
  ``min(m, p - s)`` forwards to fill the pipeline, then alternates one backward and
  one forward, then drains its backwards. It holds at most ``min(m, p - s)``.

Those are the in-flight counts the stage model prices
(``stage_model.inflight_microbatches``). A single controller issues the actions of all
stages as one sequence (``issue_order``): it walks the stages in rounds, taking from
each the next action whose inputs exist (the forward of stage ``s - 1``, the backward
of stage ``s + 1``), which is the order the stages would run them in, one time slot
each, on devices of their own.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Sequence

from tofu_tf.pipeline.stage_model import Schedule, check_pipeline_shape


class Pass(enum.Enum):
    FORWARD = "F"
    BACKWARD = "B"


@dataclasses.dataclass(frozen=True)
class Action:
    """Stage ``stage`` runs ``pass_`` of micro-batch ``microbatch``."""

    stage: int
    pass_: Pass
    microbatch: int

    def __str__(self) -> str:
        return f"{self.pass_.value}{self.microbatch}@{self.stage}"


def stage_actions(stage: int, num_stages: int, num_microbatches: int,
                  schedule: "Schedule | str") -> tuple[Action, ...]:
    """Stage ``stage``'s own sequence of actions under ``schedule``.

    >>> [str(a) for a in stage_actions(2, 4, 4, "1f1b")]
    ['F0@2', 'F1@2', 'B0@2', 'F2@2', 'B1@2', 'F3@2', 'B2@2', 'B3@2']
    """
    schedule = Schedule.from_user(schedule)
    check_pipeline_shape(num_stages, num_microbatches)
    if not 0 <= stage < num_stages:
        raise ValueError(f"stage {stage} out of range for {num_stages} stages")
    forward = [Action(stage, Pass.FORWARD, i) for i in range(num_microbatches)]
    backward = [Action(stage, Pass.BACKWARD, i) for i in range(num_microbatches)]
    if schedule is Schedule.GPIPE:
        return tuple(forward + backward)
    warmup = min(num_microbatches, num_stages - stage)
    actions = forward[:warmup]
    for i in range(num_microbatches - warmup):
        actions += [backward[i], forward[warmup + i]]
    return tuple(actions + backward[num_microbatches - warmup:])


def issue_order(num_stages: int, num_microbatches: int, schedule: "Schedule | str") -> tuple[Action, ...]:
    """Every stage's actions merged into one sequence that respects their dependencies.

    >>> [str(a) for a in issue_order(2, 2, "gpipe")]
    ['F0@0', 'F1@0', 'F0@1', 'F1@1', 'B0@1', 'B0@0', 'B1@1', 'B1@0']
    """
    schedule = Schedule.from_user(schedule)
    check_pipeline_shape(num_stages, num_microbatches)
    queues = [list(stage_actions(s, num_stages, num_microbatches, schedule)) for s in range(num_stages)]
    done: set[Action] = set()
    order: list[Action] = []
    while any(queues):
        ready = [queue[0] for queue in queues if queue and _inputs_done(queue[0], num_stages, done)]
        if not ready:       # cannot happen for the schedules above; a guard against a bad one
            raise RuntimeError(f"pipeline schedule {schedule!r} deadlocks after {len(order)} actions")
        for action in ready:        # one time slot: every stage whose input exists runs an action
            queues[action.stage].pop(0)
        done.update(ready)
        order.extend(ready)
    return tuple(order)


def _inputs_done(action: Action, num_stages: int, done: set) -> bool:
    if action.pass_ is Pass.FORWARD:
        return action.stage == 0 or Action(action.stage - 1, Pass.FORWARD, action.microbatch) in done
    if action.stage == num_stages - 1:
        return Action(action.stage, Pass.FORWARD, action.microbatch) in done
    return Action(action.stage + 1, Pass.BACKWARD, action.microbatch) in done


def max_inflight(order: Sequence[Action], num_stages: int) -> tuple[int, ...]:
    """Per stage, the most micro-batches whose forward ran and whose backward has not,
    over ``order``: what a stage holds activations for at its peak.

    >>> max_inflight(issue_order(4, 8, "1f1b"), 4)
    (4, 3, 2, 1)
    """
    live = [0] * num_stages
    peak = [0] * num_stages
    for action in order:
        live[action.stage] += 1 if action.pass_ is Pass.FORWARD else -1
        peak[action.stage] = max(peak[action.stage], live[action.stage])
    return tuple(peak)
