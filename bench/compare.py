#!/usr/bin/env python3
"""Side by side: reliable_jobs against Celery, RQ and Dramatiq on one Redis (issue #6).

``python bench/compare.py --jobs 20000 --runs 3`` installs the contenders
into ``bench/.venv`` (never our runtime dependencies), then, for each
contender and run: flushes one Redis database, enqueues N no-op jobs as fast
as that framework's API allows, starts ONE worker process and times it until
the queue is empty, polling the framework's own keys. It ends with a Markdown
table of medians (min-max), the ratio of reliable_jobs' drain rate to each,
and the facts needed to repeat it (date, machine, versions, load).

Why from the outside, through each framework's own CLI: a framework's cost
includes its worker's start-up and its default settings, and a worker in our
process would share our interpreter's state. Runs are interleaved (run 1 of
every contender, then run 2, ...) so that load from other work on a shared
machine spreads over all contenders instead of landing on one.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib
import json
import os
import platform
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import bench_env

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
BIN = bench_env.VENV / "bin"
#: Set in a database after each flush; a database holding keys without it is
#: somebody else's and is never flushed (unless --force-flush).
MARKER_KEY = "bench-compare:owner"
#: Distributions whose installed versions are printed with the table.
REPORTED_DISTRIBUTIONS = ("reliable-jobs", "Django", "celery", "kombu", "billiard", "rq",
                          "dramatiq", "django-tasks-db", "django-tasks-redis", "django-tasks-rq",
                          "django-tasks", "django-rq", "redis", "hiredis", "psycopg")
#: Seconds a worker gets to stop after SIGTERM before its process group is killed.
STOP_GRACE_S = 15.0


@dataclass(frozen=True)
class Contender:
    """One framework in one worker configuration."""

    key: str
    label: str
    distribution: str
    module: str
    #: The worker's argv, given the Redis URL and the project folder under test.
    worker: Callable[[str, Path], list[str]]
    #: True when the worker exits by itself once drained (burst mode).
    exits_when_drained: bool
    #: True to start the worker in the project folder (``manage.py``), else in bench/.
    in_project: bool = False
    #: Jobs at most unless ``--cap`` says otherwise: a contender that drains tens of jobs
    #: a second would take the whole timeout on the default --jobs.
    cap: int | None = None


def manage(project: Path, *args: str) -> list[str]:
    return [str(BIN / "python"), str(project / "manage.py"), *args]


def celery_worker(pool: str, concurrency: int) -> Callable[[str, Path], list[str]]:
    return lambda url, project: [str(BIN / "celery"), "-A", "celery_noop", "worker",
                                 f"--pool={pool}", f"--concurrency={concurrency}",
                                 "--loglevel=WARNING"]


def dramatiq_worker(threads: int) -> Callable[[str, Path], list[str]]:
    return lambda url, project: [str(BIN / "dramatiq"), "dramatiq_noop", "--processes", "1",
                                 "--threads", str(threads)]


def rq_worker(url: str, project: Path) -> list[str]:
    return [str(BIN / "rq"), "worker", "--burst", "--quiet", "--worker-class",
            "rq.worker.SimpleWorker", "--url", url, "default"]


def djtasks_worker(kind: str, *command: str) -> Callable[[str, Path], list[str]]:
    """A django.tasks backend's own worker command, in the bench's small Django project."""
    return lambda url, project: [str(BIN / "python"), str(BENCH / "djtasks_manage.py"), kind,
                                 *command]


def runworker(*options: str) -> Callable[[str, Path], list[str]]:
    return lambda url, project: manage(project, "runworker", "--burst", *options, "-v", "0")


CONTENDERS = (
    Contender("rj", "reliable_jobs `runworker --burst --prefetch 200`", "reliable-jobs",
              "rj_noop", runworker("--prefetch", "200"), True, True),
    Contender("rj-default", "reliable_jobs `runworker --burst` (default PREFETCH)",
              "reliable-jobs", "rj_noop", runworker(), True, True),
    Contender("celery-solo", "Celery `--pool=solo`", "celery", "celery_noop",
              celery_worker("solo", 1), False),
    Contender("celery-prefork", "Celery `--pool=prefork --concurrency 2`", "celery",
              "celery_noop", celery_worker("prefork", 2), False),
    Contender("rq", "RQ `SimpleWorker --burst`", "rq", "rq_noop", rq_worker, True),
    Contender("dramatiq-t8", "Dramatiq `-p 1` (default 8 threads)", "dramatiq",
              "dramatiq_noop", dramatiq_worker(8), False),
    Contender("dramatiq-t1", "Dramatiq `-p 1 -t 1`", "dramatiq", "dramatiq_noop",
              dramatiq_worker(1), False),
    # The django.tasks backends a Django user would pick instead, each with its defaults
    # and its own worker in its burst mode; enqueue is one .enqueue() per job (the API
    # has no bulk call).
    Contender("djtasks-db", "django-tasks-db `db_worker --batch`", "django-tasks-db",
              "djtasks_db", djtasks_worker("db", "db_worker", "--batch"), True, cap=1_000),
    Contender("djtasks-redis", "django-tasks-redis `run_redis_tasks`", "django-tasks-redis",
              "djtasks_redis", djtasks_worker("redis", "run_redis_tasks"), True, cap=2_000),
    Contender("djtasks-rq", "django-tasks-rq `rqworker --burst`", "django-tasks-rq",
              "djtasks_rq", djtasks_worker("rq", "rqworker", "--job-class", "django_tasks_rq.Job",
                                           "--burst", "default"), True, cap=500),
)
#: Contenders that are django.tasks backends (the other ratio line).
DJANGO_TASKS = frozenset(c.key for c in CONTENDERS if c.key.startswith("djtasks-"))
#: The contenders every ratio is taken against, the first one measured: the
#: issue's targets compare reliable_jobs at its defaults with the others at theirs.
REFERENCES = ("rj-default", "rj")


def reference_runs(results: Results) -> list[Measurement]:
    """reliable_jobs' runs that the ratios use: at defaults when measured."""
    return next((results.measurements[key] for key in REFERENCES
                 if results.measurements.get(key)), [])


class BenchError(Exception):
    """One measurement failed; the message says how (the others go on)."""


@dataclass(frozen=True)
class Measurement:
    """One run of one contender; rates in jobs/s."""

    jobs: int
    enqueue: float
    drain: float  # worker start until empty (start-up included)
    steady: float  # first acknowledged job until empty
    cpu_us_per_job: float  # worker's CPU (user + system, whole process tree)
    load: float  # 1-minute load average when the run started
    exit_lag_s: float  # burst workers: from the queue seen empty until the process ended


@dataclass
class Results:
    """Every run's measurement, and every failure's message, by contender key."""

    measurements: dict[str, list[Measurement]] = field(default_factory=dict)
    failures: dict[str, list[str]] = field(default_factory=dict)


# -- processes -----------------------------------------------------------

LIVE: set[subprocess.Popen[bytes]] = set()


def stop(process: subprocess.Popen[bytes]) -> None:
    """Stop a worker and everything it started: SIGTERM its group, SIGKILL it after a grace."""
    for sig, wait_s in ((signal.SIGTERM, STOP_GRACE_S), (signal.SIGKILL, 5.0)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, sig)  # the worker leads a session of its own
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=wait_s)
            break
    LIVE.discard(process)


def stop_all() -> None:
    """Stop whatever is still running (the measurement that raised left it)."""
    for process in list(LIVE):
        stop(process)


def on_sigterm(signum: int, frame: object) -> None:
    """Treat SIGTERM like Ctrl-C, so the ``finally`` that stops the workers runs."""
    raise KeyboardInterrupt


def tail(path: Path, lines: int = 20) -> str:
    text = path.read_text(errors="replace").splitlines() if path.exists() else []
    return "\n".join(text[-lines:])


# -- one measurement -------------------------------------------------------

@dataclass
class Bench:
    """The shared settings of one invocation: servers, environment, limits."""

    redis_url: str
    project: Path
    timeout_s: float
    poll_s: float
    logs: Path
    client: Any  # redis.Redis, imported once inside the venv
    env: dict[str, str]
    modules: dict[str, ModuleType] = field(default_factory=dict)

    def module(self, name: str) -> ModuleType:
        if name not in self.modules:
            self.modules[name] = importlib.import_module(name)
        return self.modules[name]

    def flush(self) -> None:
        self.client.flushdb()
        self.client.set(MARKER_KEY, "bench/compare.py")

    def producer(self, module: str, action: str, count: int) -> dict[str, Any]:
        done = subprocess.run(
            [str(BIN / "python"), str(BENCH / "producer.py"), module, action, str(count)],
            cwd=BENCH, env=self.env, capture_output=True, text=True, timeout=self.timeout_s,
            check=False,
        )
        if done.returncode != 0:
            raise BenchError(f"{module} {action} failed:\n{done.stderr[-2000:]}")
        result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
        return result

    def measure(self, contender: Contender, jobs: int, run: int) -> Measurement:
        module = self.module(contender.module)
        load = os.getloadavg()[0]
        self.flush()
        enqueue_s = float(self.producer(contender.module, "enqueue", jobs)["seconds"])
        if (queued := module.pending(self.client)) != jobs:
            raise BenchError(f"{queued} jobs pending after enqueueing {jobs}.")
        log_path = self.logs / f"{contender.key}-{run}.log"
        cpu_before = resource.getrusage(resource.RUSAGE_CHILDREN)
        with log_path.open("wb") as log:
            started = time.perf_counter()
            process = subprocess.Popen(contender.worker(self.redis_url, self.project),
                                       cwd=self.project if contender.in_project else BENCH,
                                       env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                       start_new_session=True)
            LIVE.add(process)
            try:
                first, done_at_first, emptied, ended = self._watch(
                    contender, module, process, jobs, started, log_path)
            finally:
                stop(process)
        cpu_after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu_s = (cpu_after.ru_utime - cpu_before.ru_utime) + (cpu_after.ru_stime
                                                               - cpu_before.ru_stime)
        if hasattr(module, "check") and (problem := self.producer(
                contender.module, "check", jobs)["problem"]):
            raise BenchError(problem)
        steady_jobs = jobs - done_at_first
        steady = steady_jobs / (ended - first) if steady_jobs and ended > first else float("nan")
        return Measurement(jobs=jobs, enqueue=jobs / enqueue_s, drain=jobs / (ended - started),
                           steady=steady, cpu_us_per_job=cpu_s * 1e6 / jobs, load=load,
                           exit_lag_s=ended - emptied)

    def _watch(self, contender: Contender, module: ModuleType,
               process: subprocess.Popen[bytes], jobs: int, started: float,
               log_path: Path) -> tuple[float, int, float, float]:
        """Poll until drained; return (first ack, jobs done by then, seen empty, end) times.

        A burst worker's end is its exit, which comes after its own shutdown;
        "seen empty" is when the queue's keys first showed nothing pending.
        """
        first: float | None = None
        emptied: float | None = None
        done_at_first = 0
        deadline = started + self.timeout_s
        while True:
            exited = process.poll()  # before reading the queue: an exit then means drained
            pending = module.pending(self.client)
            now = time.perf_counter()
            if first is None and pending < jobs:
                first, done_at_first = now, jobs - pending
            if emptied is None and pending == 0:
                emptied = now
            if contender.exits_when_drained and exited is not None:
                if exited != 0 or pending:
                    raise BenchError(f"worker exited with {exited}, {pending} jobs pending:\n"
                                     + tail(log_path))
                return (first if first is not None else now, done_at_first,
                        emptied if emptied is not None else now, now)
            if not contender.exits_when_drained:
                if exited is not None:
                    raise BenchError(f"worker died ({exited}), {pending} jobs pending:\n"
                                     + tail(log_path))
                if pending == 0:
                    return first if first is not None else now, done_at_first, now, now
            if now > deadline:
                raise BenchError(f"not drained within {self.timeout_s:.0f} s "
                                 f"({pending} of {jobs} pending)")
            time.sleep(self.poll_s)


# -- setup and facts ---------------------------------------------------------

def with_database(url: str, name: str) -> str:
    parts = urlsplit(url)
    return urlunsplit(parts._replace(path=f"/{name}"))


def prepare_database(database_url: str, project: Path, env: dict[str, str], *,
                     force_drop: bool = False, django_tasks_db: bool = False) -> str:
    """Create the bench database afresh and migrate it; return the server's version.

    Afresh because the code under test may be another commit than last time,
    with other migrations; the name must say "bench" since it is dropped.
    """
    import psycopg
    from psycopg import sql

    name = urlsplit(database_url).path.lstrip("/")
    if "bench" not in name and not force_drop:
        raise SystemExit(f"The database is dropped and created again: its name must contain "
                         f"'bench' ({name!r} does not), or pass --force-drop-database.")
    with psycopg.connect(with_database(database_url, "postgres"), autocommit=True) as conn:
        version = str(conn.execute("SHOW server_version").fetchone()[0])  # type: ignore[index]
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
            sql.Identifier(name)))
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    subprocess.run(manage(project, "migrate", "--no-input", "-v", "0"), cwd=project, env=env,
                   check=True, timeout=300)
    if django_tasks_db:
        subprocess.run([str(BIN / "python"), str(BENCH / "djtasks_manage.py"), "db", "migrate",
                        "--no-input", "-v", "0"], cwd=BENCH, env=env, check=True, timeout=300)
    return version


def claim_redis_db(client: Any, force: bool) -> None:
    """Refuse to flush a database that holds someone else's keys."""
    if client.dbsize() and not client.exists(MARKER_KEY) and not force:
        raise SystemExit(
            f"Redis database {client.connection_pool.connection_kwargs.get('db')} holds "
            f"{client.dbsize()} keys that compare.py did not write; pick an empty one with "
            "--redis-url or pass --force-flush.")


def cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for name in REPORTED_DISTRIBUTIONS:
        with contextlib.suppress(PackageNotFoundError):
            found[name] = version(name)
    return found


# -- reporting -------------------------------------------------------------

def spread(values: list[float], digits: int = 0) -> str:
    """Median with min-max, e.g. ``9,148 (8,768-10,324)``."""
    def fmt(value: float) -> str:
        return f"{value:,.{digits}f}"
    if len(values) == 1:
        return fmt(values[0])
    return f"{fmt(statistics.median(values))} ({fmt(min(values))}-{fmt(max(values))})"


def ratio(reference: list[Measurement], other: list[Measurement],
          pick: Callable[[Measurement], float]) -> str:
    if not reference or not other:
        return "n/a"
    return f"{statistics.median(map(pick, reference)) / statistics.median(map(pick, other)):.1f}x"


def table(results: Results, found: dict[str, str], contenders: list[Contender]) -> str:
    reference = reference_runs(results)
    lines = [
        "| framework / config | version | jobs | enqueue jobs/s | drain jobs/s, worker start "
        "to empty | reliable_jobs ÷ this | drain jobs/s, first ack to empty | reliable_jobs ÷ "
        "this | worker CPU µs/job |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for contender in contenders:
        runs = results.measurements.get(contender.key, [])
        if not runs:
            failed = "; ".join(f.splitlines()[0] for f in results.failures.get(contender.key, []))
            lines.append(f"| {contender.label} | {found.get(contender.distribution, '?')} | | "
                         f"failed: {failed or 'not run'} | | | | | |")
            continue
        jobs = sorted({m.jobs for m in runs})
        lines.append(
            f"| {contender.label} | {found.get(contender.distribution, '?')} "
            f"| {'/'.join(f'{j:,}' for j in jobs)} "
            f"| {spread([m.enqueue for m in runs])} | {spread([m.drain for m in runs])} "
            f"| {ratio(reference, runs, lambda m: m.drain)} "
            f"| {spread([m.steady for m in runs])} "
            f"| {ratio(reference, runs, lambda m: m.steady)} "
            f"| {spread([m.cpu_us_per_job for m in runs])} |")
    return "\n".join(lines)


def best_other(results: Results, pick: Callable[[Measurement], float],
               among: Callable[[str], bool] = lambda key: not key.startswith("rj")) -> str:
    reference = reference_runs(results)
    others = {key: statistics.median(map(pick, runs))
              for key, runs in results.measurements.items()
              if runs and among(key)}
    if not reference or not others:
        return "n/a"
    key = max(others, key=others.__getitem__)
    label = next(c.label for c in CONTENDERS if c.key == key)
    return (f"{statistics.median(map(pick, reference)) / others[key]:.1f}x "
            f"the best other, {label} ({others[key]:,.0f} jobs/s)")


def run_benchjobs(bench: Bench, jobs: int, singles: int, runs: int) -> str:
    """Run ``manage.py benchjobs --prefetch 200`` on a flushed database; return its summary."""
    bench.flush()
    bench.producer("rj_noop", "reset", 0)
    command = manage(bench.project, "benchjobs", "--jobs", str(jobs), "--singles", str(singles),
                     "--runs", str(runs), "--prefetch", "200")
    usage = subprocess.run(manage(bench.project, "help", "benchjobs"), cwd=bench.project,
                           env=bench.env, capture_output=True, text=True, timeout=120,
                           check=False).stdout
    # Later versions also measure latency and long queues; those are not this table's.
    if "--latency-samples" in usage:
        command += ["--latency-samples", "0"]
    if "--lengths" in usage:
        command += ["--lengths", ""]
    done = subprocess.run(
        command, cwd=bench.project, env=bench.env, capture_output=True, text=True,
        timeout=bench.timeout_s * runs, check=False)
    if done.returncode != 0:
        raise BenchError(f"benchjobs failed:\n{done.stderr[-2000:]}")
    return done.stdout.strip()


# -- main --------------------------------------------------------------------

def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=20_000,
                        help="No-op jobs per run (default: %(default)r).")
    parser.add_argument("--runs", type=int, default=3,
                        help="Runs per contender; medians are shown (default: %(default)r).")
    parser.add_argument("--cap", action="append", default=[], metavar="KEY=N",
                        help="Fewer jobs for a slow contender, e.g. rq=5000.")
    parser.add_argument("--only", action="append", default=[], metavar="KEY",
                        help="Run only these contenders (repeat or comma-separate): "
                             + ", ".join(c.key for c in CONTENDERS) + ".")
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/13",
                        help="Redis database the benchmark flushes (default: %(default)r).")
    parser.add_argument("--database-url",
                        default="postgres://postgres@127.0.0.1:5432/rj_bench",
                        help="PostgreSQL database for reliable_jobs' mirror, created and "
                             "migrated if missing (default: %(default)r).")
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="Seconds one enqueue or one drain may take (default: %(default)r).")
    parser.add_argument("--poll-ms", type=float, default=5.0,
                        help="How often queue lengths are read (default: %(default)r).")
    parser.add_argument("--benchjobs-singles", type=int, default=500,
                        help="--singles for the benchjobs figures; 0 skips benchjobs "
                             "(default: %(default)r).")
    parser.add_argument("--force-flush", action="store_true",
                        help="Flush the Redis database even if it holds keys of others.")
    parser.add_argument("--force-drop-database", action="store_true",
                        help="Drop and recreate --database-url even if its name lacks 'bench'.")
    parser.add_argument("--ref", default=None,
                        help="Measure this commit of reliable_jobs (unpacked under "
                             "bench/.venv/snapshots) instead of the working tree, e.g. HEAD.")
    parser.add_argument("--upgrade", action="store_true",
                        help="Upgrade the contenders in bench/.venv first.")
    parser.add_argument("--setup-only", action="store_true",
                        help="Install bench/.venv and stop.")
    args = parser.parse_args(argv)
    if args.jobs < 1 or args.runs < 1:
        parser.error("--jobs and --runs must be at least 1.")
    keys = {c.key for c in CONTENDERS}
    args.only = [k for value in args.only for k in value.split(",") if k]
    caps: dict[str, int] = {}
    for item in args.cap:
        key, _, count = item.partition("=")
        if key not in keys or not count.isdigit() or int(count) < 1:
            parser.error(f"--cap {item!r}: use KEY=N with KEY one of {', '.join(sorted(keys))}.")
        caps[key] = int(count)
    args.caps = caps
    if unknown := set(args.only) - keys:
        parser.error(f"--only: unknown {', '.join(sorted(unknown))}.")
    return args


def environment(redis_url: str, database_url: str, project: Path) -> dict[str, str]:
    """What every child gets: both servers, the testproject, no inherited RJ_* tuning."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RJ_")}
    env.update(BENCH_REDIS_URL=redis_url, REDIS_URL=redis_url, DATABASE_URL=database_url,
               BENCH_DATABASE_URL=database_url,
               DJANGO_SETTINGS_MODULE="testproject.settings", RJ_LOG_LEVEL="WARNING",
               PYTHONPATH=os.pathsep.join([str(BENCH), str(project)]))
    return env


@contextlib.contextmanager
def cleanup() -> Iterator[None]:
    """Stop every worker started, however we leave (error, Ctrl-C, SIGTERM)."""
    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield
    finally:
        stop_all()
        signal.signal(signal.SIGTERM, previous)


def code_under_test(ref: str | None) -> tuple[Path, str]:
    """The project folder whose reliable_jobs is measured, and how to name it in the report."""
    if ref:
        commit, folder = bench_env.snapshot(ref)
        return folder, f"commit {commit[:12]}"
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True,
                              timeout=60, check=False).stdout.strip()
    dirty = git("status", "--porcelain", "--", "reliable_jobs", "testproject", "manage.py",
                "setup.cfg")
    return ROOT, f"working tree at {git('rev-parse', '--short=12', 'HEAD') or '?'}" + (
        " with uncommitted changes" if dirty else "")


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    project, code = code_under_test(args.ref)
    bench_env.ensure_venv(project, upgrade=args.upgrade and not bench_env.in_venv())
    if args.setup_only:
        return 0
    if not bench_env.in_venv():
        # Pin the commit: a moving ref (HEAD) could move before the re-run resolves it.
        pinned = ["--ref", code.split()[-1]] if args.ref else []
        bench_env.reexec_in_venv(Path(__file__), [*argv, *pinned])
    import redis

    contenders = [c for c in CONTENDERS if not args.only or c.key in args.only]
    env = environment(args.redis_url, args.database_url, project)
    os.environ["BENCH_REDIS_URL"] = args.redis_url  # for the modules imported here
    os.environ["BENCH_DATABASE_URL"] = args.database_url
    client = redis.Redis.from_url(args.redis_url)
    claim_redis_db(client, args.force_flush)
    redis_version = client.info("server")["redis_version"]
    pg_version = prepare_database(
        args.database_url, project, env, force_drop=args.force_drop_database,
        django_tasks_db=any(c.key == "djtasks-db" for c in contenders))
    found = versions()
    results = Results()
    loads = [os.getloadavg()]
    started_at = datetime.datetime.now(datetime.UTC)
    benchjobs = ""
    with tempfile.TemporaryDirectory(prefix="rj-compare-") as logs, cleanup():
        bench = Bench(args.redis_url, project, args.timeout, args.poll_ms / 1000,
                      Path(logs), client, env)
        for run in range(1, args.runs + 1):
            for contender in contenders:
                jobs = args.caps.get(contender.key, min(args.jobs, contender.cap or args.jobs))
                try:
                    measured = bench.measure(contender, jobs, run)
                except (BenchError, subprocess.TimeoutExpired) as exc:
                    results.failures.setdefault(contender.key, []).append(str(exc))
                    print(f"run {run}/{args.runs} {contender.key}: FAILED: {exc}",
                          file=sys.stderr)
                    continue
                results.measurements.setdefault(contender.key, []).append(measured)
                print(f"run {run}/{args.runs} {contender.key}: {jobs:,} jobs, enqueue "
                      f"{measured.enqueue:,.0f}/s, drain {measured.drain:,.0f}/s (steady "
                      f"{measured.steady:,.0f}/s), worker CPU {measured.cpu_us_per_job:,.0f} "
                      f"µs/job, exit {measured.exit_lag_s * 1000:,.0f} ms after empty, "
                      f"load {measured.load:.2f}", file=sys.stderr)
        loads.append(os.getloadavg())
        if args.benchjobs_singles > 0 and (not args.only or "rj" in args.only):
            try:
                benchjobs = run_benchjobs(bench, args.jobs, args.benchjobs_singles, args.runs)
            except (BenchError, subprocess.TimeoutExpired) as exc:
                benchjobs = f"benchjobs failed: {exc}"
        loads.append(os.getloadavg())
        bench.flush()
    run_loads = [m.load for runs in results.measurements.values() for m in runs]

    print(f"## {args.jobs:,} no-op jobs, one worker process, median (min-max) of "
          f"{args.runs} run(s)\n")
    print(table(results, found, contenders))
    print("\nreliable_jobs drain (worker start to empty): "
          + best_other(results, lambda m: m.drain))
    print("reliable_jobs drain (first ack to empty): " + best_other(results, lambda m: m.steady))
    print("reliable_jobs drain vs the django.tasks backends (worker start to empty): "
          + best_other(results, lambda m: m.drain, DJANGO_TASKS.__contains__))
    print("reliable_jobs drain vs the django.tasks backends (first ack to empty): "
          + best_other(results, lambda m: m.steady, DJANGO_TASKS.__contains__))
    lags = [f"{c.key} {statistics.median(m.exit_lag_s for m in runs) * 1000:,.0f} ms"
            for c in contenders if c.exits_when_drained
            and (runs := results.measurements.get(c.key))]
    if lags:
        print("Burst workers exited this long (median) after their queue was seen empty; "
              "that shutdown is inside both drain figures: " + ", ".join(lags) + ".")
    caps = {c.key: args.caps.get(c.key, min(args.jobs, c.cap or args.jobs))
            for c in contenders}
    if capped := {k: n for k, n in caps.items() if n != args.jobs}:
        print("Capped: " + ", ".join(f"{k} at {n:,} jobs" for k, n in capped.items()))
    if benchjobs:
        print(f"\n`manage.py benchjobs --jobs {args.jobs} --singles {args.benchjobs_singles} "
              f"--runs {args.runs} --prefetch 200` (in-process worker, same servers):\n")
        print("```\n" + benchjobs + "\n```")
    print(f"\nMeasured {started_at:%Y-%m-%d %H:%M} UTC on {platform.machine()} (`uname -m`), "
          f"{cpu_model()}, "
          f"{os.cpu_count()} cores, Python {platform.python_version()}, Redis {redis_version}, "
          f"PostgreSQL {pg_version}.")
    print(f"reliable_jobs code: {code}.")
    print("Versions: " + ", ".join(f"{name} {version}" for name, version in found.items()) + ".")
    print("Load average (1/5/15 min) at start {}, after the runs {}, at the end {}; 1-min load "
          "when each run started: {} to {}.".format(
              *("/".join(f"{x:.2f}" for x in load) for load in loads),
              f"{min(run_loads):.2f}" if run_loads else "?",
              f"{max(run_loads):.2f}" if run_loads else "?"))
    for key, failures in results.failures.items():
        print(f"\n{key} failed {len(failures)} time(s); first failure:\n{failures[0]}")
    return 1 if results.failures else 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except KeyboardInterrupt:
        print("Interrupted; every worker started was stopped.", file=sys.stderr)
        sys.exit(130)
