"""What the mirror writes, and the vocabulary its fencing rules are written in.

Shared by both write paths (``postgres`` and ``portable``): the attempt
record a worker or the sweep hands in, the rows of a bulk enqueue, the
state and outcome groups the rules name, and the cleaning every record
gets before either path sees it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from django.utils import timezone

from .. import payload
from ..exceptions import JobCancelled, LeaseExpired, class_path
from ..models import AttemptOutcome, JobState

#: States after which a job never runs again.
TERMINAL_STATES = (JobState.SUCCEEDED, JobState.DEAD)
#: States a job never leaves by itself; only these are pruned.
FINISHED_STATES = (JobState.SUCCEEDED, JobState.DEAD, JobState.CANCELLED)
#: Outcomes an attempt reaches by running its task to the end, or by being
#: cancelled: final for the attempt.
RAN_OUTCOMES = (AttemptOutcome.SUCCEEDED, AttemptOutcome.FAILED, AttemptOutcome.TIMED_OUT,
                AttemptOutcome.CANCELLED, AttemptOutcome.SNOOZED)
#: What a cancelled attempt's error starts with (TaskError imports the class).
CANCELLED_ERROR = f"{class_path(JobCancelled)}: the job was cancelled"

#: Outcomes that say only that the attempt's worker let go of the job: they
#: never overwrite an outcome the attempt itself recorded (RAN_OUTCOMES).
LOSS_OUTCOMES = (AttemptOutcome.LEASE_EXPIRED, AttemptOutcome.RELEASED)

#: The error of an earlier attempt still open when a later one is written: its
#: worker died before anything recorded how it ended (the sweep that saw its
#: lease expire may have died too). Both paths close it, so no attempt stays
#: "running".
ABANDONED_ERROR = (f"{class_path(LeaseExpired)}: the worker stopped before this attempt was "
                   "recorded as finished")

#: The largest attempt number the mirror's integer columns hold.
MAX_ATTEMPT = 2**31 - 1


@dataclass(slots=True)
class AttemptRecord:
    """What one attempt did, and the job state it leaves behind.

    A record with no ``outcome`` says the attempt started; a later record
    for the same attempt (or the same record, merged) says how it ended.
    """

    job_id: str
    attempt: int
    job_state: str
    worker_id: str = ""
    started_at: datetime | None = None
    finished_at: datetime | None = None
    outcome: str = ""
    error: str = ""
    traceback: str = ""
    return_value: Any = None
    extra: dict[str, Any] = field(default_factory=dict)
    #: The job's generation when this attempt was claimed (see Job.generation).
    gen: int = 0
    #: When a failed attempt's retry is due (about: Redis's clock decides), so a
    #: job rebuilt from its row while it waits does not run at once.
    retry_at: datetime | None = None
    #: A snoozed attempt only: the job's max_attempts once this attempt is
    #: given back (snooze.lua's, one more than the claim's), so a rebuild from
    #: the row keeps the budget Redis has.
    budget: int | None = None


#: One new job's own values, as an enqueue hands them in: its id (a canonical
#: UUID), its shard, its args and kwargs as JSON text (the payload's own,
#: checked by :func:`payload.check_call`: no NUL, no lone surrogate, no
#: control character left unescaped), its unique key (None for a task
#: without unique_for_ms) and its fair group ('' for none; fairness.GROUP_RE
#: otherwise, so no character COPY would have to escape).
NewRow = tuple[str, int, str, str, str | None, str]


def new_state(run_after: datetime | None, now: datetime) -> str:
    """The state a job enters Redis in as of ``now``: scheduled while ``run_after`` is later.

    One rule for a new job and a rebuilt one (enqueue.lua decides the same
    way, on Redis's clock, with the job's due time).
    """
    return JobState.SCHEDULED if run_after is not None and run_after > now else JobState.QUEUED


@dataclass(frozen=True, slots=True)
class NewJobs:
    """The rows of one enqueue: what every row shares, then what each row holds.

    Kept as text, not model instances: building a ``Job`` per row cost more
    Python than everything else in a bulk enqueue. A list of one row is a
    single enqueue; any other iterable is read once, as the rows are
    written, so a bulk enqueue can make its rows while the database takes
    the earlier ones.
    """

    backend: str
    queue: str
    task_path: str
    priority: int
    state: str
    max_attempts: int
    run_after: datetime | None
    enqueued_at: datetime
    rows: Iterable[NewRow]

    @classmethod
    def at(cls, now: datetime, *, backend: str, queue: str, task_path: str, priority: int,
           max_attempts: int, run_after: datetime | None, rows: Iterable[NewRow]) -> NewJobs:
        """The rows of an enqueue at ``now``, queued or scheduled (:func:`new_state`)."""
        return cls(backend=backend, queue=queue, task_path=task_path, priority=priority,
                   state=new_state(run_after, now), max_attempts=max_attempts,
                   run_after=run_after, enqueued_at=now, rows=rows)

    def shared(self) -> tuple[tuple[str, Any], ...]:
        """Every column the rows share, as (name, value) pairs: with NewRow, a new job's columns.

        The one list both paths write from (``postgres`` as SQL literals or
        COPY fields, ``portable`` as model fields); the clocks
        (``enqueued_at``, ``updated_at``) are each path's own. A new column
        of the jobs table is added here (and to the model) and nowhere else.
        """
        return (("backend", self.backend), ("queue", self.queue), ("task_path", self.task_path),
                ("priority", self.priority), ("state", self.state), ("attempts", 0),
                ("generation", 0), ("max_attempts", self.max_attempts),
                ("run_after", self.run_after), ("last_error", ""))


def expired_record(job_id: str, attempts: int, *, dead: bool, error: str,
                   gen: int = 0) -> AttemptRecord:
    """The record the sweep writes when a lease expired."""
    return AttemptRecord(
        job_id=job_id, attempt=attempts, gen=gen,
        job_state=JobState.DEAD if dead else JobState.QUEUED,
        finished_at=timezone.now(), outcome=AttemptOutcome.LEASE_EXPIRED, error=error,
    )


def snoozed_record(job_id: str, attempt: int, *, gen: int, delay_ms: int, max_attempts: int,
                   worker_id: str, started_at: datetime | None) -> AttemptRecord:
    """The record of an attempt whose task raised Snooze: the job waits again, the attempt
    given back (``max_attempts`` is the claim's; the record carries one more)."""
    finished_at = timezone.now()
    return AttemptRecord(
        job_id=job_id, attempt=attempt, gen=gen,
        job_state=JobState.SCHEDULED if delay_ms else JobState.QUEUED,
        worker_id=worker_id, started_at=started_at, finished_at=finished_at,
        outcome=AttemptOutcome.SNOOZED, error=f"snoozed for {delay_ms} ms",
        retry_at=finished_at + timedelta(milliseconds=delay_ms) if delay_ms else None,
        budget=min(max_attempts + 1, MAX_ATTEMPT),
    )


def cancelled_record(job_id: str, attempt: int, *, gen: int, error: str) -> AttemptRecord:
    """The record of an attempt that ended cancelled (worker or sweep)."""
    return AttemptRecord(job_id=job_id, attempt=attempt, gen=gen, job_state=JobState.CANCELLED,
                         finished_at=timezone.now(), outcome=AttemptOutcome.CANCELLED,
                         error=error)


def mark_cancelled_attempts(records: Iterable[AttemptRecord], cancelled: set[str]) -> None:
    """Record as cancelled, in place, the outcomes of attempts whose job was cancelled.

    The "cancel wins" rule, for both paths (each finds the cancelled rows
    among those it locked). Staff or code cancelled the job while the
    attempt ran (its row is 'cancelled', locked by the caller): whatever the
    attempt did after that is not the job's outcome, and the history says so
    instead of showing a success under a cancelled job. Records of the job's
    generation only reach the row (the writes are fenced by generation).
    """
    if not cancelled:
        return
    for rec in records:
        if rec.job_id in cancelled and rec.outcome in (
                AttemptOutcome.SUCCEEDED, AttemptOutcome.FAILED, AttemptOutcome.TIMED_OUT,
                AttemptOutcome.SNOOZED):
            ended = f"{rec.outcome}: {rec.error}" if rec.error else rec.outcome
            if not rec.error.startswith(CANCELLED_ERROR):
                rec.error = (f"{CANCELLED_ERROR} while it ran; the attempt then ended "
                             f"({ended}) and that result was discarded")
            rec.outcome = AttemptOutcome.CANCELLED
            rec.job_state = JobState.CANCELLED
            rec.return_value = None
            rec.retry_at = None
            rec.budget = None


def make_storable(rec: AttemptRecord) -> bool:
    """Make ``rec`` storable, in place; return False when no row can match it.

    One value the database refuses fails the whole batch, at every retry:
    an id that is not a UUID or a counter out of range (Redis holds what
    anyone wrote there), NUL or a lone surrogate in a task's message, NaN or
    infinity in its result (see payload.storable).
    """
    if not is_uuid(rec.job_id):
        return False  # enqueue writes canonical UUIDs: no row has this id
    if not 0 <= rec.attempt <= MAX_ATTEMPT:
        return False
    rec.worker_id = payload.storable_text(rec.worker_id)[:200]
    rec.error = payload.storable_text(rec.error)
    rec.traceback = payload.storable_text(rec.traceback)
    try:
        rec.return_value = payload.storable(rec.return_value)
    except RecursionError:  # nested deeper than any JSON encoder would follow
        rec.return_value = None
    return True


#: A UUID as enqueue writes it (``str(uuid.UUID(...))``: lower-case, hyphenated).
_CANONICAL_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def is_uuid(text: str) -> bool:
    """Whether ``text`` is a UUID spelled as enqueue writes one (canonical, lower case).

    The same test as ``str(uuid.UUID(text)) == text``, without building a
    UUID per record.
    """
    return isinstance(text, str) and _CANONICAL_UUID.fullmatch(text) is not None


#: Rows per query of the ORM path: SQLite refuses an expression (an OR of
#: conditions) nested more than 1,000 deep, and a sweep's batch has no bound.
CHUNK = 250


def chunks[T](items: Sequence[T], size: int = CHUNK) -> Iterator[Sequence[T]]:
    """``items`` in slices of at most ``size``."""
    for start in range(0, len(items), size):
        yield items[start:start + size]
