"""Every database write about jobs: the mirror of what happens in Redis.

Writes are fenced by attempt number like the scripts: a row is moved only by
a record whose attempt is at least the row's, so a stale worker's late write
never overwrites a newer attempt. Worker writes arrive in batches (one
transaction per batch); a failed batch is retried by the caller, never
dropped, and the Redis ack waits for it (see worker.Finisher).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from django.db import connections, transaction
from django.db.models import Q
from django.db.models.functions import Coalesce, Greatest
from django.utils import timezone

from . import payload
from .keys import shard_queue
from .models import UNFINISHED_STATES, Attempt, AttemptOutcome, Job, JobState

#: States after which a job never runs again.
TERMINAL_STATES = (JobState.SUCCEEDED, JobState.DEAD)


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


def insert_job(using: str, job: Job) -> None:
    """Insert a new job row (inside the caller's transaction, if any)."""
    job.save(using=using, force_insert=True)


#: Columns COPY writes for a new job (the rest keep their defaults: NULL or 0).
_COPY_COLUMNS = ("id", "backend", "queue", "shard", "task_path", "args", "kwargs", "priority",
                 "state", "attempts", "max_attempts", "run_after", "enqueued_at", "updated_at",
                 "last_error")


def insert_jobs(using: str, jobs: Sequence[Job]) -> None:
    """Insert new job rows in bulk, inside the caller's transaction.

    On PostgreSQL with COPY: Django's bulk_create spends most of a bulk
    enqueue building and quoting parameters (docs/prototype-performance.md: COPY is the fastest
    way in); elsewhere with bulk_create.
    """
    connection = connections[using]
    if connection.vendor != "postgresql":
        Job.objects.using(using).bulk_create(jobs, batch_size=1000)
        return
    columns = ", ".join(_COPY_COLUMNS)
    with connection.cursor() as cursor, cursor.cursor.copy(
        f"COPY {Job._meta.db_table} ({columns}) FROM STDIN"
    ) as copy:
        for job in jobs:
            copy.write_row((
                job.id, job.backend, job.queue, job.shard, job.task_path,
                json.dumps(job.args), json.dumps(job.kwargs), job.priority, job.state,
                job.attempts, job.max_attempts, job.run_after, job.enqueued_at,
                job.updated_at, job.last_error,
            ))


def record(using: str, records: Iterable[AttemptRecord]) -> None:
    """Write a batch of attempt records in one transaction.

    Records for jobs that have no row (payloads pushed into Redis by hand)
    are skipped: there is no history to keep for them.
    """
    merged: dict[tuple[str, int], AttemptRecord] = {}
    for rec in records:
        key = (rec.job_id, rec.attempt)
        earlier = merged.get(key)
        if earlier is not None:
            if earlier.outcome and not rec.outcome:
                continue  # a start arriving after its own finish changes nothing
            rec.started_at = rec.started_at or earlier.started_at
            rec.worker_id = rec.worker_id or earlier.worker_id
        merged[key] = rec
    # Cleaned once per attempt, after the start and finish records merged.
    merged = {key: rec for key, rec in merged.items() if _make_storable(rec)}
    if not merged:
        return
    # A job's newest attempt decides its row (older ones only fill in history).
    newest: dict[str, AttemptRecord] = {}
    for rec in merged.values():
        if rec.job_id not in newest or rec.attempt > newest[rec.job_id].attempt:
            newest[rec.job_id] = rec
    if connections[using].vendor == "postgresql":
        with transaction.atomic(using=using), connections[using].cursor() as cursor:
            _pg_write_attempts(cursor, list(merged.values()))
            _pg_write_jobs(cursor, list(newest.values()))
            retried = [r for r in newest.values() if r.attempt > 1]
            if retried:
                cursor.execute(_PG_CLOSE_ABANDONED, [ABANDONED_ERROR,
                                                     _joined(r.job_id for r in retried),
                                                     _joined(r.attempt for r in retried)])
        return
    now = timezone.now()
    with transaction.atomic(using=using):
        jobs = Job.objects.using(using)
        known = {str(pk) for pk in jobs.filter(pk__in=set(newest)).values_list("pk", flat=True)}
        _write_attempts(using, [r for r in merged.values() if r.job_id in known])
        for rec in newest.values():
            if rec.job_id in known:
                jobs.filter(pk=rec.job_id, attempts__lte=rec.attempt).update(
                    **_job_changes(rec, now))
                Attempt.objects.using(using).filter(
                    job_id=rec.job_id, number__lt=rec.attempt, outcome=""
                ).update(outcome=AttemptOutcome.LEASE_EXPIRED, finished_at=now,
                         error=ABANDONED_ERROR)


#: The largest attempt number the mirror's integer columns hold.
MAX_ATTEMPT = 2**31 - 1


def _make_storable(rec: AttemptRecord) -> bool:
    """Make ``rec`` storable, in place; return False when no row can match it.

    One value the database refuses fails the whole batch, at every retry:
    an id that is not a UUID or a counter out of range (Redis holds what
    anyone wrote there), NUL or a lone surrogate in a task's message, NaN or
    infinity in its result (see payload.storable).
    """
    try:
        if str(uuid.UUID(rec.job_id)) != rec.job_id:
            return False  # enqueue writes canonical UUIDs: no row has this id
    except (TypeError, ValueError, AttributeError):
        return False
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


def _job_changes(rec: AttemptRecord, now: datetime) -> dict[str, Any]:
    changes: dict[str, Any] = {"state": rec.job_state, "attempts": rec.attempt, "updated_at": now}
    if rec.started_at:
        changes["started_at"] = Coalesce("started_at", rec.started_at)
    if rec.job_state in TERMINAL_STATES:
        changes["finished_at"] = rec.finished_at or now
    if rec.job_state == JobState.SUCCEEDED:
        changes["return_value"] = rec.return_value
    if rec.error:
        changes["last_error"] = rec.error
    return changes


# An attempt whose lease expired stays 'lease_expired' whatever arrives later:
# its worker lost the job (its ack was or will be refused), and a late result
# is noted in the error instead of rewriting history.
#
# PostgreSQL: one statement per table per batch (docs/prototype-performance.md: per-row
# statements cap the drain at a few hundred jobs/s); fencing is in the WHERE
# clause, as in the ORM path. Each column travels as ONE text value, joined
# with the unit separator (U+001F) and split by string_to_array() on the
# server: Django's client-side binding would otherwise quote every array
# element in Python, which cost more than the statements themselves.
_SEPARATOR = "\x1f"


def _column(kind: str, *, nullable: bool = False) -> str:
    """SQL for one joined column parameter: NULL for '' when ``nullable``.

    The text starts with a separator whose empty first element is sliced
    off: string_to_array('') is an empty array, not one empty string.
    """
    null = ", ''" if nullable else ""
    return f"(string_to_array(%s, chr(31){null}))[2:]::{kind}[]"


def _joined(values: Iterable[Any]) -> str:
    """Join a column's values; None becomes '' (NULL in nullable columns)."""
    return _SEPARATOR + _SEPARATOR.join(
        "" if v is None else v.isoformat() if isinstance(v, datetime)
        else str(v).replace(_SEPARATOR, " ") for v in values)
_PG_UPSERT_ATTEMPTS = f"""
INSERT INTO {Attempt._meta.db_table} AS a
    (job_id, number, worker_id, started_at, finished_at, outcome, error, traceback)
SELECT v.job_id, v.number, v.worker_id, v.started_at, v.finished_at, v.outcome, v.error,
       v.traceback
FROM unnest({_column("uuid")}, {_column("int")}, {_column("text")},
            {_column("timestamptz", nullable=True)}, {_column("timestamptz", nullable=True)},
            {_column("text")}, {_column("text")}, {_column("text")})
     AS v(job_id, number, worker_id, started_at, finished_at, outcome, error, traceback)
WHERE EXISTS (SELECT 1 FROM {Job._meta.db_table} j WHERE j.id = v.job_id)
ON CONFLICT (job_id, number) DO UPDATE SET
    worker_id = COALESCE(NULLIF(EXCLUDED.worker_id, ''), a.worker_id),
    started_at = COALESCE(a.started_at, EXCLUDED.started_at),
    finished_at = COALESCE(EXCLUDED.finished_at, a.finished_at),
    outcome = CASE WHEN 'lease_expired' IN (a.outcome, EXCLUDED.outcome) THEN 'lease_expired'
                   ELSE COALESCE(NULLIF(EXCLUDED.outcome, ''), a.outcome) END,
    error = CASE WHEN a.outcome = 'lease_expired' AND EXCLUDED.outcome NOT IN ('', a.outcome)
                 THEN a.error || '; the worker then finished this attempt late ('
                      || EXCLUDED.outcome || ') and its result was discarded'
                 ELSE COALESCE(NULLIF(EXCLUDED.error, ''), a.error) END,
    traceback = COALESCE(NULLIF(EXCLUDED.traceback, ''), a.traceback)
"""

_PG_UPDATE_JOBS = f"""
UPDATE {Job._meta.db_table} AS j SET
    state = v.state,
    attempts = v.attempt,
    started_at = COALESCE(j.started_at, v.started_at),
    finished_at = CASE WHEN v.state IN ('succeeded', 'dead')
                       THEN COALESCE(v.finished_at, now()) ELSE j.finished_at END,
    return_value = CASE WHEN v.state = 'succeeded' THEN v.return_value::jsonb
                        ELSE j.return_value END,
    last_error = COALESCE(NULLIF(v.error, ''), j.last_error),
    updated_at = now()
FROM unnest({_column("uuid")}, {_column("int")}, {_column("text")},
            {_column("timestamptz", nullable=True)}, {_column("timestamptz", nullable=True)},
            {_column("text", nullable=True)}, {_column("text")})
     AS v(id, attempt, state, started_at, finished_at, return_value, error)
WHERE j.id = v.id AND j.attempts <= v.attempt
"""


# An earlier attempt still open when a later one is written was abandoned: its
# worker died before anything recorded how it ended (the sweep that saw its
# lease expire may have died too). Close it, so no attempt stays "running".
ABANDONED_ERROR = ("reliable_jobs.exceptions.LeaseExpired: the worker stopped before this "
                   "attempt was recorded as finished")
_PG_CLOSE_ABANDONED = f"""
UPDATE {Attempt._meta.db_table} AS a
SET outcome = 'lease_expired', finished_at = now(), error = %s
FROM unnest({_column("uuid")}, {_column("int")}) AS v(job_id, attempt)
WHERE a.job_id = v.job_id AND a.number < v.attempt AND a.outcome = ''
"""


def _pg_write_attempts(cursor: Any, rows: list[AttemptRecord]) -> None:
    cursor.execute(_PG_UPSERT_ATTEMPTS, [
        _joined(r.job_id for r in rows), _joined(r.attempt for r in rows),
        _joined(r.worker_id for r in rows), _joined(r.started_at for r in rows),
        _joined(r.finished_at for r in rows), _joined(r.outcome for r in rows),
        _joined(r.error for r in rows), _joined(r.traceback for r in rows),
    ])


def _pg_write_jobs(cursor: Any, rows: list[AttemptRecord]) -> None:
    cursor.execute(_PG_UPDATE_JOBS, [
        _joined(r.job_id for r in rows), _joined(r.attempt for r in rows),
        _joined(r.job_state for r in rows), _joined(r.started_at for r in rows),
        _joined(r.finished_at for r in rows),
        # JSON text never holds a raw U+001F (json.dumps escapes control characters).
        _joined(None if r.return_value is None else json.dumps(r.return_value) for r in rows),
        _joined(r.error for r in rows),
    ])


def _write_attempts(using: str, rows: Sequence[AttemptRecord]) -> None:
    """Upsert one Attempt row per record, keeping what an earlier write knew."""
    attempts = Attempt.objects.using(using)
    existing = {
        (str(a.job_id), a.number): a
        for a in attempts.filter(
            _any_of((r.job_id, r.attempt) for r in rows)
        )
    } if rows else {}
    new: list[Attempt] = []
    for rec in rows:
        row = existing.get((rec.job_id, rec.attempt))
        if row is None:
            new.append(Attempt(job_id=rec.job_id, number=rec.attempt, worker_id=rec.worker_id,
                               started_at=rec.started_at, finished_at=rec.finished_at,
                               outcome=rec.outcome, error=rec.error, traceback=rec.traceback))
            continue
        if row.outcome and not rec.outcome:
            continue
        row.worker_id = rec.worker_id or row.worker_id
        row.started_at = row.started_at or rec.started_at
        row.finished_at = rec.finished_at or row.finished_at
        if row.outcome == AttemptOutcome.LEASE_EXPIRED and rec.outcome != row.outcome:
            row.error += (f"; the worker then finished this attempt late ({rec.outcome}) and "
                          "its result was discarded")
        else:
            row.outcome, row.error = rec.outcome or row.outcome, rec.error or row.error
        row.traceback = rec.traceback or row.traceback
        row.save(using=using, update_fields=["worker_id", "started_at", "finished_at",
                                             "outcome", "error", "traceback"])
    if new:
        attempts.bulk_create(new, ignore_conflicts=True)


def _any_of(pairs: Iterable[tuple[str, int]]) -> Q:
    query = Q(pk__in=[])
    for job_id, number in pairs:
        query |= Q(job_id=job_id, number=number)
    return query


def expired_record(job_id: str, attempts: int, *, dead: bool, error: str) -> AttemptRecord:
    """The record the sweep writes when a lease expired."""
    return AttemptRecord(
        job_id=job_id, attempt=attempts,
        job_state=JobState.DEAD if dead else JobState.QUEUED,
        finished_at=timezone.now(), outcome=AttemptOutcome.LEASE_EXPIRED, error=error,
    )


# -- reconcile ----------------------------------------------------------


def reconcile_candidates(
    using: str, *, backend: str, older_than: datetime, after_id: str | None, limit: int
) -> list[Job]:
    """Unfinished jobs untouched since ``older_than``, in id order after ``after_id``."""
    rows = Job.objects.using(using).filter(
        backend=backend, state__in=UNFINISHED_STATES, updated_at__lt=older_than
    )
    if after_id is not None:
        rows = rows.filter(pk__gt=after_id)
    return list(rows.order_by("pk")[:limit])


def still_unfinished(using: str, job_ids: Sequence[Any], *, older_than: datetime) -> list[Job]:
    """Of ``job_ids``, the rows still unfinished and untouched since ``older_than``."""
    if not job_ids:
        return []
    return list(Job.objects.using(using).filter(
        pk__in=job_ids, state__in=UNFINISHED_STATES, updated_at__lt=older_than))


def touch(using: str, job_ids: Sequence[Any], *, state: str | None = None) -> None:
    """Restart the grace period of unfinished jobs reconcile just pushed again."""
    changes: dict[str, Any] = {"updated_at": timezone.now()}
    if state:
        changes["state"] = state
    Job.objects.using(using).filter(pk__in=job_ids, state__in=UNFINISHED_STATES).update(
        **changes)


def raise_budgets(using: str, budgets: dict[str, int]) -> None:
    """Mirror refunds: a claim that never started gave its job one more attempt."""
    jobs = Job.objects.using(using)
    with transaction.atomic(using=using):
        for job_id, max_attempts in budgets.items():
            jobs.filter(pk=job_id).update(max_attempts=Greatest("max_attempts", max_attempts))


def bury(using: str, job_id: str, *, attempts: int, error: str) -> None:
    """Mirror a death Redis already recorded (for example by recover)."""
    now = timezone.now()
    Job.objects.using(using).filter(pk=job_id, state__in=UNFINISHED_STATES).update(
        state=JobState.DEAD, attempts=Greatest("attempts", attempts), last_error=error,
        finished_at=now, updated_at=now,
    )


# -- the admin: staff actions and retention ------------------------------
# Added for the admin issue (staff.py, retention.py); nothing above changed.
# A staff action locks the job's row, acts in Redis, then writes the row in
# the same transaction: a worker's write about the attempt the action lets
# run waits for that commit, so it lands after the action's, never under it.

#: States a job never leaves by itself; only these are pruned.
FINISHED_STATES = (JobState.SUCCEEDED, JobState.DEAD, JobState.CANCELLED)


def lock_job(using: str, job_id: Any) -> Job | None:
    """Lock one job's row until the caller's transaction ends (None if it is gone)."""
    return Job.objects.using(using).select_for_update().filter(pk=job_id).first()


def mark_queued_again(using: str, job_id: Any, *, max_attempts: int,
                      clear_run_after: bool = False) -> None:
    """Mirror a staff retry or requeue: queued again, with ``max_attempts`` as budget.

    ``clear_run_after`` drops a future run_after the job no longer waits
    for, so a reconcile rebuild cannot schedule it for later again.
    """
    changes: dict[str, Any] = {"state": JobState.QUEUED, "max_attempts": max_attempts,
                               "finished_at": None, "updated_at": timezone.now()}
    if clear_run_after:
        changes["run_after"] = None
    Job.objects.using(using).filter(pk=job_id).update(**changes)


def mark_cancelled(using: str, job_id: Any) -> None:
    """Mirror a cancel Redis already applied (the job was taken off its list)."""
    now = timezone.now()
    Job.objects.using(using).filter(pk=job_id).update(
        state=JobState.CANCELLED, finished_at=now, updated_at=now)


def lock_prunable(using: str, *, backend: str, state: str, unchanged_since: datetime,
                  limit: int) -> list[tuple[Any, str]]:
    """Lock up to ``limit`` finished ``state`` jobs unchanged since the cutoff.

    Returns (id, physical queue) pairs.

    One state per query, oldest first, so the walk is a range scan of the
    (state, updated_at) index however many rows there are. A finished row's
    ``updated_at`` is its finish (or a later staff action), never earlier.
    Rows a staff action holds are skipped (SKIP LOCKED), not waited for: the
    action may make the job unfinished again, and the next run prunes the
    rest.
    """
    if state not in FINISHED_STATES:
        raise ValueError(f"Only finished jobs are pruned, not {state!r} ones.")
    rows = (Job.objects.using(using).select_for_update(skip_locked=True)
            .filter(backend=backend, state=state, updated_at__lt=unchanged_since)
            .order_by("updated_at")
            .values_list("pk", "queue", "shard")[:limit])
    return [(pk, shard_queue(queue, shard)) for pk, queue, shard in rows]


def delete_jobs(using: str, job_ids: Sequence[Any]) -> tuple[int, int]:
    """Delete jobs and their attempts; returns (jobs, attempts) deleted.

    Two plain DELETEs: ``QuerySet.delete()`` on jobs would first load every
    row (JSON arguments included) to collect the cascade, which doubled the
    time of a million-row prune.
    """
    attempts, _ = Attempt.objects.using(using).filter(job_id__in=job_ids).delete()
    if not job_ids:
        return 0, attempts
    connection = connections[using]
    quote, pk = connection.ops.quote_name, Job._meta.pk
    placeholders = ", ".join(["%s"] * len(job_ids))
    with connection.cursor() as cursor:
        cursor.execute(f"DELETE FROM {quote(Job._meta.db_table)} WHERE {quote(str(pk.column))} "
                       f"IN ({placeholders})",
                       [pk.get_db_prep_value(job_id, connection) for job_id in job_ids])
        return cursor.rowcount, attempts
