"""Health for orchestrators: a worker's heartbeat file, queue checks, a readiness view.

Three questions, three answers:

- *Is this worker process alive?* ``runworker --heartbeat-file PATH`` starts
  a :class:`HeartbeatFile` thread that touches PATH every
  :data:`TOUCH_EVERY_S`, but only while the worker's claim loop has gone
  round within :data:`LOOP_STALL_S`. Any thread could touch a file; this one
  proves the loop that takes work is turning, so a liveness probe on the
  file's age catches a process that is stopped, deadlocked or wedged, not
  only one that exited.
- *Is the queue being served?* :func:`check` (``manage.py checkworkers``)
  says what is wrong in one line: the database or Redis does not answer,
  a queue has no live worker (heartbeats in Redis, as the admin dashboard
  lists them), or its latency (the dashboard's: oldest ready job, oldest
  due scheduled job) passed a limit.
- *Can this web process enqueue?* :func:`ready` is a view answering 200 or
  503 with a JSON body: whether the database and Redis of each reliable_jobs
  backend answer, the two things an ``enqueue()`` needs.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from django.db import connections
from django.http import HttpRequest, JsonResponse
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_GET

from . import dashboard
from .broker import REDIS_ERRORS

if TYPE_CHECKING:
    from .backend import ReliableJobsBackend
    from .dashboard import QueueLine

logger = logging.getLogger("reliable_jobs.health")

#: How often the heartbeat file is touched, in seconds.
TOUCH_EVERY_S = 2.0
#: A claim loop that has not gone round for this long, in seconds, is
#: stalled: longer than its longest healthy pause (a 1 s blocking wait, a
#: Redis call's 10 s socket timeout, a 5 s back-off after an error).
LOOP_STALL_S = 30.0


class ClaimLoop(Protocol):
    """What a heartbeat needs from a worker: when its claim loop last went round."""

    @property
    def loop_tick(self) -> float: ...


class HeartbeatFile:
    """A daemon thread touching ``path`` while ``worker``'s claim loop turns.

    The file's modification time is then at most about ``TOUCH_EVERY_S``
    old while all is well, and stops moving within ``LOOP_STALL_S`` of the
    loop stalling (at once when the process is stopped or dies). A probe
    should allow ``LOOP_STALL_S + TOUCH_EVERY_S`` and some slack: 60 s.
    """

    def __init__(self, path: str | os.PathLike[str], worker: ClaimLoop, *,
                 every_s: float = TOUCH_EVERY_S, stall_s: float = LOOP_STALL_S) -> None:
        self.path = Path(path)
        self.worker = worker
        self.every_s = every_s
        self.stall_s = stall_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._warned = False

    def start(self) -> None:
        """Touch the file now (so a bad path fails at start-up), then keep touching it."""
        self.touch()
        self._thread = threading.Thread(target=self._run, name="rj-heartbeat-file",
                                        daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.every_s + 1.0)

    def touch(self) -> None:
        self.path.touch()

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            stalled_s = time.monotonic() - self.worker.loop_tick
            if stalled_s > self.stall_s:
                if not self._warned:
                    logger.error("The claim loop has not gone round for %.0f s: no longer "
                                 "touching the heartbeat file %s.", stalled_s, self.path)
                    self._warned = True
                continue
            self._warned = False
            try:
                self.touch()
            except OSError as exc:
                logger.warning("Could not touch the heartbeat file %s (%s).", self.path, exc)


# -- reading Redis -------------------------------------------------------------


def latency_s(line: QueueLine) -> float:
    """A queue's latency in seconds: its oldest ready job's age, or its oldest due
    scheduled job's (waiting for promotion) when older; 0 when it has neither.

    From ``dashboard.queue_counts`` (``Broker.latency``: bounded reads on
    Redis's clock, the oldest over a queue's shards).
    """
    ages = [ms for ms in (line.oldest_ready_ms, line.oldest_due_ms) if ms is not None]
    return max(ages, default=0) / 1000


def workers_by_queue(backend: ReliableJobsBackend) -> dict[str, list[str]]:
    """The live workers (unexpired heartbeats) of each of the backend's queues."""
    serving: dict[str, list[str]] = {queue: [] for queue in sorted(backend.queues)}
    for line in dashboard.workers(backend):
        for queue in line.queues:
            if queue in serving:
                serving[queue].append(line.id)
    return serving


# -- probes ----------------------------------------------------------------------


def redis_problem(backend: ReliableJobsBackend) -> str:
    """Why Redis does not answer (a sentence naming no address), or ""."""
    try:
        backend.broker.client.ping()
    except REDIS_ERRORS as exc:
        return f"Redis does not answer ({type(exc).__name__})."
    return ""


def database_problem(alias: str) -> str:
    """Why the database ``alias`` does not answer a ``SELECT 1`` (a sentence), or ""."""
    from django.db import DatabaseError, InterfaceError

    try:
        with connections[alias].cursor() as cursor:
            cursor.execute("SELECT 1")
    except (DatabaseError, InterfaceError) as exc:
        with contextlib.suppress(DatabaseError, InterfaceError):
            connections[alias].close()  # the next request starts on a fresh connection
        return f"The database {alias!r} does not answer ({type(exc).__name__})."
    return ""


@dataclass
class Report:
    """What :func:`check` found; ``problems`` empty means healthy."""

    problems: list[str] = field(default_factory=list)
    #: True when a problem is that Redis or the database does not answer.
    unreachable: bool = False
    workers: dict[str, list[str]] = field(default_factory=dict)
    ages_s: dict[str, float] = field(default_factory=dict)


def check(backend: ReliableJobsBackend, *, queues: list[str], max_latency_s: float | None,
          min_workers: int = 1) -> Report:
    """Check the database, Redis, and each of ``queues``: its workers and its latency."""
    report = Report()
    for problem in (database_problem(backend.database), redis_problem(backend)):
        if problem:
            report.problems.append(problem)
            report.unreachable = True
    if report.unreachable and any(p.startswith("Redis") for p in report.problems):
        return report  # nothing more can be read
    try:
        serving = workers_by_queue(backend)
        report.workers = {q: serving.get(q, []) for q in queues}
        lines = {line.name: line for line in dashboard.queue_counts(backend)}
        report.ages_s = {q: latency_s(lines[q]) for q in queues if q in lines}
    except REDIS_ERRORS as exc:
        report.problems.append(f"Redis stopped answering ({type(exc).__name__}).")
        report.unreachable = True
        return report
    for queue in queues:
        live = len(report.workers[queue])
        if live < min_workers:
            report.problems.append(
                f"Queue {queue!r} has {live} live worker(s), fewer than {min_workers}.")
        age = report.ages_s.get(queue, 0.0)
        if max_latency_s is not None and age > max_latency_s:
            report.problems.append(
                f"Queue {queue!r}'s oldest job has waited {age:.1f} s, more than "
                f"{max_latency_s:g} s.")
    return report


# -- the readiness view ------------------------------------------------------------


def backends() -> list[ReliableJobsBackend]:
    from .backend import reliable_backends

    return reliable_backends()


@never_cache
@require_GET
def ready(request: HttpRequest) -> JsonResponse:
    """200 when every reliable_jobs backend's database and Redis answer, else 503.

    The body says which: ``{"ready": false, "database": true, "redis": false,
    "backends": {"default": {...}}}``. It names no host, port or password
    (the view is meant for probes, which need no login); the reason is
    logged at WARNING.
    """
    body: dict[str, Any] = {"ready": True, "database": True, "redis": True, "backends": {}}
    for backend in backends():
        db_problem = database_problem(backend.database)
        redis_reason = redis_problem(backend)
        body["backends"][backend.alias] = {"database": not db_problem, "redis": not redis_reason}
        for problem, what in ((db_problem, "database"), (redis_reason, "redis")):
            if problem:
                body[what] = body["ready"] = False
                logger.warning("Not ready (backend %r): %s", backend.alias, problem)
    return JsonResponse(body, status=200 if body["ready"] else 503)
