"""The workload of ``manage.py benchjobs``: no-op jobs through the real path.

Enqueue goes through the backend (database row + Redis push), the drain
through a real :class:`~reliable_jobs.worker.Worker` in this process, with
the mirror on; what is measured is the queue's own cost per job.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

from django.tasks import Task

from .backend import ReliableJobsBackend
from .models import Job
from .worker import Worker


def noop() -> None:
    """The benchmark's task: nothing, so only the queue's cost is left."""


@dataclass(frozen=True)
class Figure:
    """A rate measured over several runs."""

    name: str
    rates: list[float]

    @property
    def median(self) -> float:
        return statistics.median(self.rates)

    def row(self) -> str:
        spread = f"{min(self.rates):,.0f} - {max(self.rates):,.0f}"
        return f"{self.name:<28} {self.median:>10,.0f} jobs/s   (runs: {spread})"


def bench_task(backend: ReliableJobsBackend, queue: str) -> Task:
    """The no-op task bound to ``backend`` and ``queue`` (registered for this process)."""
    return backend.task_class(func=noop, backend=backend.alias, queue_name=queue)


def timed(action: Callable[[], object]) -> float:
    started = time.perf_counter()
    action()
    return time.perf_counter() - started


def run_once(backend: ReliableJobsBackend, queue: str, *, jobs: int, singles: int,
             concurrency: int, prefetch: int | None = None) -> dict[str, float]:
    """Enqueue in bulk, enqueue one by one, drain; return each rate in jobs/s."""
    task = bench_task(backend, queue)
    bulk_s = timed(lambda: backend.enqueue_many(task, (((), {}) for _ in range(jobs))))
    single_s = timed(lambda: [task.enqueue() for _ in range(singles)])
    worker = Worker(backend, queues=[queue], concurrency=concurrency, burst=True, grace_s=5,
                    prefetch=prefetch)
    drain_s = timed(worker.run)
    Job.objects.using(backend.database).filter(task_path=task.module_path).delete()
    return {
        "bulk enqueue": jobs / bulk_s,
        "single enqueue": singles / single_s if singles else 0.0,
        "drain (1 process)": (jobs + singles) / drain_s,
    }
