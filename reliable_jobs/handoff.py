"""The hand-off between a worker's threads: the job buffer and start marks.

The main thread claims batches into a :class:`JobBuffer`; executor threads
take jobs from it and, before running any, record in Redis that they start
(:class:`StartMarks`, see start.lua), a few at a time so that a crash charges
only jobs that were about to run.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict, deque
from typing import Any

from .broker import REDIS_ERRORS, Applied, ClaimedJob

#: How long a start mark stays good for, in seconds: a job marked in a group
#: that has waited longer (behind a slow job) is marked again before it runs,
#: so a pause or a lost lease since its mark is seen (start.lua) before it
#: begins, not a whole slow job later. No-op jobs run within it.
MARK_FRESH_S = 0.02


class JobBuffer:
    """Claimed jobs waiting for an executor; jobs already marked started go first.

    Marked jobs are shared by all executors (never hoarded by the thread
    that marked them), so an idle thread always finds work that exists.
    """

    def __init__(self, *, fresh_s: float = MARK_FRESH_S) -> None:
        self._cond = threading.Condition()
        self._fresh_s = fresh_s
        #: Jobs marked started, each with when (monotonic s) it was marked.
        self._marked: deque[tuple[ClaimedJob, float]] = deque()
        self._unmarked: deque[ClaimedJob] = deque()
        self._closed = False

    def put(self, jobs: list[ClaimedJob]) -> None:
        with self._cond:
            self._unmarked.extend(jobs)
            self._cond.notify(len(jobs))

    def put_marked(self, jobs: list[ClaimedJob]) -> None:
        """Hand back jobs marked started but not run yet: they are next in line."""
        now = time.monotonic()
        with self._cond:
            self._marked.extendleft((job, now) for job in reversed(jobs))
            self._cond.notify(len(jobs))

    def get(self) -> tuple[ClaimedJob, bool] | None:
        """Block for a job; return (job, marked), or None once closed and empty.

        ``marked`` is False for a job whose mark is older than ``fresh_s``:
        the caller marks it again (start.lua is idempotent for a held claim).
        """
        with self._cond:
            while True:
                if self._marked:
                    job, marked_at = self._marked.popleft()
                    return job, time.monotonic() - marked_at <= self._fresh_s
                if self._unmarked:
                    return self._unmarked.popleft(), False
                if self._closed:
                    return None
                self._cond.wait()

    def take_first_attempts(self, limit: int) -> list[ClaimedJob]:
        """Take up to ``limit`` waiting first attempts from the front, without blocking."""
        taken: list[ClaimedJob] = []
        with self._cond:
            while len(taken) < limit and self._unmarked and self._unmarked[0].attempt == 1:
                taken.append(self._unmarked.popleft())
        return taken

    def close(self) -> list[ClaimedJob]:
        """Stop handing out jobs; return every job still waiting (none has started)."""
        with self._cond:
            self._closed = True
            left = [*(job for job, _ in self._marked), *self._unmarked]
            self._marked.clear()
            self._unmarked.clear()
            self._cond.notify_all()
        return left


class StartMarks:
    """Group commit of start marks: one script call for every thread waiting.

    The first executor thread to arrive flushes the marks of all threads
    that queued up meanwhile (leader/follower), so marking costs one Redis
    round trip per group of starts, not per job.
    """

    def __init__(self, broker: Any) -> None:
        self._broker = broker
        self._cond = threading.Condition()
        self._pending: list[list[Any]] = []
        self._flushing = False

    def mark(self, jobs: list[ClaimedJob]) -> list[Applied]:
        """Mark ``jobs`` started; start.lua's reply for each (see Broker.start).
        Raises RedisError."""
        slots: list[list[Any]] = [[job, None] for job in jobs]  # [job, bool or error]
        with self._cond:
            self._pending += slots
            while any(slot[1] is None for slot in slots):
                if self._flushing:
                    self._cond.wait()
                    continue
                self._flushing = True
                batch, self._pending = self._pending, []
                self._cond.release()
                try:
                    self._flush(batch)
                finally:
                    self._cond.acquire()
                    self._flushing = False
                    self._cond.notify_all()
        results = [slot[1] for slot in slots]
        for result in results:
            if isinstance(result, BaseException):
                raise result
        return results  # Broker.start's replies, already Applied

    def _flush(self, batch: list[list[Any]]) -> None:
        by_queue: dict[str, list[list[Any]]] = defaultdict(list)
        for slot in batch:
            by_queue[slot[0].queue].append(slot)
        for queue, slots in by_queue.items():
            try:
                marked: list[Any] = self._broker.start(queue, [s[0].fence for s in slots])
            except REDIS_ERRORS as exc:
                marked = [exc] * len(slots)
            for slot, result in zip(slots, marked, strict=True):
                slot[1] = result
