"""How far ahead a worker claims: by the time its jobs take, not by a count.

A fixed prefetch is wrong both ways: 20 no-op jobs are gone in a
millisecond, so the worker spends its time asking Redis for more, while 20
jobs of two seconds are 40 s of work hoarded from idle workers (and a job
recovered after a crash waits behind them). So the worker claims ahead only
as much work as its threads finish within LOOKAHEAD_MS, from a moving
average of how long its jobs have taken.
"""

from __future__ import annotations

import threading

#: Work claimed ahead of the running jobs, per thread, in milliseconds.
LOOKAHEAD_MS = 50.0
#: Most jobs claimed ahead (and so per claim call), whatever the pace.
MAX_AHEAD = 500
#: Jobs claimed ahead before any job of this worker has been timed: none, so
#: a worker that meets long jobs first never hoards them (the first job's
#: time sets the pace a moment later).
FIRST_AHEAD = 0
#: Weight of the newest duration in the moving average.
SMOOTHING = 0.05


class Pace:
    """A moving average of job durations, shared by a worker's threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._average_ms: float | None = None

    def observe(self, duration_ms: float) -> None:
        with self._lock:
            if self._average_ms is None:
                self._average_ms = duration_ms
            else:
                self._average_ms += SMOOTHING * (duration_ms - self._average_ms)

    def average_ms(self) -> float | None:
        """The moving average of job durations, in ms; None before the first job."""
        return self._average_ms

    def ahead(self, threads: int) -> int:
        """How many jobs to claim beyond those running."""
        average = self._average_ms
        if average is None:
            return FIRST_AHEAD
        return max(0, min(MAX_AHEAD, int(threads * LOOKAHEAD_MS / max(average, 0.001))))
