"""Prometheus metrics (the optional ``prometheus`` extra: ``prometheus_client``).

Counters and histograms are kept by each process as events happen (through
:mod:`reliable_jobs.telemetry`'s hook, installed at start-up when
``prometheus_client`` can be imported); gauges are read live from Redis at
each scrape. Two ways to be scraped:

- :func:`view`, a Django view a project mounts (``reliable_jobs.urls``
  mounts it at ``metrics``): the web process's counters (jobs enqueued) and
  the queue gauges;
- ``runworker --metrics-port N`` (:func:`serve`): the worker's counters
  (started, succeeded, failed, retried, dead, refused acks, recoveries), its
  histograms, the jobs it holds and the gauges of the queues it serves.
  With ``--processes P`` each worker process listens on its own port,
  N + its place (0 to P - 1): a replacement takes over its place's port.

A web server running several processes (gunicorn ``--workers``) keeps one
set of counters per process; set ``PROMETHEUS_MULTIPROC_DIR`` (an empty
directory, per the client library's multiprocess mode) before it starts
and the view sums every process's counters from there.

Names follow Prometheus conventions: ``reliable_jobs_`` first, the unit
last, ``_total`` on counters. Labels are ``queue`` (the queue as
configured, shards summed) and ``task`` (the task's dotted path; ``?`` for
a payload that names no registered task, so whoever can write to Redis
cannot invent label values).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from contextlib import AbstractContextManager
from types import TracebackType
from typing import TYPE_CHECKING, Any

from django.http import HttpRequest, HttpResponse
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_GET

from . import telemetry
from .broker import REDIS_ERRORS
from .keys import logical_queue
from .models import JobState

try:
    import prometheus_client
    from prometheus_client import CollectorRegistry, Counter, Histogram
    from prometheus_client.core import GaugeMetricFamily
except ImportError:  # the extra is not installed: every feature says so
    prometheus_client = None  # type: ignore[assignment]

if TYPE_CHECKING:
    from .backend import ReliableJobsBackend
    from .broker import ClaimedJob
    from .worker import Worker

#: Why a metrics feature cannot work, said by the view, the flag and the check.
MISSING = ("prometheus_client is not installed: install the prometheus extra "
           "(pip install 'reliable-jobs[prometheus]') to expose metrics.")
#: Histogram buckets, in seconds: a no-op task to a long report.
BUCKETS_S = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
             60.0, 300.0, 900.0, 3600.0)
#: The label a task gets when the payload names no registered task.
UNKNOWN_TASK = "?"


def available() -> bool:
    return prometheus_client is not None


class PrometheusHook(telemetry.Hook):
    """Counts the queue's events into this process's Prometheus metrics."""

    def __init__(self) -> None:
        labels = ("queue", "task")

        def counter(name: str, doc: str, names: tuple[str, ...] = labels) -> Counter:
            return Counter(f"reliable_jobs_{name}", doc, names)

        self.enqueued_total = counter("jobs_enqueued", "Jobs enqueued (counted when enqueue() "
                                                 "returns; a rolled-back transaction's too).")
        self.started_total = counter("jobs_started", "Attempts whose task started running.")
        self.succeeded_total = counter("jobs_succeeded", "Attempts that succeeded.")
        self.failed_total = counter("jobs_failed", "Attempts that failed (retried or dead).")
        self.retried_total = counter("jobs_retried", "Failed attempts that will be retried.")
        self.snoozed_total = counter("jobs_snoozed", "Attempts whose task raised Snooze (no "
                                     "failure: the job waits again, the attempt given back).")
        self.dead_total = counter("jobs_dead", "Jobs that failed for good (attempts spent or a "
                                         "permanent failure).")
        self.refused_total = counter("acks_refused", "Outcomes Redis refused: the attempt had lost "
                                               "its lease, another worker may run the job.")
        self.recovered_total = counter("jobs_recovered", "Jobs the sweep recovered, by kind "
                                                   "(expired, unstarted, orphan, dead, "
                                                   "settled, garbage, dropped).",
                                 ("queue", "kind"))
        self.run_time = Histogram("reliable_jobs_job_run_seconds",
                                  "Run time of each attempt.", labels, buckets=BUCKETS_S)
        self.queue_time = Histogram(
            "reliable_jobs_job_queue_wait_seconds",
            "How long each job waited on its queue before its first attempt was claimed.",
            labels, buckets=BUCKETS_S)
        #: Label children by (metric id, physical queue, task): a dict lookup
        #: instead of prometheus_client's locked one on every event.
        self._children: dict[tuple[int, str, str], Any] = {}

    def _child(self, metric: Any, queue: str, task: str) -> Any:
        key = (id(metric), queue, task)
        child = self._children.get(key)
        if child is None:
            from .tasks import lookup

            if task != UNKNOWN_TASK and metric is not self.enqueued_total and lookup(task) is None:
                return metric.labels(logical_queue(queue), UNKNOWN_TASK)
            child = self._children[key] = metric.labels(logical_queue(queue), task)
        return child

    def enqueue(self, queue: str, task: str, count: int) -> AbstractContextManager[str | None]:
        return _CountOnSuccess(self._child(self.enqueued_total, queue, task), count)

    def attempt(self, job: ClaimedJob, task: str,
                trace: str | None) -> AbstractContextManager[object]:
        self._child(self.started_total, job.queue, task).inc()
        if job.attempt == 1 and job.waited_ms >= 0:
            self._child(self.queue_time, job.queue, task).observe(job.waited_ms / 1000)
        return telemetry.NOTHING

    def finished(self, job: ClaimedJob, task: str, state: str, seconds: float,
                 error: BaseException | None = None) -> None:
        self._child(self.run_time, job.queue, task).observe(seconds)
        if state == JobState.SUCCEEDED:
            self._child(self.succeeded_total, job.queue, task).inc()
            return
        self._child(self.failed_total, job.queue, task).inc()
        self._child(self.dead_total if state == JobState.DEAD else self.retried_total, job.queue,
                    task).inc()

    def snoozed(self, job: ClaimedJob, task: str, seconds: float) -> None:
        self._child(self.run_time, job.queue, task).observe(seconds)
        self._child(self.snoozed_total, job.queue, task).inc()

    def refused(self, queue: str, task: str) -> None:
        self._child(self.refused_total, queue, task).inc()

    def recovered(self, queue: str, kind: str) -> None:
        self.recovered_total.labels(logical_queue(queue), kind).inc()


class _CountOnSuccess(AbstractContextManager[None]):
    """Count ``count`` on the child when the enqueue returns without an error."""

    __slots__ = ("child", "count")

    def __init__(self, child: Any, count: int) -> None:
        self.child = child
        self.count = count

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc_type is None:
            self.child.inc(self.count)


def install() -> None:
    """Count events from now on, if prometheus_client is installed (once per process)."""
    if available() and telemetry.installed(PrometheusHook) is None:
        telemetry.install(PrometheusHook())


def stop_counting_unless_served(port: int | None) -> bool:
    """In a worker process: stop counting when nothing can ever read the counters.

    Every process counts from start-up (the app's ready()), as a web
    process's view may be scraped at any time. A worker's counters are read
    only through its own ``--metrics-port``, or through the view of a
    process sharing ``PROMETHEUS_MULTIPROC_DIR``; with neither, counting
    cost about 15 µs of CPU per job for numbers nobody sees. Returns
    whether this process goes on counting.
    """
    if port is not None or os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        return telemetry.installed(PrometheusHook) is not None
    telemetry.uninstall(PrometheusHook)
    return False


# -- gauges, read from Redis at each scrape ---------------------------------------


class QueueCollector:
    """Live gauges: jobs per queue and state, oldest job's age, live workers, jobs in hand.

    ``worker`` set (the runworker endpoint): its own queues and jobs in
    hand. Unset (the view): every queue of every reliable_jobs backend, and
    the jobs in hand of each live worker, from their heartbeats.
    """

    def __init__(self, worker: Worker | None = None) -> None:
        self.worker = worker

    def collect(self) -> Iterator[Any]:
        from . import dashboard, health

        depth = GaugeMetricFamily("reliable_jobs_queue_jobs",
                                  "Jobs in Redis by queue and state (shards summed).",
                                  labels=["queue", "state"])
        age = GaugeMetricFamily("reliable_jobs_queue_oldest_age_seconds",
                                "How long the oldest ready job has waited (0 when none).",
                                labels=["queue"])
        due = GaugeMetricFamily("reliable_jobs_queue_oldest_due_age_seconds",
                                "How long the oldest due scheduled job has waited for "
                                "promotion (0 when none).", labels=["queue"])
        live = GaugeMetricFamily("reliable_jobs_queue_workers",
                                 "Live workers (unexpired heartbeats) serving the queue.",
                                 labels=["queue"])
        in_hand = GaugeMetricFamily("reliable_jobs_worker_in_hand_jobs",
                                    "Jobs a worker holds, from claim to ack.",
                                    labels=["worker"])
        up = GaugeMetricFamily("reliable_jobs_redis_up",
                               "1 when Redis answered this scrape's reads, else 0.",
                               labels=["backend"])
        for backend in self._backends():
            queues = sorted(self.worker.queues) if self.worker else sorted(backend.queues)
            try:
                counts = {line.name: line for line in dashboard.queue_counts(backend)}
                serving = health.workers_by_queue(backend)
                beats = [] if self.worker else dashboard.workers(backend)
            except REDIS_ERRORS:  # say so, and report nothing stale
                up.add_metric([backend.alias], 0)
                continue
            up.add_metric([backend.alias], 1)
            for queue in queues:
                line = counts.get(queue)
                for state in ("queued", "running", "scheduled", "dead"):
                    depth.add_metric([queue, state], getattr(line, state, 0))
                age.add_metric([queue], (line.oldest_ready_ms or 0) / 1000 if line else 0)
                due.add_metric([queue], (line.oldest_due_ms or 0) / 1000 if line else 0)
                live.add_metric([queue], len(serving.get(queue, [])))
            for beat in beats:
                in_hand.add_metric([beat.id], beat.jobs)
        if self.worker is not None:
            in_hand.add_metric([self.worker.worker_id], len(self.worker.in_hand))
        yield from (depth, age, due, live, in_hand, up)

    def _backends(self) -> list[ReliableJobsBackend]:
        from .health import backends

        if self.worker is not None:
            return [self.worker.backend]
        return backends()


class _Exposed:
    """The counters and histograms, and the gauges.

    The view shows every process's counters summed when the client library
    runs in multiprocess mode (``PROMETHEUS_MULTIPROC_DIR``), else its own
    process's. A worker's port always shows its own process's: with one
    port per process, a sum on each would count every job P times.
    """

    def __init__(self, worker: Worker | None) -> None:
        self.worker = worker
        self.gauges = QueueCollector(worker)

    def collect(self) -> Iterator[Any]:
        if self.worker is None and os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            from prometheus_client import multiprocess

            registry = CollectorRegistry()
            multiprocess.MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
            yield from registry.collect()
        else:
            yield from prometheus_client.REGISTRY.collect()
        yield from self.gauges.collect()


def registry(worker: Worker | None = None) -> CollectorRegistry:
    """A registry holding what a scrape shows (see :class:`_Exposed`)."""
    exposed = CollectorRegistry(auto_describe=False)
    exposed.register(_Exposed(worker))
    return exposed


@never_cache
@require_GET
def view(request: HttpRequest) -> HttpResponse:
    """The Prometheus text exposition of this process's counters and the queue gauges.

    It needs no login, as Prometheus scrapes without one: mount it where only
    your monitoring reaches it (an internal port, a path the proxy blocks).
    """
    if not available():
        return HttpResponse(MISSING, status=501, content_type="text/plain; charset=utf-8")
    return HttpResponse(prometheus_client.generate_latest(registry()),
                        content_type=prometheus_client.CONTENT_TYPE_LATEST)


def serve(port: int, worker: Worker, *, addr: str = "0.0.0.0") -> Any:
    """Serve ``worker``'s metrics over HTTP on ``port`` from a daemon thread."""
    if not available():
        raise RuntimeError(MISSING)
    install()
    server, _thread = prometheus_client.start_http_server(port, addr=addr,
                                                          registry=registry(worker))
    return server


# -- for the system check (W020, in checks.py) ---------------------------------------


def mounted(patterns: list[Any]) -> bool:
    """Whether the URL patterns (nested includes too) route to :func:`view`.

    ``reliable_jobs.urls`` mounts it through ``metrics_view``, which imports
    this module on the first request.
    """
    from .urls import metrics_view

    for pattern in patterns:
        if getattr(pattern, "callback", None) in (view, metrics_view):
            return True
        with contextlib.suppress(Exception):
            if mounted(list(getattr(pattern, "url_patterns", []))):
                return True
    return False
