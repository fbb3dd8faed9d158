"""What a long search is doing, in the log.

Most plans take a fraction of a second; a few take minutes (an LSTM unrolled over
its timesteps on 64 devices: dozens of meshes, each with axis problems too wide for
exact elimination that go to HiGHS). A user waiting on the first ``fit`` should see
which mesh and axis the planner is on and how far it has come, and a fast plan
should not fill the log: each solved axis problem is logged at INFO once the search
has run ``QUIET_SECONDS``, and at verbosity 1 (``--v=1``) before that, with an
estimate of the first pass's remaining time at the pace so far (a budget that
the first pass's plans miss adds a bisection, which no estimate foresees).
"""

from __future__ import annotations

import time
from typing import Callable

from absl import logging

QUIET_SECONDS = 5.0


class SearchProgress:
    """Counts solved axis problems against the first pass's total and logs each one."""

    def __init__(self, first_pass_problems: int, *, quiet_seconds: float | None = None,
                 clock: Callable[[], float] = time.perf_counter):
        self._clock = clock
        self._start = clock()
        self._quiet_seconds = QUIET_SECONDS if quiet_seconds is None else quiet_seconds
        self._first_pass = first_pass_problems
        self.solved = 0

    def axis_solved(self, mesh_text: str, axis: int, axes: int, size: int, decisions: int,
                    proved: bool, seconds: float) -> None:
        """Log one solved axis problem: where it sits in the search and how long it took."""
        self.solved += 1
        elapsed = self._clock() - self._start
        if self.solved < self._first_pass:
            # Axis problems take alike on average: the rest of the first pass at the pace so far.
            left = elapsed / self.solved * (self._first_pass - self.solved)
            count = f"{self.solved} of {self._first_pass} axis problems solved, about {left:.0f} s to go"
        elif self.solved == self._first_pass:
            count = f"{self.solved} of {self._first_pass} axis problems solved"
        else:
            count = f"{self.solved} axis problems solved (searching for a plan within the memory budget)"
        level = logging.INFO if elapsed >= self._quiet_seconds else 1
        logging.log(level, "tofu_tf planner: mesh %s axis %d of %d (size %d, %d decisions) %s in %.1f s; %s, "
                    "%.1f s so far", mesh_text, axis + 1, axes, size, decisions,
                    "solved to optimality" if proved else "solved, optimality not proved", seconds, count, elapsed)
