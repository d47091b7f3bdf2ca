"""The mirror's PostgreSQL path: every statement named, and what runs each.

``portable`` holds the same writes through the ORM, for every other
database; each fencing rule (see the package docstring) is written once
here, in SQL, and once there, and the docstrings name the rule.

Worker batches: one statement per table per batch
(docs/prototype-performance.md: per-row statements cap the drain at a few
hundred jobs/s); fencing is in the WHERE clause. Each column travels as ONE
text value, joined with the unit separator (U+001F) and split by
string_to_array() on the server: Django's client-side binding would
otherwise quote every array element in Python, which cost more than the
statements themselves.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from datetime import datetime
from functools import cached_property, lru_cache
from itertools import islice
from typing import Any

from django.db import connections, transaction
from django.db.backends.base.base import BaseDatabaseWrapper
from django.db.backends.utils import CursorWrapper

from ..faults import stop_point
from ..models import UNFINISHED_STATES, Attempt, Job
from .portable import raise_snoozed_budgets
from .records import (
    ABANDONED_ERROR,
    RAN_OUTCOMES,
    AttemptRecord,
    NewJobs,
    NewRow,
    chunks,
    mark_cancelled_attempts,
)

# -- new jobs -------------------------------------------------------------

#: ``updated_at`` as every INSERT and UPDATE here writes it: the database's
#: clock (G4), the one reconcile's grace period is measured on
#: (reconcile.grace_cutoff), whatever the writing process's clock says. Only
#: the COPY of a bulk enqueue cannot: it writes the producer's clock.
DATABASE_NOW = "statement_timestamp()"

#: A new job's own columns as the INSERTs take them, NewRow's order then its
#: enqueue time; the rest are NewJobs.shared() and ``updated_at``.
OWN_COLUMNS = ("id", "shard", "args", "kwargs", "unique_key", "fair_key", "enqueued_at")
#: Rows per INSERT of unique jobs (six parameters each).
UNIQUE_BATCH = 500


@lru_cache(maxsize=256)
def insert_sql(shared: tuple[tuple[str, Any], ...], rows: int, *, keyed: bool) -> str:
    """The INSERT of ``rows`` new jobs that share ``shared`` (NewJobs.shared()).

    The shared values are SQL literals (quoted by psycopg), so each row sends
    seven parameters, six without a key: each parameter costs the driver a
    value to adapt per call (a datetime about 10 µs), and a single enqueue
    would otherwise send sixteen values of seven types. ``keyed`` skips the
    rows whose unique key is taken (the rj_job_unique_key index judges) and
    returns the ids inserted.
    """
    from psycopg.sql import Literal  # here: the mirror imports this module on every database

    own = OWN_COLUMNS if keyed else tuple(c for c in OWN_COLUMNS if c != "unique_key")
    # A "%" in a literal (a backend alias may hold one) would read as a placeholder.
    literals = ", ".join(Literal(value).as_string().replace("%", "%%") for _, value in shared)
    row = f"({', '.join(['%s'] * len(own))}, {literals}, {DATABASE_NOW})"
    columns = ", ".join((*own, *(name for name, _ in shared), "updated_at"))
    sql = f"INSERT INTO {Job._meta.db_table} ({columns}) VALUES {', '.join([row] * rows)}"
    return sql + " ON CONFLICT DO NOTHING RETURNING id" if keyed else sql


def insert_one(connection: BaseDatabaseWrapper, new: NewJobs) -> None:
    """The one row of ``new`` (a single enqueue): one INSERT, as a COPY takes two round trips.

    Timestamps go as ISO text, as in the COPY (PostgreSQL reads the offset;
    a naive one is read in the connection's time zone, as Django's would be).
    """
    [(job_id, shard, args, kwargs, _, group)] = new.rows
    with connection.cursor() as cursor:
        cursor.execute(insert_sql(new.shared(), 1, keyed=False),
                       (job_id, shard, args, kwargs, group, new.enqueued_at.isoformat()))


def insert_keyed(connection: BaseDatabaseWrapper, new: NewJobs) -> set[str]:
    """Insert the rows whose unique key is free (ON CONFLICT DO NOTHING); the ids inserted."""
    rows: list[NewRow] = list(new.rows)
    shared, enqueued_at = new.shared(), new.enqueued_at.isoformat()
    inserted: set[str] = set()
    with connection.cursor() as cursor:
        for chunk in chunks(rows, UNIQUE_BATCH):
            cursor.execute(insert_sql(shared, len(chunk), keyed=True), [
                value for row in chunk for value in (*row, enqueued_at)])
            inserted.update(str(pk) for (pk,) in cursor.fetchall())
    return inserted


#: COPY's columns: a row's own values first (NewRow's, its key left out: a
#: keyed row goes through insert_keyed), then the shared ones and the clocks.
COPY_COLUMNS = ("id", "shard", "args", "kwargs", "fair_key")
#: Rows per write while a COPY streams: PostgreSQL parses and indexes one
#: chunk while the caller makes the next (rows may come from a generator).
COPY_CHUNK = 1000

#: A backslash, and how COPY's text format spells one.
BACKSLASH, ESCAPED = "\\", "\\\\"


def _copy_text(value: object) -> str:
    """``value`` as a field of COPY's text format (None is NULL)."""
    if value is None:
        return "\\N"
    text = value.isoformat() if isinstance(value, datetime) else str(value)
    return (text.replace("\\", "\\\\").replace("\t", "\\t").replace("\n", "\\n")
            .replace("\r", "\\r"))


def copy_jobs(connection: BaseDatabaseWrapper, new: NewJobs) -> None:
    """COPY the rows of ``new`` in its text format, the lines written by hand.

    The shared columns are formatted once, and per row only the id, the
    shard and two JSON texts are joined (psycopg's ``write_row`` spent more
    per row formatting each value; COPY is the fastest way in, see
    docs/prototype-performance.md). The JSON texts hold no tab, newline or
    carriage return (the encoder escapes control characters), so a backslash
    is the one character to escape. Rows are taken COPY_CHUNK at a time and
    each chunk is sent as soon as it is made.
    """
    shared = new.shared()
    names = ", ".join((*COPY_COLUMNS, *(name for name, _ in shared), "enqueued_at",
                       "updated_at"))
    tail = "\t".join(_copy_text(value) for value in (
        *(value for _, value in shared), new.enqueued_at, new.enqueued_at))
    rows = iter(new.rows)
    with (connection.cursor() as cursor,
          cursor.cursor.copy(f"COPY {Job._meta.db_table} ({names}) FROM STDIN") as copy):
        while chunk := list(islice(rows, COPY_CHUNK)):
            copy.write("".join([
                f"{job_id}\t{shard}\t{args.replace(BACKSLASH, ESCAPED)}\t"
                f"{kwargs.replace(BACKSLASH, ESCAPED)}\t{group}\t{tail}\n"
                for job_id, shard, args, kwargs, _, group in chunk
            ]))


# -- unique keys ----------------------------------------------------------

#: The unfinished jobs holding some keys: a ready-made statement, as the plain
#: INSERT is (the ORM built it each time, most of a duplicate enqueue's cost).
KEY_HOLDERS = (f"SELECT * FROM {Job._meta.db_table} WHERE unique_key = ANY(%s) AND state IN ("
               + ", ".join(f"'{state}'" for state in UNFINISHED_STATES) + ")")


def key_holders(using: str, keys: Sequence[str]) -> Iterable[Job]:
    """KEY_HOLDERS: a new statement, so under READ COMMITTED it sees the holder
    whose commit the INSERT waited for (an INSERT ... RETURNING could not)."""
    return Job.objects.using(using).raw(KEY_HOLDERS, [list(keys)])


# -- worker and sweep batches --------------------------------------------

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


# The worker's batches join about twenty columns of a few hundred values each:
# per column type, the joins below do in C what _joined does per value in Python.


def _joined_text(values: list[str]) -> str:
    """Join text (never None); a separator inside a value becomes a space, as in _joined."""
    joined = _SEPARATOR.join(values)
    if joined.count(_SEPARATOR) > len(values) - 1:  # rare: some value holds one
        joined = _SEPARATOR.join(v.replace(_SEPARATOR, " ") for v in values)
    return _SEPARATOR + joined


def _joined_ints(values: list[int]) -> str:
    return _SEPARATOR + _SEPARATOR.join(map(str, values))


def _joined_times(values: list[datetime | None]) -> str:
    return _SEPARATOR + _SEPARATOR.join("" if v is None else v.isoformat() for v in values)


#: Rule "lock order", and the half of "cancel wins" that finds the cancelled
#: rows: locks every row of the batch, and returns the ids of those
#: cancelled. The CTE is MATERIALIZED: a locking sub-SELECT locks only the
#: rows it returns, and the planner could push "state = 'cancelled'" down
#: into it, leaving the others unlocked (a cancel could then slip in between
#: this and the writes).
LOCK_JOBS = f"""
WITH locked AS MATERIALIZED (
    SELECT id, state FROM {Job._meta.db_table}
    WHERE id = ANY({_column("uuid")}) ORDER BY id FOR NO KEY UPDATE)
SELECT id FROM locked WHERE state = 'cancelled'
"""

#: One record per attempt, as the two statements below take them.
_ATTEMPT_ROWS = f"""unnest({_column("uuid")}, {_column("int")}, {_column("text")},
            {_column("timestamptz", nullable=True)}, {_column("timestamptz", nullable=True)},
            {_column("text")}, {_column("text")}, {_column("text")}, {_column("int")})
     AS v(job_id, number, worker_id, started_at, finished_at, outcome, error, traceback, gen)"""

#: Rule "generation fence": the row is of the record's generation.
_OF_ITS_GENERATION = f"""EXISTS (SELECT 1 FROM {Job._meta.db_table} j WHERE j.id = v.job_id
              AND j.generation = v.gen)"""

#: The attempts a batch's records find already written (a start in an earlier
#: batch, a sweep's record), updated keeping what the earlier write knew.
#: Rules "generation fence" and "outcomes final" (the CASEs: an outcome the
#: attempt reached by running is final, and so is 'lease_expired', whose late
#: result is only noted in its error; worker, start and traceback still fill in).
UPDATE_ATTEMPTS = f"""
UPDATE {Attempt._meta.db_table} AS a SET
    worker_id = COALESCE(NULLIF(v.worker_id, ''), a.worker_id),
    started_at = COALESCE(a.started_at, v.started_at),
    finished_at = CASE WHEN a.outcome IN {_RAN} THEN a.finished_at
                       ELSE COALESCE(v.finished_at, a.finished_at) END,
    outcome = CASE WHEN a.outcome IN {_RAN} THEN a.outcome
                   WHEN a.outcome = 'lease_expired' THEN a.outcome
                   ELSE COALESCE(NULLIF(v.outcome, ''), a.outcome) END,
    error = CASE WHEN a.outcome IN {_RAN} THEN a.error
                 WHEN a.outcome = 'lease_expired' AND v.outcome NOT IN ('', a.outcome)
                 THEN a.error || '; the worker then finished this attempt late ('
                      || v.outcome || ') and its result was discarded'
                 ELSE COALESCE(NULLIF(v.error, ''), a.error) END,
    traceback = COALESCE(NULLIF(v.traceback, ''), a.traceback)
FROM {_ATTEMPT_ROWS}
WHERE a.job_id = v.job_id AND a.number = v.number AND {_OF_ITS_GENERATION}
"""

#: The attempts not written yet (usually all of them: a job's start and
#: outcome merge into one record), under rule "generation fence". A plain
#: INSERT, not INSERT ... ON CONFLICT: a speculative insertion logs one more
#: WAL record per row (about 50 bytes a job). Nothing can insert the same
#: attempt between the NOT EXISTS and the INSERT: every writer of attempts
#: holds its job's row first (rule "lock order", LOCK_JOBS).
INSERT_ATTEMPTS = f"""
INSERT INTO {Attempt._meta.db_table}
    (job_id, number, worker_id, started_at, finished_at, outcome, error, traceback)
SELECT v.job_id, v.number, v.worker_id, v.started_at, v.finished_at, v.outcome, v.error,
       v.traceback
FROM {_ATTEMPT_ROWS}
WHERE {_OF_ITS_GENERATION}
  AND NOT EXISTS (SELECT 1 FROM {Attempt._meta.db_table} a
                  WHERE a.job_id = v.job_id AND a.number = v.number)
"""

#: The WHERE clause, line by line: rule "generation fence" (same generation,
#: attempt at least the row's), rule "cancel wins" (never a cancelled row),
#: rule "ended stays ended" (a finished row moves only to a later success),
#: rule "lost attempt" (the NOT EXISTS: a late result of an attempt recorded
#: lease_expired does not move the job).
UPDATE_JOBS = f"""
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
    updated_at = {DATABASE_NOW}
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

#: Rule "abandoned closed": an earlier attempt still open when a later one is
#: written is closed as lease_expired; under rule "generation fence" only by a
#: record of the row's generation (the EXISTS): a stale holder's late record
#: (a higher attempt number from before a rebuild) never closes the attempt
#: that holds the job now.
CLOSE_ABANDONED = f"""
UPDATE {Attempt._meta.db_table} AS a
SET outcome = 'lease_expired', finished_at = now(), error = %s
FROM unnest({_column("uuid")}, {_column("int")}, {_column("int")}) AS v(job_id, attempt, gen)
WHERE a.job_id = v.job_id AND a.number < v.attempt AND a.outcome = ''
  AND EXISTS (SELECT 1 FROM {Job._meta.db_table} j WHERE j.id = v.job_id
              AND j.generation = v.gen)
"""


def write_batch(using: str, merged: Sequence[AttemptRecord],
                newest: dict[str, AttemptRecord]) -> None:
    """Write one batch in one transaction: ``merged`` into the history, ``newest`` onto the jobs."""
    with transaction.atomic(using=using), connections[using].cursor() as cursor:
        # Rows first, in id order, as every other writer locks them: a
        # sweep expiring one of these attempts holds its row, and an
        # attempt INSERT that reserved its key before waiting for that row
        # would deadlock with the sweep's own record of the attempt.
        cursor.execute(LOCK_JOBS, [_joined_text(sorted(newest))])
        mark_cancelled_attempts(merged, {str(row[0]) for row in cursor.fetchall()})
        attempts = _Columns(merged)
        _write_attempts(cursor, attempts)
        stop_point("in_mirror_transaction")
        jobs = list(newest.values())
        # Usually one record per job: then the jobs are the attempts, in the
        # same order (newest keeps the order records first appear in), and
        # the columns both statements share are joined once.
        _write_jobs(cursor, attempts if len(jobs) == len(merged) else _Columns(jobs))
        retried = [r for r in jobs if r.attempt > 1]
        if retried:
            cursor.execute(CLOSE_ABANDONED, [ABANDONED_ERROR,
                                             _joined_text([r.job_id for r in retried]),
                                             _joined_ints([r.attempt for r in retried]),
                                             _joined_ints([r.gen for r in retried])])
        raise_snoozed_budgets(using, jobs)


class _Columns:
    """One batch's records as joined columns, each joined once when first used.

    Ids are canonical UUIDs (make_storable), text is never None (AttemptRecord).
    """

    def __init__(self, rows: Sequence[AttemptRecord]) -> None:
        self.rows = rows

    @cached_property
    def job_ids(self) -> str:
        return _joined_text([r.job_id for r in self.rows])

    @cached_property
    def attempts(self) -> str:
        return _joined_ints([r.attempt for r in self.rows])

    @cached_property
    def started(self) -> str:
        return _joined_times([r.started_at for r in self.rows])

    @cached_property
    def finished(self) -> str:
        return _joined_times([r.finished_at for r in self.rows])

    @cached_property
    def outcomes(self) -> str:
        return _joined_text([r.outcome for r in self.rows])

    @cached_property
    def errors(self) -> str:
        return _joined_text([r.error for r in self.rows])

    @cached_property
    def gens(self) -> str:
        return _joined_ints([r.gen for r in self.rows])


def _write_attempts(cursor: CursorWrapper, rows: _Columns) -> None:
    """UPDATE_ATTEMPTS, then INSERT_ATTEMPTS (so the rows just inserted are not
    read again by the UPDATE)."""
    values = [rows.job_ids, rows.attempts, _joined_text([r.worker_id for r in rows.rows]),
              rows.started, rows.finished, rows.outcomes, rows.errors,
              _joined_text([r.traceback for r in rows.rows]), rows.gens]
    cursor.execute(UPDATE_ATTEMPTS, values)
    cursor.execute(INSERT_ATTEMPTS, values)


def _write_jobs(cursor: CursorWrapper, rows: _Columns) -> None:
    cursor.execute(UPDATE_JOBS, [
        rows.job_ids, rows.attempts, _joined_text([r.job_state for r in rows.rows]),
        rows.started, rows.finished,
        # JSON text never holds a raw U+001F (json.dumps escapes control characters).
        _joined(None if r.return_value is None else json.dumps(r.return_value)
                for r in rows.rows),
        rows.errors, rows.gens, rows.outcomes, _joined_times([r.retry_at for r in rows.rows]),
    ])
