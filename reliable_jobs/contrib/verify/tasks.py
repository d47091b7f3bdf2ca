"""The tasks the chaos run and the benchmark enqueue: a sleep that keeps a ledger, a no-op.

They live here, in an installed app's ``tasks`` module, because that is
what a worker imports at start-up (``tasks.discover``) and the only place
it runs tasks from (``tasks.lookup``): ``chaosjobs`` enqueues
:data:`chaos_job` for workers in other processes, so it must be a task
every worker registers by itself. The benchmark's functions
(:func:`noop`, :func:`first_line`) stay plain functions: ``benchjobs``
binds them to the backend and queue it measures, and runs them in its own
process, so any backend alias works.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.utils.module_loading import import_string

from reliable_jobs.backend import ReliableJobsBackend
from reliable_jobs.compat import (
    DEFAULT_TASK_BACKEND_ALIAS,
    DEFAULT_TASK_QUEUE_NAME,
    TaskContext,
    task,
    task_backends,
)
from reliable_jobs.exceptions import PermanentFailure

from .chaos_ledger import ledger_run


def backend_alias() -> str:
    """The TASKS alias this module's tasks belong to.

    The default alias when it is a reliable_jobs backend (what ``chaosjobs
    --backend`` defaults to), else the first alias in TASKS that is one.
    """
    configured: dict[str, dict[str, Any]] = getattr(settings, "TASKS", {})
    ours = [alias for alias, options in configured.items() if _is_ours(options.get("BACKEND"))]
    if DEFAULT_TASK_BACKEND_ALIAS in ours:
        return DEFAULT_TASK_BACKEND_ALIAS
    if not ours:
        raise ImproperlyConfigured(
            "reliable_jobs.contrib.verify is in INSTALLED_APPS but no TASKS backend is "
            "reliable_jobs.backend.ReliableJobsBackend: add one, or remove the app."
        )
    return ours[0]


def _is_ours(path: object) -> bool:
    """Whether the BACKEND ``path`` names reliable_jobs' backend or a subclass of it."""
    if not isinstance(path, str):
        return False
    try:
        backend = import_string(path)
    except ImportError:
        return False
    return isinstance(backend, type) and issubclass(backend, ReliableJobsBackend)


def first_queue(alias: str) -> str:
    """The queue the chaos run uses unless told otherwise: the backend's first, by name.

    Not Django's ``"default"``, which the backend's QUEUES may not hold.
    """
    return min(task_backends[alias].queues, default=DEFAULT_TASK_QUEUE_NAME)


#: The backend this module's tasks belong to (a worker runs only its own backend's).
BACKEND = backend_alias()


# -- the chaos run -------------------------------------------------------------

@task(backend=BACKEND, queue_name=first_queue(BACKEND), takes_context=True, retry_base_ms=100,
      retry_max_ms=1_000)
def chaos_job(context: TaskContext[[float, int, bool], float], seconds: float,
              fail_attempts: int = 0, give_up: bool = False) -> float:
    """The chaos run's job: sleep, maybe fail as planned, and record the run in the ledger.

    It sleeps so that it is running when its worker is SIGKILLed. It fails
    (retryably) while ``context.attempt <= fail_attempts``, or for good with
    ``give_up``, so the run also checks that retried and dead jobs end as
    their last run says. Every run is written to the execution ledger
    (:mod:`reliable_jobs.contrib.verify.chaos_ledger`) when ``chaosjobs`` set
    one up. Short retry delays keep the drain short.
    """
    with ledger_run(context.task_result.id, context.attempt):
        time.sleep(seconds)
        if give_up:
            raise PermanentFailure(f"planned: gives up on attempt {context.attempt}")
        if context.attempt <= fail_attempts:
            raise RuntimeError(f"planned failure on attempt {context.attempt} of {fail_attempts}")
    return seconds


#: The cap of :data:`flow_capped_job` (tests/test_flow_processes.py).
FLOW_CAP = 5


@task(backend=BACKEND, queue_name=first_queue(BACKEND), takes_context=True, retry_base_ms=100,
      retry_max_ms=1_000, concurrency=FLOW_CAP)
def flow_capped_job(context: TaskContext[[float, int, bool], float], seconds: float,
                    fail_attempts: int = 0, give_up: bool = False) -> float:
    """:func:`chaos_job` with at most FLOW_CAP running at once, across every worker.

    ``chaosjobs --task reliable_jobs.contrib.verify.tasks.flow_capped_job``
    runs the chaos run under the cap; its report's "most runs at once" must
    not exceed FLOW_CAP.
    """
    with ledger_run(context.task_result.id, context.attempt):
        time.sleep(seconds)
        if give_up:
            raise PermanentFailure(f"planned: gives up on attempt {context.attempt}")
        if context.attempt <= fail_attempts:
            raise RuntimeError(f"planned failure on attempt {context.attempt} of {fail_attempts}")
    return seconds


# -- the benchmark ---------------------------------------------------------------

def noop() -> None:
    """The benchmark's task: nothing, so only the queue's cost is left."""


#: When each latency probe's task began (perf_counter), by token.
first_lines: dict[str, float] = {}
#: Set each time a latency probe's task begins.
arrived = threading.Event()


def first_line(token: str) -> None:
    """The latency probe: note when the task's first line runs."""
    first_lines[token] = time.perf_counter()
    arrived.set()
