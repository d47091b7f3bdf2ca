"""Staff actions on one job: retry, cancel, requeue, reprioritize (the admin calls these).

Each action runs in one database transaction that first locks the job's row,
then acts in Redis through the broker (an atomic script), then mirrors what
Redis did onto the row. Redis decides whether the action applies (the row
may lag behind it by a batch), and an action that cannot apply changes
nothing and says why: the returned :class:`StaffResult` is a whole sentence an
admin message can show as it is.

The row lock orders the action before any worker write about the attempt it
lets run. If Redis acted but the commit then fails, the job still runs and
the worker's own mirror writes bring the row up to date. A rebuild (a retry
of a job Redis no longer holds, a requeue of a cancelled job) is the one
exception to that order: a new generation is pushed only after the row
holding it has committed (see sweep.push_rebuilt), or the mirror would
refuse every record of the job Redis runs.

Each action takes ``backend.parts`` (a :class:`~reliable_jobs.parts.BackendParts`:
alias, settings, queues, broker), not the backend, so this module never
imports the backend that calls it (``backend.cancel``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from django.db import transaction
from django.utils import timezone

from . import mirror
from .broker import REDIS_ERRORS, NewJob
from .models import Job, JobState
from .sweep import TOMBSTONES, push_rebuilt
from .tasks import discover, lookup

if TYPE_CHECKING:
    from .parts import BackendParts

#: Django's priority range (django.tasks' TASK_MIN_PRIORITY / TASK_MAX_PRIORITY).
MIN_PRIORITY, MAX_PRIORITY = -100, 100

#: Largest payload a rebuild may write: the row was accepted when it was
#: enqueued, so a later, smaller MAX_PAYLOAD_BYTES must not strand it.
REBUILD_MAX_BYTES = 10 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class StaffResult:
    """What an action did to one job, or why it did nothing."""

    job_id: str
    done: bool
    message: str


def retry(parts: BackendParts, job_id: Any) -> StaffResult:
    """Queue a dead job again with a fresh attempt budget, keeping its history.

    Attempt numbers keep counting (they are fencing tokens): the budget
    becomes attempts spent + the task's ``max_attempts``. A dead job whose
    hash Redis no longer holds (Redis restarted empty) is rebuilt from the
    row, as reconcile rebuilds lost jobs.
    """
    database = parts.config.DATABASE
    rebuild: NewJob | None = None
    with transaction.atomic(using=database):
        job = mirror.lock_job(database, job_id)
        if job is None:
            return _gone(job_id)
        jid = str(job.pk)
        if job.state != JobState.DEAD:
            return StaffResult(jid, False,
                               f"Job {jid} is {job.state}, not dead: it was not retried.")
        extra = fresh_budget(parts, job)
        held = parts.broker.held_states(job.physical_queue, [jid]).get(jid)
        if held is None:
            mirror.next_generation(database, [job])
            attempts = job.attempts
            rebuild = _rebuilt(parts, job, max_attempts=attempts + extra)
        elif held["state"] == JobState.DEAD:
            attempts = max(job.attempts, int(held["attempts"]))
            if not parts.broker.revive(job.physical_queue, jid, extra_attempts=extra):
                return _redis_moved(jid, "retried")
        else:
            return StaffResult(jid, False, f"Job {jid} is dead in the database but "
                           f"{held['state']} in Redis, which is ahead: it was not retried.")
        mirror.mark_queued_again(database, job, max_attempts=attempts + extra)
    if rebuild is not None and (refused := _push(parts, job, rebuild, "retried")):
        return refused
    return StaffResult(jid, True, f"Job {jid} is queued again with {extra} more "
                   f"attempt{'s' if extra != 1 else ''} (attempts {attempts + 1} to "
                   f"{attempts + extra}).")


def cancel(parts: BackendParts, job_id: Any) -> StaffResult:
    """Cancel an unfinished job: a waiting one never runs, a running one is stopped.

    Redis decides (``cancel.lua``): a queued or scheduled job is taken off
    its list; a job a worker holds is marked for cancellation, and its
    worker stops it (kills its child process, or tells its thread through
    the task's context) and records its attempt as cancelled, whatever the
    task then does. A job Redis does not hold (its push on the way, or lost
    and soon rebuilt) is left for the caller to try again.

    The row is locked first and marked cancelled in the same transaction:
    a worker's outcome that reached the mirror first wins (the job has
    finished: nothing is cancelled), one that comes later finds the row
    cancelled and is recorded as a cancelled attempt (mirror/). Either
    way the job ends one of the two, and its history says which.
    """
    database = parts.config.DATABASE
    with transaction.atomic(using=database):
        job = mirror.lock_job(database, job_id)
        if job is None:
            return _gone(job_id)
        outcome, mark = _cancel_locked(parts, job)
        if mark:
            mirror.mark_cancelled(database, outcome.job_id)
    return outcome


#: Jobs :func:`cancel_many` cancels per transaction.
CANCEL_CHUNK = 200


def cancel_many(parts: BackendParts, job_ids: Sequence[Any]) -> list[StaffResult]:
    """:func:`cancel` for many jobs (a workflow's rest): the same rules and sentences,
    a chunk of rows per transaction.

    Each chunk's rows are locked first, in id order (as a worker's batch
    locks them), then Redis decides for each job (``cancel.lua``, one call a
    job), then the jobs it cancelled are marked in one write and their
    dependents settled once (``mirror.mark_cancelled_many``). A chunk holds
    its locks for a few tens of milliseconds.
    """
    database = parts.config.DATABASE
    outcomes: dict[str, StaffResult] = {}
    ordered = sorted(dict.fromkeys(str(job_id) for job_id in job_ids))
    for start in range(0, len(ordered), CANCEL_CHUNK):
        chunk = ordered[start:start + CANCEL_CHUNK]
        with transaction.atomic(using=database):
            rows = {str(job.pk): job for job in Job.objects.using(database)
                    .select_for_update().filter(pk__in=chunk).order_by("pk")}
            marked = []
            for jid in chunk:
                if jid not in rows:
                    outcomes[jid] = _gone(jid)
                    continue
                outcomes[jid], mark = _cancel_locked(parts, rows[jid])
                if mark:
                    marked.append(jid)
            mirror.mark_cancelled_many(database, marked)
    return [outcomes[str(job_id)] for job_id in job_ids]


def _cancel_locked(parts: BackendParts, job: Job) -> tuple[StaffResult, bool]:
    """:func:`cancel`'s rule for one locked row: what it did, and whether the row is to be
    marked cancelled (Redis cancelled it, or it was waiting and never in Redis)."""
    jid = str(job.pk)
    if job.state in mirror.FINISHED_STATES:
        return StaffResult(jid, False, f"Job {jid} has finished ({job.state}): there is "
                           "nothing to cancel."), False
    if job.state == JobState.WAITING:
        # Never pushed (it waits for other jobs): nothing in Redis to take off.
        return StaffResult(jid, True, f"Job {jid} was cancelled while it waited for other "
                           "jobs: it will not run, nor will the jobs waiting for it."), True
    cancelled, found = parts.broker.cancel(job.physical_queue, jid)
    if not cancelled:
        if not found:
            return StaffResult(jid, False, f"Job {jid} is not in Redis yet (its push is on "
                               "the way, or the recovery sweep is rebuilding it): it was not "
                               "cancelled; try again in a minute."), False
        return StaffResult(jid, False, f"Job {jid} is {found} in Redis: it was not "
                           "cancelled."), False
    if found == JobState.RUNNING:
        return StaffResult(jid, True, f"Job {jid} was cancelled while running: its worker "
                           "stops it and it will not run again."), True
    return StaffResult(jid, True, f"Job {jid} was cancelled ({found}, taken off Redis): it "
                       "will not run."), True


def requeue(parts: BackendParts, job_id: Any) -> StaffResult:
    """Run a job now: a scheduled job stops waiting, a cancelled one is queued again.

    A cancelled job gets back the attempts it had left (a fresh budget if it
    had none). Dead jobs are for :func:`retry`; queued and running jobs need
    nothing.
    """
    database = parts.config.DATABASE
    rebuild: NewJob | None = None
    with transaction.atomic(using=database):
        job = mirror.lock_job(database, job_id)
        if job is None:
            return _gone(job_id)
        jid = str(job.pk)
        future = job.run_after is not None and job.run_after > timezone.now()
        if job.state == JobState.CANCELLED:
            held = parts.broker.held_states(job.physical_queue, [jid]).get(jid)
            if held is not None and held["state"] not in TOMBSTONES:
                # Cancelled while running, and its worker has not stopped it yet.
                return StaffResult(jid, False, f"Job {jid} is cancelled but still "
                               f"{held['state']} in Redis: it was not requeued; try again "
                               "once it has stopped.")
            mirror.next_generation(database, [job])
            budget = (job.max_attempts if job.max_attempts > job.attempts
                      else job.attempts + fresh_budget(parts, job))
            rebuild = _rebuilt(parts, job, max_attempts=budget)
            mirror.mark_queued_again(database, job, max_attempts=budget, clear_run_after=future)
        elif job.state == JobState.DEAD:
            return StaffResult(jid, False, f"Job {jid} is dead: use the retry action, which "
                           "gives it a fresh attempt budget.")
        elif job.state == JobState.SUCCEEDED:
            return StaffResult(jid, False, f"Job {jid} succeeded: it was not requeued.")
        else:
            moved, found = parts.broker.requeue(job.physical_queue, jid)
            if not moved:
                shown = found or "not in Redis yet"
                return StaffResult(jid, False, f"Job {jid} is {shown}, not scheduled: only a "
                               "waiting job can be run now; it was not requeued.")
            mirror.mark_queued_again(database, job, max_attempts=job.max_attempts,
                                     clear_run_after=future)
    if rebuild is None:
        return StaffResult(jid, True, f"Job {jid} was scheduled and is queued now.")
    if refused := _push(parts, job, rebuild, "requeued"):
        return refused
    return StaffResult(jid, True, f"Job {jid} was cancelled and is queued again "
                   f"({rebuild.max_attempts - job.attempts} attempts left).")


def reprioritize(parts: BackendParts, job_id: Any, priority: int) -> StaffResult:
    """Give a job that waits (queued or scheduled) another priority.

    Redis decides (``reprioritize.lua``): a queued job moves to its new
    priority's list, a scheduled one is promoted onto it when due, and a job
    a worker already claimed is left alone. The row records the new
    priority, so a rebuild from the mirror keeps it.
    """
    if (isinstance(priority, bool) or not isinstance(priority, int)
            or not MIN_PRIORITY <= priority <= MAX_PRIORITY):
        return StaffResult(str(job_id), False, f"Priority {priority!r} is not a whole number from "
                       f"{MIN_PRIORITY} to {MAX_PRIORITY}: job {job_id} was not changed.")
    database = parts.config.DATABASE
    with transaction.atomic(using=database):
        job = mirror.lock_job(database, job_id)
        if job is None:
            return _gone(job_id)
        jid = str(job.pk)
        if job.state not in (JobState.QUEUED, JobState.SCHEDULED):
            return StaffResult(jid, False, f"Job {jid} is {job.state}: only a queued or scheduled "
                           "job's priority can be changed; it was not changed.")
        changed, found, old = parts.broker.reprioritize(job.physical_queue, jid, priority)
        if not changed:
            if found in (JobState.QUEUED, JobState.SCHEDULED) and old == priority:
                if job.priority != priority:
                    mirror.mark_priority(database, jid, priority)  # the row lagged behind
                return StaffResult(jid, False, f"Job {jid} already has priority {priority}.")
            if not found:
                return StaffResult(jid, False, f"Job {jid} is not in Redis yet (its push is on "
                               "the way, or the recovery sweep is rebuilding it): its priority "
                               "was not changed; try again in a minute.")
            return StaffResult(jid, False, f"Job {jid} is {found} in Redis: its priority was not "
                           "changed.")
        mirror.mark_priority(database, jid, priority)
    return StaffResult(jid, True, f"Job {jid} now has priority {priority} (it had {old}).")


def fresh_budget(parts: BackendParts, job: Job) -> int:
    """The attempts a retry adds: the task's ``max_attempts``, else the backend's."""
    task = lookup(job.task_path)
    if task is None:
        discover()  # the admin process may not have imported the tasks modules yet
        task = lookup(job.task_path)
    if task is None:
        return parts.config.MAX_ATTEMPTS
    return int(parts.task_option(task, "max_attempts"))


def _rebuilt(parts: BackendParts, job: Job, *, max_attempts: int) -> NewJob:
    """The Redis job for a row, due now, attempts kept (see mirror.rebuilt_job)."""
    return mirror.rebuilt_job(job, max_attempts=max_attempts, max_bytes=REBUILD_MAX_BYTES,
                              flow=parts.flow_of)


def _push(parts: BackendParts, job: Job, rebuild: NewJob, verb: str
          ) -> StaffResult | None:
    """Push a rebuild whose row is committed; None when Redis took it, else why not.

    A push that Redis cannot take leaves the row queued with its new
    generation and no Redis job: reconcile pushes it after the grace.
    """
    jid = str(job.pk)
    try:
        taken = push_rebuilt(parts.broker, parts.config.DATABASE, job.physical_queue,
                             [rebuild])
    except REDIS_ERRORS as exc:
        return StaffResult(jid, True, f"Job {jid} was {verb} in the database, but Redis did not "
                       f"take it ({exc}): the recovery sweep pushes it within "
                       f"{parts.config.RECONCILE_GRACE_MS // 1000} s.")
    return None if taken == [True] else _redis_moved(jid, verb)


def _gone(job_id: Any) -> StaffResult:
    return StaffResult(str(job_id), False, f"Job {job_id} no longer exists (pruned?).")


def _redis_moved(jid: str, verb: str) -> StaffResult:
    return StaffResult(jid, False, f"Job {jid} changed in Redis meanwhile: it was not {verb}; "
                   "reload and try again.")
