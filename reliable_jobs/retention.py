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


def prune(backend: ReliableJobsBackend, *, older_than: timedelta, batch: int = DEFAULT_BATCH,
          now: datetime | None = None) -> PruneReport:
    """Delete ``backend``'s jobs that finished (and were untouched) more than ``older_than`` ago."""
    cutoff = (now or timezone.now()) - older_than
    report = PruneReport()
    for state in mirror.FINISHED_STATES:
        while _prune_batch(backend, state, cutoff, batch, report) == batch:
            continue
    return report


def _prune_batch(backend: ReliableJobsBackend, state: str, cutoff: datetime, batch: int,
                 report: PruneReport) -> int:
    """Delete one batch of ``state`` jobs in one transaction; returns how many were locked."""
    database = backend.config.DATABASE
    with transaction.atomic(using=database):
        rows = mirror.lock_prunable(database, backend=backend.alias, state=state,
                                    unchanged_since=cutoff, limit=batch)
        if not rows:
            return 0
        # Every finished state, not only dead: a row can end succeeded while
        # Redis still buries the job (a lease expiry recorded after the
        # outcome), and nothing but this prune would ever forget that entry.
        by_queue: dict[str, list[str]] = {}
        for job_id, queue in rows:
            by_queue.setdefault(queue, []).append(str(job_id))
        for queue, ids in by_queue.items():
            report.redis_hashes += backend.broker.purge(queue, ids)
        jobs, attempts = mirror.delete_jobs(database, [job_id for job_id, _ in rows])
    report.jobs += jobs
    report.attempts += attempts
    report.by_state[state] = report.by_state.get(state, 0) + jobs
    report.batches += 1
    return len(rows)
