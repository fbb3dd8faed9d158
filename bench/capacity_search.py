"""What the capacity benchmarks share: a child process run under a resident-memory cap, and the
search for the widest size that fits (``bench/capacity.py`` on an MLP, ``bench/hub_capacity.py``
on keras-hub models).

"Fits" is decided by the caller from the child's run; the cap is enforced here, by sampling the
child's resident memory and killing it when it passes the cap (a process over it would otherwise
push the machine into swap, or be killed by the kernel with no word of why).
"""

from __future__ import annotations

import dataclasses
import subprocess
import time
from typing import Callable, Sequence

POLL_SECONDS = 0.05


@dataclasses.dataclass(frozen=True)
class CappedRun:
    """A child process's end: its peak resident memory as sampled, whether it was killed for
    passing the cap, its exit status and output."""
    peak_rss_bytes: int
    over_cap: bool
    returncode: int
    stdout: str
    stderr: str
    seconds: float


def resident_bytes(pid: int) -> int:
    """``pid``'s resident memory now (0 once it has ended)."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except FileNotFoundError:
        pass
    return 0


def run_capped(args: Sequence[str], cap_bytes: int, env: dict) -> CappedRun:
    """Run ``args``, killing the process when its resident memory passes ``cap_bytes``."""
    start = time.perf_counter()
    child = subprocess.Popen(list(args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    peak, over = 0, False
    while child.poll() is None:
        peak = max(peak, resident_bytes(child.pid))
        if peak > cap_bytes:
            child.kill()
            over = True
            break
        time.sleep(POLL_SECONDS)
    stdout, stderr = child.communicate()
    return CappedRun(peak, over, child.returncode, stdout, stderr, time.perf_counter() - start)


def largest_fit(attempt: Callable[[int], object], *, start_width: int, precision: float, step: int):
    """Doubling from ``start_width`` until a width fails, then bisection (widths multiples of
    ``step``) until the failure is within ``precision`` of the fit. ``attempt(width)`` returns a
    trial with ``fits`` and ``width``. Returns (largest fit or None, smallest failure, trials)."""
    trials = []

    def tried(width):
        trial = attempt(width)
        trials.append(trial)
        return trial

    fit, fail, width = None, None, start_width
    while fail is None:
        trial = tried(width)
        if trial.fits:
            fit, width = trial, width * 2
        else:
            fail = trial
    low = fit.width if fit else 0
    while fail.width > low * (1 + precision):
        middle = (low + fail.width) // 2 // step * step
        if middle <= low:
            break
        trial = tried(middle)
        if trial.fits:
            fit, low = trial, middle
        else:
            fail = trial
    return fit, fail, trials
