"""The recovery sweep: recover expired leases, promote due jobs, reconcile.

Run by ``manage.py recoverjobs`` (cron-able, or ``--interval`` to loop) and
by every worker on a timer, so a deployment without a sweep process still
recovers. Every step is safe to run from many processes at once: Redis steps
are atomic scripts and reconcile's push skips jobs Redis already holds.
"""

from __future__ import annotations

import logging
import sys
from collections import defaultdict
from dataclasses import dataclass, fields
from datetime import datetime, timedelta
from typing import TYPE_CHECKING

from django.db import DatabaseError
from django.utils import timezone

from . import mirror, payload
from .broker import NewJob
from .faults import crash_point
from .mirror import AttemptRecord
from .models import Job, JobState

if TYPE_CHECKING:
    from .backend import ReliableJobsBackend

logger = logging.getLogger("reliable_jobs.sweep")

#: Rows reconcile reads per database query and checks per Redis pipeline.
RECONCILE_BATCH = 500


@dataclass
class SweepReport:
    """Counts of one pass, printed by ``recoverjobs``."""

    requeued: int = 0
    dead: int = 0
    orphans: int = 0
    garbage: int = 0
    promoted: int = 0
    checked: int = 0
    pushed: int = 0
    buried: int = 0

    def add(self, other: SweepReport) -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def __str__(self) -> str:
        return ", ".join(f"{f.name} {getattr(self, f.name)}" for f in fields(self))


def rebuilt_job(row: Job, *, max_attempts: int, due_ms: int = 0,
                max_bytes: int = sys.maxsize) -> NewJob:
    """The Redis job for a mirror row, its attempts kept: how a lost job comes back.

    Reconcile rebuilds what Redis lost; a staff retry rebuilds a dead job
    Redis no longer holds. The row was accepted when it was enqueued, so the
    current MAX_PAYLOAD_BYTES is not applied again.
    """
    text = payload.encode(row.task_path, tuple(row.args), dict(row.kwargs), max_bytes=max_bytes)
    return NewJob(str(row.pk), text, max_attempts, due_ms=due_ms, attempts=row.attempts)


class Sweep:
    """One backend's sweep over a set of queues; keeps reconcile's cursor."""

    def __init__(self, backend: ReliableJobsBackend, queues: list[str] | None = None) -> None:
        self.backend = backend
        #: Queue names as configured; each pass covers all their shards.
        self.queues = sorted(queues or backend.queues)
        self._cursor: str | None = None

    def physical_queues(self) -> list[str]:
        """Every shard of the swept queues, read afresh (SHARDS may have changed)."""
        return self.backend.broker.physical_queues(self.queues, self.backend.config.SHARDS)

    def redis_pass(self, physical: list[str] | None = None
                   ) -> tuple[SweepReport, list[AttemptRecord]]:
        """Recover and promote every shard; return the mirror records to write.

        Refunded budgets (claims that never started) are mirrored here at
        once: they are only shown in the admin, and losing one loses nothing.
        """
        report = SweepReport()
        records: list[AttemptRecord] = []
        refunds: dict[str, int] = {}
        broker = self.backend.broker
        lease_ms = self.backend.config.LEASE_MS
        for queue in physical if physical is not None else self.physical_queues():
            recovered = broker.recover(queue, lease_ms=lease_ms)
            report.orphans += recovered.stamped
            for job in recovered.outcomes:
                if job.kind == "expired":
                    report.requeued += 1
                    records.append(mirror.expired_record(
                        job.id, job.attempts, dead=False,
                        error=f"reliable_jobs.exceptions.LeaseExpired: attempt {job.attempts} "
                              "stopped renewing its lease (worker lost or stalled)"))
                elif job.kind == "dead":
                    report.dead += 1
                    records.append(mirror.expired_record(
                        job.id, job.attempts, dead=True,
                        error=f"reliable_jobs.exceptions.LeaseExpired: attempt {job.attempts} "
                              "stopped renewing its lease and no attempt is left"))
                elif job.kind == "unstarted":
                    report.requeued += 1
                    refunds[job.id] = job.max_attempts
                elif job.kind == "orphan":
                    report.requeued += 1
                elif job.kind == "garbage":
                    report.garbage += 1
                    logger.warning("Moved aside %r found on queue %r: no such job.", job.id, queue)
            crash_point("sweep_after_recover")
            report.promoted += broker.promote(queue)
        if refunds:
            try:
                mirror.raise_budgets(self.backend.config.DATABASE, refunds)
            except DatabaseError as exc:
                logger.warning("Could not mirror %d refunded attempt(s): %s", len(refunds), exc)
        return report, records

    def reconcile(self, *, max_batches: int | None = None) -> SweepReport:
        """Push again every unfinished job Redis lost; mirror deaths Redis recorded.

        Only rows untouched for RECONCILE_GRACE_MS are candidates, so a job
        whose push or mirror write is on its way is never pushed twice. The
        walk is by id with a cursor, ``max_batches`` batches per call (all
        when None), so one pass over a million rows never stalls the caller.
        """
        report = SweepReport()
        config = self.backend.config
        older_than = timezone.now() - timedelta(milliseconds=config.RECONCILE_GRACE_MS)
        batches = 0
        while max_batches is None or batches < max_batches:
            rows = mirror.reconcile_candidates(
                config.DATABASE, backend=self.backend.alias, older_than=older_than,
                after_id=self._cursor, limit=RECONCILE_BATCH,
            )
            if not rows:
                self._cursor = None
                break
            batches += 1
            self._cursor = str(rows[-1].pk)
            report.checked += len(rows)
            by_queue: dict[str, list[Job]] = defaultdict(list)
            for row in rows:
                by_queue[row.physical_queue].append(row)
            for queue, queue_rows in by_queue.items():
                pushed, buried = self._reconcile_queue(queue, queue_rows, older_than)
                report.pushed += pushed
                report.buried += buried
            if len(rows) < RECONCILE_BATCH:
                self._cursor = None
                break
        return report

    def _reconcile_queue(self, queue: str, rows: list[Job],
                         older_than: datetime) -> tuple[int, int]:
        broker = self.backend.broker
        database = self.backend.config.DATABASE
        held = broker.held_states(queue, [str(row.pk) for row in rows])
        buried = 0
        for job_id, state in held.items():
            if state["state"] == JobState.DEAD:
                mirror.bury(database, job_id, attempts=int(state["attempts"]),
                            error=state["last_error"])
                buried += 1
        # Read the missing rows again, AFTER asking Redis: a worker writes the
        # mirror before it acks (which frees the hash), so a job that finished
        # since the first read now shows as finished (or freshly touched) and
        # is left alone. What is still unfinished and old was really lost.
        missing = [row.pk for row in rows if str(row.pk) not in held]
        now = timezone.now()
        lost: list[NewJob] = []
        for row in mirror.still_unfinished(database, missing, older_than=older_than):
            due = row.run_after if row.run_after and row.run_after > now else None
            lost.append(rebuilt_job(row, max_attempts=row.max_attempts,
                                    due_ms=int(due.timestamp() * 1000) if due else 0))
        if lost:
            broker.enqueue(queue, lost, register=True)  # Redis may have lost the index too
            mirror.touch(database, [job.id for job in lost if not job.due_ms],
                         state=JobState.QUEUED)
            mirror.touch(database, [job.id for job in lost if job.due_ms],
                         state=JobState.SCHEDULED)
            logger.warning("Pushed %d job(s) of queue %r again: Redis had lost them.",
                           len(lost), queue)
        return len(lost), buried

    def run_once(self) -> SweepReport:
        """One full pass: Redis steps, their mirror records, then reconcile."""
        report, records = self.redis_pass()
        mirror.record(self.backend.config.DATABASE, records)
        crash_point("sweep_after_promote")
        report.add(self.reconcile())
        return report
