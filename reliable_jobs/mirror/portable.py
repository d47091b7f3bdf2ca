"""The mirror's portable path: the writes of ``postgres``, through the ORM.

Taken on every database but PostgreSQL (the test suite runs it on SQLite).
Each function here does what its namesake in ``postgres`` does, and each
fencing rule (see the package docstring) is written once here, as Python
and querysets, under the rule's name. Clocks: the worker batches stamp
``updated_at`` with the database's clock (Django's ``Now()``) as
``postgres`` does; new rows are inserted with the producer's clock
(``Model.save()`` and ``bulk_create`` take values, not expressions).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable, Sequence
from datetime import datetime
from typing import Any

from django.db import IntegrityError, transaction
from django.db.models import Exists, OuterRef, Q
from django.db.models.functions import Coalesce, Greatest, Now
from django.utils import timezone

from ..faults import stop_point
from ..models import UNFINISHED_STATES, Attempt, AttemptOutcome, Job, JobState
from .records import (
    ABANDONED_ERROR,
    FINISHED_STATES,
    RAN_OUTCOMES,
    TERMINAL_STATES,
    AttemptRecord,
    NewJobs,
    NewRow,
    chunks,
    mark_cancelled_attempts,
)


def _job(new: NewJobs, row: NewRow) -> Job:
    """One row of ``new`` as a model instance (the clocks: the producer's)."""
    job_id, shard, args, kwargs, key, group = row
    return Job(id=uuid.UUID(job_id), shard=shard, args=json.loads(args),
               kwargs=json.loads(kwargs), unique_key=key, fair_key=group,
               enqueued_at=new.enqueued_at,
               updated_at=new.enqueued_at, **dict(new.shared()))


def insert_jobs(using: str, new: NewJobs) -> None:
    """``bulk_create`` of the rows of one enqueue."""
    Job.objects.using(using).bulk_create([_job(new, row) for row in new.rows], batch_size=1000)


def key_holders(using: str, keys: Sequence[str]) -> Iterable[Job]:
    """The unfinished jobs holding some of ``keys``, a query per chunk."""
    return (row for chunk in chunks(keys) for row in Job.objects.using(using).filter(
        unique_key__in=chunk, state__in=UNFINISHED_STATES).order_by())


def insert_keyed(using: str, new: NewJobs) -> set[str]:
    """Insert the rows whose unique key is free; the ids inserted.

    One savepoint per row, a unique violation rolled back to it: works on
    every database Django supports.
    """
    inserted: set[str] = set()
    for row in new.rows:
        try:
            with transaction.atomic(using=using):
                _job(new, row).save(using=using, force_insert=True)
        except IntegrityError:
            continue
        inserted.add(row[0])
    return inserted


def write_batch(using: str, merged: Sequence[AttemptRecord],
                newest: dict[str, AttemptRecord]) -> None:
    """Write one batch in one transaction: ``merged`` into the history, ``newest`` onto the jobs."""
    now = timezone.now()
    with transaction.atomic(using=using):
        jobs = Job.objects.using(using)
        # Rule "lock order": rows first, in id order (a no-op on SQLite).
        locked = [(str(pk), gen, state) for ids in chunks(sorted(newest))
                  for pk, gen, state in jobs.select_for_update(no_key=True).filter(pk__in=ids)
                  .order_by("pk").values_list("pk", "generation", "state")]
        known = {pk: gen for pk, gen, _ in locked}
        mark_cancelled_attempts(merged,
                                {pk for pk, _, state in locked if state == JobState.CANCELLED})
        # Rule "generation fence", for the history: records of the row's generation only.
        _write_attempts(using, [r for r in merged if known.get(r.job_id) == r.gen])
        stop_point("in_mirror_transaction")
        # Rule "lost attempt": attempts recorded lease_expired.
        lost = {(str(job_id), number) for chunk in chunks(list(newest.values()))
                for job_id, number in Attempt.objects.using(using).filter(
                    _any_of((r.job_id, r.attempt) for r in chunk),
                    outcome=AttemptOutcome.LEASE_EXPIRED).values_list("job_id", "number")}
        for rec in newest.values():
            if known.get(rec.job_id) == rec.gen:
                # Rules "generation fence" and "cancel wins".
                fenced = jobs.filter(pk=rec.job_id, generation=rec.gen, attempts__lte=rec.attempt
                                     ).exclude(state=JobState.CANCELLED)
                # Rule "ended stays ended".
                if rec.job_state != JobState.SUCCEEDED:
                    fenced = fenced.exclude(state__in=TERMINAL_STATES)
                else:
                    fenced = fenced.exclude(state__in=TERMINAL_STATES, attempts__gte=rec.attempt)
                if (rec.outcome != AttemptOutcome.LEASE_EXPIRED
                        and (rec.job_id, rec.attempt) in lost):
                    continue  # the worker lost this attempt: its late result is not the job's
                fenced.update(**_job_changes(rec, now))
        # Rule "abandoned closed": every retried job's newest record; under rule
        # "generation fence" only one of the row's generation, so a stale
        # holder's late record never closes the attempt that holds the job now.
        for retried in chunks([rec for rec in newest.values()
                               if rec.attempt > 1 and known.get(rec.job_id) == rec.gen]):
            closing = Q(pk__in=[])
            for rec in retried:
                closing |= Q(job_id=rec.job_id, number__lt=rec.attempt)
            Attempt.objects.using(using).filter(closing, outcome="").update(
                outcome=AttemptOutcome.LEASE_EXPIRED, finished_at=now, error=ABANDONED_ERROR)
        raise_snoozed_budgets(using, newest.values())


def raise_snoozed_budgets(using: str, newest: Iterable[AttemptRecord]) -> None:
    """Give each snoozed attempt back to its job: max_attempts to the record's budget.

    Both paths call this inside their batch's transaction, after the job
    and attempt writes, so the budget moves with the snooze or not at all.
    Only where the snooze was recorded: the row holds that attempt of that
    generation and the attempt's own outcome is 'snoozed' (rules
    "generation fence" and "outcomes final": a stale holder's snooze, or
    one of an attempt already recorded lease_expired, gives nothing back).
    Greatest(): a batch written again after a lost commit reply adds nothing.
    """
    for rec in newest:
        if rec.budget is None or rec.outcome != AttemptOutcome.SNOOZED:
            continue
        Job.objects.using(using).filter(
            Exists(Attempt.objects.using(using).filter(
                job_id=OuterRef("pk"), number=rec.attempt, outcome=AttemptOutcome.SNOOZED)),
            pk=rec.job_id, generation=rec.gen, attempts=rec.attempt,
        ).exclude(state__in=FINISHED_STATES).update(
            max_attempts=Greatest("max_attempts", rec.budget))


def _write_attempts(using: str, rows: Sequence[AttemptRecord]) -> None:
    """Upsert one Attempt row per record, keeping what an earlier write knew."""
    attempts = Attempt.objects.using(using)
    existing = {
        (str(a.job_id), a.number): a
        for chunk in chunks(rows)
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
        # Rule "outcomes final", column by column as postgres.UPDATE_ATTEMPTS: an
        # outcome the attempt reached by running (RAN_OUTCOMES) is final, and so is
        # 'lease_expired' (a late result is only noted in its error); worker, start
        # and traceback still fill in.
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


def _any_of(pairs: Iterable[tuple[str, int]]) -> Q:
    """Attempts matching any of the (job id, number) ``pairs``."""
    query = Q(pk__in=[])
    for job_id, number in pairs:
        query |= Q(job_id=job_id, number=number)
    return query


def _job_changes(rec: AttemptRecord, now: datetime) -> dict[str, Any]:
    """The columns postgres.UPDATE_JOBS sets, for one record."""
    # updated_at on the database's clock (Django's Now()), as postgres.UPDATE_JOBS.
    changes: dict[str, Any] = {"state": rec.job_state, "attempts": rec.attempt,
                               "updated_at": Now()}
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
