"""Dependencies between jobs: written with a workflow, settled by the write that ends a job.

The database decides when a dependent job may run, in the transaction that
records its last dependency's end, so a fan-in fires exactly once:

- every write that ends a job (a worker's or the sweep's batch, ``bury``,
  ``mark_cancelled``) calls :func:`settle` with the jobs it wrote, before it
  commits, holding their rows (rule "lock order": they were locked first);
- :func:`settle` marks each unsettled edge of a job that has ended
  (``Dependency.state`` '' -> the job's state, its result copied), then
  locks the dependents in id order and takes each one's ``waiting_for``
  down by the edges settled: the one write that reaches 0 makes it queued
  (or scheduled), its results put in front of its arguments. The counter is
  read under the dependent's row lock, so of two writes settling its last
  two edges at once the second waits for the first's commit and sees 0
  (it can fire neither twice nor never);
- an edge whose upstream ended dead or cancelled cancels its dependent
  under the ``cancel`` policy (and, in the same loop, the jobs that wait for
  that one), or counts as settled under ``run``; under ``only`` (a callback
  on failure) it releases the dependent at once, and the write that settles
  the last edge of one whose upstreams all succeeded cancels it as not
  needed (``CallbackNotNeeded``);
- the jobs made runnable are announced by :data:`jobs_released` once the
  transaction has committed (``workflows.py`` pushes them). A push lost to
  a crash leaves a queued row Redis lacks: reconcile pushes it after its
  grace, as it pushes any committed job whose on-commit push was lost.

A producer adding edges to jobs that exist already (``after=``) takes a
share lock on them first (:func:`lock_upstreams`), so an upstream ending at
that moment either committed before (its state is seen, and :func:`settle`
runs for it here) or waits for this commit (and its own settle sees the
new edges).
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable, Sequence
from functools import partial
from typing import Any

from django.db import connections, transaction
from django.db.models.functions import Now
from django.dispatch import Signal
from django.utils import timezone

from ..exceptions import CallbackNotNeeded, UpstreamFailed, class_path
from ..models import Dependency, Job, JobState, OnFailure, PassResult, Workflow
from .records import FINISHED_STATES, chunks, new_state

#: Sent after a commit that made waiting jobs runnable: ``using`` (the
#: database alias) and ``job_ids`` (their ids, as text).
jobs_released = Signal()

#: One edge as a producer writes it: (dependent id, upstream id, on_failure,
#: passes, position).
Edge = tuple[str, str, str, int, int]

#: Rows per COPY write of edges.
_COPY_CHUNK = 5000


def add(using: str, edges: Sequence[Edge]) -> None:
    """Insert ``edges`` in the caller's transaction (COPY on PostgreSQL)."""
    if not edges:
        return
    if connections[using].vendor == "postgresql":
        table = Dependency._meta.db_table
        columns = "job_id, upstream_id, state, on_failure, passes, position"
        with (connections[using].cursor() as cursor,
              cursor.cursor.copy(f"COPY {table} ({columns}) FROM STDIN") as copy):
            for chunk in chunks(edges, _COPY_CHUNK):
                copy.write("".join(f"{job}\t{up}\t\t{policy}\t{passes}\t{position}\n"
                                   for job, up, policy, passes, position in chunk))
        return
    Dependency.objects.using(using).bulk_create(
        [Dependency(job_id=job, upstream_id=up, on_failure=policy, passes=passes,
                    position=position) for job, up, policy, passes, position in edges],
        batch_size=500)


def lock_upstreams(using: str, job_ids: Sequence[str]) -> set[str]:
    """Share-lock the rows of jobs a new job will wait for; the ids that have a row.

    FOR SHARE conflicts with the lock every write that ends a job takes, so
    no upstream ends between this look and the commit of the new edges
    without seeing them. (SQLite: the transaction's write lock does it.)
    """
    if not job_ids:
        return set()
    if connections[using].vendor == "postgresql":
        with connections[using].cursor() as cursor:
            cursor.execute(f"SELECT id FROM {Job._meta.db_table} WHERE id = ANY(%s::uuid[]) "
                           "ORDER BY id FOR SHARE", [list(job_ids)])
            return {str(pk) for (pk,) in cursor.fetchall()}
    return {str(pk) for pk in Job.objects.using(using).filter(pk__in=job_ids)
            .values_list("pk", flat=True)}


def settle(using: str, job_ids: Iterable[str]) -> list[str]:
    """Settle the edges of those of ``job_ids`` that have ended; the jobs it made runnable.

    Runs in the caller's transaction, which holds the rows of ``job_ids``.
    Idempotent: an edge is settled once (its ``state`` leaves ''), so a
    superset of the jobs that ended, or a second call, changes nothing.
    The jobs made runnable are sent with :data:`jobs_released` on commit.
    """
    released: list[str] = []
    frontier = list(dict.fromkeys(str(job_id) for job_id in job_ids))
    while frontier:
        pending = _unsettled(using, frontier)
        if not pending:
            break
        ended = {str(pk): (state, value, error) for ids in chunks(
            list({str(edge[2]) for edge in pending})) for pk, state, value, error in
            Job.objects.using(using).filter(pk__in=ids, state__in=FINISHED_STATES)
            .values_list("pk", "state", "return_value", "last_error")}
        settled = [edge for edge in pending if str(edge[2]) in ended]
        if not settled:
            break
        _mark_edges(using, settled, ended)
        frontier = []
        counts: dict[str, int] = defaultdict(int)
        failed: dict[str, str] = {}
        only: set[str] = set()  # callbacks on failure (policy "only")
        fired: set[str] = set()  # ... one of whose upstreams failed now
        for _, job, upstream, policy, _ in settled:
            counts[str(job)] += 1
            state = ended[str(upstream)][0]
            if policy == OnFailure.ONLY:
                only.add(str(job))
                if state != JobState.SUCCEEDED:
                    fired.add(str(job))
            elif state != JobState.SUCCEEDED and policy == OnFailure.CANCEL:
                failed.setdefault(str(job), f"job {upstream} ended {state}")
        for job_id, waiting_for, run_after in _lock_waiting(using, sorted(counts)):
            left = max(0, waiting_for - counts[job_id])
            rows = Job.objects.using(using).filter(pk=job_id)
            if job_id in failed:
                rows.update(state=JobState.CANCELLED, waiting_for=left, finished_at=timezone.now(),
                            updated_at=Now(), last_error=f"{class_path(UpstreamFailed)}: "
                            f"{failed[job_id]}, so this job was cancelled")
                frontier.append(job_id)  # its own dependents are settled in the next round
            elif job_id in fired or (left == 0 and job_id not in only):
                # A callback on failure runs at the first failure, under this row
                # lock: a second failure's write waits, then finds it no longer waiting.
                _release(using, job_id, run_after)
                released.append(job_id)
            elif left == 0:
                rows.update(state=JobState.CANCELLED, waiting_for=0, finished_at=timezone.now(),
                            updated_at=Now(), last_error=f"{class_path(CallbackNotNeeded)}: "
                            "every job it waited for succeeded, so this callback on failure "
                            "was not needed")
                frontier.append(job_id)
            else:
                rows.update(waiting_for=left)
    if released:
        transaction.on_commit(partial(jobs_released.send, sender=Dependency, using=using,
                                      job_ids=tuple(released)), using=using, robust=True)
    return released


#: _mark_edges on PostgreSQL: one statement for every edge of a batch, the
#: result copied from the upstream's row (or its failure, as a JSON object).
MARK_EDGES = f"""
UPDATE {Dependency._meta.db_table} AS d SET state = j.state,
    result = CASE WHEN d.passes = 0 THEN NULL
                  WHEN j.state = 'succeeded' THEN j.return_value
                  ELSE jsonb_build_object('failed', j.state, 'job', j.id::text,
                                          'error', j.last_error) END
FROM {Job._meta.db_table} AS j
WHERE d.id = ANY(%s) AND d.upstream_id = j.id AND d.state = ''
"""


#: _unsettled on PostgreSQL: the ids as one text parameter (a worker batch's
#: hundreds of ids cost the driver one value to adapt, not one each).
UNSETTLED = f"""
SELECT id, job_id, upstream_id, on_failure, passes FROM {Dependency._meta.db_table}
WHERE upstream_id = ANY(string_to_array(%s, ',')::uuid[]) AND state = ''
"""


def _unsettled(using: str, job_ids: list[str]) -> list[tuple[Any, ...]]:
    """The unsettled edges of ``job_ids`` (the one query every write that ends jobs makes)."""
    if connections[using].vendor == "postgresql":
        with connections[using].cursor() as cursor:
            cursor.execute(UNSETTLED, [",".join(job_ids)])
            return list(cursor.fetchall())
    return [edge for ids in chunks(job_ids) for edge in Dependency.objects.using(using).filter(
        upstream_id__in=ids, state="").values_list(
        "pk", "job_id", "upstream_id", "on_failure", "passes")]


def _mark_edges(using: str, settled: list[tuple[Any, ...]],
                ended: dict[str, tuple[str, Any, str]]) -> None:
    """Write each settled edge's state, and the result its dependent takes (if it passes one)."""
    if connections[using].vendor == "postgresql":
        with connections[using].cursor() as cursor:
            cursor.execute(MARK_EDGES, [[edge[0] for edge in settled]])
        return
    deps = Dependency.objects.using(using)
    plain: dict[str, list[Any]] = defaultdict(list)
    for pk, _, upstream, _, passes in settled:
        state, value, error = ended[str(upstream)]
        if passes == PassResult.NO:
            plain[state].append(pk)
            continue
        result = value if state == JobState.SUCCEEDED else {
            "failed": state, "job": str(upstream), "error": error}
        deps.filter(pk=pk, state="").update(state=state, result=result)
    for state, pks in plain.items():
        for ids in chunks(pks):
            deps.filter(pk__in=ids, state="").update(state=state)


def _lock_waiting(using: str, job_ids: Sequence[str]) -> list[tuple[str, int, Any]]:
    """Lock, in id order, those of ``job_ids`` still waiting; (id, waiting_for, run_after) each."""
    jobs = Job.objects.using(using).select_for_update(no_key=True)
    return [(str(pk), waiting_for, run_after) for ids in chunks(job_ids)
            for pk, waiting_for, run_after in jobs.filter(pk__in=ids, state=JobState.WAITING)
            .order_by("pk").values_list("pk", "waiting_for", "run_after")]


def _release(using: str, job_id: str, run_after: Any) -> None:
    """Make a waiting job runnable: its results in front of its arguments, queued or scheduled."""
    rows = Job.objects.using(using).filter(pk=job_id)
    changes: dict[str, Any] = {"state": new_state(run_after, timezone.now()), "waiting_for": 0,
                               "updated_at": Now()}
    passed = list(Dependency.objects.using(using).filter(job_id=job_id).exclude(
        passes=PassResult.NO).order_by("position").values_list("passes", "result"))
    if passed:
        [args] = rows.values_list("args", flat=True)
        first = passed[0][1] if passed[0][0] == PassResult.VALUE else [r for _, r in passed]
        # Through JSON once: what the worker decodes is exactly what was stored.
        changes["args"] = [json.loads(json.dumps(first)), *args]
    rows.update(**changes)


#: The error :func:`settle` writes on a job it cancels because an upstream
#: failed, and on a callback on failure it cancels as not needed: how
#: :func:`put_back` and ``workflows.progress()`` tell them from staff cancels.
UPSTREAM_FAILED = f"{class_path(UpstreamFailed)}:"
NOT_NEEDED = f"{class_path(CallbackNotNeeded)}:"
#: States of an upstream that may still succeed (or did): a dependent it
#: cancelled may wait for it again.
MAY_SUCCEED = (JobState.WAITING, JobState.SCHEDULED, JobState.QUEUED, JobState.RUNNING,
               JobState.SUCCEEDED)
_FAILED_EDGE = (JobState.DEAD, JobState.CANCELLED)


def put_back(using: str, workflow_id: Any) -> list[str]:
    """Make the jobs of a workflow that a failure cancelled wait again; their ids.

    ``workflows.retry_failed`` calls it once the dead jobs are queued again.
    A job cancelled by :func:`settle` (its error ``UpstreamFailed``) waits
    again when every failed upstream that cancelled it may now succeed (it
    is queued, running, waiting... or succeeded meanwhile) or is put back
    here too; its edges to those upstreams are unsettled again, and its
    ``waiting_for`` is the count of its unsettled edges. Jobs staff
    cancelled stay cancelled, and so do the jobs whose failed upstream stays
    failed (dead and not retried, cancelled by staff).

    One transaction, the protocol of ``after=``: the workflow's row first
    (two put-backs of one workflow run one after the other), the cancelled
    rows, then a share lock on every upstream (:func:`lock_upstreams`): an
    upstream ending now either committed first (seen ended here, and
    :func:`settle` settles the edge at once, releasing the job if it was the
    last) or waits for this commit (and its own settle sees the edge).
    """
    with transaction.atomic(using=using):
        list(Workflow.objects.using(using).select_for_update().filter(pk=workflow_id)
             .values_list("pk", flat=True))
        cancelled = [str(pk) for pk in Job.objects.using(using).select_for_update(no_key=True)
                     .filter(workflow_id=workflow_id, state=JobState.CANCELLED,
                             last_error__startswith=UPSTREAM_FAILED)
                     .order_by("pk").values_list("pk", flat=True)]
        if not cancelled:
            return []
        edges: dict[str, list[tuple[Any, str, str, str]]] = defaultdict(list)
        for ids in chunks(cancelled):
            for pk, dependent, upstream, state, policy in Dependency.objects.using(using).filter(
                    job_id__in=ids).values_list("pk", "job_id", "upstream_id", "state",
                                                "on_failure"):
                edges[str(dependent)].append((pk, str(upstream), state, policy))
        upstreams = sorted({edge[1] for job_edges in edges.values() for edge in job_edges})
        lock_upstreams(using, upstreams)
        now_in: dict[str, str] = {str(pk): state for ids in chunks(upstreams) for pk, state in
                                  Job.objects.using(using).filter(pk__in=ids)
                                  .values_list("pk", "state")}
        back = set(cancelled)

        def may_succeed(upstream: str) -> bool:
            return upstream in back or now_in.get(upstream) in MAY_SUCCEED

        shrinking = True
        while shrinking:  # the largest set whose every cause may now succeed
            shrinking = False
            for job in sorted(back):
                if any(state in _FAILED_EDGE and policy == OnFailure.CANCEL
                       and not may_succeed(upstream) for _, upstream, state, policy in edges[job]):
                    back.discard(job)
                    shrinking = True
        reset: list[Any] = []
        by_count: dict[int, list[str]] = defaultdict(list)
        for job in sorted(back):
            again = [pk for pk, upstream, state, _ in edges[job]
                     if state in _FAILED_EDGE and may_succeed(upstream)]
            reset.extend(again)
            by_count[len(again) + sum(state == "" for _, _, state, _ in edges[job])].append(job)
        for ids in chunks(reset):
            Dependency.objects.using(using).filter(pk__in=ids).update(state="", result=None)
        for waiting_for, jobs in by_count.items():
            for ids in chunks(jobs):
                Job.objects.using(using).filter(pk__in=ids).update(
                    state=JobState.WAITING, waiting_for=waiting_for, finished_at=None,
                    last_error="", updated_at=Now())
        # Upstreams that succeeded meanwhile: their edges settle (and may release) now.
        settle(using, sorted({upstream for job in back for _, upstream, state, _ in edges[job]
                              if now_in.get(upstream) == JobState.SUCCEEDED}))
        return sorted(back)


def cancel_waiting(using: str, workflow_id: Any) -> list[str]:
    """Cancel, in one transaction, every job of a workflow that still waits; their ids.

    What ``staff.cancel`` does to one waiting job (``mark_cancelled``), for
    all of them at once: they are locked in id order, as :func:`settle`
    locks waiting jobs, so a write releasing one of them at this moment
    either committed first (the job is no longer waiting, and is left to
    the caller's cancel through Redis) or waits and finds it cancelled.
    None of them is then released by another's cancel: all go together.
    """
    with transaction.atomic(using=using):
        waiting = [str(pk) for pk in Job.objects.using(using).select_for_update(no_key=True)
                   .filter(workflow_id=workflow_id, state=JobState.WAITING)
                   .order_by("pk").values_list("pk", flat=True)]
        now = timezone.now()
        for ids in chunks(waiting):
            Job.objects.using(using).filter(pk__in=ids).update(
                state=JobState.CANCELLED, finished_at=now, updated_at=Now())
        settle(using, waiting)  # jobs outside the workflow (after=) may wait for them
        return waiting
