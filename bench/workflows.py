"""Workflows, measured: what a group costs to enqueue, how soon a chord calls back, chaos.

    python bench/workflows.py enqueue [--members 10000] [--rounds 5]
    python bench/workflows.py lag [--members 2000] [--runs 10]
    python bench/workflows.py chaos [--members 1000] [--runs 5] [--kill-every 0.7] [--flush]

- enqueue: in this process, alternating, each in its own transaction on
  empty tables: ``enqueue_many`` of N ``demo.noop`` calls, a ``group`` of
  the same N calls, and a ``chord`` of them with a callback (N edges more).
  Timed from building the calls to the commit (pushes included). Printed:
  each one's median seconds, and the group's and the chord's ratio to
  ``enqueue_many``.
- lag: one ``runworker --concurrency 4`` process; per run a chord of N
  ``demo.add`` members and a ``demo.total`` callback. The lag is the
  callback's ``started_at`` minus the last member's ``finished_at`` (both
  rows, written by the worker), and minus the last member's ``updated_at``
  (the database's clock when its success was written: the release's
  commit). The difference is the worker's mirror backlog. Printed: p50,
  p99 and max over the runs.
- chaos: two ``runworker`` processes and a ``recoverjobs --interval 0.5``
  sweep (LEASE_MS and RECONCILE_GRACE_MS 1,000); a random worker is
  SIGKILLed and started again every ``--kill-every`` seconds, and with
  ``--flush`` Redis is flushed (FLUSHDB) once in each run. Per run: members
  lost (not succeeded), the callback's state, how many attempts of it
  started, and whether it received every member's result exactly once.

Uses ``REDIS_URL`` (a database it FLUSHES: give it one nobody else uses) and
``DATABASE_URL`` (its job tables are TRUNCATED: a database of its own,
migrated). Every wait is bounded; every process it starts is stopped.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent.parent
#: Settings of the chaos run's processes (short leases: kills are seen within a second).
CHAOS_OPTIONS = {"LEASE_MS": 1000, "RENEW_INTERVAL_MS": 250, "SWEEP_INTERVAL_MS": 250,
                 "RECONCILE_GRACE_MS": 1000, "RETRY_BASE_MS": 50, "RETRY_MAX_MS": 200,
                 "MAX_ATTEMPTS": 20}


def setup() -> None:
    sys.path.insert(0, str(HERE))
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "testproject.settings")
    os.environ["RJ_OPTIONS"] = json.dumps(CHAOS_OPTIONS)
    import django

    django.setup()


def reset() -> None:
    from django.apps import apps
    from django.db import connection

    from reliable_jobs.compat import task_backends

    tables = [m._meta.db_table for m in apps.get_app_config("reliable_jobs").get_models()]
    with connection.cursor() as cursor:
        cursor.execute("TRUNCATE " + ", ".join(connection.ops.quote_name(t) for t in tables))
    task_backends["default"].broker.client.flushdb()


def enqueue_cost(members: int, rounds: int) -> None:
    from django.db import transaction

    from reliable_jobs.canvas import chord, group
    from reliable_jobs.compat import task_backends
    from testproject.demo import tasks as demo

    backend: Any = task_backends["default"]

    def plain() -> None:
        with transaction.atomic():
            backend.enqueue_many(demo.noop, [((), {}) for _ in range(members)])

    def as_group() -> None:
        group(*(demo.noop.s() for _ in range(members))).enqueue()

    def as_chord() -> None:
        chord(group(*(demo.noop.s() for _ in range(members))), demo.total.s()).enqueue()

    timings: dict[str, list[float]] = {"enqueue_many": [], "group": [], "chord": []}
    kinds = [("enqueue_many", plain), ("group", as_group), ("chord", as_chord)]
    for round_ in range(rounds + 1):
        for name, run in kinds if round_ % 2 else reversed(kinds):
            reset()
            began = time.perf_counter()
            run()
            if round_:  # the first round warms caches and connections
                timings[name].append(time.perf_counter() - began)
    reset()
    base = statistics.median(timings["enqueue_many"])
    for name, values in timings.items():
        median = statistics.median(values)
        print(f"{name:13} {members} jobs: median {median:.3f} s over {rounds} rounds "
              f"({median / base:.2f}x enqueue_many)")


class Workers:
    """Worker and sweep processes of ``manage.py``, every one stopped at the end."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1"}

    def start(self, *args: str) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen([sys.executable, str(HERE / "manage.py"), *args], cwd=HERE,
                                env=self.env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        self.procs.append(proc)
        return proc

    def kill(self, proc: subprocess.Popen[bytes]) -> None:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        self.procs.remove(proc)

    def stop_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        self.procs = []


def enqueue_chord(members: int) -> tuple[str, list[str]]:
    from reliable_jobs.canvas import chord, group
    from testproject.demo import tasks as demo

    flow = chord(group(*(demo.add.s(i, 0) for i in range(members))),
                 demo.total.s().with_results()).enqueue()
    return flow.last.id, [r.id for r in flow.results[:-1]]


def callback_done(callback: str) -> bool:
    from reliable_jobs.models import Job, JobState

    return Job.objects.filter(pk=callback, state__in=(JobState.SUCCEEDED, JobState.DEAD,
                                                      JobState.CANCELLED)).exists()


def wait(predicate: Any, timeout: float, tick: Any = None) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        if tick is not None:
            tick()
        time.sleep(0.05)
    return False


def lag(members: int, runs: int, timeout: float) -> None:
    from django.db.models import Max

    from reliable_jobs.models import Job

    reset()
    workers = Workers()
    lags: list[float] = []
    after_write: list[float] = []
    try:
        workers.start("runworker", "--concurrency", "4")
        for _ in range(runs):
            callback, ids = enqueue_chord(members)
            if not wait(lambda c=callback: callback_done(c), timeout):
                raise SystemExit(f"the callback did not finish within {timeout} s")
            last = Job.objects.filter(pk__in=ids).aggregate(
                finished=Max("finished_at"), written=Max("updated_at"))
            started = Job.objects.get(pk=callback).started_at
            lags.append((started - last["finished"]).total_seconds())
            after_write.append((started - last["written"]).total_seconds())
    finally:
        workers.stop_all()
    for name, values in (("the last member's task ended", lags),
                         ("the last member's success was written", after_write)):
        values.sort()
        p99 = values[min(len(values) - 1, int(len(values) * 0.99))]
        print(f"chord of {members}, {runs} runs: callback start after {name}: "
              f"p50 {statistics.median(values) * 1000:.0f} ms, p99 {p99 * 1000:.0f} ms, "
              f"max {values[-1] * 1000:.0f} ms")


def chaos_run(members: int, kill_every: float, flush: bool, timeout: float) -> bool:
    """One chaos run of a chord; print what became of it, and whether it is whole."""
    from reliable_jobs.compat import task_backends
    from reliable_jobs.models import Attempt, Job, JobState

    reset()
    workers = Workers()
    kills = flushed = 0
    try:
        pool = [workers.start("runworker", "--concurrency", "2") for _ in range(2)]
        workers.start("recoverjobs", "--interval", "0.5")
        callback, ids = enqueue_chord(members)
        began = time.monotonic()
        next_kill = began + kill_every
        flush_at = began + random.uniform(0.3, 1.5) if flush else None

        def tick() -> None:
            nonlocal next_kill, kills, flush_at, flushed
            now = time.monotonic()
            if now >= next_kill:
                victim = random.choice(pool)
                workers.kill(victim)
                pool.remove(victim)
                pool.append(workers.start("runworker", "--concurrency", "2"))
                kills += 1
                next_kill = now + kill_every
            if flush_at is not None and now >= flush_at:
                task_backends["default"].broker.client.flushdb()
                flushed, flush_at = flushed + 1, None

        finished = wait(lambda: callback_done(callback), timeout, tick)
    finally:
        workers.stop_all()
    lost = Job.objects.filter(pk__in=ids).exclude(state=JobState.SUCCEEDED).count()
    row = Job.objects.get(pk=callback)
    started = Attempt.objects.filter(job=row, started_at__isnull=False).count()
    exact = row.args == [list(range(members))]
    ok = finished and lost == 0 and row.state == JobState.SUCCEEDED and exact
    print(f"{members} members, {kills} SIGKILLs, {flushed} FLUSHDB; members lost {lost}; "
          f"callback {row.state}, attempts started {started}, results exactly once {exact}; "
          f"{'ok' if ok else 'FAILED'}", flush=True)
    return ok


def chaos(members: int, runs: int, kill_every: float, flush: bool, timeout: float) -> None:
    ok = sum(chaos_run(members, kill_every, flush, timeout) for _ in range(runs))
    print(f"{ok} of {runs} chaos runs ok")
    if ok < runs:
        raise SystemExit(1)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("what", choices=["enqueue", "lag", "chaos"])
    parser.add_argument("--members", type=int)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--kill-every", type=float, default=0.7)
    parser.add_argument("--flush", action="store_true")
    parser.add_argument("--timeout", type=float, default=300.0)
    options = parser.parse_args(argv)
    setup()
    if options.what == "enqueue":
        enqueue_cost(options.members or 10_000, options.rounds)
    elif options.what == "lag":
        lag(options.members or 2_000, options.runs, options.timeout)
    else:
        chaos(options.members or 1_000, options.runs, options.kill_every, options.flush,
              options.timeout)


if __name__ == "__main__":
    main(sys.argv[1:])
