"""The finisher: write outcomes to the database mirror, then ack or nack them.

Redis never forgets a job whose outcome the database could still lose: each
batch is committed to the mirror first (retried until it lands), and only
then acked or nacked in Redis. A job whose outcome reached the mirror is
never handed back to the queue: if its ack does not land, recover settles
it from the mirror (see scripts/recover.lua).

A job cancelled while it ran is acked like a success: ack.lua (and nack.lua,
should the outcome be a failure the worker did not know was cancelled)
finishes it as cancelled, and the mirror records it so (the ``mirror`` package).
"""

from __future__ import annotations

import logging
import queue as queue_module
import threading
import time
from collections import defaultdict
from dataclasses import dataclass

from django.db import DatabaseError, connections

from .. import mirror, retry, telemetry
from ..broker import REDIS_ERRORS, Applied, Broker, ClaimedJob
from ..faults import crash_point, raise_point
from ..logformat import printable
from ..mirror import AttemptRecord
from ..models import AttemptOutcome
from .backoff import Backoff
from .database import is_transient
from .shared import Shared

logger = logging.getLogger("reliable_jobs.worker")

#: Finished attempts written to the mirror per transaction at most.
FINISH_BATCH = 500
#: How long a start record waits for its attempt's outcome, in seconds. A job
#: that ends within it has its row written once, queued to finished, in the
#: outcome's batch; otherwise the start went alone, in a batch of its own,
#: while the task ran, and the row was written twice, each time a new row
#: version with an entry in every index (about 1,000 bytes of WAL per job for
#: a task doing one Redis call and one query). A longer job shows "running"
#: in the mirror this much later; Redis, which decides, knew at once.
START_HOLD_S = 0.05


class _Due:
    """What _next says when a held start is due and nothing else arrived."""


_DUE = _Due()


@dataclass(slots=True)
class FinishedAttempt:
    """A finished attempt on its way to the mirror and then to Redis.

    ``delay_ms`` is None for a success (ack), else the nack decision
    (:data:`retry.DEAD` to bury). A record with no Redis action (a start, a
    sweep result) has ``job`` None.
    """

    record: AttemptRecord
    job: ClaimedJob | None = None
    delay_ms: int | None = None
    #: The task's dotted path, for metrics ("?" when unknown).
    task: str = "?"
    #: A start record, held up to START_HOLD_S for its outcome to join it.
    start: bool = False
    #: The task raised Snooze: snooze.lua, after ``delay_ms``, instead of a nack.
    snoozed: bool = False


class Finisher:
    """A thread that mirrors outcomes in batches and then applies them in Redis."""

    def __init__(self, *, broker: Broker, database: str, shared: Shared) -> None:
        self.broker = broker
        self.database = database
        self.in_hand = shared.in_hand
        self.stats = shared.stats
        self.redis_outage = shared.redis_outage
        self.db_outage = shared.db_outage
        self.hard_stop = shared.hard_stop
        self.slot_freed = shared.slot_freed
        #: Outcomes and records, flush markers (wait_until_flushed) and None (close).
        self._queue: queue_module.SimpleQueue[FinishedAttempt | threading.Event | None] = \
            queue_module.SimpleQueue()
        #: Set when the thread's loop has ended (closed, or a hard stop).
        self._ended = threading.Event()

    # -- other threads -----------------------------------------------------

    def record(self, record: AttemptRecord) -> None:
        """Mirror a record that needs no Redis action (a sweep result)."""
        self.submit(FinishedAttempt(record))

    def started(self, record: AttemptRecord) -> None:
        """Mirror an attempt's start, with its outcome if that comes within START_HOLD_S."""
        self.submit(FinishedAttempt(record, start=True))

    def submit(self, outcome: FinishedAttempt) -> None:
        """Hand over a finished attempt (or a record, ``job`` None)."""
        self._queue.put(outcome)

    def close(self) -> None:
        """Finish what was submitted, then end the thread."""
        self._queue.put(None)

    def wait_until_flushed(self) -> None:
        """Block until every record and outcome submitted so far is mirrored and applied.

        A job on its second attempt or later may be one that crashed its
        worker. Before it runs again, what this worker already knows (the
        jobs it finished, what its sweep recovered) is made durable, so a
        poison job can neither make them run again nor erase their history.
        """
        # A marker behind everything submitted so far (the queue is FIFO): the
        # finisher sets it once the batch it ends up in is mirrored and applied.
        marker = threading.Event()
        self._queue.put(marker)
        while not marker.wait(timeout=0.5):
            if self.hard_stop.is_set() or self._ended.is_set():
                return

    # -- the thread ----------------------------------------------------------

    def run(self) -> None:
        try:
            self._loop()
        finally:
            self._ended.set()

    def _loop(self) -> None:
        closing = False
        #: Start records waiting for their outcome: (job id, generation, attempt)
        #: to (when the hold ends, the record).
        held: dict[tuple[str, int, int], tuple[float, FinishedAttempt]] = {}
        while not closing:
            batch: list[FinishedAttempt] = []
            markers: list[threading.Event] = []
            item = self._next(held)
            while True:
                if item is None:
                    closing = True
                    break
                if isinstance(item, FinishedAttempt):
                    key = _attempt_key(item)
                    if item.start:
                        held[key] = (time.monotonic() + START_HOLD_S, item)
                    else:
                        start = held.pop(key, None)
                        if start is not None:  # first: mirror.record merges the later into it
                            batch.append(start[1])
                        batch.append(item)
                        if len(batch) >= FINISH_BATCH:
                            break
                elif isinstance(item, threading.Event):
                    markers.append(item)
                try:
                    item = self._queue.get_nowait()
                except queue_module.Empty:
                    break
            # Starts whose hold is over go now; all of them when someone waits
            # for everything submitted (a marker) or the thread ends.
            now, everything = time.monotonic(), closing or bool(markers)
            for key, (due, _) in list(held.items()):
                if everything or due <= now:
                    batch.append(held.pop(key)[1])
            raise_point("finisher_bug")
            self.in_hand.writing(o.job for o in batch if o.job is not None)
            if batch and not self._write_mirror(batch):
                return
            self.in_hand.mirrored(o.job for o in batch if o.job is not None)
            if batch and not self._apply_in_redis([o for o in batch if o.job is not None]):
                return
            for marker in markers:
                marker.set()

    def _next(self, held: dict[tuple[str, int, int], tuple[float, FinishedAttempt]]
              ) -> FinishedAttempt | threading.Event | _Due | None:
        """The next item submitted, or _DUE once the earliest held start's hold is over."""
        if not held:
            return self._queue.get()
        wait = min(due for due, _ in held.values()) - time.monotonic()
        try:
            return self._queue.get(timeout=max(wait, 0.0)) if wait > 0 else self._queue.get_nowait()
        except queue_module.Empty:
            return _DUE

    def _write_mirror(self, batch: list[FinishedAttempt]) -> bool:
        """Write the batch, retrying until it lands (False only on a hard stop)."""
        backoff = Backoff()
        while True:
            try:
                mirror.record(self.database, [o.record for o in batch])
                self.db_outage.ok()
                return True
            except DatabaseError as exc:
                # A lost or refused connection, a lock or statement timeout, a
                # deadlock, a session the server ended: worth retrying. Any other
                # database error is a bug no retry fixes, and it propagates: the
                # worker stops and hands its jobs back.
                if not is_transient(exc):
                    raise
                self.db_outage.failed(exc, f"writing {len(batch)} outcome(s) to the mirror")
                connections[self.database].close()
            if backoff.wait(self.hard_stop):
                return False

    def _apply_in_redis(self, finished: list[FinishedAttempt]) -> bool:
        """Ack or nack each finished attempt; False on a hard stop before Redis answered."""
        if not finished:
            return True
        crash_point("before_ack")
        by_queue: dict[str, list[FinishedAttempt]] = defaultdict(list)
        for outcome in finished:
            assert outcome.job is not None
            if outcome.record.outcome == AttemptOutcome.CANCELLED:
                # The mirror settled it as cancelled (its row was cancelled
                # while it ran): finished in Redis too, never retried, even
                # when Redis lost the cancel's mark.
                outcome.delay_ms, outcome.snoozed = None, False
            by_queue[outcome.job.queue].append(outcome)
        for queue, outcomes in by_queue.items():
            acks = [o for o in outcomes if o.delay_ms is None]
            nacks = [o for o in outcomes if o.delay_ms is not None and not o.snoozed]
            snoozes = [o for o in outcomes if o.delay_ms is not None and o.snoozed]
            if not self._apply_queue(queue, acks, nacks, snoozes):
                return False
        crash_point("after_ack")
        self.in_hand.drop(o.job for o in finished if o.job is not None)
        self.slot_freed.set()
        return True

    def _apply_queue(self, queue: str, acks: list[FinishedAttempt],
                     nacks: list[FinishedAttempt], snoozes: list[FinishedAttempt]) -> bool:
        """Ack, nack and snooze one queue's outcomes; False on a hard stop before Redis answered.

        Retried whole after an error: the three scripts are fenced, so an outcome
        the first try applied before the connection dropped is refused by
        the second. After a retry a refusal is therefore no sign of a lost
        lease, and is not counted as one.
        """
        backoff = Backoff()
        retried = False
        while True:
            try:
                acked = self.broker.ack(queue, [_fence(o) for o in acks])
                nacked = self.broker.nack(queue, [
                    (*_fence(o), _delay(o), o.record.error[:4000]) for o in nacks])
                snoozed = self.broker.snooze(queue, [(*_fence(o), _delay(o)) for o in snoozes])
                break
            except REDIS_ERRORS as exc:
                self.redis_outage.failed(
                    exc, f"acking {len(acks) + len(nacks) + len(snoozes)} job(s)")
                retried = True
                if backoff.wait(self.hard_stop):
                    return False
        self.redis_outage.ok()
        self._count(acks + nacks + snoozes, acked + nacked + snoozed, retried=retried)
        return True

    def _count(self, outcomes: list[FinishedAttempt], applied: list[Applied], *,
               retried: bool) -> None:
        for outcome, ok in zip(outcomes, applied, strict=True):
            if ok == Applied.CANCELLED:
                self.stats.cancelled += 1
            elif not ok and not retried:
                self.stats.refused += 1
                telemetry.hook.refused(outcome.job.queue if outcome.job else "", outcome.task)
                logger.warning("Redis refused the outcome of job %s attempt %d: that attempt "
                               "is no longer held (lease expired).",
                               printable(outcome.record.job_id), outcome.record.attempt)
            elif outcome.delay_ms is None:
                self.stats.succeeded += 1
            elif outcome.snoozed:
                self.stats.snoozed += 1
            elif outcome.delay_ms == retry.DEAD:
                self.stats.dead += 1
            else:
                self.stats.failed += 1


def _attempt_key(outcome: FinishedAttempt) -> tuple[str, int, int]:
    record = outcome.record
    return record.job_id, record.gen, record.attempt


def _fence(outcome: FinishedAttempt) -> tuple[str, int, int]:
    assert outcome.job is not None
    return outcome.job.fence


def _delay(outcome: FinishedAttempt) -> int:
    assert outcome.delay_ms is not None
    return outcome.delay_ms
