"""Fair shares, measured with real `manage.py runworker` processes and the mirror on.

    python bench/fair.py backlog [--rounds 3]   # tenant B's 10 jobs behind A's 100,000
    python bench/fair.py weights                # FAIR_WEIGHTS {"A": 3, "B": 1}, 40,000 starts
    python bench/fair.py cost --main-tree DIR [--rounds 6] [--jobs 30000]
                                                # plain jobs' drain: this tree vs DIR
    python bench/fair.py claims --main-tree DIR [--rounds 10] [--jobs 50000]
                                                # the claim script alone, plain jobs

Every figure comes from the job rows the worker wrote (``started_at``,
``finished_at``), so a worker's start-up is never part of it:

- backlog: A's 100,000 jobs (``demo.tenant_add``, ``fair_key="tenant"``) are
  enqueued, then B's 10 one call each; then one worker with default settings
  starts. B's wait is each B job's start minus the first start of any job
  (the moment the worker began on the backlog). Printed: p50, p99, max over
  every round's 10 jobs; with ``--baseline`` also the same jobs enqueued
  without groups (B behind the whole backlog).
- weights: 40,000 of A's and 20,000 of B's jobs, FAIR_WEIGHTS A=3; the first
  40,000 starts (by start time, then id) are counted per tenant.
- cost: N plain no-op jobs (no group), drained by ``runworker --burst`` in this
  tree and in DIR (e.g. a worktree of main), alternating, each in a database of
  its own migrated by its own tree. Rate: N / (last finish - first start).
- claims: the claim script alone on N plain jobs (Broker.enqueue, then
  Broker.claim of 100 until empty, no worker, no mirror), in this tree and in
  DIR, alternating: what a queue without groups pays in Redis for them
  (wall clock, and the server's own CPU time in EVALSHA per job, from
  ``INFO commandstats``: the server is reset with CONFIG RESETSTAT, so give
  it a server of its own).

Uses ``--redis-url`` (a database it flushes: give it one nobody else uses) and
``--database-url`` (databases named ``<name>`` and ``<name>_other`` are dropped and made).
Every wait is bounded; each worker is stopped, also on an error.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent.parent


def claim_time(tree: str, redis_url: str, jobs: int) -> None:
    """Print the seconds ``tree``'s claim script takes to claim ``jobs`` plain jobs, 100 a call."""
    sys.path.insert(0, tree)
    import uuid

    from reliable_jobs.broker import Broker, NewJob

    broker = Broker(redis_url, "claims")
    broker.client.flushdb()
    payload = '{"task": "testproject.demo.tasks.noop", "args": [], "kwargs": {}}'
    for start in range(0, jobs, 1000):
        broker.enqueue("q", [NewJob(str(uuid.uuid4()), payload, 3)
                             for _ in range(min(1000, jobs - start))])
    broker.client.config_resetstat()  # the bench's own server: its stats are ours
    began = time.perf_counter()
    claimed = 0
    while got := len(broker.claim("q", count=100, lease_ms=600_000).jobs):
        claimed += got
    elapsed = time.perf_counter() - began
    stats = broker.client.info("commandstats")
    server_us = stats["cmdstat_evalsha"]["usec"]
    commands = sum(v["calls"] for k, v in stats.items() if k != "cmdstat_evalsha")
    broker.client.flushdb()
    if claimed != jobs:
        raise SystemExit(f"claimed {claimed} of {jobs}")
    print(elapsed, server_us, commands)


def child(tree: str, action: str, *args: str) -> None:
    """Run in a subprocess with ``tree`` first on the path: reset, enqueue or read the rows."""
    if action == "claims":
        claim_time(tree, args[0], int(args[1]))
        return
    sys.path.insert(0, tree)
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "testproject.settings")
    import django

    django.setup()
    from django.apps import apps
    from django.db import connection

    from reliable_jobs.compat import task_backends
    from testproject.demo import tasks as demo

    backend: Any = task_backends["default"]
    if action == "reset":
        tables = [m._meta.db_table for m in apps.get_app_config("reliable_jobs").get_models()]
        with connection.cursor() as cursor:
            cursor.execute("TRUNCATE " + ", ".join(connection.ops.quote_name(t) for t in tables))
        backend.broker.client.flushdb()
    elif action == "enqueue":
        count, tenant = int(args[0]), args[1]
        # "plain": the same task and arguments without fair groups (the baseline).
        tenant_add = (dataclasses.replace(demo.tenant_add, fair_key=None)
                      if args[2:] == ("plain",) else demo.tenant_add)
        if tenant == "-":
            backend.enqueue_many(demo.noop, (((), {}) for _ in range(count)))
        elif count <= 10:
            for i in range(count):
                tenant_add.enqueue(tenant, i, 0)
        else:
            backend.enqueue_many(tenant_add, (((tenant, i, 0), {}) for i in range(count)))
    elif action == "rows":
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT args->>0, EXTRACT(EPOCH FROM started_at), EXTRACT(EPOCH FROM finished_at)"
                " FROM reliable_jobs_job WHERE started_at IS NOT NULL"
                " ORDER BY started_at, id")
            print(json.dumps([(a, float(s), float(f) if f is not None else None)
                              for a, s, f in cursor.fetchall()]))
    elif action == "succeeded":
        with connection.cursor() as cursor:
            cursor.execute("SELECT COUNT(*) FROM reliable_jobs_job WHERE state = 'succeeded'"
                           + (f" AND args->>0 = '{args[0]}'" if args else ""))
            print(cursor.fetchone()[0])
    else:
        raise SystemExit(f"unknown action {action!r}")


class Bench:
    def __init__(self, options: argparse.Namespace) -> None:
        self.redis_url = options.redis_url
        self.database_url = options.database_url
        self.timeout = options.timeout

    def env(self, tree: Path, database_url: str, **rj_options: Any) -> dict[str, str]:
        return {**os.environ, "REDIS_URL": self.redis_url, "DATABASE_URL": database_url,
                "DJANGO_SETTINGS_MODULE": "testproject.settings",
                "RJ_OPTIONS": json.dumps(rj_options), "PYTHONPATH": str(tree)}

    def run(self, tree: Path, env: dict[str, str], *args: str) -> str:
        done = subprocess.run([sys.executable, str(Path(__file__).resolve()), "_child",
                               str(tree), *args], cwd=tree, env=env, capture_output=True,
                              text=True, timeout=self.timeout, check=False)
        if done.returncode:
            raise SystemExit(f"{args[0]} failed in {tree}:\n{done.stderr[-2000:]}")
        return done.stdout

    def prepare(self, tree: Path, database_url: str) -> None:
        name = database_url.rsplit("/", 1)[1]
        admin = database_url.rsplit("/", 1)[0] + "/postgres"
        import psycopg

        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}"')
            conn.execute(f'CREATE DATABASE "{name}"')
        subprocess.run([sys.executable, "manage.py", "migrate", "-v0"], cwd=tree,
                       env=self.env(tree, database_url), check=True, timeout=self.timeout)

    def worker(self, tree: Path, env: dict[str, str], *args: str) -> subprocess.Popen[bytes]:
        return subprocess.Popen([sys.executable, "manage.py", "runworker", *args], cwd=tree,
                                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)

    def stop(self, proc: subprocess.Popen[bytes]) -> None:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)

    def wait_for(self, tree: Path, env: dict[str, str], count: int, *args: str) -> None:
        deadline = time.monotonic() + self.timeout
        while int(self.run(tree, env, "succeeded", *args)) < count:
            if time.monotonic() > deadline:
                raise SystemExit(f"timed out waiting for {count} succeeded jobs {args}")
            time.sleep(0.5)


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(p / 100 * len(ordered) + 0.5) - 1))]


def backlog(bench: Bench, options: argparse.Namespace) -> None:
    tree = HERE
    database = bench.database_url
    bench.prepare(tree, database)
    for label, fair in (("fair groups", True), *((("no groups", False),) if options.baseline
                                                  else ())):
        waits: list[float] = []
        for _ in range(options.rounds):
            env = bench.env(tree, database)
            bench.run(tree, env, "reset")
            plain = () if fair else ("plain",)
            started = time.monotonic()
            bench.run(tree, env, "enqueue", str(options.backlog), "A", *plain)
            bench.run(tree, env, "enqueue", "10", "B", *plain)
            enqueue_s = time.monotonic() - started
            proc = bench.worker(tree, env)
            try:
                bench.wait_for(tree, env, 10, "B")
            finally:
                bench.stop(proc)
            rows = json.loads(bench.run(tree, env, "rows"))
            first = min(s for _, s, _ in rows)
            b = [s - first for tenant, s, _ in rows if tenant == "B"]
            waits += b
            print(f"  round ({label}): enqueue {enqueue_s:.1f} s, B waited "
                  f"{', '.join(f'{w * 1000:.0f}' for w in sorted(b))} ms; "
                  f"{len(rows)} jobs had started", flush=True)
        print(f"{label}: B's wait over {len(waits)} starts: p50 "
              f"{percentile(waits, 50) * 1000:.0f} ms, p99 {percentile(waits, 99) * 1000:.0f} ms, "
              f"max {max(waits) * 1000:.0f} ms (backlog {options.backlog:,} of A's jobs)",
              flush=True)


def weights(bench: Bench, options: argparse.Namespace) -> None:
    tree, database = HERE, bench.database_url
    bench.prepare(tree, database)
    env = bench.env(tree, database, FAIR_WEIGHTS={"A": 3, "B": 1})
    for _ in range(options.rounds):
        bench.run(tree, env, "reset")
        bench.run(tree, env, "enqueue", str(options.starts), "A")
        bench.run(tree, env, "enqueue", str(options.starts // 2), "B")
        proc = bench.worker(tree, env)
        try:
            bench.wait_for(tree, env, options.starts)
        finally:
            bench.stop(proc)
        rows = json.loads(bench.run(tree, env, "rows"))[:options.starts]
        a = sum(1 for tenant, _, _ in rows if tenant == "A")
        b = len(rows) - a
        print(f"weights A=3, B=1: first {len(rows):,} starts: A {a:,}, B {b:,}, "
              f"ratio {a / b:.3f}", flush=True)


def cost(bench: Bench, options: argparse.Namespace) -> None:
    trees = {"this": HERE, "other": Path(options.main_tree).resolve()}
    databases = {"this": bench.database_url, "other": bench.database_url + "_other"}
    for key, tree in trees.items():
        bench.prepare(tree, databases[key])
    rates: dict[str, list[float]] = {key: [] for key in trees}
    for round_ in range(options.rounds):
        order = ("this", "other") if round_ % 2 == 0 else ("other", "this")
        for key in order:
            tree, env = trees[key], bench.env(trees[key], databases[key])
            bench.run(tree, env, "reset")
            bench.run(tree, env, "enqueue", str(options.jobs), "-")
            proc = bench.worker(tree, env, "--burst")
            try:
                proc.wait(timeout=bench.timeout)
            finally:
                bench.stop(proc)
            rows = json.loads(bench.run(tree, env, "rows"))
            if len(rows) != options.jobs:
                raise SystemExit(f"{key}: {len(rows)} of {options.jobs} jobs ran")
            span = max(f for _, _, f in rows) - min(s for _, s, _ in rows)
            rates[key].append(options.jobs / span)
            print(f"  {key}: {options.jobs / span:,.0f} jobs/s", flush=True)
    this, other = statistics.median(rates["this"]), statistics.median(rates["other"])
    print(f"plain drain, median of {options.rounds}: this tree {this:,.0f} jobs/s, "
          f"{options.main_tree} {other:,.0f} jobs/s: {100 * (this / other - 1):+.1f}%", flush=True)


def claims(bench: Bench, options: argparse.Namespace) -> None:
    trees = {"this": HERE, "other": Path(options.main_tree).resolve()}
    rates: dict[str, list[float]] = {key: [] for key in trees}
    server: dict[str, list[float]] = {key: [] for key in trees}
    for round_ in range(options.rounds):
        for key in ("this", "other") if round_ % 2 == 0 else ("other", "this"):
            tree = trees[key]
            seconds, usec, commands = map(float, bench.run(
                tree, bench.env(tree, bench.database_url), "claims", bench.redis_url,
                str(options.jobs)).split())
            rates[key].append(options.jobs / seconds)
            server[key].append(usec / options.jobs)
            print(f"  {key}: {options.jobs / seconds:,.0f} claims/s, Redis "
                  f"{usec / options.jobs:.2f} µs and {commands / options.jobs:.3f} commands "
                  "per job", flush=True)
    this, other = statistics.median(rates["this"]), statistics.median(rates["other"])
    this_us, other_us = statistics.median(server["this"]), statistics.median(server["other"])
    print(f"claim script, plain jobs, 100 a call, median of {options.rounds}: this tree "
          f"{this:,.0f}/s, {options.main_tree} {other:,.0f}/s: {100 * (this / other - 1):+.1f}%; "
          f"Redis CPU per job {this_us:.2f} against {other_us:.2f} µs: "
          f"{100 * (this_us / other_us - 1):+.1f}%", flush=True)


def main(argv: list[str]) -> None:
    if argv and argv[0] == "_child":
        child(*argv[1:])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("figure", choices=["backlog", "weights", "cost", "claims"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--backlog", type=int, default=100_000)
    parser.add_argument("--baseline", action="store_true",
                        help="backlog: also measure without groups")
    parser.add_argument("--starts", type=int, default=40_000)
    parser.add_argument("--jobs", type=int, default=30_000)
    parser.add_argument("--main-tree", default="")
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6391/1")
    parser.add_argument("--database-url",
                        default="postgres://postgres@127.0.0.1:5432/rj_fair_bench")
    parser.add_argument("--timeout", type=float, default=600.0)
    options = parser.parse_args(argv)
    if options.figure in ("cost", "claims") and not options.main_tree:
        parser.error(f"{options.figure} needs --main-tree")
    {"backlog": backlog, "weights": weights, "cost": cost,
     "claims": claims}[options.figure](Bench(options), options)


if __name__ == "__main__":
    main(sys.argv[1:])
