"""The recovery sweep: recover expired leases, promote due jobs, reconcile.

Run by ``manage.py recoverjobs`` (cron-able, or ``--interval`` to loop) and
by every worker on a timer, so a deployment without a sweep process still
recovers. Every step is safe to run from many processes at once: Redis steps
are atomic scripts and reconcile's push skips jobs Redis already holds.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Collection
from dataclasses import dataclass, fields
from datetime import datetime
from typing import TYPE_CHECKING

from django.db import DatabaseError, InterfaceError, connections, transaction
from django.utils import timezone

from . import mirror, telemetry
from .broker import (
    REDIS_ERRORS,
    SCRIPT_ERRORS,
    TOMBSTONE_MS,
    Broker,
    Fence,
    NewJob,
    RecoverResult,
    Settlement,
    epoch_ms,
)
from .exceptions import LeaseExpired, class_path
from .faults import crash_point
from .mirror import AttemptRecord
from .models import Job, JobState

if TYPE_CHECKING:
    from .parts import BackendParts

logger = logging.getLogger("reliable_jobs.sweep")

#: Rows reconcile reads per database query and checks per Redis pipeline.
RECONCILE_BATCH = 500
#: Redis states that mark a job as done with (see ack.lua and cancel.lua).
TOMBSTONES = ("finished", "cancelled")
#: States of a job Redis may still run: a cancel the row holds and Redis
#: lost is applied again to these (see Sweep.recancel).
CANCELLABLE = ("queued", "scheduled", "running")
#: How far back reconcile looks for cancels Redis may have lost, in ms: as
#: long as the tombstone a cancel leaves (TOMBSTONE_MS).
RECANCEL_MS = TOMBSTONE_MS
LEASE_EXPIRED = class_path(LeaseExpired)
#: What one queue's damaged Redis data can raise (a script error, a reply
#: that does not parse): the sweep logs it and goes on with the other
#: queues. An outage (a lost connection, the database down) propagates: the
#: next pass retries everything.
QUEUE_ERRORS: tuple[type[Exception], ...] = (*SCRIPT_ERRORS, ValueError, TypeError)


@dataclass
class SweepReport:
    """Counts of one pass, printed by ``recoverjobs``."""

    requeued: int = 0
    dead: int = 0
    orphans: int = 0
    garbage: int = 0
    promoted: int = 0
    settled: int = 0
    cancelled: int = 0
    checked: int = 0
    pushed: int = 0
    buried: int = 0
    recancelled: int = 0
    purged: int = 0

    def add(self, other: SweepReport) -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def __str__(self) -> str:
        return ", ".join(f"{f.name} {getattr(self, f.name)}" for f in fields(self))


def push_rebuilt(broker: Broker, database: str, queue: str, jobs: list[NewJob], *,
                 register: bool = False) -> list[bool]:
    """Push rebuilt jobs whose rows already hold their new generation; say which Redis took.

    Every rebuild (reconcile, a staff retry or requeue) commits the row's
    new generation first and pushes after, as enqueue pushes after its
    commit: a push never outruns a row that could still roll back (the
    database would then refuse every record of the job it pushed). A crash
    between the two leaves a row with no Redis job, which reconcile
    rebuilds once the grace has passed (the commit freshened the row).

    A push Redis refuses found the job there already. Of the same or a
    newer generation: another rebuild since, which the row holds too. Of an
    older one, claimed or dead (a waiting one is taken over, see
    enqueue.lua): a late push that landed after the look; that incarnation
    is the job, so the row goes back to its generation and the holder's
    records land (mirror.follow_held_generation).
    """
    written = broker.enqueue_each(queue, jobs, register=register)
    refused = [job for job, taken in zip(jobs, written, strict=True) if not taken]
    if refused:
        found = broker.held_states(queue, [job.id for job in refused])
        for job in refused:
            held = found.get(job.id)
            if held is not None and held["state"] not in TOMBSTONES and held["gen"].isdigit():
                mirror.follow_held_generation(database, job.id, committed=job.gen,
                                              held=int(held["gen"]))
    return written


class Sweep:
    """One backend's sweep over a set of queues; keeps reconcile's cursor."""

    def __init__(self, parts: BackendParts, queues: list[str] | None = None) -> None:
        #: The backend's alias, settings and Redis side (``backend.parts``).
        self.parts = parts
        #: Queue names as configured; each pass covers all their shards.
        self.queues = sorted(queues or parts.queues)
        self._cursor: str | None = None
        #: Per shard, the rank in its dead set where the orphan walk goes on.
        self._dead_cursor: dict[str, int] = {}

    def physical_queues(self) -> list[str]:
        """Every shard of the swept queues, read afresh (SHARDS may have changed)."""
        return self.parts.broker.physical_queues(self.queues, self.parts.config.SHARDS)

    def redis_pass(self, physical: list[str] | None = None) -> SweepReport:
        """Recover and promote every shard, mirroring what recover did as it goes.

        Refunded budgets (claims that never started) are mirrored at the end:
        they are only shown in the admin, and losing one loses nothing.
        """
        report = SweepReport()
        refunds: dict[str, int] = {}
        queues = physical if physical is not None else self.physical_queues()
        for queue in self.parts.broker.sweepable(queues):
            try:
                self._sweep_queue(queue, report, refunds)
            except QUEUE_ERRORS:
                logger.exception("Skipped queue %r in this sweep: its Redis data made a "
                                 "script fail; the other queues were swept.", queue)
        if refunds:
            try:
                mirror.raise_budgets(self.parts.config.DATABASE, refunds)
            except DatabaseError as exc:
                logger.warning("Could not mirror %d refunded attempt(s): %s", len(refunds), exc)
        return report

    def _sweep_queue(self, queue: str, report: SweepReport, refunds: dict[str, int]) -> None:
        """Recover and promote one shard, counting into ``report`` and ``refunds``."""
        recovered = self._recover(queue, report)
        report.orphans += recovered.stamped
        for job in recovered.outcomes:
            telemetry.hook.recovered(queue, job.kind)
            if job.kind in ("unstarted", "orphan"):
                report.requeued += 1
                if job.kind == "unstarted":
                    refunds[job.id] = job.max_attempts
            elif job.kind == "garbage":
                report.garbage += 1
                logger.warning("Moved aside %r found on queue %r: no such job.", job.id, queue)
        report.promoted += self.parts.broker.promote(queue)

    def _recover(self, queue: str, report: SweepReport) -> RecoverResult:
        """Run recover on one shard with the mirror's agreement; count what it did.

        An expired attempt that started may have written its outcome to the
        mirror before its worker died, or may write it any moment now (a
        stalled worker). So the rows of the expired started attempts are
        locked first (SKIP LOCKED: a row a worker is writing right now is
        left for the next pass), those the mirror holds as finished are
        settled, the others may be requeued or buried, and what recover did
        is mirrored before the locks go: a late outcome of the same attempt
        then finds it recorded as expired and cannot rewrite the job.
        Without the database only what needs no mirror is recovered.
        """
        broker = self.parts.broker
        database = self.parts.config.DATABASE
        lease_ms = self.parts.config.LEASE_MS
        expired = broker.expired(queue)
        if not expired:
            return broker.recover(queue, lease_ms=lease_ms, allowed=[])
        try:
            with transaction.atomic(using=database):
                rows = mirror.lock_for_recovery(database, [job_id for job_id, _, _ in expired])
                settle: list[Settlement] = []
                allowed: list[Fence] = []
                snoozed = mirror.snoozed_attempts(database, [
                    (job_id, attempt) for job_id, attempt, gen in expired
                    if _waits_after(rows.get(job_id), attempt, gen)])
                for job_id, attempt, gen in expired:
                    row = rows.get(job_id)
                    if row is mirror.LOCKED_ELSEWHERE:
                        continue
                    if (row is not None and row.state in mirror.TERMINAL_STATES
                            and (row.attempts, row.generation) == (attempt, gen)):
                        settle.append(Settlement(job_id, attempt, gen, row.state, row.last_error))
                    elif job_id in snoozed:
                        # Its task raised Snooze and the mirror has it; the
                        # worker died before snooze.lua ran: snooze it now.
                        settle.append(Settlement(job_id, attempt, gen, "snoozed"))
                    elif (row is not None and row.state == JobState.CANCELLED
                          and row.generation == gen):
                        # Cancelled while it ran (the row may lag behind on
                        # attempts): never run again, whatever Redis holds.
                        settle.append(Settlement(job_id, attempt, gen, JobState.CANCELLED))
                    else:
                        allowed.append((job_id, attempt, gen))
                recovered = broker.recover(queue, lease_ms=lease_ms, settle=settle,
                                           allowed=allowed)
                crash_point("sweep_after_recover")
                cancelled = {s.id for s in settle if s.final == JobState.CANCELLED}
                mirror.record(database, self._records(recovered, report, cancelled))
        except (DatabaseError, InterfaceError) as exc:
            logger.warning("Recovering only jobs that never started on queue %r: the database "
                           "is unavailable (%s).", queue, exc)
            return broker.recover(queue, lease_ms=lease_ms, allowed=[])
        return recovered

    @staticmethod
    def _records(recovered: RecoverResult, report: SweepReport,
                 cancelled: Collection[str] = ()) -> list[AttemptRecord]:
        """The mirror records of the started attempts recover settled, requeued or buried.

        An attempt whose job was cancelled while it ran, and whose worker
        then stopped (``cancelled``: settled from a cancelled row; or kind
        'cancelled': Redis held the mark), is closed as cancelled.
        """
        records: list[AttemptRecord] = []
        for job in recovered.outcomes:
            if job.kind == "cancelled" or (job.kind == "settled" and job.id in cancelled):
                report.cancelled += 1
                records.append(mirror.cancelled_record(
                    job.id, job.attempts, gen=job.gen,
                    error=f"{mirror.CANCELLED_ERROR} while it ran; its worker then stopped "
                          "renewing the lease, and it was not run again"))
            elif job.kind == "settled":
                report.settled += 1
            elif job.kind == "expired":
                report.requeued += 1
                records.append(mirror.expired_record(
                    job.id, job.attempts, dead=False, gen=job.gen,
                    error=f"{LEASE_EXPIRED}: attempt {job.attempts} "
                          "stopped renewing its lease (worker lost or stalled)"))
            elif job.kind == "dead":
                report.dead += 1
                records.append(mirror.expired_record(
                    job.id, job.attempts, dead=True, gen=job.gen,
                    error=f"{LEASE_EXPIRED}: attempt {job.attempts} "
                          "stopped renewing its lease and no attempt is left"))
        return records

    def reconcile(self, *, max_batches: int | None = None) -> SweepReport:
        """Push again every unfinished job Redis lost; mirror deaths Redis recorded.

        Only rows untouched for RECONCILE_GRACE_MS are candidates, so a job
        whose push or mirror write is on its way is never pushed twice. The
        walk is by id with a cursor, ``max_batches`` batches per call (all
        when None), so one pass over a million rows never stalls the caller.
        Then cancels Redis lost are applied again (:meth:`recancel`) and each
        shard's dead set is walked for jobs with no row (:meth:`purge_orphans`).
        """
        report = SweepReport()
        config = self.parts.config
        older_than = mirror.grace_cutoff(config.DATABASE, config.RECONCILE_GRACE_MS)
        batches = 0
        while max_batches is None or batches < max_batches:
            rows = mirror.reconcile_candidates(
                config.DATABASE, backend=self.parts.alias, older_than=older_than,
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
                try:
                    pushed, buried = self._reconcile_queue(queue, queue_rows, older_than)
                except QUEUE_ERRORS:
                    logger.exception("Skipped %d row(s) of queue %r in this reconcile: its "
                                     "Redis data made a script fail; the other queues were "
                                     "reconciled.", len(queue_rows), queue)
                    continue
                report.pushed += pushed
                report.buried += buried
            if len(rows) < RECONCILE_BATCH:
                self._cursor = None
                break
        report.recancelled += self.recancel()
        for queue in self.physical_queues():
            try:
                report.purged += self.purge_orphans(queue)
            except QUEUE_ERRORS:
                logger.exception("Skipped the dead set of queue %r in this reconcile: its "
                                 "Redis data made a script fail.", queue)
        return report

    def purge_orphans(self, queue: str) -> int:
        """Forget dead jobs that have no row, RECONCILE_GRACE_MS after their death.

        A dead job keeps its hash for a staff retry, and prune forgets it with
        its row; one whose row is gone anyway (deleted by hand, pruned by a
        version that did not purge, or never committed: an id pushed into
        Redis by hand) would stay for ever. Each call walks the next
        RECONCILE_BATCH entries of the dead set, wrapping round. An id is
        forgotten only when no row holds it and it died before the grace:
        every push follows its row's commit (enqueue pushes on commit,
        rebuilds after theirs), so a row that may still commit has no job in
        Redis yet, let alone one dead that long. purge.lua keeps a job that
        is no longer dead (revived meanwhile).
        """
        broker = self.parts.broker
        config = self.parts.config
        start = self._dead_cursor.get(queue, 0)
        before_ms = broker.server_time_ms() - config.RECONCILE_GRACE_MS
        ids, more = broker.dead_since(queue, before_ms=before_ms, start=start,
                                      count=RECONCILE_BATCH)
        rows = mirror.existing(config.DATABASE, ids) if ids else set()
        orphans = [job_id for job_id in ids if job_id not in rows]
        self._dead_cursor[queue] = start + RECONCILE_BATCH - len(orphans) if more else 0
        if not orphans:
            return 0
        broker.purge(queue, orphans)
        logger.warning("Forgot %d dead job(s) of queue %r that have no row in the database.",
                       len(orphans), queue)
        return len(orphans)

    def recancel(self) -> int:
        """Cancel again in Redis the recent cancels Redis lost; return how many.

        A cancel acts in Redis, then commits the row; a failover to a replica
        that missed the cancel's write brings the job back, waiting or running
        unmarked, while its row says cancelled (a finished row, which the walk
        above never looks at). So every row cancelled within RECANCEL_MS is
        locked (SKIP LOCKED: a staff requeue of it holds the row) and looked
        up, and cancel.lua is run again on those Redis still holds as waiting
        or running: a no-op on a job already marked, and the row's word is the
        last (a requeue makes the row unfinished before it pushes).
        """
        config = self.parts.config
        since = mirror.grace_cutoff(config.DATABASE, RECANCEL_MS)
        applied, after = 0, None
        while True:
            with transaction.atomic(using=config.DATABASE):
                rows = mirror.lock_recent_cancels(config.DATABASE, backend=self.parts.alias,
                                                  since=since, after_id=after,
                                                  limit=RECONCILE_BATCH)
                by_queue: dict[str, list[str]] = defaultdict(list)
                for row in rows:
                    by_queue[row.physical_queue].append(str(row.pk))
                for queue, ids in by_queue.items():
                    try:
                        applied += self._recancel_queue(queue, ids)
                    except QUEUE_ERRORS:
                        logger.exception("Skipped the cancels of queue %r in this reconcile: "
                                         "its Redis data made a script fail.", queue)
            if len(rows) < RECONCILE_BATCH:
                return applied
            after = str(rows[-1].pk)

    def _recancel_queue(self, queue: str, job_ids: list[str]) -> int:
        broker = self.parts.broker
        held = broker.held_states(queue, job_ids)
        again = [job_id for job_id, found in held.items() if found["state"] in CANCELLABLE]
        for job_id in again:
            broker.cancel(queue, job_id)
            if held[job_id]["state"] != "running":
                logger.warning("Cancelled job %s of queue %r again: Redis had lost its cancel.",
                               job_id, queue)
        return len(again)

    def _reconcile_queue(self, queue: str, rows: list[Job],
                         older_than: datetime) -> tuple[int, int]:
        """Rebuild the jobs of ``rows`` that Redis lost; mirror deaths it recorded.

        The rows are read again and locked (SKIP LOCKED) AFTER the candidate
        scan: a worker writes the mirror before it acks (which frees the
        hash), a staff cancel holds the row while it acts, and another
        reconciler holds the rows it rebuilds, so a row still unfinished,
        old and unlocked whose hash is gone was really lost. A tombstone
        ('finished' or 'cancelled') whose row is still unfinished this long
        after is a write that never reached the mirror: rebuilt too.

        The new generations are committed before the push (push_rebuilt).
        What then keeps a second reconciler from pushing the same rows: the
        commit freshened them, so they are no candidates until the grace
        has passed; and should this push be slower than that, each
        reconciler pushes the generation it committed, and Redis keeps the
        newest (enqueue.lua refuses an older one, and a newer one takes over
        an older one still waiting).
        """
        broker = self.parts.broker
        database = self.parts.config.DATABASE
        buried = 0
        with transaction.atomic(using=database):
            locked = mirror.lock_unfinished(database, [row.pk for row in rows],
                                            older_than=older_than)
            held = broker.held_states(queue, [str(row.pk) for row in locked])
            lost_rows: list[Job] = []
            for row in locked:
                state = held.get(str(row.pk))
                if state is None or state["state"] in TOMBSTONES:
                    lost_rows.append(row)
                elif state["state"] == JobState.DEAD:
                    # The row is locked and this hash is the job's only
                    # incarnation, so its death is the job's outcome, even
                    # the death of a late push of an older generation than
                    # the row's (Redis lost a rebuilt job, then the original
                    # on-commit push arrived): fenced by the hash's own gen
                    # and attempts, that bury would leave the row unfinished
                    # for ever behind a hash reconcile never rebuilds.
                    mirror.bury(database, str(row.pk),
                                attempts=max(int(state["attempts"]), row.attempts),
                                gen=row.generation, error=state["last_error"])
                    buried += 1
            now = timezone.now()
            mirror.next_generation(database, lost_rows)
            lost = [mirror.rebuilt_job(row, max_attempts=row.max_attempts,
                                due_ms=epoch_ms(row.run_after) if row.run_after
                                and row.run_after > now else 0,
                                flow=self.parts.flow_of)
                    for row in lost_rows]
            if lost:
                mirror.mark_rebuilt(database, lost_rows, now=now)
        if not lost:
            return 0, buried
        crash_point("reconcile_before_push")
        # register: Redis may have lost the shards index too
        pushed = sum(push_rebuilt(broker, database, queue, lost, register=True))
        crash_point("reconcile_after_push")
        if pushed:
            logger.warning("Pushed %d job(s) of queue %r again: Redis had lost them.",
                           pushed, queue)
        return pushed, buried

    def run_once(self) -> SweepReport:
        """One full pass: the Redis steps (mirrored as they go), then reconcile."""
        report = self.redis_pass()
        crash_point("sweep_after_promote")
        report.add(self.reconcile())
        return report

    def run_every(self, interval_s: float, stop: threading.Event, *,
                  on_pass: Callable[[SweepReport, float], None],
                  on_failure: Callable[[Exception], None]) -> None:
        """Run a pass every ``interval_s`` seconds until ``stop`` is set.

        A pass that cannot reach Redis or the database is retried at the next
        one (every step is safe to repeat), after ``on_failure`` has been told
        and the database connection dropped, so the next pass reconnects.
        ``on_pass`` gets each report and the pass's duration in milliseconds.
        Setting ``stop`` ends the loop after the pass under way: every step is
        atomic, so stopping between passes leaves nothing half done.
        """
        while not stop.is_set():
            started = time.monotonic()
            try:
                report = self.run_once()
            except (*REDIS_ERRORS, DatabaseError) as exc:  # type: ignore[misc]  # mypy cannot unpack a tuple[type, ...]
                on_failure(exc)
                connections[self.parts.config.DATABASE].close()
                stop.wait(interval_s)
                continue
            on_pass(report, (time.monotonic() - started) * 1000)
            stop.wait(max(0.0, interval_s - (time.monotonic() - started)))


def _waits_after(row: object, attempt: int, gen: int) -> bool:
    """Whether a locked row waits again after exactly this attempt (a retry or a snooze)."""
    return (isinstance(row, mirror.RowState) and row.state in (JobState.SCHEDULED,
                                                                 JobState.QUEUED)
            and (row.attempts, row.generation) == (attempt, gen))
