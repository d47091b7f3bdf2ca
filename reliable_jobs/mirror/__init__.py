"""Every database write about jobs: the mirror of what happens in Redis.

The package's modules: this one is the write API (what the rest of the
package imports); ``records`` holds what is written (attempt records, new
rows) and the state groups the rules name; ``postgres`` the PostgreSQL
statements, ``portable`` the same writes through the ORM for every other
database, each rule below written once per path under its name;
``reconcile`` what recovery reads and locks; ``prune`` the deletes.

Writes are fenced like the scripts, by generation and attempt number, and
outcomes are final. The rules, by the names the two paths use:

- "generation fence": a row is moved only by a record of the row's
  generation whose attempt is at least the row's, so a stale worker's late
  write (an older attempt, or any attempt from before the job was rebuilt)
  never overwrites a newer one;
- "outcomes final": an attempt's own outcome (succeeded, failed, timed out)
  is never overwritten by a record that its lease expired or it was
  released;
- "ended stays ended": a job that ended (succeeded or dead) is moved only
  by a later attempt that succeeded (Redis ran it again after a lease
  expiry), never back to queued, scheduled or running, and never from
  succeeded to dead;
- "lost attempt": an attempt recorded as lease_expired (its worker lost the
  job) does not move the job when its late result arrives: the history
  keeps the result in the attempt's error, the job follows the attempt that
  holds it now;
- "cancel wins": no worker record moves a cancelled job, and an attempt
  that ends after its job was cancelled (staff or code cancelled it while
  it ran) is recorded as cancelled, whatever it returned or raised: the job
  ends either succeeded (its outcome reached the mirror first, and the
  cancel is refused) or cancelled, never both;
- "abandoned closed": an earlier attempt still open when a later one of
  the row's generation is written is closed as lease_expired, so no attempt
  stays "running" (a stale holder's record, of an older generation, closes
  nothing: the open attempt may be the one that holds the job now);
- "lock order": every writer locks the rows it moves first, in id order.

A unique job's key (``Job.unique_key``) counts only while the row is
unfinished (the partial index rj_job_unique_key), so every write here that
ends a job frees its key with the same UPDATE, at no extra cost; the one
write that makes a finished job unfinished again (:func:`mark_queued_again`)
clears the key first, and :func:`insert_jobs` (its unique path) is the only reader.

Worker writes arrive in batches (one transaction per batch); a failed batch
is retried by the caller, never dropped, and the Redis ack waits for it.

Clocks (G4): ``updated_at``, what reconcile's grace period compares, is
stamped with the database's clock by the worker batches, the staff writes
and ``bury`` (``statement_timestamp()`` in ``postgres``' SQL, Django's
``Now()`` through the ORM) and by PostgreSQL's single-row INSERTs; new rows
of a bulk enqueue (and every new row on the portable path) carry the
producer's clock, and :func:`mark_rebuilt` the time its caller passes.
Event times (enqueued, started, finished) are the clock of the process that
saw the event.

A staff action locks the job's row, acts in Redis, then writes the row in
the same transaction: a worker's write about the attempt the action lets
run waits for that commit, so it lands after the action's, never under it.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import Any

from django.db import connections, transaction
from django.db.models.functions import Greatest, Now
from django.utils import timezone

from ..models import UNFINISHED_STATES, Job, JobState
from . import dependencies, portable, postgres
from .prune import delete_jobs, lock_prunable
from .reconcile import (
    LOCKED_ELSEWHERE,
    RowState,
    existing,
    grace_cutoff,
    lock_for_recovery,
    lock_recent_cancels,
    lock_unfinished,
    next_generation,
    rebuilt_job,
    reconcile_candidates,
    snoozed_attempts,
)
from .records import (
    ABANDONED_ERROR,
    CANCELLED_ERROR,
    FINISHED_STATES,
    LOSS_OUTCOMES,
    MAX_ATTEMPT,
    RAN_OUTCOMES,
    TERMINAL_STATES,
    AttemptRecord,
    NewJobs,
    NewRow,
    cancelled_record,
    chunks,
    expired_record,
    make_storable,
    new_state,
    snoozed_record,
)

__all__ = [
    "ABANDONED_ERROR", "CANCELLED_ERROR", "FINISHED_STATES", "LOCKED_ELSEWHERE", "LOSS_OUTCOMES",
    "MAX_ATTEMPT", "RAN_OUTCOMES", "TERMINAL_STATES", "Absorb", "AttemptRecord", "NewJobs",
    "NewRow", "RowState", "UniqueRule", "bury", "cancelled_record", "delete_jobs", "existing",
    "expired_record", "follow_held_generation", "grace_cutoff", "insert_jobs",
    "lock_for_recovery", "lock_job", "lock_prunable", "lock_recent_cancels",
    "lock_unfinished", "mark_cancelled", "mark_cancelled_many", "mark_priority",
    "mark_queued_again", "mark_rebuilt",
    "new_state", "next_generation", "raise_budgets", "rebuilt_job", "reconcile_candidates",
    "record", "snoozed_attempts", "snoozed_record",
]


def _on_postgresql(using: str) -> bool:
    return connections[using].vendor == "postgresql"


# -- new jobs -------------------------------------------------------------


#: Rounds of insert, look-up and release a keyed insert makes before it
#: gives up: each round ends with every row inserted or its key's holder
#: found, unless a holder finished or went stale in between; two suffice
#: unless the rows keep changing under it.
_UNIQUE_ROUNDS = 5


#: Asked about the rows that hold keys: each one's state as Redis has it now
#: (a JobState value), by job id; a job Redis does not hold is left out.
StatesInRedis = Callable[[Sequence[Job]], Mapping[str, str]]

#: Asked, for a debounced task, to give an equal call to the job holding its
#: key (the holder's row, locked; the call's row): the holder's new run_after
#: if Redis took the call (the job was still pending), else None.
Absorb = Callable[[Job, NewRow], datetime | None]


@dataclass(frozen=True, slots=True)
class UniqueRule:
    """When an unfinished job's unique key keeps an equal call from inserting its own.

    A holder counts while it is queued or scheduled (running too with
    ``while_running``) and its window lasts: ``window_ms`` from its enqueue,
    or from its run_after when that is later. Its state is Redis's
    (``states_in_redis``), which runs ahead of the row: a worker's start and
    finish records reach the database batched, so a row still says queued
    while its task runs, or after it ended.
    """

    window_ms: int
    while_running: bool
    states_in_redis: StatesInRedis
    #: A debounced task's: the holder counts only if it takes the call (see
    #: :func:`_absorbed`); the window and the states above are not asked.
    absorb: Absorb | None = None


def insert_jobs(using: str, new: NewJobs, *, unique: UniqueRule | None = None) -> dict[str, Job]:
    """Insert the rows of one enqueue, in the caller's transaction if any: every new job's way in.

    The statement is picked here. With ``unique``, each row whose key no
    other unfinished job holds, by INSERT ... ON CONFLICT (see
    :func:`_insert_unique`); returns the holders of the other rows' keys,
    by key. Otherwise (returning nothing): on PostgreSQL one row (``rows`` a
    list of one) by one INSERT that commits by itself outside a
    transaction, more by one COPY; elsewhere with ``bulk_create``. Many rows
    go in a transaction (a savepoint inside the caller's) so a row that
    fails as it is made, its call refused, leaves nothing written.
    """
    if unique is not None:
        return _insert_unique(using, new, unique)
    if isinstance(new.rows, list) and len(new.rows) == 1:
        if _on_postgresql(using):
            postgres.insert_one(connections[using], new)
        else:
            portable.insert_jobs(using, new)
        return {}
    with transaction.atomic(using=using):
        if _on_postgresql(using):
            postgres.copy_jobs(connections[using], new)
        else:
            portable.insert_jobs(using, new)
    return {}


def _insert_unique(using: str, new: NewJobs, rule: UniqueRule) -> dict[str, Job]:
    """Insert each row unless an unfinished job holds its unique key; the holders by key.

    A key absent from the answer was taken by the first of the rows that
    carry it, which was inserted. No transaction of its own: in the
    caller's, if any, everything is in it; outside one each statement
    commits by itself, which is enough (the rj_job_unique_key index judges
    each INSERT, and a stale key given up stays given up). Of two
    transactions inserting one key the second waits for the first, and
    takes the key itself if the first rolls back. A holder that no longer
    counts (:class:`UniqueRule`) gives its key up here (the row keeps its
    state; the caller's transaction holds its lock until it ends), and the
    row is inserted in its place.
    """
    firsts: dict[str, NewRow] = {}
    for row in new.rows:
        if not row[4]:
            raise ValueError(f"Job {row[0]} has no unique key.")
        firsts.setdefault(row[4], row)
    holders: dict[str, Job] = {}
    pending = list(firsts.values())
    now, window = new.enqueued_at, timedelta(milliseconds=rule.window_ms)
    for _ in range(_UNIQUE_ROUNDS):
        inserted = _insert_keyed(using, replace(new, rows=pending))
        taken = [row for row in pending if row[0] not in inserted]
        if not taken:
            break
        found = _key_holders(using, [str(row[4]) for row in taken])
        if rule.absorb is not None:
            pending = _absorb_calls(using, taken, found, rule.absorb, holders)
            if not pending:
                break
            continue
        states = _states_now(using, found, window, rule.while_running, now,
                             rule.states_in_redis)
        pending, stale = [], []
        for row in taken:
            holder = found.get(str(row[4]))
            if holder is not None and _holds_key(holder, states[holder.pk], window,
                                                 rule.while_running, now):
                holders[str(row[4])] = holder
                continue
            if holder is not None:
                stale.append(holder.pk)
            pending.append(row)  # the holder finished in between, or is stale: try again
        _release_keys(using, stale)
        if not pending:
            break
    else:
        raise RuntimeError(
            f"Could not settle the unique keys of {len(pending)} job(s) in {_UNIQUE_ROUNDS} "
            "rounds: their holders kept changing. Enqueue them again.")
    return holders


def _absorb_calls(using: str, taken: Sequence[NewRow], found: dict[str, Job], absorb: Absorb,
                  holders: dict[str, Job]) -> list[NewRow]:
    """Give each call whose key is taken to the key's holder; the calls to insert again.

    A holder that took its call goes into ``holders`` (its row as written
    now); one that did not (it left the pending state) gives its key up,
    and its call is inserted in its place.
    """
    pending, stale = [], []
    for row in taken:
        holder = found.get(str(row[4]))
        taker = None if holder is None else _absorbed(using, holder, row, absorb)
        if taker is not None:
            holders[str(row[4])] = taker
            continue
        if holder is not None:
            stale.append(holder.pk)
        pending.append(row)
    _release_keys(using, stale)
    return pending


def _absorbed(using: str, holder: Job, row: NewRow, absorb: Absorb) -> Job | None:
    """The holder's row with the call's arguments and run_after, if its job took the call.

    The row is locked (and read again) before Redis is asked and written in
    the same transaction (the caller's, or one of its own): a worker's
    record about the job, and an equal call in another process, wait for
    it, so the row's arguments are always those of the run Redis holds. A
    row that no longer waits (it runs, ended, or lost its key) is not asked
    about. The run keeps its first enqueue time, and its key.
    """
    with transaction.atomic(using=using, savepoint=False):
        locked = (Job.objects.using(using).select_for_update(no_key=True)
                  .filter(pk=holder.pk, unique_key=row[4],
                          state__in=(JobState.QUEUED, JobState.SCHEDULED)).first())
        if locked is None:
            return None
        run_after = absorb(locked, row)
        if run_after is None:
            return None
        locked.args, locked.kwargs = json.loads(row[2]), json.loads(row[3])
        locked.run_after, locked.state = run_after, JobState.SCHEDULED
        Job.objects.using(using).filter(pk=locked.pk).update(
            args=locked.args, kwargs=locked.kwargs, run_after=run_after, state=locked.state,
            updated_at=Now())
    return locked


def _insert_keyed(using: str, new: NewJobs) -> set[str]:
    """Insert those rows of ``new`` whose unique key is free; return the ids inserted."""
    if _on_postgresql(using):
        return postgres.insert_keyed(connections[using], new)
    return portable.insert_keyed(using, new)


def _key_holders(using: str, keys: Sequence[str]) -> dict[str, Job]:
    """The unfinished job holding each of ``keys`` (those held), by key."""
    rows = (postgres.key_holders(using, keys) if _on_postgresql(using)
            else portable.key_holders(using, keys))
    return {str(row.unique_key): row for row in rows}


def _states_now(using: str, found: dict[str, Job], window: timedelta, while_running: bool,
                now: datetime, states_in_redis: StatesInRedis) -> dict[uuid.UUID, str | None]:
    """The state of each key holder now (None: it finished since it was read).

    Redis is asked about the holders the rows say count, in one round trip.
    One Redis does not hold was not pushed yet (its enqueue just committed,
    or Redis was down), or its hash was freed since the look-up; a worker
    writes the row before it frees the hash, so a second look-up, after
    Redis's answer, tells the two apart.
    """
    states: dict[uuid.UUID, str | None] = {row.pk: row.state for row in found.values()}
    asked = [row for row in found.values() if _holds_key(row, row.state, window,
                                                          while_running, now)]
    if not asked:
        return states
    in_redis = states_in_redis(asked)
    states.update((row.pk, in_redis[str(row.pk)]) for row in asked if str(row.pk) in in_redis)
    absent = [str(row.unique_key) for row in asked if str(row.pk) not in in_redis]
    if absent:
        again = _key_holders(using, absent)
        for key in absent:
            row, now_row = found[key], again.get(key)
            states[row.pk] = now_row.state if now_row is not None and now_row.pk == row.pk else None
    return states


def _holds_key(row: Job, state: str | None, window: timedelta, while_running: bool,
               now: datetime) -> bool:
    """Whether an unfinished job, now in ``state``, still holds its unique key for an equal call."""
    if state not in UNFINISHED_STATES or (state == JobState.RUNNING and not while_running):
        return False
    start = max(row.enqueued_at, row.run_after) if row.run_after else row.enqueued_at
    return start + window > now


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


# -- worker and sweep records --------------------------------------------


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
    storable = [rec for rec in merged.values() if make_storable(rec)]
    if not storable:
        return
    # A job's newest attempt decides its row (older ones only fill in history).
    newest: dict[str, AttemptRecord] = {}
    for rec in storable:
        if rec.job_id not in newest or (rec.gen, rec.attempt) > (newest[rec.job_id].gen,
                                                                 newest[rec.job_id].attempt):
            newest[rec.job_id] = rec
    if _on_postgresql(using):
        postgres.write_batch(using, storable, newest)
    else:
        portable.write_batch(using, storable, newest)


# -- recovery: what the sweep and staff rebuilds write --------------------


def mark_rebuilt(using: str, rows: Sequence[Job], *, now: datetime) -> None:
    """Mirror rebuilt jobs: their new generation and attempts, their state, a fresh grace."""
    for row in rows:
        Job.objects.using(using).filter(pk=row.pk).update(
            generation=row.generation, attempts=row.attempts, updated_at=now,
            state=new_state(row.run_after, now))


def follow_held_generation(using: str, job_id: Any, *, committed: int, held: int) -> bool:
    """Put a rebuilt row back on the older generation Redis holds; True if it moved.

    A rebuild commits the row's new generation before it pushes (see
    sweep.push_rebuilt); when Redis refuses that push because an older
    incarnation of the job got there first (a late push, claimed or buried
    before the rebuild's push arrived), that incarnation is the job, and its
    records must land. Fenced by the generation committed: a row a newer
    rebuild has moved since is left alone. Nobody holds a token of the
    committed generation (its push was refused), so none is orphaned.
    """
    if held >= committed:
        return False
    return bool(Job.objects.using(using).filter(
        pk=job_id, generation=committed, state__in=UNFINISHED_STATES).update(generation=held))


def raise_budgets(using: str, budgets: dict[str, int]) -> None:
    """Mirror refunds: a claim that never started gave its job one more attempt."""
    jobs = Job.objects.using(using)
    with transaction.atomic(using=using):
        for job_id, max_attempts in budgets.items():
            jobs.filter(pk=job_id).update(max_attempts=Greatest("max_attempts", max_attempts))


def bury(using: str, job_id: str, *, attempts: int, gen: int, error: str) -> None:
    """Mirror a death Redis already recorded (for example by recover), fenced.

    The job's dependents are settled in the same transaction.
    """
    with transaction.atomic(using=using):
        if Job.objects.using(using).filter(
                pk=job_id, state__in=UNFINISHED_STATES, generation=gen,
                attempts__lte=attempts).update(
                state=JobState.DEAD, attempts=Greatest("attempts", attempts), last_error=error,
                finished_at=timezone.now(), updated_at=Now()):
            dependencies.settle(using, [job_id])


# -- staff actions (staff.py) ---------------------------------------------


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
                               "finished_at": None, "updated_at": Now()}
    if job.state in FINISHED_STATES:
        # Its unique key was freed when it finished and may have a new holder:
        # the job runs again without one (keeping it could break the index).
        changes["unique_key"] = None
    if clear_run_after:
        changes["run_after"] = None
    Job.objects.using(using).filter(pk=job.pk).update(**changes)


def mark_cancelled(using: str, job_id: Any) -> None:
    """Mirror a cancel Redis already applied (or of a waiting job, which Redis never had).

    The job's dependents are settled in the same transaction (by default
    they are cancelled too).
    """
    with transaction.atomic(using=using):
        Job.objects.using(using).filter(pk=job_id).update(
            state=JobState.CANCELLED, finished_at=timezone.now(), updated_at=Now())
        dependencies.settle(using, [str(job_id)])


def mark_cancelled_many(using: str, job_ids: Sequence[str]) -> None:
    """:func:`mark_cancelled` for many jobs at once (``staff.cancel_many``): one write a
    chunk, their dependents settled once, in the caller's transaction."""
    if not job_ids:
        return
    with transaction.atomic(using=using):
        now = timezone.now()
        for ids in chunks(job_ids):
            Job.objects.using(using).filter(pk__in=ids).update(
                state=JobState.CANCELLED, finished_at=now, updated_at=Now())
        dependencies.settle(using, job_ids)


def mark_priority(using: str, job_id: Any, priority: int) -> None:
    """Mirror a priority change Redis already applied (see reprioritize.lua).

    The row's priority is what a rebuild from the mirror pushes again, so a
    job Redis loses later comes back at the priority staff gave it.
    """
    Job.objects.using(using).filter(pk=job_id).update(priority=priority, updated_at=Now())
