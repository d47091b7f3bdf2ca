"""What a worker's threads share: the jobs in hand, what stops them, what is counted.

The main thread, the executors, the finisher, the lease keeper and the
maintenance thread each get this one object rather than a dozen arguments
and callbacks into the worker. Each role binds the fields it uses once, in
its constructor: the per-job path reads a plain attribute, as it did when
each was passed on its own.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from ..handoff import JobBuffer
from .backoff import Outage
from .pace import Pace
from .registry import InHand


@dataclass
class WorkerStats:
    succeeded: int = 0
    failed: int = 0
    dead: int = 0
    refused: int = 0
    #: Outcomes Redis finished as cancelled (the job was cancelled while it ran).
    cancelled: int = 0
    #: Attempts whose task raised Snooze (the job waits again, attempt given back).
    snoozed: int = 0


class Shared:
    """The state a worker's roles share; one per worker."""

    def __init__(self, worker_id: str = "w", *, queues: list[str] | None = None,
                 concurrency: int = 1, prefetch: int | None = None) -> None:
        self.worker_id = worker_id
        #: The shards of the queues served (just the queues when none is
        #: sharded), refreshed by every sweep so a change of SHARDS is picked
        #: up; the main loop claims from these.
        self.physical = list(queues or [])
        #: Executor threads.
        self.concurrency = concurrency
        #: Jobs claimed beyond those running: fixed, or None to follow the
        #: pace of the jobs (see pace.py).
        self.prefetch = prefetch
        # -- what is in hand
        #: Every job claimed and not yet acked, nacked or released.
        self.in_hand = InHand()
        #: Claimed jobs waiting for an executor thread.
        self.buffer = JobBuffer()
        # -- what stops
        #: The worker stops claiming; executors hand back what they have not begun.
        self.stopping = threading.Event()
        #: A second signal, or a thread died: hand back everything that may be, now.
        self.hard_stop = threading.Event()
        #: Wakes the main loop: room to claim, or a stop.
        self.slot_freed = threading.Event()
        # -- what is counted
        self.stats = WorkerStats()
        #: How long jobs take (how far ahead to claim).
        self.pace = Pace()
        self.redis_outage = Outage("Redis")
        self.db_outage = Outage("The database")

    def stop(self) -> None:
        """Stop claiming and wake the main loop to notice."""
        self.stopping.set()
        self.slot_freed.set()

    def ahead(self) -> int:
        """Jobs to claim beyond those running."""
        return self.pace.ahead(self.concurrency) if self.prefetch is None else self.prefetch

    def wants_room(self, waiting: int) -> bool:
        """Whether a job that just ran should wake the main loop to claim more.

        ``waiting``: jobs in hand not run yet (running ones included). Yes
        when a thread may go idle, or when at most half of the claim ahead is
        left; not after every job of a flood, which woke the main loop (an
        Event, a count of the room, a small claim) once per job.
        """
        if waiting < self.concurrency:
            return True
        ahead = self.pace.ahead(self.concurrency) if self.prefetch is None else self.prefetch
        return 2 * waiting <= self.concurrency + ahead
