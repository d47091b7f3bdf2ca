"""Workflows: enqueue a graph of jobs in one transaction; push the jobs it releases.

The builders are in ``canvas.py`` (``chain``, ``group``, ``chord``,
``task.s(...)``), the rules that decide when a waiting job may run in
``mirror/dependencies.py``. This module joins them to the backend and the
broker:

- :func:`enqueue_plan` writes a whole workflow in one transaction: a
  ``Workflow`` row, every job through the backend's one enqueue (the calls
  of one task that wait for the same number of jobs in one bulk insert, a
  COPY on PostgreSQL), then every edge (one COPY). Jobs that wait for
  nothing are pushed on commit as any job is; waiting ones are not pushed.
- :func:`enqueue_after` is ``task.using(after=[...]).enqueue(...)``: jobs
  waiting for jobs that exist already (maybe ended already).
- :func:`push_released` receives ``jobs_released`` (sent after the commit
  that made jobs runnable) and pushes them. If the process dies first, the
  rows are queued with no Redis job, and reconcile pushes them once its
  grace has passed (crash point ``released_before_push``).
- :func:`progress` counts a workflow's jobs; :func:`retry_failed` and
  :func:`cancel_rest` act on a whole workflow through the staff actions
  (``staff.py``), so fencing and the mirror's rules stay those of one job.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from django.db import transaction
from django.db.models import Count, Q
from django.utils import timezone

from . import staff
from .broker import REDIS_ERRORS, epoch_ms
from .canvas import PASS_LIST, PASS_NO, Plan, WorkflowHandle
from .compat import InvalidTask, Task, TaskResult
from .faults import crash_point
from .jobids import new_job_id
from .mirror import dependencies, rebuilt_job
from .models import Job, JobState, Workflow
from .newjobs import PUSH_CHUNK
from .staff import StaffResult

if TYPE_CHECKING:
    from .backend import ReliableJobsBackend
    from .newjobs import Calls
    from .parts import BackendParts

logger = logging.getLogger("reliable_jobs")


def enqueue_plan(backend: ReliableJobsBackend, plan: Plan, *, name: str = "") -> WorkflowHandle:
    """Write every job and edge of ``plan`` in one transaction; the workflow's handle.

    Nodes are inserted by bucket, (task, jobs waited for), each bucket one
    bulk enqueue, so a group of 10,000 calls of one task costs one COPY.
    """
    backend._raise_if_misconfigured()  # E009 before a model is touched
    for node in plan.nodes:
        _check_joins(node.call.task)
        if node.call.task.backend != backend.alias:
            raise InvalidTask("Every job of a workflow must use the same backend "
                              f"({backend.alias!r}), not {node.call.task.backend!r}.")
    workflow_id = new_job_id()
    buckets: dict[tuple[Any, int], list[int]] = defaultdict(list)
    for index, node in enumerate(plan.nodes):
        buckets[(node.call.task, len(node.waits))].append(index)
    results: list[Any] = [None] * len(plan.nodes)
    with transaction.atomic(using=backend.database):
        Workflow.objects.using(backend.database).create(
            id=workflow_id, name=name[:200], total=len(plan.nodes), created_at=timezone.now())
        for (task, waits), indexes in buckets.items():
            calls = [(plan.nodes[i].call.args, plan.nodes[i].call.kwargs) for i in indexes]
            made = backend._enqueue(task, calls, None, waiting_for=waits,
                                    workflow_id=workflow_id)
            for i, result in zip(indexes, made, strict=True):
                results[i] = result
        dependencies.add(backend.database, [
            (results[i].id, results[upstream].id, node.call.on_failure, passes, position)
            for i, node in enumerate(plan.nodes) for upstream, passes, position in node.waits])
    return WorkflowHandle(workflow_id, results)


def enqueue_after(backend: ReliableJobsBackend, task: Task[..., Any], calls: Calls,
                  trace: str | None) -> list[TaskResult[..., Any]]:
    """Enqueue ``calls`` of ``task`` waiting for the jobs ``task.after`` names.

    In one transaction: the upstream rows are share-locked (an upstream
    ending now is either seen ended here or sees the new edges), the jobs
    inserted waiting, their edges written, then settled at once against
    the upstreams that ended already (all succeeded: they are queued now).
    """
    _check_joins(task)
    after: Sequence[str] = task.after  # type: ignore[attr-defined]  # a ReliableTask's
    passes = PASS_LIST if getattr(task, "pass_results", False) else PASS_NO
    policy = getattr(task, "on_failure", "cancel")
    upstreams = list(dict.fromkeys(after))
    database = backend.database
    with transaction.atomic(using=database):
        found = dependencies.lock_upstreams(database, upstreams)
        missing = [job_id for job_id in upstreams if job_id not in found]
        if missing:
            raise InvalidTask(f"after= names job(s) that do not exist: {', '.join(missing)}.")
        results = backend._enqueue(task, calls, trace, waiting_for=len(after))
        dependencies.add(database, [(result.id, upstream, policy, passes, position)
                                    for result in results
                                    for position, upstream in enumerate(after)])
        dependencies.settle(database, upstreams)
    return results


def _check_joins(task: Task[..., Any]) -> None:
    """Refuse a task that cannot wait in a workflow: a unique one (its key would be
    held by a waiting row, which the unique index does not count)."""
    if getattr(task, "unique_for_ms", None) is not None:
        raise InvalidTask(f"Task {task.module_path} is unique (unique_for_ms): it cannot be "
                          "part of a workflow.")


def push_released(sender: Any, *, using: str, job_ids: Sequence[str], **kwargs: Any) -> None:
    """Push the jobs a commit made runnable (receiver of ``dependencies.jobs_released``).

    Errors are logged, never raised: the commit stands, and reconcile
    pushes what this did not (the rows are queued, Redis lacks them).
    """
    from .backend import find_backend  # same layer: backend imports this module lazily

    crash_point("released_before_push")
    rows = list(Job.objects.using(using).filter(
        pk__in=job_ids, state__in=(JobState.QUEUED, JobState.SCHEDULED)))
    by_queue: dict[tuple[str, str], list[Job]] = defaultdict(list)
    for row in rows:
        by_queue[(row.backend, row.physical_queue)].append(row)
    now = timezone.now()
    for (alias, queue), jobs in by_queue.items():
        try:
            backend = find_backend(alias)
            pushes = [rebuilt_job(
                row, max_attempts=row.max_attempts, flow=backend.parts.flow_of,
                due_ms=epoch_ms(row.run_after) if row.run_after and row.run_after > now else 0)
                for row in jobs]
            for start in range(0, len(pushes), PUSH_CHUNK):  # as an enqueue pushes
                backend.broker.enqueue(queue, pushes[start:start + PUSH_CHUNK])
        except Exception as exc:
            logger.warning(
                "Could not push %d job(s) released by their dependencies to queue %r (%s); "
                "they are safe in the database and the recovery sweep will push them.",
                len(jobs), queue, exc, exc_info=not isinstance(exc, REDIS_ERRORS))


def progress(workflow_id: Any, *, using: str = "default") -> dict[str, int]:
    """A workflow's jobs by state, with ``total``, ``done`` (succeeded), ``failed`` (dead
    or cancelled) and ``skipped`` (callbacks on failure not needed, as every job they
    waited for succeeded: cancelled, but no failure): readable while it runs, one
    grouped count. The workflow has ended when done + failed + skipped == total."""
    not_needed = Q(last_error__startswith=dependencies.NOT_NEEDED, state=JobState.CANCELLED)
    rows = (Job.objects.using(using).filter(workflow_id=workflow_id).order_by()
            .values_list("state").annotate(n=Count("pk"), skipped=Count("pk", filter=not_needed))
            .values_list("state", "n", "skipped"))
    counts: dict[str, int] = {}
    skipped = 0
    for state, n, unneeded in rows:
        counts[state] = n
        skipped += unneeded
    return {**counts, "total": sum(counts.values()),
            "done": counts.get(JobState.SUCCEEDED, 0),
            "failed": counts.get(JobState.DEAD, 0) + counts.get(JobState.CANCELLED, 0) - skipped,
            "skipped": skipped}


@dataclass(frozen=True, slots=True)
class WorkflowAction:
    """What :func:`retry_failed` or :func:`cancel_rest` did to one workflow.

    ``acted``: the outcome of each job acted on through ``staff`` (retried,
    or cancelled through Redis), done or refused with the reason;
    ``waiting``: the jobs made to wait again (retry) or cancelled while they
    waited (cancel); ``left``: jobs the action leaves as they are, with why.
    """

    workflow_id: str
    verb: str
    acted: list[StaffResult] = field(default_factory=list)
    waiting: list[str] = field(default_factory=list)
    left: str = ""

    @property
    def done(self) -> list[StaffResult]:
        return [outcome for outcome in self.acted if outcome.done]

    @property
    def refused(self) -> list[StaffResult]:
        return [outcome for outcome in self.acted if not outcome.done]

    @property
    def message(self) -> str:
        """One sentence an admin message can show as it is."""
        if self.verb == "retried":
            said = (f"Workflow {self.workflow_id}: {len(self.done)} dead job(s) queued again, "
                    f"{len(self.waiting)} job(s) cancelled by a failure waiting again")
        else:
            said = (f"Workflow {self.workflow_id}: {len(self.waiting)} waiting job(s) and "
                    f"{len(self.done)} queued, scheduled or running job(s) cancelled")
        if self.refused:
            said += f"; {len(self.refused)} not changed ({self.refused[0].message})"
        return said + (f"; {self.left}." if self.left else ".")


#: Rounds of cancel_rest: a job released by a member ending during one
#: (pushed just after that commit) is cancelled by the next.
CANCEL_ROUNDS = 3


def retry_failed(workflow_id: Any, *, backend: str = "default") -> WorkflowAction:
    """Run a workflow again from its failures: its dead jobs, then what they cancelled.

    Each dead job is retried as staff retry one (``staff.retry``: fenced,
    a fresh attempt budget, rebuilt if Redis lost it); then the jobs that
    a failure cancelled wait again for the jobs that may now succeed
    (``dependencies.put_back``), and run once those succeed, each exactly
    once, as they would have. Jobs cancelled by staff, or by ``cancel_rest``,
    stay cancelled (requeue one from the job list to run it); so do the
    jobs whose failed upstream is not run again.
    """
    rj = _find(backend)
    database = rj.database
    dead = [str(pk) for pk in Job.objects.using(database).filter(
        workflow_id=workflow_id, state=JobState.DEAD).order_by("pk").values_list("pk", flat=True)]
    acted = [_staff(rj.parts, staff.retry, job_id) for job_id in dead]
    waiting = dependencies.put_back(database, workflow_id)
    kept = (Job.objects.using(database).filter(workflow_id=workflow_id, state=JobState.CANCELLED)
            .exclude(last_error__startswith=dependencies.NOT_NEEDED).count())
    left = f"{kept} cancelled job(s) stay cancelled" if kept else ""
    return WorkflowAction(str(workflow_id), "retried", acted, waiting, left)


def cancel_rest(workflow_id: Any, *, backend: str = "default") -> WorkflowAction:
    """Cancel every job of a workflow that has not finished; nothing of it runs after.

    The waiting jobs first, all in one transaction
    (``dependencies.cancel_waiting``: none is released by another's cancel),
    then each queued, scheduled or running job as staff cancel one
    (``staff.cancel_many``: ``staff.cancel``'s rules, a chunk per
    transaction: taken off Redis, or a running one stopped by its worker).
    A job released meanwhile by a member that ended is caught by the next
    round; a job Redis does not hold yet is reported as not changed.
    """
    rj = _find(backend)
    database = rj.database
    waiting: list[str] = []
    acted: dict[str, StaffResult] = {}
    for round_ in range(CANCEL_ROUNDS):
        waiting += dependencies.cancel_waiting(database, workflow_id)
        rest = [str(pk) for pk in Job.objects.using(database).filter(
            workflow_id=workflow_id, state__in=(JobState.QUEUED, JobState.SCHEDULED,
                                                JobState.RUNNING))
            .order_by("pk").values_list("pk", flat=True)]
        if not rest:
            break
        todo = [job_id for job_id in rest if not acted.get(job_id, _NOT_YET).done]
        try:
            acted.update((outcome.job_id, outcome)
                         for outcome in staff.cancel_many(rj.parts, todo))
        except REDIS_ERRORS as exc:
            acted.update((job_id, StaffResult(job_id, False, f"Redis did not answer ({exc}): "
                                              f"job {job_id} was not changed."))
                         for job_id in todo if job_id not in acted)
            break
        if all(outcome.done for outcome in acted.values()):
            break
        time.sleep(0.1 * (round_ + 1))  # a release's push follows its commit closely
    return WorkflowAction(str(workflow_id), "cancelled", list(acted.values()), waiting)


_NOT_YET = StaffResult("", False, "")


def _find(alias: str) -> ReliableJobsBackend:
    from .backend import find_backend  # same layer, deferred as in push_released

    return find_backend(alias)


def _staff(parts: BackendParts, action: Callable[[BackendParts, Any], StaffResult],
           job_id: str) -> StaffResult:
    """One staff action on one job; Redis not answering is a refusal, as in the admin."""
    try:
        return action(parts, job_id)
    except REDIS_ERRORS as exc:
        return StaffResult(job_id, False, f"Redis did not answer ({exc}): job {job_id} was "
                           "not changed.")
