"""The worker: claim jobs from Redis, run them in threads, mirror, then ack.

Threads and what each owns:

- the main thread claims batches (one claim script call for many jobs),
  waits with ``BLMOVE`` (one queue) or one ``BLPOP`` over wake markers
  (several queues) when there is nothing to claim, renews the leases of
  every job in hand, heartbeats, and runs promote/recover on a timer;
- ``concurrency`` executor threads run tasks;
- one finisher thread writes outcomes to the database mirror in batches and
  only then acks or nacks them in Redis, so Redis never forgets a job whose
  outcome the database could still lose. While the database is down the
  finisher retries and the main thread keeps renewing the leases, so the
  jobs stay held; nothing is dropped.

A job is "in hand" from its claim until its ack/nack/release; its lease is
renewed for all that time. Shutdown: the first SIGTERM/SIGINT stops
claiming, releases unstarted jobs at once and lets running ones finish
within the grace period; a second signal releases everything and exits.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue as queue_module
import signal
import socket
import threading
import time
import traceback
import uuid
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any

import redis
from django.db import (
    DatabaseError,
    InterfaceError,
    OperationalError,
    close_old_connections,
    connections,
)
from django.tasks import TaskContext, TaskResult, TaskResultStatus
from django.tasks.signals import task_finished, task_started
from django.utils import timezone
from django.utils.json import normalize_json

from . import mirror, payload, retry
from .broker import ClaimedJob
from .checks import mask_password
from .exceptions import JobTimeout, UnknownTask
from .faults import crash_point, raise_point
from .handoff import JobBuffer, StartMarks
from .isolation import ChildFailed, run_in_child
from .keys import logical_queue
from .mirror import AttemptRecord
from .models import AttemptOutcome, JobState
from .sweep import Sweep, SweepReport
from .tasks import discover, lookup

if TYPE_CHECKING:
    from .backend import ReliableJobsBackend

logger = logging.getLogger("reliable_jobs.worker")

#: Longest single block on Redis, in seconds: bounds how late the main
#: thread notices a signal or a due timer.
MAX_WAIT_S = 1.0
#: Outcomes written to the mirror per transaction at most.
FINISH_BATCH = 500
#: Backoff after a Redis or database error, in seconds (doubles to the cap).
BACKOFF_START_S, BACKOFF_MAX_S = 0.1, 5.0
#: First attempts an executor thread marks started in one round trip, then
#: runs in turn: the most a crash in one of them can charge the others.
MARK_AHEAD = 16
#: Reconcile at most this often from a worker, in seconds.
RECONCILE_EVERY_S = 30.0


class Outage:
    """Log a dependency's outage once: the first failure, then its return.

    Retries repeat every few seconds while Redis or the database is down;
    one ERROR line when it goes, one INFO line when it is back, DEBUG between.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self.down_since: float | None = None

    def failed(self, exc: BaseException, what: str) -> None:
        if self.down_since is None:
            self.down_since = time.monotonic()
            logger.error("%s is unavailable (%s) while %s; retrying with backoff, holding "
                         "every job (nothing is lost).", self.name, exc, what)
        else:
            logger.debug("%s still unavailable (%s) while %s.", self.name, exc, what)

    def ok(self) -> bool:
        """Note a success; return True if this ends an outage."""
        if self.down_since is None:
            return False
        logger.warning("%s is back after %.1f s.", self.name, time.monotonic() - self.down_since)
        self.down_since = None
        return True


@dataclass(slots=True)
class Held:
    """A job in hand: claimed, maybe running, not yet acked."""

    job: ClaimedJob
    started: bool = False
    lost: bool = False


@dataclass(slots=True)
class Outcome:
    """A finished attempt on its way to the mirror and then to Redis.

    ``delay_ms`` is None for a success (ack), else the nack decision
    (:data:`retry.DEAD` to bury). A record with no Redis action (a start, a
    sweep result) has ``job`` None.
    """

    record: AttemptRecord
    job: ClaimedJob | None = None
    delay_ms: int | None = None


@dataclass
class WorkerStats:
    succeeded: int = 0
    failed: int = 0
    dead: int = 0
    refused: int = 0
    by_outcome: dict[str, int] = field(default_factory=dict)


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
    ) -> None:
        self.backend = backend
        self.config = backend.config
        self.queues = sorted(queues or backend.queues)
        self.concurrency = max(1, concurrency)
        self.worker_id = worker_id or default_worker_id()
        self.burst = burst
        self.max_jobs = max_jobs
        self.grace_s = grace_s
        self.prefetch = self.config.PREFETCH if prefetch is None else prefetch
        self.progress = progress
        self.broker = backend.broker
        self.sweep = Sweep(backend, self.queues)
        #: The shards of ``queues`` (just the queues when none is sharded),
        #: refreshed with every sweep so a change of SHARDS is picked up.
        self._physical = list(self.queues)
        self._claim_offset = 0
        self.stats = WorkerStats()
        #: True when a worker thread died of an unexpected error (exit non-zero).
        self.crashed = False
        self._start_marks = StartMarks(self.broker)
        self._buffer = JobBuffer()
        #: Outcomes handed to the finisher, and a condition on their flushing.
        self._outcomes_total = 0
        self._flushed = threading.Condition()

        self._in_hand: dict[tuple[str, str], Held] = {}
        self._lock = threading.Lock()
        self._done: queue_module.SimpleQueue[Outcome | None] = queue_module.SimpleQueue()
        self._slot_freed = threading.Event()
        self._stopping = threading.Event()
        self._hard_stop = threading.Event()
        self._claimed_total = 0
        self._finished_total = 0
        self._signals = 0
        self._redis_outage = Outage("Redis")
        self._db_outage = Outage("The database")
        self._started_at = time.time()
        self._next_renew = self._next_beat = self._next_sweep = 0.0
        self._next_reconcile = time.monotonic() + RECONCILE_EVERY_S

    # -- lifecycle -------------------------------------------------------

    def install_signal_handlers(self) -> None:
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)

    def _on_signal(self, signum: int, frame: Any) -> None:
        self._signals += 1
        if self._signals == 1:
            logger.warning("Got %s: finishing running jobs (a second signal stops at once).",
                           signal.Signals(signum).name)
            self.stop()
        else:
            logger.warning("Got %s again: releasing every job now.", signal.Signals(signum).name)
            self._hard_stop.set()
            self.stop()

    def stop(self) -> None:
        self._stopping.set()
        self._slot_freed.set()

    def run(self) -> WorkerStats:
        """Serve until stopped (or, in burst mode, until nothing is left)."""
        known = discover()
        logger.info(
            "Worker %s serving %s from %s with %d thread(s); %d task(s) registered.",
            self.worker_id, ", ".join(self.queues), mask_password(self.broker.url),
            self.concurrency, known,
        )
        executors = [
            threading.Thread(target=self._guarded, args=(self._execute_loop,),
                             name=f"rj-exec-{i}", daemon=True)
            for i in range(self.concurrency)
        ]
        finisher = threading.Thread(target=self._guarded, args=(self._finish_loop,),
                                    name="rj-finisher", daemon=True)
        for thread in (*executors, finisher):
            thread.start()
        try:
            self._main_loop()
        finally:
            self._shutdown(executors, finisher)
        return self.stats

    def _guarded(self, loop: Callable[[], None]) -> None:
        """Run a thread's loop; if it dies of a bug, stop the whole worker.

        A worker missing its finisher or an executor would keep renewing the
        leases of jobs nobody finishes: they would be stuck forever. Better to
        hand everything back and exit non-zero, so a supervisor restarts it.
        """
        try:
            loop()
        except BaseException:
            self.crashed = True
            logger.critical("Worker thread %s died; handing every job back and stopping.",
                            threading.current_thread().name, exc_info=True)
            self._hard_stop.set()
            self.stop()

    def _shutdown(self, executors: list[threading.Thread], finisher: threading.Thread) -> None:
        self._stopping.set()
        self._release([(job, False) for job in self._buffer.close()])
        deadline = time.monotonic() + (0 if self._hard_stop.is_set() else self.grace_s)
        for thread in executors:
            while (thread.is_alive() and time.monotonic() < deadline
                   and not self._hard_stop.is_set()):
                self._maintain(renew_only=True)
                thread.join(timeout=0.1)
        self._done.put(None)
        finisher_deadline = deadline + (0 if self._hard_stop.is_set() else 10.0)
        while finisher.is_alive() and time.monotonic() < finisher_deadline:
            if not self._hard_stop.is_set():
                self._maintain(renew_only=True)
            finisher.join(timeout=0.1)
        with self._lock:
            leftovers = [(held.job, held.started) for held in self._in_hand.values()]
        if leftovers:
            logger.warning("Releasing %d job(s) still in hand.", len(leftovers))
            self._release(leftovers)
        with contextlib.suppress(redis.RedisError):
            self.broker.forget_worker(self.worker_id)
        logger.info("Worker %s stopped: %s.", self.worker_id, self._summary())

    def _release(self, jobs: list[tuple[ClaimedJob, bool]]) -> None:
        """Hand jobs back to queued now; record interrupted attempts as released."""
        by_queue: dict[str, list[tuple[str, int, bool]]] = defaultdict(list)
        for job, started in jobs:
            by_queue[job.queue].append((job.id, job.attempt, started))
        released: list[AttemptRecord] = []
        budgets = {job.id: job.max_attempts + 1 for job, _ in jobs}
        refunds: dict[str, int] = {}
        for queue, entries in by_queue.items():
            try:
                done = self.broker.release(queue, entries)
            except redis.RedisError as exc:
                logger.warning("Could not release %d job(s) (%s); their leases will expire "
                               "and the sweep will recover them.", len(entries), exc)
                continue
            released += [
                AttemptRecord(job_id=job_id, attempt=attempt, job_state=JobState.QUEUED,
                              finished_at=timezone.now(), outcome=AttemptOutcome.RELEASED,
                              error="reliable_jobs.worker: the worker stopped during this "
                                    "attempt and handed the job back")
                for (job_id, attempt, started), ok in zip(entries, done, strict=True)
                if ok and started
            ]
            refunds.update({job_id: budgets[job_id] for (job_id, _, started), ok
                            in zip(entries, done, strict=True) if ok and not started})
        try:
            if released:
                mirror.record(self.config.DATABASE, released)
            if refunds:
                mirror.raise_budgets(self.config.DATABASE, refunds)
        except (DatabaseError, InterfaceError) as exc:
            logger.warning("Could not mirror %d released job(s) (%s).", len(jobs), exc)
        with self._lock:
            for job, _ in jobs:
                self._in_hand.pop((job.queue, job.id), None)

    # -- main thread: claim, wait, maintain -------------------------------

    def _main_loop(self) -> None:
        backoff = BACKOFF_START_S
        while not self._stopping.is_set():
            try:
                self._maintain()
                if self._limit_reached():
                    break
                capacity = self._capacity()
                if capacity <= 0:
                    self._slot_freed.wait(self._time_to_next_timer())
                    self._slot_freed.clear()
                    continue
                if self._claim_round(capacity):
                    continue
                if self.burst:
                    if self._burst_done():
                        break
                    self._slot_freed.wait(0.05)
                    self._slot_freed.clear()
                    continue
                woken = self.broker.wait(self._physical,
                                         min(MAX_WAIT_S, self._time_to_next_timer()))
                if woken is not None:
                    queue, moved_id = woken
                    crash_point("after_blmove")
                    self._claim(queue, self._capacity(), moved_id)
                backoff = BACKOFF_START_S
                if self._redis_outage.ok():
                    # Redis may have come back empty: reconcile as soon as the
                    # grace period allows, not at the next routine pass.
                    self._next_reconcile = min(
                        self._next_reconcile,
                        time.monotonic() + self.config.RECONCILE_GRACE_MS / 1000)
            except redis.RedisError as exc:
                self._redis_outage.failed(exc, "claiming")
                self._stopping.wait(backoff)
                backoff = min(backoff * 2, BACKOFF_MAX_S)

    def _limit_reached(self) -> bool:
        return self.max_jobs is not None and self._claimed_total >= self.max_jobs and (
            not self._in_hand
        )

    def _capacity(self) -> int:
        room = self.concurrency + self.prefetch - len(self._in_hand)
        if self.max_jobs is not None:
            room = min(room, self.max_jobs - self._claimed_total)
        return room

    def _claim_round(self, capacity: int) -> int:
        """Claim without blocking from every queue in turn; return how many.

        Each round starts one queue further on, so no queue (or shard) is
        always served first.
        """
        claimed = 0
        queues = self._physical
        self._claim_offset = (self._claim_offset + 1) % len(queues)
        for queue in queues[self._claim_offset:] + queues[:self._claim_offset]:
            if capacity - claimed <= 0:
                break
            claimed += self._claim(queue, capacity - claimed, None)
        return claimed

    def _claim(self, queue: str, count: int, moved_id: str | None) -> int:
        result = self.broker.claim(queue, count=max(count, 0), lease_ms=self.config.LEASE_MS,
                                   moved_id=moved_id)
        crash_point("after_claim")
        with self._lock:
            for job in result.jobs:
                self._in_hand[(queue, job.id)] = Held(job)
        self._claimed_total += len(result.jobs)
        self._buffer.put(result.jobs)
        for job_id, attempts in result.dead:
            self._done.put(Outcome(mirror.expired_record(
                job_id, attempts, dead=True,
                error=f"reliable_jobs.exceptions.AttemptsExhausted: claimed {attempts} time(s) "
                      "without finishing (worker lost or lease expired)")))
        for garbage in result.garbage:
            logger.warning("Moved aside %r found on queue %r: no such job.", garbage, queue)
        return len(result.jobs)

    def _burst_done(self) -> bool:
        if self._in_hand:
            return False
        counts = [self.broker.counts(queue) for queue in self._physical]
        return not any(c.queued or c.running or c.scheduled for c in counts)

    def _time_to_next_timer(self) -> float:
        now = time.monotonic()
        return max(0.01, min(self._next_renew, self._next_beat, self._next_sweep) - now)

    def _maintain(self, renew_only: bool = False) -> None:
        now = time.monotonic()
        if now >= self._next_renew:
            self._next_renew = now + self.config.renew_interval_ms / 1000
            self._renew()
        if renew_only:
            return
        if now >= self._next_beat:
            self._next_beat = now + min(5.0, self.config.LEASE_MS / 3000)
            self._heartbeat()
        if now >= self._next_sweep:
            self._next_sweep = now + self.config.SWEEP_INTERVAL_MS / 1000
            self._physical = self.sweep.physical_queues()
            report, records = self.sweep.redis_pass(self._physical)
            self._record_now(records)
            if report.requeued or report.dead or report.garbage:
                logger.info("Sweep: %s.", report)
            if self.progress and self.burst:
                self.progress(self._summary())
        if now >= self._next_reconcile:
            self._next_reconcile = now + RECONCILE_EVERY_S
            self._reconcile()

    def _record_now(self, records: list[AttemptRecord]) -> None:
        """Mirror sweep results before going on: a poison job may kill this
        process with its next attempt, and its history must keep this one.
        The finisher takes them instead if the database is down."""
        if not records:
            return
        try:
            mirror.record(self.config.DATABASE, records)
        except (DatabaseError, InterfaceError):
            connections[self.config.DATABASE].close()
            for record in records:
                self._done.put(Outcome(record))

    def _reconcile(self) -> SweepReport | None:
        try:
            return self.sweep.reconcile(max_batches=10)
        except (DatabaseError, InterfaceError) as exc:
            logger.warning("Reconcile skipped: the database is unavailable (%s).", exc)
            connections[self.config.DATABASE].close()
            return None

    def _renew(self) -> None:
        with self._lock:
            by_queue: dict[str, list[Held]] = defaultdict(list)
            for held in self._in_hand.values():
                if not held.lost:
                    by_queue[held.job.queue].append(held)
        for queue, helds in by_queue.items():
            try:
                kept = self.broker.extend(queue, [(h.job.id, h.job.attempt) for h in helds],
                                          lease_ms=self.config.LEASE_MS)
            except redis.RedisError as exc:
                self._redis_outage.failed(exc, "renewing leases")
                self._next_renew = time.monotonic() + 0.2
                continue
            for held, ok in zip(helds, kept, strict=True):
                if not ok:
                    held.lost = True
                    logger.warning("Lost the lease of job %s attempt %d: another worker may "
                                   "run it; this attempt's ack will be refused.",
                                   held.job.id, held.job.attempt)

    def _heartbeat(self) -> None:
        info = {"id": self.worker_id, "host": socket.gethostname(), "pid": os.getpid(),
                "queues": self.queues, "concurrency": self.concurrency,
                "jobs": [f"{q}:{j}" for q, j in list(self._in_hand)[:50]],
                "in_hand": len(self._in_hand),
                "started": self._started_at, "claimed": self._claimed_total,
                "finished": self._finished_total}
        try:
            self.broker.heartbeat(self.worker_id, info, ttl_ms=max(15_000, self.config.LEASE_MS))
        except redis.RedisError as exc:
            logger.debug("Heartbeat failed: %s", exc)

    def _summary(self) -> str:
        s = self.stats
        return (f"{self._claimed_total} claimed, {s.succeeded} succeeded, {s.failed} failed "
                f"(retrying), {s.dead} dead, {s.refused} refused as stale, "
                f"{len(self._in_hand)} in hand")

    # -- executor threads --------------------------------------------------

    def _execute_loop(self) -> None:
        """Run jobs from the buffer, marking them started in small groups first.

        A first attempt is marked together with up to MARK_AHEAD - 1 more
        waiting first attempts (one round trip for the group), which go back
        to the front of the buffer for any thread to run; a crash charges at
        most those. A later attempt, possibly a job that crashed its worker
        before, is marked alone and only once the outcomes of everything this
        worker finished are durable.
        """
        close_old_connections()
        while (item := self._buffer.get()) is not None:
            job, marked = item
            if self._stopping.is_set():
                self._release([(job, False)])
                continue
            if not marked:
                if job.attempt > 1:
                    self._wait_until_flushed()
                    group = [job]
                else:
                    group = [job, *self._buffer.take_first_attempts(MARK_AHEAD - 1)]
                held = self._mark_started(group)
                if not held:
                    continue
                job = held[0]
                self._buffer.put_marked(held[1:])
            try:
                self._execute(job)
            finally:
                # Like Django's request cycle: a task's database connection is
                # closed (or kept, per CONN_MAX_AGE) when it ends, so the next
                # job never starts on a broken or stale one.
                close_old_connections()

    def _mark_started(self, jobs: list[ClaimedJob]) -> list[ClaimedJob]:
        """Record in Redis that ``jobs`` start now; return those still ours.

        Must succeed before any of them runs (see start.lua): while Redis is
        unreachable they wait here, their leases renewed by the main thread.
        """
        backoff = BACKOFF_START_S
        while True:
            try:
                marked = self._start_marks.mark(jobs)
                break
            except redis.RedisError as exc:
                self._redis_outage.failed(exc, "marking jobs started")
                if self._hard_stop.wait(backoff):
                    self._release([(job, False) for job in jobs])
                    return []
                backoff = min(backoff * 2, BACKOFF_MAX_S)
        lost = [job for job, ok in zip(jobs, marked, strict=True) if not ok]
        if lost:
            with self._lock:
                for job in lost:
                    self._in_hand.pop((job.queue, job.id), None)
            self._slot_freed.set()
            for job in lost:
                logger.warning("Job %s attempt %d is no longer held (lease lost before it "
                               "started); not running it.", job.id, job.attempt)
        return [job for job, ok in zip(jobs, marked, strict=True) if ok]

    def _finish(self, outcome: Outcome) -> None:
        with self._flushed:
            self._outcomes_total += 1
        self._done.put(outcome)

    def _wait_until_flushed(self) -> None:
        """Block until every outcome handed to the finisher so far is mirrored and acked.

        A job on its second attempt or later may be one that crashed its
        worker. Before it runs again, the jobs this worker already finished
        are made durable, so a poison job cannot make them run again.
        """
        with self._flushed:
            target = self._outcomes_total
            while self._finished_total < target and not self._hard_stop.is_set():
                self._flushed.wait(timeout=0.5)

    def _execute(self, job: ClaimedJob) -> None:
        with self._lock:
            held = self._in_hand.get((job.queue, job.id))
            if held is not None:
                held.started = True
        started_at = timezone.now()
        started_clock = time.perf_counter()
        record = AttemptRecord(job_id=job.id, attempt=job.attempt, job_state=JobState.RUNNING,
                               worker_id=self.worker_id, started_at=started_at)
        self._done.put(Outcome(record))
        task_path = "?"
        result: TaskResult | None = None
        try:
            decoded = payload.decode(job.payload, max_bytes=self.config.MAX_PAYLOAD_BYTES)
            task_path = decoded.task_path
            task = lookup(decoded.task_path)
            if task is None or task.backend != self.backend.alias:
                raise UnknownTask(
                    f"{decoded.task_path!r} is not a registered task of backend "
                    f"{self.backend.alias!r}; it was not imported."
                )
            result = self._task_result(task, job, decoded, started_at)
            task_started.send(type(self.backend), task_result=result)
            crash_point("in_task")
            timeout_ms = self.backend.task_option(task, "timeout_ms")
            if timeout_ms:
                value = run_in_child(
                    payload_text=job.payload, job_id=job.id, attempt=job.attempt,
                    worker_id=self.worker_id, backend=self.backend.alias,
                    queue=logical_queue(job.queue),
                    timeout_s=timeout_ms / 1000,
                )
            elif task.takes_context:
                value = task.call(TaskContext(task_result=result), *decoded.args, **decoded.kwargs)
            else:
                value = task.call(*decoded.args, **decoded.kwargs)
            value = normalize_json(value)
        except Exception as exc:
            self._fail(job, exc, task_path, result, started_at, started_clock)
        else:
            finished_at = timezone.now()
            object.__setattr__(result, "status", TaskResultStatus.SUCCESSFUL)
            object.__setattr__(result, "finished_at", finished_at)
            object.__setattr__(result, "_return_value", value)
            task_finished.send(type(self.backend), task_result=result)
            done = AttemptRecord(job_id=job.id, attempt=job.attempt,
                                 job_state=JobState.SUCCEEDED, worker_id=self.worker_id,
                                 started_at=started_at, finished_at=finished_at,
                                 outcome=AttemptOutcome.SUCCEEDED, return_value=value)
            self._finish(Outcome(done, job=job, delay_ms=None))
            logger.info("Job %s %s attempt %d/%d succeeded in %.1f ms.", job.id, task_path,
                        job.attempt, job.max_attempts,
                        (time.perf_counter() - started_clock) * 1000)

    def _task_result(self, task: Any, job: ClaimedJob, decoded: payload.Payload,
                     started_at: datetime) -> TaskResult:
        queue = logical_queue(job.queue)  # the shard's queue, as enqueued
        if task.queue_name != queue:
            task = task.using(queue_name=queue)
        return TaskResult(
            task=task, id=job.id, status=TaskResultStatus.RUNNING, enqueued_at=None,
            started_at=started_at, finished_at=None, last_attempted_at=started_at,
            args=decoded.args, kwargs=decoded.kwargs, backend=self.backend.alias,
            errors=[], worker_ids=[self.worker_id] * job.attempt,
        )

    def _fail(self, job: ClaimedJob, exc: BaseException, task_path: str,
              result: TaskResult | None, started_at: datetime, started_clock: float) -> None:
        """Record a failed attempt; called inside the ``except`` block (signals read exc_info)."""
        task = lookup(task_path)
        delay_ms = retry.next_delay_ms(
            exc, attempt=job.attempt, max_attempts=job.max_attempts,
            base_ms=self.backend.task_option(task, "retry_base_ms") if task
            else self.config.RETRY_BASE_MS,
            max_ms=self.backend.task_option(task, "retry_max_ms") if task
            else self.config.RETRY_MAX_MS,
        )
        if isinstance(exc, ChildFailed):
            error, trace = f"{exc.class_path}: {exc}", exc.child_traceback
        else:
            error = f"{type(exc).__module__}.{type(exc).__qualname__}: {exc}"
            trace = "".join(traceback.format_exception(exc))
        # Task code may put NUL or lone surrogates in a message: PostgreSQL and
        # Redis (UTF-8) refuse them, and the outcome could never be written.
        error, trace = payload.storable_text(error), payload.storable_text(trace)
        state = (JobState.DEAD if delay_ms == retry.DEAD
                 else JobState.QUEUED if delay_ms == 0 else JobState.SCHEDULED)
        record = AttemptRecord(
            job_id=job.id, attempt=job.attempt, job_state=state, worker_id=self.worker_id,
            started_at=started_at, finished_at=timezone.now(),
            outcome=AttemptOutcome.TIMED_OUT if isinstance(exc, JobTimeout)
            else AttemptOutcome.FAILED,
            error=error, traceback=trace,
        )
        if result is not None:
            object.__setattr__(result, "status", TaskResultStatus.FAILED)
            object.__setattr__(result, "finished_at", record.finished_at)
            task_finished.send(type(self.backend), task_result=result)
        self._finish(Outcome(record, job=job, delay_ms=delay_ms))
        level = logging.WARNING if state == JobState.DEAD else logging.INFO
        logger.log(level, "Job %s %s attempt %d/%d failed in %.1f ms: %s; %s.", job.id,
                   task_path, job.attempt, job.max_attempts,
                   (time.perf_counter() - started_clock) * 1000, error,
                   "dead" if state == JobState.DEAD else f"retry in {delay_ms} ms")

    # -- finisher thread -----------------------------------------------------

    def _finish_loop(self) -> None:
        closing = False
        while not closing:
            first = self._done.get()
            batch: list[Outcome] = []
            if first is None:
                closing = True
            else:
                batch.append(first)
            while len(batch) < FINISH_BATCH:
                try:
                    item = self._done.get_nowait()
                except queue_module.Empty:
                    break
                if item is None:
                    closing = True
                    break
                batch.append(item)
            raise_point("finisher_bug")
            if batch and not self._write_mirror(batch):
                return
            if batch:
                self._apply_in_redis([o for o in batch if o.job is not None])

    def _write_mirror(self, batch: list[Outcome]) -> bool:
        """Write the batch, retrying until it lands (False only on a hard stop)."""
        backoff = BACKOFF_START_S
        while True:
            try:
                mirror.record(self.config.DATABASE, [o.record for o in batch])
                self._db_outage.ok()
                return True
            except (OperationalError, InterfaceError) as exc:
                # Only a lost or refused connection is worth retrying; any other
                # database error is a bug no retry fixes, and it propagates:
                # the worker stops and hands its jobs back (see _guarded).
                self._db_outage.failed(exc, f"writing {len(batch)} outcome(s) to the mirror")
                connections[self.config.DATABASE].close()
            if self._hard_stop.wait(backoff):
                return False
            backoff = min(backoff * 2, BACKOFF_MAX_S)

    def _apply_in_redis(self, finished: list[Outcome]) -> None:
        crash_point("before_ack")
        by_queue: dict[str, list[Outcome]] = defaultdict(list)
        for outcome in finished:
            assert outcome.job is not None
            by_queue[outcome.job.queue].append(outcome)
        for queue, outcomes in by_queue.items():
            acks = [o for o in outcomes if o.delay_ms is None]
            nacks = [o for o in outcomes if o.delay_ms is not None]
            backoff = BACKOFF_START_S
            while True:
                try:
                    acked = self.broker.ack(queue, [(o.record.job_id, o.record.attempt)
                                                    for o in acks])
                    nacked = self.broker.nack(queue, [
                        (o.record.job_id, o.record.attempt, o.delay_ms, o.record.error[:4000])
                        for o in nacks
                    ])
                    break
                except redis.RedisError as exc:
                    self._redis_outage.failed(exc, f"acking {len(outcomes)} job(s)")
                    if self._hard_stop.wait(backoff):
                        return
                    # Retried whole: both scripts are fenced, so a repeat is refused.
                    backoff = min(backoff * 2, BACKOFF_MAX_S)
            self._count(acks, acked, nacks, nacked)
        crash_point("after_ack")
        with self._lock:
            for outcome in finished:
                assert outcome.job is not None
                self._in_hand.pop((outcome.job.queue, outcome.job.id), None)
        with self._flushed:
            self._finished_total += len(finished)
            self._flushed.notify_all()
        self._slot_freed.set()

    def _count(self, acks: list[Outcome], acked: list[bool],
               nacks: list[Outcome], nacked: list[bool]) -> None:
        for outcome, ok in zip(acks + nacks, acked + nacked, strict=True):
            if not ok:
                self.stats.refused += 1
                logger.warning("Redis refused the outcome of job %s attempt %d: that attempt "
                               "is no longer held (lease expired).", outcome.record.job_id,
                               outcome.record.attempt)
            elif outcome.delay_ms is None:
                self.stats.succeeded += 1
            elif outcome.delay_ms == retry.DEAD:
                self.stats.dead += 1
            else:
                self.stats.failed += 1
