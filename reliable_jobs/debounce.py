"""Debounce and throttle, on top of unique jobs: many equal calls, one run.

A task with ``debounce_ms`` (and ``unique_for_ms``, whose key says which
calls are equal) runs once per burst of equal calls: each call makes the
job *pending* (scheduled ``debounce_ms`` ahead) or, when an equal job is
already pending, gives it the call's arguments and pushes it back, so it
runs ``debounce_ms`` after the last call, with the last call's arguments.
``max_wait_ms`` bounds the push back: a pending job is due at most that
long after it was made, so while calls keep coming a run happens at least
that often (a throttle).

Who decides what: the database still judges the key (one unfinished job
per key, mirror.insert_jobs); Redis decides whether the holder is still
pending, in debounce.lua, atomically with promote and claim, so a call
either lands in a run that has not been claimed yet or makes a new
pending job; it never changes a run that may have begun. The holder's
row is locked while Redis is asked and is written (arguments, run_after)
in the same transaction, so after a Redis loss the rebuilt job carries the
last call's arguments and due time.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol

from .broker import REDIS_ERRORS, Broker, DebounceOutcome, NewJob
from .compat import InvalidTask

if TYPE_CHECKING:
    from .mirror import Absorb, NewRow
    from .models import Job

logger = logging.getLogger("reliable_jobs")


class DebouncedTask(Protocol):
    """What this module reads of a task (a ``tasks.ReliableTask``, which it does not import)."""

    @property
    def debounce_ms(self) -> int | None: ...
    @property
    def max_wait_ms(self) -> int | None: ...
    @property
    def unique_for_ms(self) -> int | None: ...
    @property
    def unique_while_running(self) -> bool: ...


def check_options(task: DebouncedTask) -> None:
    """Raise InvalidTask, with the fix, for debounce options that cannot work.

    The whole-number checks (``>= 1``) come first, in ReliableTask.
    """
    if task.debounce_ms is None:
        if task.max_wait_ms is not None:
            raise InvalidTask(
                "max_wait_ms has no effect without debounce_ms: set debounce_ms to how long "
                "(in ms) after the last call the run starts.")
        return
    if task.unique_for_ms is None:
        raise InvalidTask(
            "debounce_ms needs unique_for_ms: the unique key says which calls are one "
            "run (set unique_for_ms, and unique_by to count only some arguments).")
    if task.unique_while_running:
        raise InvalidTask(
            "debounce_ms cannot be used with unique_while_running=True: a call made while "
            "the debounced job runs makes the next run, it never joins the running one.")
    if task.max_wait_ms is not None and task.max_wait_ms < task.debounce_ms:
        raise InvalidTask(
            f"max_wait_ms ({task.max_wait_ms}) is shorter than debounce_ms "
            f"({task.debounce_ms}), so debounce_ms would never count: make max_wait_ms at "
            "least debounce_ms, or drop it.")


@dataclass(frozen=True, slots=True)
class Debounce:
    """A debounced task's two durations, as its enqueue uses them."""

    debounce_ms: int
    #: 0: no bound (debounce.lua's spelling of None).
    max_wait_ms: int

    def task_at(self, task: Any, now: datetime) -> Any:
        """``task`` as a call at ``now`` enqueues it: run_after ``debounce_ms`` ahead.

        That is the new row's run_after; Redis's due time, on its own clock,
        is set when the job is pushed. A call given its own run_after is
        refused (InvalidTask).
        """
        if task.run_after is not None:
            raise InvalidTask(
                f"{task.module_path} is debounced: its run time is debounce_ms after the last "
                "call, so it takes no run_after.")
        return task.using(run_after=now + timedelta(milliseconds=self.debounce_ms))

    def absorb(self, broker: Broker, job_of: Callable[[str], NewJob]) -> Absorb:
        """How an equal call goes to a pending holder (``job_of``: the call's push, by id)."""
        def absorb(holder: Job, row: NewRow) -> datetime | None:
            return replace_pending(broker, self, holder, job_of(row[0]))
        return absorb

    def push(self, broker: Broker) -> Callable[[str, list[NewJob]], None]:
        """How the new jobs of a committed enqueue go to Redis (see :func:`push_new`)."""
        return partial(push_new, broker, self)


def debounce_of(task: object) -> Debounce | None:
    """The debounce of ``task``, or None for a task that is not debounced."""
    debounce_ms = getattr(task, "debounce_ms", None)
    if debounce_ms is None:
        return None
    return Debounce(debounce_ms, getattr(task, "max_wait_ms", None) or 0)


def push_new(broker: Broker, spec: Debounce, queue: str, jobs: list[NewJob]) -> None:
    """Push committed new debounced jobs (made only if Redis does not hold them yet).

    Due ``debounce_ms`` from now on Redis's clock. If Redis is down the
    sweep's reconcile pushes them from their rows, as for any job (G5).
    """
    try:
        for job in jobs:
            broker.debounce(queue, job, debounce_ms=spec.debounce_ms,
                            max_wait_ms=spec.max_wait_ms, replace=False)
    except REDIS_ERRORS as exc:
        logger.warning(
            "Redis refused the push of %d debounced job(s) to queue %r (%s); they are safe in "
            "the database and the recovery sweep will push them.", len(jobs), queue, exc)


def replace_pending(broker: Broker, spec: Debounce, holder: Job, call: NewJob) -> datetime | None:
    """Give the pending job ``holder`` (its row locked) the call's payload; its new run_after.

    None when Redis refused (the job was promoted, claimed, ran or ended:
    the caller makes a new job) or did not answer (likewise: a new job may
    run beside the old one, but no call is lost).
    """
    job = replace(call, id=str(holder.pk), max_attempts=holder.max_attempts,
                  attempts=holder.attempts, gen=holder.generation, priority=holder.priority,
                  group=holder.fair_key)
    try:
        done = broker.debounce(holder.physical_queue, job, debounce_ms=spec.debounce_ms,
                               max_wait_ms=spec.max_wait_ms, replace=True)
    except REDIS_ERRORS as exc:
        logger.warning("Redis did not say whether debounced job %s is still pending (%s); "
                       "the call makes a new job.", holder.pk, exc)
        return None
    if done.outcome is DebounceOutcome.REFUSED:
        return None
    return datetime.fromtimestamp(done.due_ms / 1000, tz=UTC)
