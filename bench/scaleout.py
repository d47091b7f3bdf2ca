"""Drain throughput with 1, 2 and 4 worker processes, on one Redis and on a cluster.

    python bench/scaleout.py --jobs 20000 --processes 1,2,4 --cluster

Each run enqueues N no-op jobs (mirror on, through ``enqueue_many``), then
times ``manage.py runworker --burst --processes P`` until it exits (burst
mode exits when everything is drained). With ``--cluster`` the same runs
happen on a 3-master Redis Cluster started on loopback ports, with the queue
split into 3 shards (one per master). Needs DATABASE_URL pointing at a
PostgreSQL database of its own (it is migrated and emptied).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

ENQUEUE = """
from django.tasks import task_backends
from testproject.demo.tasks import noop
from reliable_jobs.models import Job
Job.objects.all().delete()
backend = task_backends["default"]
for start in range(0, {n}, 10_000):
    backend.enqueue_many(noop, [((), {{}})] * min(10_000, {n} - start))
"""


def manage(*args: str, env: dict[str, str], timeout: float = 600) -> float:
    """Run a manage.py command; return how long it took in seconds."""
    started = time.perf_counter()
    subprocess.run([sys.executable, str(REPO / "manage.py"), *args], env=env, check=True,
                   timeout=timeout, cwd=REPO, stdout=subprocess.DEVNULL)
    return time.perf_counter() - started


def drain_rate(env: dict[str, str], *, jobs: int, processes: int) -> float:
    manage("shell", "-c", ENQUEUE.format(n=jobs), env=env)
    seconds = manage("runworker", "--burst", "--processes", str(processes), "--prefetch", "200",
                     "--concurrency", "1", "-v", "0", env=env)
    return jobs / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=20_000)
    parser.add_argument("--processes", default="1,2,4")
    parser.add_argument("--cluster", action="store_true")
    options = parser.parse_args()
    if "DATABASE_URL" not in os.environ:
        parser.error("set DATABASE_URL to a PostgreSQL database for the benchmark")
    counts = [int(p) for p in options.processes.split(",")]
    base = {**os.environ, "RJ_LOG_LEVEL": "WARNING"}
    manage("migrate", "-v", "0", env=base)

    rows: list[tuple[str, int, float]] = []
    single = {**base, "REDIS_URL": os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/12"),
              "RJ_OPTIONS": json.dumps({})}
    import redis

    for processes in counts:
        redis.Redis.from_url(single["REDIS_URL"]).flushdb()
        rows.append(("one Redis, 1 queue", processes,
                     drain_rate(single, jobs=options.jobs, processes=processes)))
    if options.cluster:
        from tests.redis_cluster import RedisClusterHarness

        harness = RedisClusterHarness(Path(tempfile.mkdtemp(prefix="rj-scaleout-")))
        harness.start()
        try:
            clustered = {**base, "REDIS_URL": harness.url,
                         "RJ_OPTIONS": json.dumps({"SHARDS": {"default": 3}})}
            for processes in counts:
                harness.client().flushall()
                rows.append(("3-master cluster, 3 shards", processes,
                             drain_rate(clustered, jobs=options.jobs, processes=processes)))
        finally:
            harness.stop()
    print(f"\n{options.jobs:,} no-op jobs, mirror on, runworker --burst --prefetch 200 "
          f"--concurrency 1 --processes P ({os.cpu_count()} cores)\n")
    print("| Redis | processes | drain jobs/s |\n|---|---:|---:|")
    for where, processes, rate in rows:
        print(f"| {where} | {processes} | {rate:,.0f} |")


if __name__ == "__main__":
    main()
