"""What recovery reads from the mirror (the sweep's reconcile and recover, staff rebuilds).

Reads only, except that they lock: a row another transaction holds is
skipped, never waited for, and the next pass sees what that transaction
did. The writes recovery makes go through the package's write API; what a row
becomes in Redis again is :func:`rebuilt_job`.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.db import connections
from django.db.models import Max, Q
from django.utils import timezone

from .. import payload
from ..broker.records import NewJob
from ..models import UNFINISHED_STATES, Attempt, AttemptOutcome, Job, JobState
from .records import is_uuid


def rebuilt_job(row: Job, *, max_attempts: int, due_ms: int = 0,
                max_bytes: int = sys.maxsize,
                flow: Callable[[str, list[Any], dict[str, Any]], str] | None = None) -> NewJob:
    """The Redis job for a mirror row, its attempts kept: how a lost job comes back.

    Reconcile rebuilds what Redis lost; a staff retry rebuilds a dead job
    Redis no longer holds. The caller has locked the row and given it its
    next generation (:func:`next_generation`), so no token from before the
    rebuild matches. The row was accepted when it was enqueued, so the
    current MAX_PAYLOAD_BYTES is not applied again. The row's priority
    comes back with it (staff changes of it are mirrored onto the row), and
    so do its flow limits: ``flow`` (the backend's ``flow_of``) spells them
    again from the task's options and the call; its fair group comes back
    too.
    """
    path = row.task_path
    text = payload.encode(path, tuple(row.args), dict(row.kwargs), max_bytes=max_bytes,
                          flow=None if flow is None else (lambda a, k: flow(path, a, k)))
    return NewJob(str(row.pk), text, max_attempts, due_ms=due_ms, attempts=row.attempts,
                  gen=row.generation, priority=row.priority, group=row.fair_key)


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
    ids = [job_id for job_id in job_ids if is_uuid(job_id)]
    jobs = Job.objects.using(using)
    locked = {str(pk): RowState(state, attempts, generation, error)
              for pk, state, attempts, generation, error in
              jobs.select_for_update(skip_locked=True).filter(pk__in=ids).values_list(
                  "pk", "state", "attempts", "generation", "last_error")}
    existing = {str(pk) for pk in jobs.filter(pk__in=ids).values_list("pk", flat=True)}
    return {**dict.fromkeys(existing - set(locked), LOCKED_ELSEWHERE), **locked}


def snoozed_attempts(using: str, attempts: Sequence[tuple[str, int]]) -> set[str]:
    """Of these (job id, attempt number) pairs, the jobs whose attempt is recorded snoozed.

    The sweep asks about expired attempts whose row waits again after them:
    a snooze the mirror has but Redis never got (its worker died between
    the two) is settled as a snooze, not charged as a lost attempt.
    """
    if not attempts:
        return set()
    query = Q(pk__in=[])
    for job_id, number in attempts:
        query |= Q(job_id=job_id, number=number)
    return {str(job_id) for job_id in Attempt.objects.using(using).filter(
        query, outcome=AttemptOutcome.SNOOZED).values_list("job_id", flat=True)}


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
    :func:`reliable_jobs.mirror.mark_rebuilt` (or a staff write) then
    writes them.
    """
    if not rows:
        return
    highest = dict(Attempt.objects.using(using).filter(job_id__in=[row.pk for row in rows])
                   .values("job_id").annotate(top=Max("number")).values_list("job_id", "top"))
    for row in rows:
        row.generation += 1
        row.attempts = max(row.attempts, highest.get(row.pk) or 0)


def lock_recent_cancels(using: str, *, backend: str, since: datetime, after_id: str | None,
                        limit: int) -> list[Job]:
    """Lock, in id order after ``after_id``, the jobs cancelled since ``since``.

    For the caller's transaction. A row another transaction holds (a staff
    requeue making it unfinished again) is skipped, not waited for.
    """
    rows = Job.objects.using(using).select_for_update(skip_locked=True).filter(
        backend=backend, state=JobState.CANCELLED, updated_at__gte=since)
    if after_id is not None:
        rows = rows.filter(pk__gt=after_id)
    return list(rows.order_by("pk")[:limit])


def existing(using: str, job_ids: Sequence[str]) -> set[str]:
    """Those of ``job_ids`` that have a row (ids that are no UUID never do)."""
    ids = [job_id for job_id in job_ids if is_uuid(job_id)]
    return {str(pk) for pk in Job.objects.using(using).filter(pk__in=ids)
            .values_list("pk", flat=True)}
