"""Executor threads: mark jobs started, run their tasks, hand outcomes on.

A job runs only once Redis recorded that it starts (start.lua) and only if
its lease is still ours; what it did goes to the finisher. Task code runs
here (or, with a time limit, in a child process started from here).

A job cancelled while it is in hand (the lease keeper sets its
:class:`~reliable_jobs.cancellation.Cancellation`) ends cancelled whatever
its task then does: a claim not started yet never runs, a child process is
killed, a thread task sees ``context.cancelled`` and may stop at a
checkpoint, or runs to completion; its outcome is recorded as cancelled
and acked (ack.lua finishes it as cancelled), never retried.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
import traceback
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

from django.conf import settings
from django.db import close_old_connections
from django.utils import timezone

from .. import payload, retry, telemetry
from ..broker import REDIS_ERRORS, Applied, ClaimedJob
from ..cancellation import JobContext
from ..compat import (
    TaskResult,
    normalize_json,
    task_finished,
    task_started,
)
from ..exceptions import JobCancelled, JobTimeout, Snooze, UnknownTask, class_path
from ..faults import crash_point
from ..handoff import StartMarks
from ..isolation import ChildFailed, ChildStopped, run_in_child
from ..keys import logical_queue
from ..logformat import log_attempt, printable
from ..mirror import CANCELLED_ERROR, AttemptRecord, cancelled_record, snoozed_record
from ..mirror.journal import Journal
from ..models import AttemptOutcome, JobState
from ..results import (
    attempt_result,
    finish_cancelled,
    finish_failed,
    finish_snoozed,
    finish_succeeded,
)
from ..signalwatch import SignalWatch
from ..tasks import lookup
from .backoff import Backoff
from .database import close_old_connections_if_opened
from .finisher import FinishedAttempt, Finisher
from .registry import Held
from .shared import Shared

if TYPE_CHECKING:
    from ..backend import ReliableJobsBackend

logger = logging.getLogger("reliable_jobs.worker")

#: First attempts an executor thread marks started in one round trip, then
#: runs in turn: the most a crash in one of them can charge the others.
MARK_AHEAD = 16
#: ... up to this many when the jobs are so short (see mark_group) that the
#: whole group is run within MARK_WITHIN_MS: the round trip per group was
#: the largest cost of a no-op job, and a crash charges at most jobs this
#: worker would have run within a few milliseconds anyway.
MARK_AHEAD_MAX = 64
MARK_WITHIN_MS = 2.0


def mark_group(average_ms: float | None) -> int:
    """How many first attempts to mark in one round trip, by the observed pace."""
    if average_ms is None:
        return MARK_AHEAD
    return max(MARK_AHEAD, min(MARK_AHEAD_MAX, int(MARK_WITHIN_MS / max(average_ms, 0.001))))


class Executor:
    """What every executor thread runs; the threads share one instance."""

    def __init__(self, *, backend: ReliableJobsBackend, shared: Shared, finisher: Finisher,
                 retry_gate: threading.Lock,
                 release: Callable[[list[tuple[ClaimedJob, bool]]], None]) -> None:
        self.backend = backend
        self.config = backend.config
        self.finisher = finisher
        #: Held by a sweep that may requeue jobs (see Maintenance.sweep_once).
        self.retry_gate = retry_gate
        #: Hands jobs back to their queue (Worker._release).
        self.release = release
        # The shared state, bound once: every job reads these.
        self.worker_id = shared.worker_id
        self.buffer = shared.buffer
        self.in_hand = shared.in_hand
        self.redis_outage = shared.redis_outage
        self.stopping = shared.stopping
        self.hard_stop = shared.hard_stop
        self.slot_freed = shared.slot_freed
        self.pace = shared.pace
        #: Given the jobs in hand not run yet, whether to wake the main loop to claim.
        self.wants_room = shared.wants_room
        self.start_marks = StartMarks(backend.broker)
        #: timezone.now() without its settings look-up per call (twice a job):
        #: USE_TZ is read once per worker.
        self.now = functools.partial(datetime.now, UTC if settings.USE_TZ else None)
        #: Whether the signals of a started or successful attempt would be seen.
        self.started_watch = SignalWatch(task_started, type(backend))
        self.finished_watch = SignalWatch(task_finished, type(backend))

    def run(self) -> None:
        """Run jobs from the buffer, marking them started in small groups first.

        A first attempt is marked together with up to MARK_AHEAD - 1 more
        waiting first attempts (MARK_AHEAD_MAX - 1 for very short jobs, see
        mark_group; one round trip for the group), which go back to the
        front of the buffer for any thread to run; a crash charges at most
        those. A later attempt, possibly a job that crashed its worker
        before, is marked alone and only once the outcomes of everything this
        worker finished are durable.
        """
        close_old_connections()
        while (item := self.buffer.get()) is not None:
            job, marked = item
            if self.stopping.is_set():
                self.release([(job, False)])
                continue
            if not marked:
                if job.attempt > 1:
                    with self.retry_gate:
                        pass  # a sweep that may have requeued this job has handed over
                    self.finisher.wait_until_flushed()
                    group = [job]
                else:
                    group = [job, *self.buffer.take_first_attempts(
                        mark_group(self.pace.average_ms()) - 1)]
                ours = self._mark_started(group)
                if not ours:
                    continue
                job = ours[0]
                self.buffer.put_marked(ours[1:])
            held = self.in_hand.begin(job)
            if held is None:
                # Its lease was lost after the start mark: another worker may
                # hold it now, and running it would run it twice at once.
                logger.warning("Job %s attempt %d lost its lease before it ran; not running "
                               "it.", printable(job.id), job.attempt)
                self.slot_freed.set()
                continue
            try:
                if not self._execute(job, held):
                    continue  # its killed child was not reaped: left to its lease
                # Room to claim ahead again, when the main loop wants it (see
                # Shared.wants_room: not after every no-op job). Set only if not
                # set already: the main loop clears it before it counts the
                # room, so an Event still set means it has yet to count.
                if self.wants_room(self.in_hand.done(job)) and not self.slot_freed.is_set():
                    self.slot_freed.set()
            finally:
                # Like Django's request cycle: a task's database connection is
                # closed (or kept, per CONN_MAX_AGE) when it ends, so the next
                # job never starts on a broken or stale one. A thread whose
                # tasks never opened one has nothing to close.
                close_old_connections_if_opened()

    def _mark_started(self, jobs: list[ClaimedJob]) -> list[ClaimedJob]:
        """Record in Redis that ``jobs`` start now; return those still ours.

        Must succeed before any of them runs (see start.lua): while Redis is
        unreachable they wait here, their leases renewed by the lease keeper.
        """
        backoff = Backoff()
        while True:
            try:
                marked = self.start_marks.mark(jobs)
                break
            except REDIS_ERRORS as exc:
                self.redis_outage.failed(exc, "marking jobs started")
                if backoff.wait(self.hard_stop):
                    self.release([(job, False) for job in jobs])
                    return []
        held = [job for job, ok in zip(jobs, marked, strict=True) if ok == Applied.DONE]
        if len(held) == len(jobs):  # the usual case: every job still ours
            return held
        lost = [job for job, ok in zip(jobs, marked, strict=True)
                if ok in (Applied.REFUSED, Applied.EXPIRED)]
        for job, ok in zip(jobs, marked, strict=True):
            if ok == Applied.CANCELLED:
                # Cancelled between its claim and its start: never run, ack it
                # (ack.lua finishes it as cancelled).
                self.in_hand.done(job)
                self.finisher.submit(FinishedAttempt(cancelled_record(
                    job.id, job.attempt, gen=job.gen,
                    error=f"{CANCELLED_ERROR} before it started"),
                    job=job, delay_ms=None))
                self.slot_freed.set()
                logger.info("Job %s attempt %d was cancelled before it started; not running it.",
                            printable(job.id), job.attempt)
        if lost:
            # Not released: an expired claim is the sweep's to requeue (as never
            # started), and one no longer held is someone else's.
            self.in_hand.drop(lost)
            self.slot_freed.set()
            for job, ok in zip(jobs, marked, strict=True):
                if ok == Applied.EXPIRED:
                    logger.warning("Job %s attempt %d: its lease expired before it started; "
                                   "not running it (the sweep requeues it).",
                                   printable(job.id), job.attempt)
                elif ok == Applied.REFUSED:
                    logger.warning("Job %s attempt %d is no longer held (lease lost before it "
                                   "started); not running it.", printable(job.id), job.attempt)
        return held

    def _execute(self, job: ClaimedJob, held: Held) -> bool:
        """Run the attempt; False only if its child was killed and could not be reaped."""
        started_at = self.now()
        started_clock = time.perf_counter()
        try:
            return self._run_task(job, held, started_at, started_clock)
        finally:
            self.pace.observe((time.perf_counter() - started_clock) * 1000)

    def _run_task(self, job: ClaimedJob, held: Held, started_at: datetime,
                  started_clock: float) -> bool:
        cancellation = held.cancellation
        self.finisher.started(AttemptRecord(
            job_id=job.id, attempt=job.attempt, gen=job.gen, job_state=JobState.RUNNING,
            worker_id=self.worker_id, started_at=started_at))
        task_path = "?"
        result: TaskResult[..., Any] | None = None
        #: The decoded payload and its task, once the task is known to be runnable.
        runnable: tuple[payload.Payload, Any] | None = None
        try:
            decoded = payload.decode(job.payload, max_bytes=self.config.MAX_PAYLOAD_BYTES)
            task_path = decoded.task_path
            task = lookup(decoded.task_path)
            if task is None or task.backend != self.backend.alias:
                raise UnknownTask(
                    f"{decoded.task_path!r} is not a registered task of backend "
                    f"{self.backend.alias!r}; it was not imported."
                )
            runnable = decoded, task
            # Django's TaskResult (and normalize_json of the arguments) only for
            # someone who can see it: a takes_context task, a receiver of the
            # signals that does more than log to a silenced logger (signalwatch.py).
            # A failure builds one later if task_finished has any listener.
            if task.takes_context or self.started_watch.observed():
                result = self._task_result(task, job, decoded, started_at)
                task_started.send(type(self.backend), task_result=result)
            elif self.finished_watch.observed():
                result = self._task_result(task, job, decoded, started_at)
            with telemetry.hook.attempt(job, task_path, decoded.trace):
                crash_point("in_task")
                if cancellation.requested():  # since its start mark: do not begin the task
                    raise JobCancelled("it was cancelled before its task began")
                timeout_ms = self.backend.task_option(task, "timeout_ms")
                if timeout_ms:
                    held.isolated = True
                    value = run_in_child(
                        payload_text=job.payload, job_id=job.id, attempt=job.attempt,
                        worker_id=self.worker_id, backend=self.backend.alias,
                        queue=logical_queue(job.queue),
                        timeout_s=timeout_ms / 1000, cancellation=cancellation,
                        interrupt=held.interrupt, gen=job.gen, database=self.config.DATABASE,
                    )
                elif task.takes_context:
                    assert result is not None  # built above for every takes_context task
                    journal = Journal(self.config.DATABASE, job.id, attempt=job.attempt,
                                      gen=job.gen)
                    try:
                        value = task.call(JobContext(task_result=result,
                                                     cancellation=cancellation,
                                                     journal=journal),
                                          *decoded.args, **decoded.kwargs)
                    finally:
                        # Progress reported since the last write: before the
                        # outcome, so a finished row is never written after.
                        journal.flush()
                else:
                    value = task.call(*decoded.args, **decoded.kwargs)
            value = normalize_json(value)
        except ChildStopped as exc:
            return self._stopped(job, reaped=exc.reaped)
        except Snooze as exc:
            result = self._unsuccessful_result(result, runnable, job, started_at)
            if cancellation.requested():
                self._cancelled(job, exc, task_path, result, started_at)
            else:
                self._snoozed(job, exc, task_path, result, started_at, started_clock)
        except Exception as exc:
            result = self._unsuccessful_result(result, runnable, job, started_at)
            if cancellation.requested():
                self._cancelled(job, exc, task_path, result, started_at)
            else:
                self._fail(job, exc, task_path, result, started_at, started_clock)
        else:
            if cancellation.requested():
                result = self._unsuccessful_result(result, runnable, job, started_at)
                self._cancelled(job, None, task_path, result, started_at)
                return True
            finished_at = self.now()
            if result is not None:
                finish_succeeded(result, value=value, finished_at=finished_at)
                task_finished.send(type(self.backend), task_result=result)
            done = AttemptRecord(job_id=job.id, attempt=job.attempt, gen=job.gen,
                                 job_state=JobState.SUCCEEDED, worker_id=self.worker_id,
                                 started_at=started_at, finished_at=finished_at,
                                 outcome=AttemptOutcome.SUCCEEDED, return_value=value)
            self.finisher.submit(FinishedAttempt(done, job=job, delay_ms=None, task=task_path))
            telemetry.hook.finished(job, task_path, JobState.SUCCEEDED,
                                    time.perf_counter() - started_clock)
            # One line per success only from -v 2: at a few thousand jobs a
            # second it cost about a quarter of the drain rate. Failures keep
            # their line at the default verbosity.
            if logger.isEnabledFor(logging.DEBUG):
                log_attempt(logging.DEBUG, job, task_path, AttemptOutcome.SUCCEEDED,
                            (time.perf_counter() - started_clock) * 1000)
        return True

    def _stopped(self, job: ClaimedJob, *, reaped: bool) -> bool:
        """The worker stopped past its grace period and killed this attempt's child.

        Reaped, nothing of the attempt runs any more: hand the job back now
        (its start record first, so the released record lands after it).
        Otherwise it stays in hand, left to its lease like a thread task.
        """
        if not reaped:
            logger.warning("Job %s attempt %d: its killed process could not be waited for; "
                           "leaving the job to its lease.", printable(job.id), job.attempt)
            return False
        self.finisher.wait_until_flushed()
        self.release([(job, True)])
        logger.warning("Job %s attempt %d was still running when the grace period ended: its "
                       "process was killed and the job handed back.",
                       printable(job.id), job.attempt)
        return True

    def _unsuccessful_result(self, result: TaskResult[..., Any] | None,
                             runnable: tuple[payload.Payload, Any] | None, job: ClaimedJob,
                             started_at: datetime) -> TaskResult[..., Any] | None:
        """The ``TaskResult`` for a failed or cancelled attempt's ``task_finished``.

        Built now if it was not at the start: the framework's own receiver
        logs failures at ERROR, which a logger silenced only below WARNING
        still writes, so any listener counts here (as ``has_listeners`` says).
        Only the framework's receivers can be listening when it was not built
        at the start (see signalwatch.py), and they read no arguments.
        """
        if result is not None or runnable is None:
            return result
        if not task_finished.has_listeners(type(self.backend)):
            return None
        decoded, task = runnable
        return self._task_result(task, job, decoded, started_at)

    def _task_result(self, task: Any, job: ClaimedJob, decoded: payload.Payload,
                     started_at: datetime) -> TaskResult[..., Any]:
        return attempt_result(
            task, job_id=job.id, queue=logical_queue(job.queue),  # the shard's queue, as enqueued
            args=decoded.args, kwargs=decoded.kwargs, backend=self.backend.alias,
            started_at=started_at, worker_id=self.worker_id, attempt=job.attempt,
        )

    def _cancelled(self, job: ClaimedJob, exc: BaseException | None, task_path: str,
                   result: TaskResult[..., Any] | None, started_at: datetime) -> None:
        """Record an attempt cancelled while it ran, whatever it did then; ack it.

        The ack finishes the job as cancelled in Redis (ack.lua), so it is
        never retried; the mirror was told first (the row is cancelled).
        """
        if isinstance(exc, JobCancelled):
            how, trace = str(exc), ""
        elif isinstance(exc, ChildFailed):
            how, trace = f"the task then raised {exc.class_path}: {exc}", exc.child_traceback
        elif exc is not None:
            how = f"the task then raised {class_path(type(exc))}: {exc}"
            trace = "".join(traceback.format_exception(exc))
        else:
            how, trace = "the task ran to completion anyway; its result was discarded", ""
        record = cancelled_record(job.id, job.attempt, gen=job.gen,
                                  error=payload.storable_text(
                                      f"{CANCELLED_ERROR} while it ran; {how}"))
        record.worker_id, record.started_at = self.worker_id, started_at
        record.traceback = payload.storable_text(trace)
        if result is not None:
            finish_cancelled(result, traceback=record.traceback or record.error,
                             finished_at=record.finished_at)
            task_finished.send(type(self.backend), task_result=result)
        self.finisher.submit(FinishedAttempt(record, job=job, delay_ms=None))
        took_ms = ((record.finished_at or timezone.now()) - started_at).total_seconds() * 1000
        log_attempt(logging.INFO, job, task_path, AttemptOutcome.CANCELLED, took_ms, error=how)

    def _snoozed(self, job: ClaimedJob, exc: Snooze, task_path: str,
                 result: TaskResult[..., Any] | None, started_at: datetime,
                 started_clock: float) -> None:
        """Record an attempt whose task raised Snooze: the job waits again, its attempt given back.

        The finisher mirrors it (outcome 'snoozed', the row's max_attempts one
        more), then runs snooze.lua, fenced like a nack: a stale holder's
        snooze is refused in Redis as its record is in the mirror.
        """
        record = snoozed_record(job.id, job.attempt, gen=job.gen, delay_ms=exc.delay_ms,
                                max_attempts=job.max_attempts, worker_id=self.worker_id,
                                started_at=started_at)
        if result is not None:
            finish_snoozed(result)
            task_finished.send(type(self.backend), task_result=result)
        self.finisher.submit(FinishedAttempt(record, job=job, delay_ms=exc.delay_ms,
                                             task=task_path, snoozed=True))
        telemetry.hook.snoozed(job, task_path, time.perf_counter() - started_clock)
        if logger.isEnabledFor(logging.DEBUG):
            log_attempt(logging.DEBUG, job, task_path, AttemptOutcome.SNOOZED,
                        (time.perf_counter() - started_clock) * 1000,
                        retry_in_ms=exc.delay_ms)

    def _fail(self, job: ClaimedJob, exc: BaseException, task_path: str,
              result: TaskResult[..., Any] | None, started_at: datetime,
              started_clock: float) -> None:
        """Record a failed attempt; called inside the ``except`` block (signals read exc_info)."""
        task = lookup(task_path)
        delay_ms = retry.next_delay_ms(
            exc, attempt=job.attempt, max_attempts=job.max_attempts,
            base_ms=self.backend.task_option(task, "retry_base_ms") if task
            else self.config.RETRY_BASE_MS,
            max_ms=self.backend.task_option(task, "retry_max_ms") if task
            else self.config.RETRY_MAX_MS,
        )
        failed_class = exc.class_path if isinstance(exc, ChildFailed) else class_path(type(exc))
        error = f"{failed_class}: {exc}"
        if isinstance(exc, ChildFailed):
            trace = exc.child_traceback
        else:
            trace = "".join(traceback.format_exception(exc))
        # Task code may put NUL or lone surrogates in a message: PostgreSQL and
        # Redis (UTF-8) refuse them, and the outcome could never be written.
        error, trace = payload.storable_text(error), payload.storable_text(trace)
        state = (JobState.DEAD if delay_ms == retry.DEAD
                 else JobState.QUEUED if delay_ms == 0 else JobState.SCHEDULED)
        finished_at = timezone.now()
        record = AttemptRecord(
            job_id=job.id, attempt=job.attempt, gen=job.gen, job_state=state,
            worker_id=self.worker_id, started_at=started_at, finished_at=finished_at,
            outcome=AttemptOutcome.TIMED_OUT if isinstance(exc, JobTimeout)
            else AttemptOutcome.FAILED,
            error=error, traceback=trace,
            retry_at=finished_at + timedelta(milliseconds=delay_ms)
            if state == JobState.SCHEDULED else None,
        )
        if result is not None:
            finish_failed(result, exception_class_path=failed_class,
                          traceback=trace or error, finished_at=record.finished_at)
            task_finished.send(type(self.backend), task_result=result)
        self.finisher.submit(FinishedAttempt(record, job=job, delay_ms=delay_ms, task=task_path))
        telemetry.hook.finished(job, task_path, state, time.perf_counter() - started_clock, exc)
        log_attempt(logging.WARNING if state == JobState.DEAD else logging.INFO, job, task_path,
                    record.outcome, (time.perf_counter() - started_clock) * 1000,
                    error=error, retry_in_ms=None if state == JobState.DEAD else delay_ms)

