"""Tasks the demo, the admin and the test suite run: one per kind of outcome.

Each is a module-level function, as ``django.tasks`` requires, so that a
worker in another process can import it by path.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from reliable_jobs.cancellation import JobContext
from reliable_jobs.compat import TaskContext, task
from reliable_jobs.exceptions import PermanentFailure, RetryLater, Snooze


@task
def noop() -> None:
    """Do nothing: what is left is the queue's own cost."""


@task
def add(a: int, b: int) -> int:
    """Return ``a + b``: a result that is easy to check."""
    return a + b


@task(fair_key="tenant")
def tenant_add(tenant: str | None, a: int, b: int) -> int:
    """``add`` for one tenant: jobs of different tenants take turns (fair shares)."""
    return a + b


@task
def sleep_for(seconds: float) -> float:
    """Sleep, then return ``seconds``: a job that is still RUNNING when a worker is killed."""
    time.sleep(seconds)
    return seconds


# django-stubs' task() does not declare the keyword arguments a backend's
# task_class adds (max_attempts, retry_base_ms, ...), hence the ignores below.
@task(takes_context=True, max_attempts=5, retry_base_ms=100)
def fail_times(context: TaskContext[[str, int], str], key: str, times: int) -> str:
    """Raise RuntimeError on the first ``times`` attempts, then return ``key``.

    The attempt number comes from the result (``context.attempt`` starts at
    1), not from process state, so the outcome is the same whichever worker
    process runs each attempt.
    """
    if context.attempt <= times:
        raise RuntimeError(f"{key}: planned failure on attempt {context.attempt} of {times}")
    return key


@task(concurrency=2)
def capped_add(a: int, b: int) -> int:
    """Return ``a + b``, at most two at once across every worker (the model test's cap)."""
    return a + b


@task(max_attempts=3, retry_base_ms=100)
def always_fail(message: str = "boom") -> None:
    """Raise RuntimeError(message) on every attempt: a job that ends FAILED."""
    raise RuntimeError(message)


@task
async def async_add(a: int, b: int) -> int:
    """Return ``a + b`` from a coroutine, which the backend must run to completion."""
    await asyncio.sleep(0)
    return a + b


@task(takes_context=True, max_attempts=3)
def retry_once_later(context: TaskContext[..., Any], delay_ms: int) -> int:
    """Ask for a retry in ``delay_ms`` on the first attempt, then return the attempt number."""
    if context.attempt == 1:
        raise RetryLater(delay_ms, "not ready yet")
    return context.attempt


@task(max_attempts=5)
def give_up(reason: str) -> None:
    """Fail for good on the first attempt: no retry can help."""
    raise PermanentFailure(reason)


@task(timeout_ms=500, max_attempts=2, retry_base_ms=50)
def hang(seconds: float) -> float:
    """Sleep past the 500 ms limit: each attempt is killed and fails as timed out."""
    time.sleep(seconds)
    return seconds


@task(timeout_ms=5_000, max_attempts=2, retry_base_ms=50)
def isolated_add(a: int, b: int) -> int:
    """Return ``a + b`` from a child process (the task has a time limit)."""
    return a + b


@task(max_attempts=3, timeout_ms=5_000, retry_base_ms=50)
def kill_own_process() -> None:
    """Die like a segfault: the attempt's process exits without answering."""
    import os

    os._exit(9)


@task(max_attempts=3, retry_base_ms=50)
def crash_worker() -> None:
    """Kill the worker process that runs it (no time limit, so it runs in a worker thread)."""
    import os

    os._exit(13)


@task(timeout_ms=60_000, max_attempts=1)
def report_pid_then_sleep(pid_file: str, seconds: float) -> float:
    """Write this attempt's process id to ``pid_file``, then sleep.

    A test finds the isolated child by that file, kills its worker, and
    checks that the child does not outlive it.
    """
    import os

    partial = f"{pid_file}.partial"
    with open(partial, "w") as out:
        out.write(str(os.getpid()))
    os.replace(partial, pid_file)  # the test never reads a half-written pid
    time.sleep(seconds)
    return seconds


@task(takes_context=True, max_attempts=3)
def stop_when_cancelled(context: TaskContext[[float], str], seconds: float) -> str:
    """Work in small steps for ``seconds``, stopping at the first step after a cancel.

    Each step is a checkpoint: ``raise_if_cancelled`` raises JobCancelled
    once staff or code cancelled the job (reliable_jobs.cancellation).
    """
    from reliable_jobs.cancellation import raise_if_cancelled

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        raise_if_cancelled(context)
        time.sleep(0.02)
    return "finished"


@task(unique_for_ms=60_000)
def unique_add(a: int, b: int) -> int:
    """Return ``a + b``; an equal call while one waits gets that job (a unique task)."""
    return a + b


@task(unique_for_ms=60_000, unique_by=["key"], debounce_ms=2_000)
def debounced_note(key: str, n: int) -> int:
    """Return ``n``: calls with one ``key`` make one run, 2 s after the last, with its ``n``."""
    return n


@task(unique_for_ms=60_000, unique_by=["key"], debounce_ms=2_000, max_wait_ms=5_000)
def throttled_note(key: str, n: int) -> int:
    """Like ``debounced_note``, but while calls keep coming a run starts at least every 5 s."""
    return n


@task
def leave_a_thread(seconds: float) -> None:
    """Start a non-daemon thread that outlives the task by ``seconds`` (as some libraries do).

    An interpreter's normal exit waits for such a thread; a worker that
    stopped cleanly must not (tests/test_shutdown.py).
    """
    import threading

    threading.Thread(target=time.sleep, args=(seconds,), name="left-by-a-task",
                     daemon=False).start()  # not inherited from the daemon executor thread


@task
def total(values: list[Any], extra: int = 0) -> int:
    """Sum ``values`` (a chord's results) plus ``extra``: a workflow's fan-in step."""
    return sum(v for v in values if isinstance(v, int)) + extra
@task(takes_context=True, max_attempts=1)
def snooze_then_add(context: TaskContext[..., Any], times: int, a: int, b: int,
                    delay_ms: int = 0) -> int:
    """Snooze ``times`` times, counting in the job's checkpoint, then return ``a + b``.

    ``max_attempts=1``: a snooze that used an attempt would bury the job at
    its second claim.
    """
    assert isinstance(context, JobContext)  # what reliable_jobs passes; narrows for mypy
    snoozed = context.checkpoint_value or 0
    if snoozed < times:
        context.checkpoint(snoozed + 1)
        raise Snooze(delay_ms)
    return a + b


@task(takes_context=True, max_attempts=1, timeout_ms=20_000)
def snooze_then_add_in_child(context: TaskContext[..., Any], times: int, a: int, b: int,
                             delay_ms: int = 0) -> int:
    """``snooze_then_add`` in a child process of its own (a task with ``timeout_ms``)."""
    return snooze_then_add.func(context, times, a, b, delay_ms)


@task(takes_context=True, max_attempts=1000)
def count_with_checkpoints(context: TaskContext[..., Any], total: int, every: int,
                           ledger: str, pause_s: float = 0.0) -> int:
    """Go through items 0 .. total - 1, storing a checkpoint every ``every`` items.

    Each attempt resumes from the last checkpoint, and appends to the file
    ``ledger`` one line when it starts (``start <attempt> <first item>``)
    and one per item done, flushed to the OS at once (a SIGKILL loses no
    line), so a test or bench/checkpoint.py can count the items done again
    after each kill. Sleeps ``pause_s`` after each 100 items.
    """
    assert isinstance(context, JobContext)  # what reliable_jobs passes; narrows for mypy
    first = (context.checkpoint_value or {}).get("next", 0)
    with open(ledger, "a") as out:
        out.write(f"start {context.attempt} {first}\n")
        out.flush()
        for item in range(first, total):
            out.write(f"{item}\n")
            out.flush()
            done = item + 1
            if done % every == 0:
                context.checkpoint({"next": done}, done=done, total=total)
            elif done % 100 == 0:
                context.progress(done, total)
            if pause_s and done % 100 == 0:
                time.sleep(pause_s)
    return total


def redone_per_restart(ledger: str) -> tuple[list[int], int, set[int]]:
    """Read a ``count_with_checkpoints`` ledger: items redone at each restart, lines, items.

    Each attempt after the first starts at its checkpoint; the items from
    there to the last one the previous attempt wrote were done twice. Returns
    (items redone per restart, item lines written in all, distinct items done).
    """
    redone: list[int] = []
    last = -1
    lines = 0
    items: set[int] = set()
    started = False
    with open(ledger) as text:
        for line in text:
            if line.startswith("start "):
                first = int(line.split()[2])
                if started:
                    redone.append(max(0, last + 1 - first))
                started, last = True, first - 1
            elif line.strip():
                last = int(line)
                lines += 1
                items.add(last)
    return redone, lines, items
