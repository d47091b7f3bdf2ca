"""The worker process: its threads, the claim loop, start-up and shutdown.

Threads, one role each:

- the main thread claims batches (one claim script call for many jobs) and
  waits with ``BLMOVE`` (one queue) or one ``BLPOP`` over wake markers
  (several queues) when there is nothing to claim; it talks only to Redis;
- the lease keeper (:mod:`.leases`) renews the lease of every job in hand
  and beats; it talks only to Redis;
- ``concurrency`` executor threads (:mod:`.executor`) run tasks;
- the finisher (:mod:`.finisher`) writes outcomes to the database mirror in
  batches and only then acks or nacks them in Redis;
- the maintenance thread (:mod:`.maintenance`) sweeps and reconciles.

A job is "in hand" (:mod:`.registry`) from its claim until its ack, nack or
release, and its lease is renewed for all that time. Shutdown: the first
SIGTERM/SIGINT stops claiming, releases unstarted jobs at once and lets
running ones finish within the grace period; a second signal releases
everything whose outcome is not on its way and exits.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from django.db import DatabaseError, InterfaceError, connections
from django.utils import timezone

from .. import mirror
from ..broker import REDIS_ERRORS, Applied, ClaimedJob
from ..exceptions import AttemptsExhausted, class_path
from ..faults import crash_point
from ..mirror import AttemptRecord
from ..models import AttemptOutcome, JobState
from ..periodic.scheduler import Scheduler
from ..redaction import mask_password
from ..sweep import Sweep
from ..tasks import discover
from .backoff import Backoff
from .database import EXECUTOR_THREAD_PREFIX, guard_mirror_sessions
from .executor import Executor
from .finisher import Finisher
from .holds import FlowHolds
from .leases import LeaseKeeper
from .maintenance import Maintenance
from .registry import InHand
from .shared import Shared, WorkerStats
from .skip import QueueSkipper

if TYPE_CHECKING:
    from ..backend import ReliableJobsBackend

logger = logging.getLogger("reliable_jobs.worker")

#: Longest single block on Redis, in seconds: bounds how late the main
#: thread notices a signal.
MAX_WAIT_S = 1.0
#: Jobs that ran and wait for their mirror write and ack, at most, before the
#: worker stops claiming.
MAX_AWAITING_ACK = 2_000
#: How long the finisher may take after the grace period, in seconds.
FINISHER_GRACE_S = 10.0
#: How long the children killed at the end of the grace period may take to
#: be reaped and their jobs handed back, in seconds.
CHILD_STOP_S = 10.0
ATTEMPTS_EXHAUSTED = class_path(AttemptsExhausted)
RELEASED_ERROR = ("reliable_jobs.worker: the worker stopped during this attempt and handed "
                  "the job back")


def default_worker_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"


class Worker:
    """One worker process serving ``queues`` of one backend."""

    def __init__(
        self,
        backend: ReliableJobsBackend,
        *,
        queues: list[str] | None = None,
        concurrency: int = 1,
        worker_id: str | None = None,
        burst: bool = False,
        max_jobs: int | None = None,
        grace_s: float = 30.0,
        prefetch: int | None = None,
        progress: Callable[[str], None] | None = None,
        give_up_s: float | None = None,
        scheduler: bool = True,
    ) -> None:
        self.backend = backend
        self.config = backend.config
        self.broker = backend.broker
        self.queues = sorted(queues or backend.queues)
        self.burst = burst
        self.max_jobs = max_jobs
        self.grace_s = grace_s
        self.progress = progress
        #: Stop (``gave_up``) when Redis has not answered for this long (burst runs).
        self.give_up_s = give_up_s
        self.gave_up = False
        #: True when a worker thread died of an unexpected error (exit non-zero).
        self.crashed = False
        #: Tasks still running in executor threads when run() returned: their
        #: jobs are left to their leases, so the process must end now (see
        #: runworker), not after an interpreter teardown a lease may not outlive.
        self.left_running = 0
        #: time.monotonic() when the claim loop last went round (health.HeartbeatFile).
        self.loop_tick = time.monotonic()
        #: Skips queues found empty until their wake marker says otherwise.
        self._skipper = QueueSkipper()
        #: Each queue's limits, and how long they hold it after a futile claim.
        self._holds = FlowHolds(self.config.queue_limits, max_wait_s=MAX_WAIT_S)
        self._claimed_total = 0
        #: Burst runs: the queue _burst_done last found with work, checked first.
        self._burst_busy: str | None = None
        self._signals = 0
        self._started_at = time.time()
        self.shared = Shared(
            worker_id or default_worker_id(), queues=self.queues, concurrency=max(1, concurrency),
            prefetch=self.config.PREFETCH if prefetch is None else prefetch)
        self.finisher = Finisher(broker=self.broker, database=self.config.DATABASE,
                                 shared=self.shared)
        self.maintenance = Maintenance(
            sweep=Sweep(backend.parts, self.queues), database=self.config.DATABASE,
            sweep_interval_ms=self.config.SWEEP_INTERVAL_MS,
            reconcile_grace_ms=self.config.RECONCILE_GRACE_MS, shared=self.shared,
            on_pass=self._report_progress if burst and progress else None)
        self.executor = Executor(backend=backend, shared=self.shared, finisher=self.finisher,
                                 retry_gate=self.maintenance.retry_gate, release=self._release)
        #: Fires periodic jobs (periodic/scheduler.py); never in a burst run.
        self.scheduler = Scheduler(backend) if scheduler and not burst else None
        self.lease_keeper = LeaseKeeper(
            broker=self.broker, shared=self.shared, lease_ms=self.config.LEASE_MS,
            renew_interval_ms=self.config.renew_interval_ms, beat_info=self._beat_info)

    @property
    def worker_id(self) -> str:
        return self.shared.worker_id

    @property
    def concurrency(self) -> int:
        return self.shared.concurrency

    @property
    def in_hand(self) -> InHand:
        return self.shared.in_hand

    @property
    def stats(self) -> WorkerStats:
        return self.shared.stats

    # -- lifecycle -------------------------------------------------------

    def install_signal_handlers(self) -> None:
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)

    def ignore_signals(self) -> None:
        """Ignore SIGTERM and SIGINT from now on (the worker has stopped; the process exits)."""
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            signal.signal(signal.SIGINT, signal.SIG_IGN)

    def _on_signal(self, signum: int, frame: Any) -> None:
        self._signals += 1
        if self._signals == 1:
            logger.warning("Got %s: finishing running jobs (a second signal stops at once).",
                           signal.Signals(signum).name)
            self.stop()
        else:
            logger.warning("Got %s again: releasing every job now.", signal.Signals(signum).name)
            self.shared.hard_stop.set()
            self.stop()

    def stop(self) -> None:
        self.shared.stop()

    def run(self) -> WorkerStats:
        """Serve until stopped (or, in burst mode, until nothing is left)."""
        known = discover()
        guard_mirror_sessions(self.config.DATABASE, self.config.LEASE_MS)
        logger.info(
            "Worker %s serving %s from %s with %d thread(s); %d task(s) registered.",
            self.worker_id, ", ".join(self.queues), mask_password(self.broker.url),
            self.concurrency, known,
        )
        executors = [self._thread(self.executor.run, f"{EXECUTOR_THREAD_PREFIX}-{i}")
                     for i in range(self.concurrency)]
        finisher = self._thread(self.finisher.run, "rj-finisher")
        keeper = self._thread(self.lease_keeper.run, "rj-leases")
        maintenance = self._thread(self.maintenance.run, "rj-maintenance")
        scheduler = self.scheduler
        scheduling = (self._thread(lambda: scheduler.run(self.shared.stopping), "rj-scheduler")
                      if scheduler is not None else None)
        try:
            self._main_loop()
        finally:
            self._shutdown(executors, finisher)
            self.lease_keeper.stop()
            keeper.join(timeout=2.0)
            # A last renewal: what is left to its lease gets a whole lease
            # from now, the moment this process is about to end.
            self.lease_keeper.renew()
            maintenance.join(timeout=2.0)
            if scheduling is not None:
                scheduling.join(timeout=2.0)
            with contextlib.suppress(*REDIS_ERRORS):
                self.broker.forget_worker(self.worker_id)
            logger.info("Worker %s stopped: %s.", self.worker_id, self._summary())
        return self.stats

    def _thread(self, loop: Callable[[], None], name: str) -> threading.Thread:
        thread = threading.Thread(target=self._guarded, args=(loop,), name=name, daemon=True)
        thread.start()
        return thread

    def _guarded(self, loop: Callable[[], None]) -> None:
        """Run a thread's loop; if it dies of a bug, stop the whole worker.

        A worker missing its finisher, lease keeper or an executor would keep
        jobs nobody finishes, or let leases of running jobs expire. Better to
        hand everything back and exit non-zero, so a supervisor restarts it.
        """
        try:
            loop()
        except BaseException:
            self.crashed = True
            logger.critical("Worker thread %s died; handing every job back and stopping.",
                            threading.current_thread().name, exc_info=True)
            self.shared.hard_stop.set()
            self.stop()
        finally:
            # A thread's database sessions are its own: end them with it, so a
            # worker run inside a longer-lived process (tests, embedding)
            # leaves no session open behind it.
            connections.close_all()

    def _shutdown(self, executors: list[threading.Thread], finisher: threading.Thread) -> None:
        """Hand back what never started, let the rest finish, stop what may be stopped.

        Within the grace period nothing that began is touched. Past it (or
        at once on a hard stop), the attempts running in a child process are
        killed; each is handed back by its executor once its child is reaped.
        An attempt running in a thread cannot be killed, and a job whose
        outcome is with a live finisher may still be committed: handing
        either back now would let another worker run it while this process
        still runs it, or after its success landed. Both are left to their
        leases: renewed until this returns, then, the process gone, expired,
        and the sweep settles each from the mirror or runs it again. Once
        the finisher's thread has ended, an outcome it never began to write
        never will be: that job (its task over) is handed back at once.
        """
        self.shared.stopping.set()
        self._release([(job, False) for job in self.shared.buffer.close()])
        deadline = time.monotonic() + (0 if self.shared.hard_stop.is_set() else self.grace_s)
        for thread in executors:
            while thread.is_alive() and time.monotonic() < deadline \
                    and not self.shared.hard_stop.is_set():
                thread.join(timeout=0.1)
        if self.in_hand.interrupt_running():
            children_deadline = time.monotonic() + CHILD_STOP_S
            while self.in_hand.stopping_children() and time.monotonic() < children_deadline:
                time.sleep(0.02)
        self.finisher.close()
        finisher_deadline = max(deadline, time.monotonic()) + (
            0 if self.shared.hard_stop.is_set() else FINISHER_GRACE_S)
        while finisher.is_alive() and time.monotonic() < finisher_deadline:
            finisher.join(timeout=0.1)
        releasable = self.in_hand.take_releasable(finisher_ended=not finisher.is_alive())
        if releasable:
            self._release(releasable)
        running, unapplied = self.in_hand.left_running()
        self.left_running = running
        if running or unapplied:
            logger.warning(
                "Stopping with %d job(s) still running in a thread and %d whose outcome is not "
                "applied yet: they are left to their leases (the sweep settles each from the "
                "mirror, or runs it again, once its lease expires).", running, unapplied)

    def _release(self, jobs: list[tuple[ClaimedJob, bool]]) -> None:
        """Hand jobs back to queued now; record interrupted attempts as released."""
        by_queue: dict[str, list[tuple[str, int, int, bool]]] = defaultdict(list)
        for job, started in jobs:
            by_queue[job.queue].append((job.id, job.attempt, job.gen, started))
        released: list[AttemptRecord] = []
        budgets = {job.id: job.max_attempts + 1 for job, _ in jobs}
        refunds: dict[str, int] = {}
        for queue, entries in by_queue.items():
            try:
                done = self.broker.release(queue, entries)
            except REDIS_ERRORS as exc:
                logger.warning("Could not release %d job(s) (%s); their leases will expire "
                               "and the sweep will recover them.", len(entries), exc)
                continue
            for (job_id, attempt, gen, started), ok in zip(entries, done, strict=True):
                if ok == Applied.CANCELLED:  # cancelled while in hand: not handed back
                    released.append(mirror.cancelled_record(
                        job_id, attempt, gen=gen, error=f"{mirror.CANCELLED_ERROR} while the "
                        "worker held it; the worker stopped and did not hand it back"))
                elif ok and started:
                    released.append(AttemptRecord(
                        job_id=job_id, attempt=attempt, gen=gen, job_state=JobState.QUEUED,
                        finished_at=timezone.now(), outcome=AttemptOutcome.RELEASED,
                        error=RELEASED_ERROR))
                elif ok:
                    refunds[job_id] = budgets[job_id]
        try:
            if released:
                mirror.record(self.config.DATABASE, released)
            if refunds:
                mirror.raise_budgets(self.config.DATABASE, refunds)
        except (DatabaseError, InterfaceError) as exc:
            logger.warning("Could not mirror %d released job(s) (%s).", len(jobs), exc)
        self.in_hand.drop(job for job, _ in jobs)

    # -- the main thread: claim and wait -----------------------------------

    def _main_loop(self) -> None:
        backoff = Backoff()
        while not self.shared.stopping.is_set():
            self.loop_tick = time.monotonic()
            try:
                if self._limit_reached():
                    break
                capacity = self._capacity()
                if capacity <= 0:
                    self.shared.slot_freed.wait(MAX_WAIT_S)
                    self.shared.slot_freed.clear()
                    continue
                if self._claim_round(capacity):
                    continue
                hold_s = self._holds.wait_s()
                if hold_s is not None:
                    # Limits hold the jobs back: come back when one may go.
                    self.shared.slot_freed.wait(hold_s)
                    self.shared.slot_freed.clear()
                    continue
                if self.burst:
                    if self._burst_done():
                        break
                    self.shared.slot_freed.wait(0.05)
                    self.shared.slot_freed.clear()
                    continue
                woken = self.broker.wait(self.shared.physical, MAX_WAIT_S)
                if woken is not None:
                    queue, moved_id = woken
                    crash_point("after_blmove")
                    self._claim(queue, self._capacity(), moved_id)
                else:
                    self._skipper.try_all()  # idle for a while: try every queue again
                backoff.reset()
                if self.shared.redis_outage.ok():
                    # Redis may have come back empty: reconcile as soon as the
                    # grace period allows, not at the next routine pass.
                    self.maintenance.reconcile_soon()
            except REDIS_ERRORS as exc:
                self.shared.redis_outage.failed(exc, "claiming")
                if self._given_up():
                    break
                backoff.wait(self.shared.stopping)

    def _given_up(self) -> bool:
        """Whether Redis has been down longer than ``give_up_s``; if so, say so once."""
        down_since = self.shared.redis_outage.down_since
        if self.give_up_s is None or down_since is None:
            return False
        if time.monotonic() - down_since < self.give_up_s:
            return False
        logger.error("Redis has not answered for %.0f s: giving up.", self.give_up_s)
        self.gave_up = True
        return True

    def _limit_reached(self) -> bool:
        return (self.max_jobs is not None and self._claimed_total >= self.max_jobs
                and not len(self.in_hand))

    def _capacity(self) -> int:
        """How many jobs to claim now.

        Jobs that ran and wait for their ack do not count against the claim
        ahead (the mirror's commit would throttle claiming), but they are
        bounded on their own, so a database outage cannot make a worker
        claim without limit.
        """
        waiting, awaiting_ack = self.in_hand.counts()
        if awaiting_ack >= MAX_AWAITING_ACK:
            return 0
        room = self.concurrency + self.shared.ahead() - waiting
        if self.max_jobs is not None:
            room = min(room, self.max_jobs - self._claimed_total)
        return room

    def _claim_round(self, capacity: int) -> int:
        """Claim without blocking from every queue in turn; return how many.

        Each round starts one queue further on, so no queue (or shard) is
        always served first; queues found empty are skipped until they may
        have work (skip.py).
        """
        claimed = 0
        for queue in self._skipper.round(self.shared.physical, self.broker.woken):
            if capacity - claimed <= 0:
                break
            claimed += self._claim(queue, capacity - claimed, None)
        return claimed

    def _claim(self, queue: str, count: int, moved_id: str | None) -> int:
        result = self.broker.claim(queue, count=max(count, 0), lease_ms=self.config.LEASE_MS,
                                   moved_id=moved_id, limits=self._holds.claim_args(queue))
        self._holds.record(queue, result.hold_ms, by_cap=result.hold_by_cap)
        crash_point("after_claim")
        self.in_hand.add(result.jobs)
        self._claimed_total += len(result.jobs)
        self.shared.buffer.put(result.jobs)
        for job_id, attempts, gen in result.dead:
            self.finisher.record(mirror.expired_record(
                job_id, attempts, dead=True, gen=gen,
                error=f"{ATTEMPTS_EXHAUSTED}: claimed {attempts} time(s) "
                      "without finishing (worker lost or lease expired)"))
        for garbage in result.garbage:
            logger.warning("Moved aside %r found on queue %r: no such job.", garbage, queue)
        self._skipper.found(queue, bool(result.jobs or result.remaining)
                            or result.hold_ms >= 0)
        return len(result.jobs)

    def _burst_done(self) -> bool:
        """Whether nothing is queued, running or scheduled on any queue served.

        Reads the counts, stopping at the first queue with anything, rather
        than first trying every skipped queue with a claim: at the end of a
        burst on one of many queues, that claim round cost one script call
        per idle queue only to find them empty. A queue found with queued
        jobs is tried in the next round.
        """
        if len(self.in_hand):
            return False
        queues = self.shared.physical
        if self._burst_busy in queues:  # the queue that had work last time, first
            queues = [self._burst_busy, *(q for q in queues if q != self._burst_busy)]
        for queue in queues:
            counts = self.broker.counts(queue)
            if counts.queued or counts.running or counts.scheduled:
                self._burst_busy = queue
                if counts.queued:
                    self._skipper.found(queue, True)
                return False
        return True

    # -- reporting -----------------------------------------------------------

    def _beat_info(self) -> dict[str, Any]:
        return {"id": self.worker_id, "host": socket.gethostname(), "pid": os.getpid(),
                "queues": self.queues, "concurrency": self.concurrency,
                "jobs": self.in_hand.sample(50), "in_hand": len(self.in_hand),
                "started": self._started_at, "claimed": self._claimed_total,
                "finished": self.stats.succeeded + self.stats.failed + self.stats.dead}

    def _report_progress(self) -> None:
        if self.progress is not None:
            self.progress(self._summary())

    def _summary(self) -> str:
        s = self.stats
        return (f"{self._claimed_total} claimed, {s.succeeded} succeeded, {s.failed} failed "
                f"(retrying), {s.dead} dead, {s.refused} refused as stale, "
                f"{s.cancelled} cancelled, {s.snoozed} snoozed, {len(self.in_hand)} in hand")


__all__ = ["Worker", "WorkerStats", "default_worker_id"]
