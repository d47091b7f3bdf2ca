"""The workload of ``manage.py benchjobs``: no-op jobs through the real path.

Enqueue goes through the backend (database row + Redis push), the drain
through a real :class:`~reliable_jobs.worker.Worker` in this process, with
the mirror on; what is measured is the queue's own cost per job.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .backend import ReliableJobsBackend
from .compat import Task
from .models import Job
from .worker import Worker


def noop() -> None:
    """The benchmark's task: nothing, so only the queue's cost is left."""


#: When each latency probe's task began (perf_counter), by token.
_first_lines: dict[str, float] = {}
_arrived = threading.Event()


def first_line(token: str) -> None:
    """The latency probe: note when the task's first line runs."""
    _first_lines[token] = time.perf_counter()
    _arrived.set()


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


def bench_task(backend: ReliableJobsBackend, queue: str) -> Task[..., Any]:
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


def measure_latency(backend: ReliableJobsBackend, queue: str, *, samples: int) -> list[float]:
    """Enqueue-to-start latencies in ms, one job at a time, with an idle worker.

    The worker runs in a thread of this process (the producer only waits
    meanwhile) and blocks in BLMOVE between jobs, as an idle worker does; the
    clock starts when ``enqueue()`` returns (row committed, push done) and
    stops at the task's first line.
    """
    task = backend.task_class(func=first_line, backend=backend.alias, queue_name=queue)
    worker = Worker(backend, queues=[queue], concurrency=1, prefetch=0, grace_s=5)
    thread = threading.Thread(target=worker.run, name="rj-bench-worker", daemon=True)
    thread.start()
    latencies: list[float] = []
    try:
        time.sleep(0.5)  # let it reach its blocking wait
        for sample in range(samples):
            token = f"probe-{sample}"
            _arrived.clear()
            task.enqueue(token)
            returned = time.perf_counter()
            if not _arrived.wait(timeout=10):
                raise RuntimeError("a latency probe did not run within 10 s")
            latencies.append((_first_lines.pop(token) - returned) * 1000)
            time.sleep(0.002)  # the worker goes back to its blocking wait
    finally:
        worker.stop()
        thread.join(timeout=30)
        Job.objects.using(backend.database).filter(task_path=task.module_path).delete()
    return latencies


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def measure_at_length(backend: ReliableJobsBackend, queue: str, *, waiting: int, window: int,
                      prefetch: int | None) -> tuple[float, float]:
    """Drain rate of ``window`` jobs taken from a queue ``waiting`` long, and Redis
    bytes per waiting job; the rest is drained afterwards (not timed)."""
    task = bench_task(backend, queue)
    used_before = int(backend.broker.client.info("memory")["used_memory"])
    for start in range(0, waiting + window, 10_000):
        backend.enqueue_many(task, (((), {}) for _ in range(min(10_000, waiting + window
                                                                - start))))
    per_job = (int(backend.broker.client.info("memory")["used_memory"]) - used_before) / (
        waiting + window)
    timed_worker = Worker(backend, queues=[queue], burst=True, max_jobs=window,
                          prefetch=prefetch, grace_s=5)
    rate = window / timed(timed_worker.run)
    Worker(backend, queues=[queue], burst=True, prefetch=prefetch, grace_s=5).run()
    Job.objects.using(backend.database).filter(task_path=task.module_path).delete()
    return rate, per_job
