"""Helpers shared by test modules (fixtures live in conftest.py, which imports these).

Test modules import from here, never from conftest: pytest owns conftest.py
(it loads it by itself, as a plugin), so importing it by hand is a second
way in that works only by accident of the package layout.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from django.db import connections
from django.db.backends.signals import connection_created
from django.utils import timezone

from reliable_jobs import mirror
from reliable_jobs.broker import Broker
from reliable_jobs.compat import task_backends
from reliable_jobs.jobids import new_job_id
from reliable_jobs.models import Job
from reliable_jobs.periodic import Cron, Every
from reliable_jobs.worker import Worker


def insert_row(*, task_path: str, queue: str = "default", backend: str = "default",
               shard: int = 0, enqueued_at: datetime | None = None,
               run_after: datetime | None = None, state: str | None = None,
               max_attempts: int = 3, database: str = "default") -> str:
    """Insert one job's row as an enqueue does (mirror.insert_jobs), nothing pushed; its id.

    ``state`` overrides the queued-or-scheduled rule (a row as a test needs it).
    """
    new = mirror.NewJobs.at(enqueued_at or timezone.now(), backend=backend, queue=queue,
                            task_path=task_path, priority=0, max_attempts=max_attempts,
                            run_after=run_after, rows=[(job_id := new_job_id(), shard, "[]",
                                                         "{}", None, "")])
    if state is not None:
        new = replace(new, state=state)
    mirror.insert_jobs(database, new)
    return job_id


def backdate(*job_ids: str) -> None:
    """Make rows old enough for reconcile (their grace period long past)."""
    Job.objects.filter(pk__in=job_ids).update(updated_at=timezone.now() - timedelta(hours=1))


def slots_between(timetable: Cron | Every, start: datetime, end: datetime) -> list[datetime]:
    """The slots of a periodic timetable after ``start``, up to ``end`` included."""
    found = []
    for slot in timetable.after(start):
        if slot > end:
            return found
        found.append(slot)
    return found


REPO = Path(__file__).resolve().parent.parent
#: The suite's Redis: a database index of its own, flushed before each test.
REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/15")


def queued_by_priority(broker: Broker, queue: str) -> dict[int, int]:
    """Ids waiting on each priority's list of ``queue`` (copies a reprioritize left included)."""
    k = broker.keys(queue)
    bands = [int(b) for b in broker.client.zrange(k.bands, 0, -1)]
    with broker.client.pipeline(transaction=False) as pipe:
        for band in [0, *bands]:
            pipe.llen(k.band(band))
        lengths = pipe.execute()
    return {band: n for band, n in zip([0, *bands], lengths, strict=True) if n}


def wait_until(predicate: Callable[[], Any], *, timeout: float = 20.0, interval: float = 0.05,
               message: str = "condition") -> Any:
    """Poll ``predicate`` until it returns something truthy, for at most ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"Timed out after {timeout} s waiting for {message}.")
        time.sleep(interval)


class Processes:
    """Starts ``manage.py`` commands as real processes and always stops them."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.started: list[subprocess.Popen[bytes]] = []

    def manage(self, *args: str, env: dict[str, str], extra_env: dict[str, str] | None = None
               ) -> subprocess.Popen[bytes]:
        log = open(self.log_dir / f"{args[0]}-{len(self.started)}.log", "wb")  # noqa: SIM115
        proc = subprocess.Popen(
            [sys.executable, str(REPO / "manage.py"), *args],
            env={**env, **(extra_env or {})}, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
        proc.log_path = log.name  # type: ignore[attr-defined]
        log.close()
        self.started.append(proc)
        return proc

    def worker(self, env: dict[str, str], *args: str, extra_env: dict[str, str] | None = None
               ) -> subprocess.Popen[bytes]:
        return self.manage("runworker", "-v", "1", *args, env=env, extra_env=extra_env)

    def stop(self, proc: subprocess.Popen[bytes], *, timeout: float = 30.0) -> int:
        """SIGTERM a command once it is up (signal handlers installed); return its exit code.

        A process terminated while Django is still starting dies of the
        signal itself (-15), which says nothing about graceful shutdown.
        """
        self._wait_started(proc, timeout)
        proc.terminate()
        return proc.wait(timeout=timeout)

    def stop_many(self, *procs: subprocess.Popen[bytes], timeout: float = 30.0) -> list[int]:
        """:meth:`stop` several commands at once; their exit codes, in order.

        Each one's graceful stop lasts about a second (an idle worker's
        blocking claim runs out first): SIGTERMing them together pays it once.
        """
        for proc in procs:
            self._wait_started(proc, timeout)
        for proc in procs:
            proc.terminate()
        return [proc.wait(timeout=timeout) for proc in procs]

    def _wait_started(self, proc: subprocess.Popen[bytes], timeout: float) -> None:
        """Wait until ``proc`` has exited or says it serves (its signal handlers are in)."""
        if proc.poll() is None:
            wait_until(lambda: proc.poll() is not None or " serving " in self.log(proc)
                       or "Sweep of" in self.log(proc), timeout=timeout,
                       message=f"{proc.args[2]} to start")

    @staticmethod
    def log(proc: subprocess.Popen[bytes]) -> str:
        return Path(proc.log_path).read_text(errors="replace")  # type: ignore[attr-defined]

    def stop_all(self) -> None:
        for proc in self.started:
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=10)


def drain_here() -> None:
    """Run a burst worker in this process (its spans, signals and log records are then here).

    A worker limits its database sessions (lock and statement timeouts) from
    start-up on, for its whole process: those limits are taken back here, or
    every later test's sessions would have them.
    """
    database = connections["default"]
    options = dict(database.settings_dict.get("OPTIONS", {}))
    try:
        Worker(task_backends["default"], queues=["default"], burst=True).run()
    finally:
        connection_created.disconnect(dispatch_uid="reliable_jobs.worker.limits.default")
        database.settings_dict["OPTIONS"] = options
        database.close()


@contextmanager
def worker_in_thread(worker: Worker) -> Iterator[threading.Thread]:
    """Run ``worker`` in a thread of this process; take its session limits back after.

    A worker limits its database sessions for its whole process (see
    drain_here): every later test would have them otherwise.
    """
    database = connections["default"]
    options = dict(database.settings_dict.get("OPTIONS", {}))
    thread = threading.Thread(target=worker.run, name="test-worker", daemon=True)
    thread.start()
    try:
        yield thread
    finally:
        worker.stop()
        thread.join(timeout=30)
        connection_created.disconnect(dispatch_uid="reliable_jobs.worker.limits.default")
        database.settings_dict["OPTIONS"] = options
        database.close()
