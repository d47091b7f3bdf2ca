"""``benchjobs --process``: the drain as a user runs it, a real ``runworker --burst``.

The in-process benchmark (bench.py) measures the queue's own cost; a user
runs ``manage.py runworker`` in a project of their own, and pays for
Django's start-up, their settings (DEBUG off, Django's default LOGGING),
the interpreter's exit and everything else in the process. So this builds
a stock project with ``django-admin startproject`` in a temporary
directory, adds reliable_jobs and an app with two tasks through the public
API only (settings and ``@task``), and times a real ``runworker --burst``
started as a child process:

- its whole process tree's CPU (``os.wait4``'s resource usage: the worker
  and every child it waited for), per job;
- jobs/s from the worker's start to the queue seen empty, and from its
  first job's start (start-up subtracted);
- how long it took to exit once the queue was seen empty;
- the WAL the drain wrote, per job: this database's records (pg_walinspect,
  when the extension can be created) and the whole cluster's (the LSN moved;
  other databases' writes count there too).

``BENCH_PROFILE_DIR`` set: each worker runs under cProfile (every thread,
Python 3.12 and later) and its stats are written there.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from django.db import connections

import reliable_jobs
from reliable_jobs.backend import ReliableJobsBackend

from .bench import delete_rows

#: The stock project's tasks: a no-op, and one Redis INCR plus one ORM query.
TASKS = {"no-op": "noop", "INCR + query": "incr_and_query"}
#: The app added to the stock project, and its module prefix in task paths.
APP = "benchapp"
#: How often the parent looks at the queue while the worker drains it, in seconds.
POLL_S = 0.005
#: Longest a measured worker may run, in seconds.
WORKER_TIMEOUT_S = 900.0

SETTINGS_TAIL = '''

# -- added by benchjobs --process: reliable_jobs through its public settings only
import json as _json
import os as _os

DEBUG = False
INSTALLED_APPS += ["reliable_jobs", "benchapp"]
DATABASES = {"default": _json.loads(_os.environ["RJ_BENCH_DATABASE"])}
TASKS = {"default": {"BACKEND": "reliable_jobs.backend.ReliableJobsBackend",
                     "QUEUES": [_os.environ["RJ_BENCH_QUEUE"]],
                     "OPTIONS": _json.loads(_os.environ["RJ_BENCH_OPTIONS"])}}
'''

TASKS_MODULE = '''"""The benchmark's tasks (written by benchjobs --process)."""

import os

import redis
from django.contrib.contenttypes.models import ContentType

try:
    from django.tasks import task
except ImportError:  # Django 5.2: the django-tasks backport
    from django_tasks import task

_redis = redis.Redis.from_url(os.environ["RJ_BENCH_REDIS_URL"])
COUNTER = os.environ["RJ_BENCH_COUNTER"]


@task
def noop():
    return None


@task
def incr_and_query():
    _redis.incr(COUNTER)
    return ContentType.objects.filter(app_label="auth").count()
'''

#: Where PROFILE_LAUNCHER goes in the temporary project (not a file of this repository).
LAUNCHER = Path("profile_launcher").with_suffix(".py")
#: Runs ``manage.py`` under cProfile, every thread, and writes the stats even
#: when the process ends with ``os._exit`` (runworker's prompt exit).
PROFILE_LAUNCHER = '''import cProfile, os, runpy, sys

path = sys.argv.pop(1)
sys.argv = sys.argv[1:]  # manage.py and its arguments, as if run directly
profile = cProfile.Profile()
real_exit = os._exit


def dump():
    profile.disable()
    profile.dump_stats(path)


def exit_after_dump(code):
    dump()
    real_exit(code)


os._exit = exit_after_dump
profile.enable()
try:
    runpy.run_path("manage.py", run_name="__main__")
finally:
    dump()
'''

ENQUEUE = '''
from django.tasks import task_backends
from benchapp import tasks
chosen = getattr(tasks, {name!r})
backend = task_backends[chosen.backend]
for start in range(0, {count}, 10_000):
    backend.enqueue_many(chosen, (((), {{}}) for _ in range(min(10_000, {count} - start))))
'''


@dataclass(frozen=True)
class ProcessRun:
    """One ``runworker --burst`` over ``jobs`` jobs of one task."""

    task: str
    jobs: int
    #: From the worker's start to the queue seen empty, in seconds.
    to_empty_s: float
    #: From the worker's first job start to the queue seen empty.
    drain_s: float
    #: From the queue seen empty to the process's exit.
    exit_s: float
    #: User plus system CPU of the whole process tree, in seconds.
    cpu_s: float
    #: WAL of this database's records (None without pg_walinspect), and the cluster's.
    wal_bytes: int | None
    cluster_wal_bytes: int
    #: Of ``wal_bytes``, full-page images (see Written.images).
    wal_image_bytes: int = 0
    profile: Path | None = None

    @property
    def rate(self) -> float:
        return self.jobs / self.to_empty_s

    @property
    def drain_rate(self) -> float:
        return self.jobs / self.drain_s

    @property
    def cpu_us_per_job(self) -> float:
        return self.cpu_s * 1e6 / self.jobs

    @property
    def wal_per_job(self) -> float:
        return (self.cluster_wal_bytes if self.wal_bytes is None else self.wal_bytes) / self.jobs

    def line(self) -> str:
        wal = (f"WAL {self.cluster_wal_bytes / self.jobs:,.0f} B/job (whole cluster)"
               if self.wal_bytes is None
               else f"WAL {self.wal_bytes / self.jobs:,.0f} B/job (page images "
                    f"{self.wal_image_bytes / self.jobs:,.0f}; cluster "
                    f"{self.cluster_wal_bytes / self.jobs:,.0f})")
        return (f"{self.task:<13} {self.jobs:>7,} jobs: {self.rate:>7,.0f} jobs/s start to empty, "
                f"{self.drain_rate:>7,.0f} from the first job, CPU {self.cpu_us_per_job:>5,.0f} "
                f"µs/job, exit {self.exit_s * 1000:>5,.0f} ms after empty, {wal}")


def summary(runs: list[ProcessRun]) -> list[str]:
    """Medians per task over ``runs`` (min - max in brackets)."""
    lines = []
    for task in dict.fromkeys(run.task for run in runs):
        mine = [run for run in runs if run.task == task]

        def figure(values: list[float], unit: str, fmt: str = ",.0f") -> str:
            return (f"{statistics.median(values):{fmt}} {unit} "
                    f"({min(values):{fmt}} - {max(values):{fmt}})")

        lines.append(
            f"{task}, median of {len(mine)}: "
            f"{figure([r.rate for r in mine], 'jobs/s')} start to empty; "
            f"{figure([r.drain_rate for r in mine], 'jobs/s')} from the first job; "
            f"CPU {figure([r.cpu_us_per_job for r in mine], 'µs/job')}; "
            f"exit {figure([r.exit_s * 1000 for r in mine], 'ms')} after empty; "
            f"WAL {figure([r.wal_per_job for r in mine], 'B/job')}, without page images "
            f"{figure([r.wal_per_job - r.wal_image_bytes / r.jobs for r in mine], 'B/job')}")
    return lines


class StockProject:
    """A ``startproject`` project in ``root`` serving ``queue`` of the caller's servers."""

    def __init__(self, root: Path, backend: ReliableJobsBackend, queue: str) -> None:
        self.root = root
        self.backend = backend
        self.queue = queue
        settings_dict = connections[backend.database].settings_dict
        database = {key: settings_dict[key] for key in
                    ("ENGINE", "NAME", "USER", "PASSWORD", "HOST", "PORT")}
        test_name = (settings_dict.get("TEST") or {}).get("NAME")
        if connections[backend.database].vendor == "sqlite":
            # SQLite needs its write lock taken at BEGIN (check E016), as the README says.
            database["OPTIONS"] = settings_dict.get("OPTIONS", {})
            if test_name:
                database["NAME"] = test_name
        self.counter = backend.broker.keys(queue).job_prefix + "bench-counter"
        self.env = {
            **os.environ,
            "DJANGO_SETTINGS_MODULE": "benchsite.settings",
            "RJ_BENCH_DATABASE": json.dumps(database, default=str),
            "RJ_BENCH_QUEUE": queue,
            "RJ_BENCH_OPTIONS": json.dumps({"REDIS_URL": backend.config.REDIS_URL,
                                            "PREFIX": backend.config.PREFIX}),
            "RJ_BENCH_REDIS_URL": backend.config.REDIS_URL,
            "RJ_BENCH_COUNTER": self.counter,
            "PYTHONUNBUFFERED": "1",
        }
        # The reliable_jobs that runs this command, wherever it is installed (an
        # editable install of another checkout would otherwise win).
        self.env["PYTHONPATH"] = str(Path(reliable_jobs.__file__).resolve().parent.parent)

    def create(self) -> None:
        """startproject, startapp, the settings' tail, the tasks; then migrate."""
        self._run(sys.executable, "-m", "django", "startproject", "benchsite", ".")
        self._run(sys.executable, "manage.py", "startapp", APP)
        with open(self.root / "benchsite" / "settings.py", "a") as settings:
            settings.write(SETTINGS_TAIL)
        (self.root / APP / "tasks.py").write_text(TASKS_MODULE)
        (self.root / LAUNCHER).write_text(PROFILE_LAUNCHER)
        self._run(sys.executable, "manage.py", "migrate", "-v", "0")

    def enqueue(self, task: str, count: int) -> None:
        self._run(sys.executable, "manage.py", "shell", "-c",
                  ENQUEUE.format(name=TASKS[task], count=count))

    def run_worker(self, task: str, jobs: int, *, profile: Path | None = None) -> ProcessRun:
        """Enqueue ``jobs`` jobs of ``task``, time a ``runworker --burst`` over them, clean up."""
        self.enqueue(task, jobs)
        counts = self.backend.broker.counts
        wal = WalMeter(self.backend)
        command = [sys.executable, "manage.py", "runworker", "--burst", "-v", "0"]
        if profile is not None:
            command[1:2] = [str(LAUNCHER), str(profile), "manage.py"]
        with wal.measure() as written:
            started = time.time()
            proc = subprocess.Popen(command, cwd=self.root, env=self.env,
                                    stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT)
            empty_at = None
            while True:
                pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
                if pid:
                    exited_at = time.time()
                    break
                if empty_at is None:
                    now = counts(self.queue)
                    if not (now.queued or now.running or now.scheduled):
                        empty_at = time.time()
                if time.time() - started > WORKER_TIMEOUT_S:
                    proc.kill()
                    raise RuntimeError(f"runworker --burst did not end within "
                                       f"{WORKER_TIMEOUT_S:.0f} s.")
                time.sleep(POLL_S)
        proc.returncode = os.waitstatus_to_exitcode(status)
        output = proc.stdout.read().decode(errors="replace") if proc.stdout else ""
        if proc.returncode != 0:
            raise RuntimeError(f"runworker --burst exited {proc.returncode}:\n{output}")
        empty_at = empty_at or exited_at
        first = self._first_start(task)
        delete_rows(self.backend, task_path=f"{APP}.tasks.{TASKS[task]}")
        self.backend.broker.client.delete(self.counter)
        return ProcessRun(
            task=task, jobs=jobs, to_empty_s=empty_at - started,
            drain_s=max(empty_at - (first or started), 1e-6),
            exit_s=max(exited_at - empty_at, 0.0), cpu_s=usage.ru_utime + usage.ru_stime,
            wal_bytes=written.database, cluster_wal_bytes=written.cluster,
            wal_image_bytes=written.images, profile=profile)

    def _first_start(self, task: str) -> float | None:
        from reliable_jobs.models import Attempt

        first = (Attempt.objects.using(self.backend.database)
                 .filter(job__task_path=f"{APP}.tasks.{TASKS[task]}")
                 .order_by("started_at").values_list("started_at", flat=True).first())
        return first.timestamp() if first else None

    def _run(self, *command: str) -> None:
        done = subprocess.run(command, cwd=self.root, env=self.env, stdin=subprocess.DEVNULL,
                              capture_output=True, text=True, timeout=600, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(command[:4])} failed:\n{done.stdout}{done.stderr}")


@dataclass
class Written:
    """WAL bytes written while measuring: this database's records and the cluster's."""

    database: int | None = None
    cluster: int = 0
    #: Of ``database``, the full-page images: the first change to a page after
    #: a checkpoint logs the whole page, so this part depends on when the
    #: server's checkpoints fell (other databases' writes bring them sooner).
    images: int = 0


class WalMeter:
    """WAL written during a block, on PostgreSQL (zeros elsewhere).

    The cluster's figure is how far the WAL insert position moved. This
    database's is the sum of the records that touch one of its blocks, plus
    the commit records of their transactions, read back with pg_walinspect
    (created here when missing; the figure is None when that is refused).
    """

    def __init__(self, backend: ReliableJobsBackend) -> None:
        self.connection = connections[backend.database]
        #: Bytes of full-page images in the last measurement of this database.
        self.images = 0
        self.inspect = self.connection.vendor == "postgresql" and self._walinspect()

    def _walinspect(self) -> bool:
        from django.db import DatabaseError

        try:
            with self.connection.cursor() as cursor:
                cursor.execute("CREATE EXTENSION IF NOT EXISTS pg_walinspect")
            return True
        except DatabaseError:
            return False

    def _lsn(self) -> str:
        with self.connection.cursor() as cursor:
            cursor.execute("SELECT pg_current_wal_lsn()")
            return str(cursor.fetchone()[0])

    @contextmanager
    def measure(self) -> Iterator[Written]:
        written = Written()
        if self.connection.vendor != "postgresql":
            yield written
            return
        # A temporary replication slot keeps the WAL from here on until it is
        # read back: other databases' writes could otherwise make a checkpoint
        # recycle it first. Dropped at once, and by the server should this die.
        slot = self.inspect and self._reserve()
        try:
            start = self._lsn()
            yield written
            end = self._lsn()
            with self.connection.cursor() as cursor:
                cursor.execute("SELECT pg_wal_lsn_diff(%s, %s)", [end, start])
                written.cluster = int(cursor.fetchone()[0])
            if self.inspect:
                written.database = self._database_wal(start, end)
                written.images = self.images
        finally:
            if slot:
                with self.connection.cursor() as cursor:
                    cursor.execute("SELECT pg_drop_replication_slot(%s)", [SLOT])

    def _reserve(self) -> bool:
        from django.db import DatabaseError

        try:
            with self.connection.cursor() as cursor:
                cursor.execute("SELECT pg_create_physical_replication_slot(%s, true, true)",
                               [SLOT])
            return True
        except DatabaseError:
            return False

    def _database_wal(self, start: str, end: str) -> int | None:
        """This database's records between two positions; None when the WAL is gone
        (a checkpoint recycled it: other databases wrote a lot meanwhile)."""
        from django.db import DatabaseError

        try:
            with self.connection.cursor() as cursor:
                cursor.execute(DATABASE_WAL, [start, end, start, end])
                total, images = cursor.fetchone()
                self.images = int(images)
                return int(total)
        except DatabaseError:
            return None


#: The temporary replication slot that keeps the WAL of a measurement.
SLOT = f"rj_bench_{os.getpid()}"

#: The records of this database's blocks, and the commits of their transactions.
DATABASE_WAL = """
WITH ours AS (
    SELECT xid, record_length, fpi_length FROM pg_get_wal_records_info(%s::pg_lsn, %s::pg_lsn)
    WHERE block_ref LIKE '%%/' || (SELECT oid FROM pg_database
                                   WHERE datname = current_database()) || '/%%')
SELECT (SELECT coalesce(sum(record_length), 0) FROM ours)
     + (SELECT coalesce(sum(record_length), 0) FROM pg_get_wal_records_info(%s::pg_lsn, %s::pg_lsn)
        WHERE resource_manager = 'Transaction'
          AND xid IN (SELECT xid FROM ours WHERE xid <> '0')),
       (SELECT coalesce(sum(fpi_length), 0) FROM ours)
"""


def measure(backend: ReliableJobsBackend, queue: str, *, sizes: dict[str, int], runs: int,
            report: Callable[[ProcessRun], None]) -> list[ProcessRun]:
    """``runs`` rounds of a worker per task of ``sizes`` (task to jobs per run),
    interleaved; ``report`` sees each."""
    profile_dir = os.environ.get("BENCH_PROFILE_DIR")
    results = []
    with tempfile.TemporaryDirectory(prefix="rj-bench-project-") as root:
        project = StockProject(Path(root), backend, queue)
        project.create()
        for run in range(1, runs + 1):
            for task, jobs in sizes.items():
                profile = None
                if profile_dir:
                    Path(profile_dir).mkdir(parents=True, exist_ok=True)
                    slug = TASKS[task]
                    profile = Path(profile_dir).resolve() / f"runworker-{slug}-{run}.prof"
                result = project.run_worker(task, jobs, profile=profile)
                results.append(result)
                report(result)
    return results
