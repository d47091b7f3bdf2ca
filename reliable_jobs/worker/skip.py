"""Which queues a claim round tries: skip those found empty until they may have work.

A worker configured with many queues but busy on one used to make one claim
call per empty queue per round: with 500 queues that cost most of the drain
rate. A queue whose last claim found nothing is now skipped until:

- its wake marker says it may have work: the blocking wait of an idle worker
  returns it (``BLPOP`` over the markers), and a busy worker, which never
  blocks, takes the markers of its skipped queues without blocking every
  ``poll_s`` (``Broker.woken``);
- or, as a safety net for a marker lost with a worker that took it and died
  before claiming, every ``full_s`` and after every idle wait that timed
  out, when every queue is tried again.

Every producer of work pushes the queue's marker when none is waiting
(enqueue, nack, release, promote, recover, claim leaving work behind: see
scripts/include/wake_marker.lua), so a job on a skipped queue starts within
about ``poll_s`` of its enqueue, however busy the worker is on the others.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

#: How often a busy worker asks for the wake markers of its skipped queues, in seconds.
WAKE_POLL_S = 0.05
#: How often every queue is tried again regardless of markers, in seconds.
FULL_RECHECK_S = 5.0


class QueueSkipper:
    """The queues to try in the next claim round, rotating so none is always first."""

    def __init__(self, *, poll_s: float = WAKE_POLL_S, full_s: float = FULL_RECHECK_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._poll_s = poll_s
        self._full_s = full_s
        self._clock = clock
        self._empty: set[str] = set()
        self._offset = 0
        self._poll_at = 0.0
        self._full_at = clock() + full_s
        #: Whether the last round tried every queue (none skipped).
        self.last_full = True

    def round(self, queues: Sequence[str],
              woken: Callable[[list[str]], list[str]]) -> list[str]:
        """The queues to try now, in turn; ``woken`` takes markers of skipped ones.

        One queue is never skipped: skipping it would only trade its claim
        call for the ``BLMOVE`` of an idle wait, with work on the queue (see
        ``Broker.wait``), which is the path for an idle worker only.
        """
        if len(queues) == 1:
            self.last_full = True
            return list(queues)
        if self._empty:
            now = self._clock()
            if now >= self._full_at:
                self.try_all()
            elif now >= self._poll_at:
                self._poll_at = now + self._poll_s
                skipped = [q for q in queues if q in self._empty]
                if skipped:
                    self._empty.difference_update(woken(skipped))
        active = [q for q in queues if q not in self._empty] if self._empty else list(queues)
        self.last_full = len(active) == len(queues)
        if not active:
            return active
        self._offset = (self._offset + 1) % len(active)
        return active[self._offset:] + active[:self._offset]

    def found(self, queue: str, work: bool) -> None:
        """Record what a claim on ``queue`` found: skip it while it has none."""
        if work:
            self._empty.discard(queue)
        else:
            self._empty.add(queue)

    def try_all(self) -> None:
        """Try every queue in the next round (a timed-out wait, the safety net, a burst end)."""
        self._empty.clear()
        self._full_at = self._clock() + self._full_s
