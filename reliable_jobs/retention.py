"""Retention: delete the history of jobs that finished long ago (``prunejobs``).

Only finished jobs (succeeded, dead, cancelled) are ever deleted, in batches,
each batch in its own short transaction, so a prune of millions of rows
never holds long locks or one huge transaction. A dead job's Redis hash
(kept so staff can retry it) is forgotten in the same batch, before its row
goes: if the commit then fails, the row is still there and a retry rebuilds
the job from it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import TYPE_CHECKING

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from . import mirror

if TYPE_CHECKING:
    from .backend import ReliableJobsBackend

#: Default of ``prunejobs --older-than``, in days, when the project does not
#: set ``RELIABLE_JOBS_PRUNE_DAYS``.
DEFAULT_PRUNE_DAYS = 30
#: Jobs deleted per transaction.
DEFAULT_BATCH = 1_000
#: Redis states of a job not finished yet: its row is never pruned.
UNFINISHED_IN_REDIS = ("queued", "scheduled", "running")


def prune_days() -> float:
    """``settings.RELIABLE_JOBS_PRUNE_DAYS``, read when called so tests can override it."""
    return getattr(settings, "RELIABLE_JOBS_PRUNE_DAYS", DEFAULT_PRUNE_DAYS)


@dataclass
class PruneReport:
    """What one prune removed."""

    jobs: int = 0
    attempts: int = 0
    #: Jobs removed, by state.
    by_state: dict[str, int] = field(default_factory=dict)
    #: Dead jobs' hashes deleted from Redis.
    redis_hashes: int = 0
    batches: int = 0
    #: Finished rows left alone because Redis still holds their job unfinished.
    kept: int = 0


def prune_floor(backend: ReliableJobsBackend) -> timedelta:
    """The youngest a finished job may be and still be pruned: RECONCILE_GRACE_MS + LEASE_MS.

    A row that finished a moment ago may belong to a job Redis has not
    finished yet (an outcome mirrored before its ack, a cancel its worker
    has not heard of), and a late push of it is refused only while its
    tombstone can find the row's generation. Whatever ``--older-than`` says.
    """
    config = backend.config
    return timedelta(milliseconds=config.RECONCILE_GRACE_MS + config.LEASE_MS)


def prune(backend: ReliableJobsBackend, *, older_than: timedelta, batch: int = DEFAULT_BATCH,
          now: datetime | None = None) -> PruneReport:
    """Delete ``backend``'s jobs that finished (and were untouched) more than ``older_than``
    ago (at least :func:`prune_floor`), except those whose job Redis still holds unfinished."""
    cutoff = (now or timezone.now()) - max(older_than, prune_floor(backend))
    report = PruneReport()
    for state in mirror.FINISHED_STATES:
        keep: set[str] = set()
        while _prune_batch(backend, state, cutoff, batch, report, keep) == batch:
            continue
    return report


def _prune_batch(backend: ReliableJobsBackend, state: str, cutoff: datetime, batch: int,
                 report: PruneReport, keep: set[str]) -> int:
    """Delete one batch of ``state`` jobs in one transaction; returns how many were locked.

    A row whose job Redis still holds waiting or running (a job cancelled
    while it ran whose worker has not stopped it, an outcome not yet acked)
    is kept and added to ``keep``: deleting it would let recover run the job
    again with no row to settle it from.
    """
    database = backend.config.DATABASE
    with transaction.atomic(using=database):
        rows = mirror.lock_prunable(database, backend=backend.alias, state=state,
                                    unchanged_since=cutoff, limit=batch, keep=keep)
        if not rows:
            return 0
        # Every finished state, not only dead: a row can end succeeded while
        # Redis still buries the job (a lease expiry recorded after the
        # outcome), and nothing but this prune would ever forget that entry.
        by_queue: dict[str, list[str]] = {}
        for job_id, queue in rows:
            by_queue.setdefault(queue, []).append(str(job_id))
        for queue, ids in by_queue.items():
            held = backend.broker.held_states(queue, ids)
            running = {job_id for job_id, found in held.items()
                       if found["state"] in UNFINISHED_IN_REDIS}
            report.kept += len(running)
            keep |= running
            report.redis_hashes += backend.broker.purge(queue, [i for i in ids if i not in keep])
        jobs, attempts = mirror.delete_jobs(
            database, [job_id for job_id, _ in rows if str(job_id) not in keep])
    report.jobs += jobs
    report.attempts += attempts
    report.by_state[state] = report.by_state.get(state, 0) + jobs
    report.batches += 1
    return len(rows)
