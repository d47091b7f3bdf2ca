"""Every database write about jobs: the mirror of what happens in Redis.

Writes are fenced like the scripts, by generation and attempt number: a row
is moved only by a record of the row's generation whose attempt is at least
the row's, so a stale worker's late write (an older attempt, or any attempt
from before the job was rebuilt) never overwrites a newer one. Outcomes are
final:

- an attempt's own outcome (succeeded, failed, timed out) is never
  overwritten by a record that its lease expired or it was released;
- a job that ended (succeeded or dead) is moved only by a later attempt that
  succeeded (Redis ran it again after a lease expiry), never back to
  queued, scheduled or running, and never from succeeded to dead;
- an attempt recorded as lease_expired (its worker lost the job) does not
  move the job when its late result arrives: the history keeps the result
  in the attempt's error, the job follows the attempt that holds it now;
- no worker record moves a cancelled job, and an attempt that ends after
  its job was cancelled (staff or code cancelled it while it ran) is
  recorded as cancelled, whatever it returned or raised: the job ends
  either succeeded (its outcome reached the mirror first, and the cancel
  is refused) or cancelled, never both.

A unique job's key (``Job.unique_key``) counts only while the row is
unfinished (the partial index rj_job_unique_key), so every write here that
ends a job frees its key with the same UPDATE, at no extra cost; the one
write that makes a finished job unfinished again (:func:`mark_queued_again`)
clears the key first, and :func:`insert_unique_jobs` is the only reader.

Worker writes arrive in batches (one transaction per batch); a failed batch
is retried by the caller, never dropped, and the Redis ack waits for it.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from functools import lru_cache
from typing import Any

from django.db import IntegrityError, connections, transaction
from django.db.models import Max, Q
from django.db.models.functions import Coalesce, Greatest
from django.utils import timezone

from . import payload
from .exceptions import JobCancelled, LeaseExpired, class_path
from .faults import stop_point
from .keys import shard_queue
from .models import UNFINISHED_STATES, Attempt, AttemptOutcome, Job, JobState

#: States after which a job never runs again.
TERMINAL_STATES = (JobState.SUCCEEDED, JobState.DEAD)
#: Outcomes an attempt reaches by running its task to the end, or by being
#: cancelled: final for the attempt.
RAN_OUTCOMES = (AttemptOutcome.SUCCEEDED, AttemptOutcome.FAILED, AttemptOutcome.TIMED_OUT,
                AttemptOutcome.CANCELLED)
#: What a cancelled attempt's error starts with (TaskError imports the class).
CANCELLED_ERROR = f"{class_path(JobCancelled)}: the job was cancelled"

#: Outcomes that say only that the attempt's worker let go of the job: they
#: never overwrite an outcome the attempt itself recorded (RAN_OUTCOMES).
LOSS_OUTCOMES = (AttemptOutcome.LEASE_EXPIRED, AttemptOutcome.RELEASED)


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


def insert_job(using: str, job: Job) -> None:
    """Insert a new job row (inside the caller's transaction, if any).

    On PostgreSQL with one prepared-once INSERT: building the statement with
    ``Model.save()`` cost about as much Python as the round trip itself.
    """
    connection = connections[using]
    if connection.vendor != "postgresql":
        job.save(using=using, force_insert=True)
        return
    with connection.cursor() as cursor:
        cursor.execute(_PG_INSERT_JOB, _row_values(job))


#: Columns the single INSERT writes for a new job (the rest keep their defaults: NULL or 0).
_COPY_COLUMNS = ("id", "backend", "queue", "shard", "task_path", "args", "kwargs", "priority",
                 "state", "attempts", "generation", "max_attempts", "run_after", "enqueued_at",
                 "updated_at", "last_error")


_PG_INSERT_JOB = (f"INSERT INTO {Job._meta.db_table} ({', '.join(_COPY_COLUMNS)}) "
                  f"VALUES ({', '.join(['%s'] * len(_COPY_COLUMNS))})")


def _row_values(job: Job) -> tuple[Any, ...]:
    """A new job's values in _COPY_COLUMNS order (JSON columns as JSON text)."""
    return (job.id, job.backend, job.queue, job.shard, job.task_path,
            json.dumps(job.args), json.dumps(job.kwargs), job.priority, job.state,
            job.attempts, job.generation, job.max_attempts, job.run_after, job.enqueued_at,
            job.updated_at, job.last_error)


@dataclass(frozen=True, slots=True)
class NewJobs:
    """The rows of one bulk enqueue: what every row shares, then what each row holds.

    Kept as text, not model instances: building a ``Job`` per row cost more
    Python than everything else in a bulk enqueue. ``rows`` holds (id, shard,
    args JSON, kwargs JSON) per job; the JSON texts are the payload's own
    (checked by :func:`payload.check_call`: no NUL, no lone surrogate, no
    control character left unescaped).
    """

    backend: str
    queue: str
    task_path: str
    priority: int
    state: str
    max_attempts: int
    run_after: datetime | None
    enqueued_at: datetime
    rows: list[tuple[str, int, str, str]]


#: COPY's column order for NewJobs: a row's own values first, then the shared ones.
_NEW_JOB_COLUMNS = ("id", "shard", "args", "kwargs", "backend", "queue", "task_path",
                    "priority", "state", "attempts", "generation", "max_attempts", "run_after",
                    "enqueued_at", "updated_at", "last_error")


#: A backslash, and how COPY's text format spells one.
BACKSLASH, ESCAPED = "\\", "\\\\"


def _copy_text(value: object) -> str:
    """``value`` as a field of COPY's text format (None is NULL)."""
    if value is None:
        return "\\N"
    text = value.isoformat() if isinstance(value, datetime) else str(value)
    return (text.replace("\\", "\\\\").replace("\t", "\\t").replace("\n", "\\n")
            .replace("\r", "\\r"))


def insert_new_jobs(using: str, new: NewJobs) -> None:
    """Insert the rows of one bulk enqueue, inside the caller's transaction.

    On PostgreSQL with one COPY in its text format, the lines written by
    hand: the shared columns are formatted once, and per row only the id,
    the shard and two JSON texts are joined (psycopg's ``write_row`` spent
    more per row formatting each value; COPY is the fastest way in, see
    docs/prototype-performance.md). The JSON texts hold no tab, newline or
    carriage return (the encoder escapes control characters), so a backslash
    is the one character to escape. Elsewhere with ``bulk_create``.
    """
    connection = connections[using]
    if connection.vendor != "postgresql":
        Job.objects.using(using).bulk_create([
            Job(id=uuid.UUID(job_id), backend=new.backend, queue=new.queue, shard=shard,
                task_path=new.task_path, args=json.loads(args), kwargs=json.loads(kwargs),
                priority=new.priority, state=new.state, max_attempts=new.max_attempts,
                run_after=new.run_after, enqueued_at=new.enqueued_at,
                updated_at=new.enqueued_at)
            for job_id, shard, args, kwargs in new.rows
        ], batch_size=1000)
        return
    shared = "\t".join(_copy_text(value) for value in (
        new.backend, new.queue, new.task_path, new.priority, new.state, 0, 0,
        new.max_attempts, new.run_after, new.enqueued_at, new.enqueued_at, ""))
    with connection.cursor() as cursor, cursor.cursor.copy(
        f"COPY {Job._meta.db_table} ({', '.join(_NEW_JOB_COLUMNS)}) FROM STDIN"
    ) as copy:
        rows = new.rows
        for start in range(0, len(rows), 1000):
            copy.write("".join([
                f"{job_id}\t{shard}\t{args.replace(BACKSLASH, ESCAPED)}\t"
                f"{kwargs.replace(BACKSLASH, ESCAPED)}\t{shared}\n"
                for job_id, shard, args, kwargs in rows[start:start + 1000]
            ]))


#: Rounds of insert, look-up and release insert_unique_jobs makes before it
#: gives up: each round ends with every job inserted or its key's holder
#: found, unless a holder finished or went stale in between; two suffice
#: unless the rows keep changing under it.
_UNIQUE_ROUNDS = 5
_UNIQUE_COLUMNS = (*_COPY_COLUMNS, "unique_key")
#: Rows per INSERT of insert_unique_jobs on PostgreSQL (17 parameters each).
_UNIQUE_BATCH = 500


def insert_unique_jobs(using: str, jobs: Sequence[Job], *, window_ms: int,
                       while_running: bool, now: datetime) -> list[Job]:
    """Insert each job unless an unfinished job holds its ``unique_key``.

    Returns, per job in order, the job that holds its key: the job itself
    when it was inserted, the earlier job otherwise (an earlier one of
    ``jobs`` with the same key counts too). Runs in the caller's
    transaction, if any (each statement commits by itself otherwise): the
    rj_job_unique_key index is the judge, so of two transactions inserting
    one key the second waits for the first, and takes the key itself if the
    first rolls back.

    A holder counts while it is queued or scheduled (running too with
    ``while_running``) and its window lasts: ``window_ms`` from its enqueue,
    or from its run_after when that is later. One that no longer counts
    gives its key up here (the row keeps its state; the caller's
    transaction holds its lock until it ends), and the job is inserted in
    its place.
    """
    firsts: dict[str, Job] = {}
    for job in jobs:
        if not job.unique_key:
            raise ValueError(f"Job {job.pk} has no unique_key.")
        firsts.setdefault(job.unique_key, job)
    holders: dict[str, Job] = {}
    pending = list(firsts.values())
    window = timedelta(milliseconds=window_ms)
    for _ in range(_UNIQUE_ROUNDS):
        inserted = _insert_ignoring_conflicts(using, pending)
        holders.update((str(job.unique_key), job) for job in pending if job.pk in inserted)
        taken = [job for job in pending if job.pk not in inserted]
        if not taken:
            break
        found = _key_holders(using, [str(job.unique_key) for job in taken])
        pending, stale = [], []
        for job in taken:
            row = found.get(str(job.unique_key))
            if row is not None and _holds_key(row, window, while_running, now):
                holders[str(job.unique_key)] = row
                continue
            if row is not None:
                stale.append(row.pk)
            pending.append(job)  # the holder finished in between, or is stale: try again
        _release_keys(using, stale)
        if not pending:
            break
    else:
        raise RuntimeError(
            f"Could not settle the unique keys of {len(pending)} job(s) in {_UNIQUE_ROUNDS} "
            "rounds: their holders kept changing. Enqueue them again.")
    return [holders[str(job.unique_key)] for job in jobs]


#: The unfinished jobs holding some keys: a ready-made statement, as the plain
#: INSERT is (the ORM built it each time, most of a duplicate enqueue's cost).
_PG_KEY_HOLDERS = (f"SELECT * FROM {Job._meta.db_table} WHERE unique_key = ANY(%s) AND state IN ("
                   + ", ".join(f"'{state}'" for state in UNFINISHED_STATES) + ")")


def _key_holders(using: str, keys: Sequence[str]) -> dict[str, Job]:
    """The unfinished job holding each of ``keys`` (those held), by key.

    A new statement: under READ COMMITTED it sees the holder whose commit
    the INSERT waited for (an INSERT ... RETURNING could not).
    """
    if connections[using].vendor == "postgresql":
        rows: Iterable[Job] = Job.objects.using(using).raw(_PG_KEY_HOLDERS, [list(keys)])
    else:
        rows = (row for chunk in _chunks(keys) for row in Job.objects.using(using).filter(
            unique_key__in=chunk, state__in=UNFINISHED_STATES).order_by())
    return {str(row.unique_key): row for row in rows}


def _holds_key(row: Job, window: timedelta, while_running: bool, now: datetime) -> bool:
    """Whether an unfinished job still holds its unique key for an equal call."""
    if row.state == JobState.RUNNING and not while_running:
        return False
    start = max(row.enqueued_at, row.run_after) if row.run_after else row.enqueued_at
    return start + window > now


def _insert_ignoring_conflicts(using: str, jobs: Sequence[Job]) -> set[uuid.UUID]:
    """Insert those of ``jobs`` whose unique key is free; return the ids inserted.

    PostgreSQL: INSERT ... ON CONFLICT DO NOTHING RETURNING id. Elsewhere:
    one savepoint per row, a unique violation rolled back to it, which works
    on every database Django supports.
    """
    inserted: set[uuid.UUID] = set()
    connection = connections[using]
    if connection.vendor != "postgresql":
        for job in jobs:
            try:
                with transaction.atomic(using=using):
                    job.save(using=using, force_insert=True)
            except IntegrityError:
                continue
            inserted.add(job.pk)
        return inserted
    with connection.cursor() as cursor:
        for chunk in _chunks(jobs, _UNIQUE_BATCH):
            cursor.execute(_pg_insert_unique(len(chunk)), [
                value for job in chunk for value in (*_row_values(job), job.unique_key)])
            inserted.update(pk for (pk,) in cursor.fetchall())
    return inserted


@lru_cache(maxsize=8)
def _pg_insert_unique(rows: int) -> str:
    """INSERT of ``rows`` new jobs with their keys, skipping those whose key is taken."""
    row = "(" + ", ".join(["%s"] * len(_UNIQUE_COLUMNS)) + ")"
    return (f"INSERT INTO {Job._meta.db_table} ({', '.join(_UNIQUE_COLUMNS)}) "
            f"VALUES {', '.join([row] * rows)} ON CONFLICT DO NOTHING RETURNING id")


def _release_keys(using: str, job_ids: Sequence[Any]) -> None:
    """Take the unique key off unfinished jobs whose key no longer counts.

    Rows locked first, in id order, as every other mirror writer locks them.
    """
    if not job_ids:
        return
    rows = Job.objects.using(using).filter(pk__in=job_ids, state__in=UNFINISHED_STATES)
    with transaction.atomic(using=using, savepoint=False):
        locked = list(rows.select_for_update(no_key=True).order_by("pk")
                      .values_list("pk", flat=True))
        Job.objects.using(using).filter(pk__in=locked).update(unique_key=None)


def record(using: str, records: Iterable[AttemptRecord]) -> None:
    """Write a batch of attempt records in one transaction.

    Records for jobs that have no row (payloads pushed into Redis by hand)
    are skipped: there is no history to keep for them.
    """
    merged: dict[tuple[str, int, int], AttemptRecord] = {}
    for rec in records:
        key = (rec.job_id, rec.gen, rec.attempt)
        earlier = merged.get(key)
        if earlier is not None:
            if (earlier.outcome and not rec.outcome) or (
                    earlier.outcome in RAN_OUTCOMES and rec.outcome in LOSS_OUTCOMES):
                continue  # a start after its finish, or a loss after a result, changes nothing
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
        if rec.job_id not in newest or (rec.gen, rec.attempt) > (newest[rec.job_id].gen,
                                                                 newest[rec.job_id].attempt):
            newest[rec.job_id] = rec
    if connections[using].vendor == "postgresql":
        with transaction.atomic(using=using), connections[using].cursor() as cursor:
            # Rows first, in id order, as every other writer locks them: a
            # sweep expiring one of these attempts holds its row, and an
            # attempt INSERT that reserved its key before waiting for that row
            # would deadlock with the sweep's own record of the attempt.
            cursor.execute(_PG_LOCK_JOBS, [_joined(sorted(newest))])
            _mark_cancelled_attempts(merged.values(), {str(row[0]) for row in cursor.fetchall()})
            _pg_write_attempts(cursor, list(merged.values()))
            stop_point("in_mirror_transaction")
            _pg_write_jobs(cursor, list(newest.values()))
            retried: Sequence[AttemptRecord] = [r for r in newest.values() if r.attempt > 1]
            if retried:
                cursor.execute(_PG_CLOSE_ABANDONED, [ABANDONED_ERROR,
                                                     _joined(r.job_id for r in retried),
                                                     _joined(r.attempt for r in retried)])
        return
    now = timezone.now()
    with transaction.atomic(using=using):
        jobs = Job.objects.using(using)
        # Rows first, in id order (see the PostgreSQL branch); a no-op on SQLite.
        locked = [(str(pk), gen, state) for ids in _chunks(sorted(newest))
                  for pk, gen, state in jobs.select_for_update(no_key=True).filter(pk__in=ids)
                  .order_by("pk").values_list("pk", "generation", "state")]
        known = {pk: gen for pk, gen, _ in locked}
        _mark_cancelled_attempts(merged.values(),
                                 {pk for pk, _, state in locked if state == JobState.CANCELLED})
        _write_attempts(using, [r for r in merged.values() if known.get(r.job_id) == r.gen])
        stop_point("in_mirror_transaction")
        # Attempts the worker lost (see the PostgreSQL statement's NOT EXISTS).
        lost = {(str(job_id), number) for chunk in _chunks(list(newest.values()))
                for job_id, number in Attempt.objects.using(using).filter(
                    _any_of((r.job_id, r.attempt) for r in chunk),
                    outcome=AttemptOutcome.LEASE_EXPIRED).values_list("job_id", "number")}
        for rec in newest.values():
            if known.get(rec.job_id) == rec.gen:
                fenced = jobs.filter(pk=rec.job_id, generation=rec.gen, attempts__lte=rec.attempt
                                     ).exclude(state=JobState.CANCELLED)
                if rec.job_state != JobState.SUCCEEDED:
                    fenced = fenced.exclude(state__in=TERMINAL_STATES)
                else:
                    fenced = fenced.exclude(state__in=TERMINAL_STATES, attempts__gte=rec.attempt)
                if (rec.outcome != AttemptOutcome.LEASE_EXPIRED
                        and (rec.job_id, rec.attempt) in lost):
                    continue  # the worker lost this attempt: its late result is not the job's
                fenced.update(**_job_changes(rec, now))
        # Like _PG_CLOSE_ABANDONED: every retried job's newest record, whatever its generation.
        for retried in _chunks([rec for rec in newest.values() if rec.attempt > 1]):
            closing = Q(pk__in=[])
            for rec in retried:
                closing |= Q(job_id=rec.job_id, number__lt=rec.attempt)
            Attempt.objects.using(using).filter(closing, outcome="").update(
                outcome=AttemptOutcome.LEASE_EXPIRED, finished_at=now, error=ABANDONED_ERROR)


def _mark_cancelled_attempts(records: Iterable[AttemptRecord], cancelled: set[str]) -> None:
    """Record as cancelled, in place, the outcomes of attempts whose job was cancelled.

    Staff or code cancelled the job while the attempt ran (its row is
    'cancelled', locked by the caller): whatever the attempt did after that
    is not the job's outcome, and the history says so instead of showing a
    success under a cancelled job. Records of the job's generation only
    reach the row (the writes are fenced by generation).
    """
    if not cancelled:
        return
    for rec in records:
        if rec.job_id in cancelled and rec.outcome in (
                AttemptOutcome.SUCCEEDED, AttemptOutcome.FAILED, AttemptOutcome.TIMED_OUT):
            ended = f"{rec.outcome}: {rec.error}" if rec.error else rec.outcome
            if not rec.error.startswith(CANCELLED_ERROR):
                rec.error = (f"{CANCELLED_ERROR} while it ran; the attempt then ended "
                             f"({ended}) and that result was discarded")
            rec.outcome = AttemptOutcome.CANCELLED
            rec.job_state = JobState.CANCELLED
            rec.return_value = None
            rec.retry_at = None


def cancelled_record(job_id: str, attempt: int, *, gen: int, error: str) -> AttemptRecord:
    """The record of an attempt that ended cancelled (worker or sweep)."""
    return AttemptRecord(job_id=job_id, attempt=attempt, gen=gen, job_state=JobState.CANCELLED,
                         finished_at=timezone.now(), outcome=AttemptOutcome.CANCELLED,
                         error=error)


#: The largest attempt number the mirror's integer columns hold.
MAX_ATTEMPT = 2**31 - 1


def _make_storable(rec: AttemptRecord) -> bool:
    """Make ``rec`` storable, in place; return False when no row can match it.

    One value the database refuses fails the whole batch, at every retry:
    an id that is not a UUID or a counter out of range (Redis holds what
    anyone wrote there), NUL or a lone surrogate in a task's message, NaN or
    infinity in its result (see payload.storable).
    """
    if not _is_uuid(rec.job_id):
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


def _job_changes(rec: AttemptRecord, now: datetime) -> dict[str, Any]:
    changes: dict[str, Any] = {"state": rec.job_state, "attempts": rec.attempt, "updated_at": now}
    if rec.started_at:
        changes["started_at"] = Coalesce("started_at", rec.started_at)
    if rec.job_state in TERMINAL_STATES or rec.job_state == JobState.CANCELLED:
        changes["finished_at"] = rec.finished_at or now
    if rec.job_state == JobState.SUCCEEDED:
        changes["return_value"] = rec.return_value
    if rec.error:
        changes["last_error"] = rec.error
    if rec.retry_at:
        changes["run_after"] = rec.retry_at
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
#: RAN_OUTCOMES as an SQL list.
_RAN = "(" + ", ".join(f"'{outcome}'" for outcome in RAN_OUTCOMES) + ")"


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
# Locks every row of the batch, and returns the ids of those cancelled. The
# CTE is MATERIALIZED: a locking sub-SELECT locks only the rows it returns,
# and the planner could push "state = 'cancelled'" down into it, leaving the
# others unlocked (a cancel could then slip in between this and the writes).
_PG_LOCK_JOBS = f"""
WITH locked AS MATERIALIZED (
    SELECT id, state FROM {Job._meta.db_table}
    WHERE id = ANY({_column("uuid")}) ORDER BY id FOR NO KEY UPDATE)
SELECT id FROM locked WHERE state = 'cancelled'
"""

_PG_UPSERT_ATTEMPTS = f"""
INSERT INTO {Attempt._meta.db_table} AS a
    (job_id, number, worker_id, started_at, finished_at, outcome, error, traceback)
SELECT v.job_id, v.number, v.worker_id, v.started_at, v.finished_at, v.outcome, v.error,
       v.traceback
FROM unnest({_column("uuid")}, {_column("int")}, {_column("text")},
            {_column("timestamptz", nullable=True)}, {_column("timestamptz", nullable=True)},
            {_column("text")}, {_column("text")}, {_column("text")}, {_column("int")})
     AS v(job_id, number, worker_id, started_at, finished_at, outcome, error, traceback, gen)
WHERE EXISTS (SELECT 1 FROM {Job._meta.db_table} j WHERE j.id = v.job_id
              AND j.generation = v.gen)
ON CONFLICT (job_id, number) DO UPDATE SET
    worker_id = COALESCE(NULLIF(EXCLUDED.worker_id, ''), a.worker_id),
    started_at = COALESCE(a.started_at, EXCLUDED.started_at),
    finished_at = CASE WHEN a.outcome IN {_RAN} THEN a.finished_at
                       ELSE COALESCE(EXCLUDED.finished_at, a.finished_at) END,
    outcome = CASE WHEN a.outcome IN {_RAN} THEN a.outcome
                   WHEN a.outcome = 'lease_expired' THEN a.outcome
                   ELSE COALESCE(NULLIF(EXCLUDED.outcome, ''), a.outcome) END,
    error = CASE WHEN a.outcome IN {_RAN} THEN a.error
                 WHEN a.outcome = 'lease_expired' AND EXCLUDED.outcome NOT IN ('', a.outcome)
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
    finished_at = CASE WHEN v.state IN ('succeeded', 'dead', 'cancelled')
                       THEN COALESCE(v.finished_at, now()) ELSE j.finished_at END,
    return_value = CASE WHEN v.state = 'succeeded' THEN v.return_value::jsonb
                        ELSE j.return_value END,
    last_error = COALESCE(NULLIF(v.error, ''), j.last_error),
    run_after = COALESCE(v.retry_at, j.run_after),
    updated_at = now()
FROM unnest({_column("uuid")}, {_column("int")}, {_column("text")},
            {_column("timestamptz", nullable=True)}, {_column("timestamptz", nullable=True)},
            {_column("text", nullable=True)}, {_column("text")}, {_column("int")},
            {_column("text")}, {_column("timestamptz", nullable=True)})
     AS v(id, attempt, state, started_at, finished_at, return_value, error, gen, outcome,
          retry_at)
WHERE j.id = v.id AND j.generation = v.gen AND j.attempts <= v.attempt
  AND j.state <> 'cancelled'
  AND (j.state NOT IN ('succeeded', 'dead')
       OR (v.state = 'succeeded' AND v.attempt > j.attempts))
  AND (v.outcome = 'lease_expired' OR NOT EXISTS (
       SELECT 1 FROM {Attempt._meta.db_table} a
       WHERE a.job_id = v.id AND a.number = v.attempt AND a.outcome = 'lease_expired'))
"""


# An earlier attempt still open when a later one is written was abandoned: its
# worker died before anything recorded how it ended (the sweep that saw its
# lease expire may have died too). Close it, so no attempt stays "running".
ABANDONED_ERROR = (f"{class_path(LeaseExpired)}: the worker stopped before this attempt was "
                   "recorded as finished")
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
        _joined(r.gen for r in rows),
    ])


def _pg_write_jobs(cursor: Any, rows: list[AttemptRecord]) -> None:
    cursor.execute(_PG_UPDATE_JOBS, [
        _joined(r.job_id for r in rows), _joined(r.attempt for r in rows),
        _joined(r.job_state for r in rows), _joined(r.started_at for r in rows),
        _joined(r.finished_at for r in rows),
        # JSON text never holds a raw U+001F (json.dumps escapes control characters).
        _joined(None if r.return_value is None else json.dumps(r.return_value) for r in rows),
        _joined(r.error for r in rows), _joined(r.gen for r in rows),
        _joined(r.outcome for r in rows), _joined(r.retry_at for r in rows),
    ])


def _write_attempts(using: str, rows: Sequence[AttemptRecord]) -> None:
    """Upsert one Attempt row per record, keeping what an earlier write knew."""
    attempts = Attempt.objects.using(using)
    existing = {
        (str(a.job_id), a.number): a
        for chunk in _chunks(rows)
        for a in attempts.filter(_any_of((r.job_id, r.attempt) for r in chunk))
    }
    new: list[Attempt] = []
    for rec in rows:
        row = existing.get((rec.job_id, rec.attempt))
        if row is None:
            new.append(Attempt(job_id=rec.job_id, number=rec.attempt, worker_id=rec.worker_id,
                               started_at=rec.started_at, finished_at=rec.finished_at,
                               outcome=rec.outcome, error=rec.error, traceback=rec.traceback))
            continue
        # Column by column as _PG_UPSERT_ATTEMPTS: an outcome the attempt reached by
        # running (RAN_OUTCOMES) is final, and so is 'lease_expired' (a late result
        # is only noted in its error); worker, start and traceback still fill in.
        row.worker_id = rec.worker_id or row.worker_id
        row.started_at = row.started_at or rec.started_at
        if row.outcome not in RAN_OUTCOMES:
            row.finished_at = rec.finished_at or row.finished_at
            if row.outcome != AttemptOutcome.LEASE_EXPIRED:
                row.outcome, row.error = rec.outcome or row.outcome, rec.error or row.error
            elif rec.outcome not in ("", row.outcome):
                row.error += (f"; the worker then finished this attempt late ({rec.outcome}) "
                              "and its result was discarded")
            else:
                row.error = rec.error or row.error
        row.traceback = rec.traceback or row.traceback
        row.save(using=using, update_fields=["worker_id", "started_at", "finished_at",
                                             "outcome", "error", "traceback"])
    if new:
        attempts.bulk_create(new, ignore_conflicts=True)


#: Rows per query of the ORM path: SQLite refuses an expression (an OR of
#: conditions) nested more than 1,000 deep, and a sweep's batch has no bound.
_CHUNK = 250


def _chunks[T](items: Sequence[T], size: int = _CHUNK) -> Iterator[Sequence[T]]:
    for start in range(0, len(items), size):
        yield items[start:start + size]


def _any_of(pairs: Iterable[tuple[str, int]]) -> Q:
    query = Q(pk__in=[])
    for job_id, number in pairs:
        query |= Q(job_id=job_id, number=number)
    return query


def expired_record(job_id: str, attempts: int, *, dead: bool, error: str,
                   gen: int = 0) -> AttemptRecord:
    """The record the sweep writes when a lease expired."""
    return AttemptRecord(
        job_id=job_id, attempt=attempts, gen=gen,
        job_state=JobState.DEAD if dead else JobState.QUEUED,
        finished_at=timezone.now(), outcome=AttemptOutcome.LEASE_EXPIRED, error=error,
    )


# -- reconcile ----------------------------------------------------------


def grace_cutoff(using: str, grace_ms: int) -> datetime:
    """Now minus ``grace_ms`` on the database's clock (on PostgreSQL), the clock
    that stamps ``updated_at`` in the worker's writes: a worker whose own clock
    runs ahead cannot make a healthy job look old."""
    if connections[using].vendor == "postgresql":
        with connections[using].cursor() as cursor:
            cursor.execute("SELECT now()")
            now: datetime = cursor.fetchone()[0]
    else:
        now = timezone.now()
    return now - timedelta(milliseconds=grace_ms)


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


@dataclass(frozen=True, slots=True)
class RowState:
    """What the mirror says of a job, as recovery needs it."""

    state: str
    attempts: int
    generation: int
    last_error: str


#: The row exists, but another transaction holds it (see lock_for_recovery).
LOCKED_ELSEWHERE = RowState("", -1, -1, "")


def lock_for_recovery(using: str, job_ids: Sequence[str]) -> dict[str, RowState]:
    """Lock the rows of ``job_ids`` for the caller's transaction; say what each holds.

    A row another transaction holds (a worker writing its outcome, a staff
    action, another sweep) maps to LOCKED_ELSEWHERE: it is not waited for,
    the next pass sees what that transaction did. An id with no row (a job
    pushed into Redis by hand) is missing from the result.
    """
    ids = [job_id for job_id in job_ids if _is_uuid(job_id)]
    jobs = Job.objects.using(using)
    locked = {str(pk): RowState(state, attempts, generation, error)
              for pk, state, attempts, generation, error in
              jobs.select_for_update(skip_locked=True).filter(pk__in=ids).values_list(
                  "pk", "state", "attempts", "generation", "last_error")}
    existing = {str(pk) for pk in jobs.filter(pk__in=ids).values_list("pk", flat=True)}
    return {**dict.fromkeys(existing - set(locked), LOCKED_ELSEWHERE), **locked}


def _is_uuid(text: str) -> bool:
    try:
        return str(uuid.UUID(text)) == text
    except (TypeError, ValueError, AttributeError):
        return False


def lock_unfinished(using: str, job_ids: Sequence[Any], *, older_than: datetime) -> list[Job]:
    """Lock, of ``job_ids``, the rows still unfinished and untouched since ``older_than``.

    For the caller's transaction. Rows another transaction holds (a staff
    action, another reconciler, a worker's mirror write) are skipped, not
    waited for: whoever holds them is acting on the job right now, and the
    next pass sees what it did.
    """
    if not job_ids:
        return []
    return list(Job.objects.using(using).select_for_update(skip_locked=True).filter(
        pk__in=job_ids, state__in=UNFINISHED_STATES, updated_at__lt=older_than))


def next_generation(using: str, rows: Sequence[Job]) -> None:
    """Give locked rows the generation and attempt count of their rebuild, in place.

    The generation goes up by one, so every token handed out before the
    rebuild is refused after it; attempts become the highest attempt the
    history holds, so attempt numbers keep counting and never repeat.
    """
    if not rows:
        return
    highest = dict(Attempt.objects.using(using).filter(job_id__in=[row.pk for row in rows])
                   .values("job_id").annotate(top=Max("number")).values_list("job_id", "top"))
    for row in rows:
        row.generation += 1
        row.attempts = max(row.attempts, highest.get(row.pk) or 0)


def mark_rebuilt(using: str, rows: Sequence[Job], *, now: datetime) -> None:
    """Mirror rebuilt jobs: their new generation and attempts, their state, a fresh grace."""
    for row in rows:
        Job.objects.using(using).filter(pk=row.pk).update(
            generation=row.generation, attempts=row.attempts, updated_at=now,
            state=JobState.SCHEDULED if row.run_after and row.run_after > now
            else JobState.QUEUED)


def raise_budgets(using: str, budgets: dict[str, int]) -> None:
    """Mirror refunds: a claim that never started gave its job one more attempt."""
    jobs = Job.objects.using(using)
    with transaction.atomic(using=using):
        for job_id, max_attempts in budgets.items():
            jobs.filter(pk=job_id).update(max_attempts=Greatest("max_attempts", max_attempts))


def bury(using: str, job_id: str, *, attempts: int, gen: int, error: str) -> None:
    """Mirror a death Redis already recorded (for example by recover), fenced."""
    now = timezone.now()
    Job.objects.using(using).filter(pk=job_id, state__in=UNFINISHED_STATES, generation=gen,
                                    attempts__lte=attempts).update(
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


def mark_queued_again(using: str, job: Job, *, max_attempts: int,
                      clear_run_after: bool = False) -> None:
    """Mirror a staff retry or requeue: queued again, with ``max_attempts`` as budget.

    The row's generation and attempts are written as ``job`` holds them
    (raised by :func:`next_generation` when the action rebuilt the job).
    ``clear_run_after`` drops a future run_after the job no longer waits
    for, so a reconcile rebuild cannot schedule it for later again. A
    finished job queued again gives up its unique key.
    """
    changes: dict[str, Any] = {"state": JobState.QUEUED, "max_attempts": max_attempts,
                               "generation": job.generation, "attempts": job.attempts,
                               "finished_at": None, "updated_at": timezone.now()}
    if job.state in FINISHED_STATES:
        # Its unique key was freed when it finished and may have a new holder:
        # the job runs again without one (keeping it could break the index).
        changes["unique_key"] = None
    if clear_run_after:
        changes["run_after"] = None
    Job.objects.using(using).filter(pk=job.pk).update(**changes)


def mark_cancelled(using: str, job_id: Any) -> None:
    """Mirror a cancel Redis already applied (the job was taken off its list)."""
    now = timezone.now()
    Job.objects.using(using).filter(pk=job_id).update(
        state=JobState.CANCELLED, finished_at=now, updated_at=now)


def mark_priority(using: str, job_id: Any, priority: int) -> None:
    """Mirror a priority change Redis already applied (see reprioritize.lua).

    The row's priority is what a rebuild from the mirror pushes again, so a
    job Redis loses later comes back at the priority staff gave it.
    """
    Job.objects.using(using).filter(pk=job_id).update(priority=priority,
                                                      updated_at=timezone.now())


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
