#!/usr/bin/env python3
"""Pause figure (issue 24): how late after a pause returns can an attempt still start?

``python bench/pause.py --pauses 100 --flushes 10 --processes 2 --threads 4``
  keeps a queue busy with short jobs (``contrib.verify``'s ``chaos_job``,
  which writes every run to the execution ledger, outside the queue), runs
  real ``manage.py runworker`` processes on it, then ``--pauses`` times:
  pause the queue through the backend, note when the call returned, watch
  ``--watch-ms``, read from the ledger every run that started after the
  return, resume, and wait until runs start again. ``--flushes`` of those
  pauses also empty the Redis database (FLUSHDB) right after the pause and
  run reconcile once the rows are past RECONCILE_GRACE_MS (the sweep puts
  the pause back from the database before reconcile pushes any lost job),
  watching through all of it. Prints per pause the latest start after the
  return (0 when none), then p50, p99 and the worst, in ms, with and
  without the flushes.

Environment: DATABASE_URL (a database of its own, migrated here) and
REDIS_URL naming a database index of its own: FLUSHDB empties that whole
index, so the script refuses one that holds keys outside its prefix.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
QUEUE = "pausebench"
PREFIX = "rjpausebench"
#: Short leases and grace, so a flush is reconciled within seconds.
OPTIONS = {"LEASE_MS": 2_000, "RENEW_INTERVAL_MS": 500, "SWEEP_INTERVAL_MS": 500,
           "RECONCILE_GRACE_MS": 2_000}


def child_env(ledger: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update({"RJ_QUEUES": f"default,{QUEUE}", "RJ_PREFIX": PREFIX,
                "RJ_OPTIONS": json.dumps(OPTIONS), "PYTHONUNBUFFERED": "1",
                "RJ_LOG_LEVEL": "WARNING", "RJ_CHAOS_LEDGER": ledger})
    return env


def percentile(values: list[float], share: float) -> float:
    """The nearest-rank percentile (p99 of 100 values is the 99th smallest)."""
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * share // 1))
    return ordered[int(rank) - 1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pauses", type=int, default=100)
    parser.add_argument("--flushes", type=int, default=10,
                        help="How many of the pauses also FLUSHDB and reconcile.")
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--job-ms", type=float, default=20.0, help="How long each job sleeps.")
    parser.add_argument("--watch-ms", type=float, default=300.0,
                        help="How long after each pause to look for late starts.")
    args = parser.parse_args()

    # A SIGTERM ends the run through its finally (the workers are stopped).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    ledger = tempfile.mkdtemp(prefix="pausebench-ledger-")
    os.environ.update(child_env(ledger))
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "testproject.settings")
    sys.path.insert(0, str(ROOT))
    import django

    django.setup()
    from django.core.management import call_command

    from reliable_jobs import pausing
    from reliable_jobs.compat import task_backends
    from reliable_jobs.contrib.verify.chaos_ledger import read_ledger
    from reliable_jobs.contrib.verify.tasks import chaos_job
    from reliable_jobs.models import Job, QueuePause
    from reliable_jobs.sweep import Sweep

    call_command("migrate", verbosity=0)
    backend: Any = task_backends["default"]
    client = backend.broker.client
    strangers = [k for k in client.scan_iter(count=1_000) if not k.startswith(f"{PREFIX}:")]
    if strangers:
        raise SystemExit(f"REDIS_URL's database holds keys this script did not write (e.g. "
                         f"{strangers[0]!r}): give it an index of its own (it runs FLUSHDB).")
    client.flushdb()
    Job.objects.filter(queue=QUEUE).delete()
    QueuePause.objects.filter(queue=QUEUE).delete()
    task = chaos_job.using(queue_name=QUEUE)
    seconds = args.job_ms / 1000

    def top_up() -> None:
        if backend.broker.counts(QUEUE).queued < 2_000:
            backend.enqueue_many(task, [((seconds,), {})] * 4_000)

    top_up()
    logs = Path(tempfile.mkdtemp(prefix="pausebench-logs-"))
    procs = [subprocess.Popen(
        [sys.executable, str(ROOT / "manage.py"), "runworker", "--concurrency",
         str(args.threads), "--queue", QUEUE],
        env=child_env(ledger), cwd=ROOT, stdout=open(logs / f"w{i}.log", "wb"),  # noqa: SIM115
        stderr=subprocess.STDOUT, start_new_session=True) for i in range(args.processes)]

    def starts() -> list[float]:
        return [run.start for run in read_ledger(Path(ledger)).runs]

    def wait_for_runs_after(moment: float, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not any(t > moment for t in starts()):
            if time.monotonic() > deadline:
                raise SystemExit(f"No run started within {timeout_s} s: see {logs}.")
            time.sleep(0.02)

    plain: list[float] = []
    flushed: list[float] = []
    flush_every = max(1, args.pauses // args.flushes) if args.flushes else 0
    try:
        wait_for_runs_after(0.0, timeout_s=120.0)
        for n in range(args.pauses):
            top_up()
            time.sleep(0.1)  # runs are flowing again
            flush = bool(flush_every) and n % flush_every == flush_every - 1 \
                and len(flushed) < args.flushes
            pausing.pause_queue(QUEUE, by="bench/pause.py")
            returned = time.time()
            if flush:
                client.flushdb()  # the bench's own index only: checked above
                time.sleep(OPTIONS["RECONCILE_GRACE_MS"] / 1000 + 0.2)
                report = Sweep(backend.parts).reconcile()
                assert report.repaused or backend.broker.paused_since([QUEUE]), report
            time.sleep(args.watch_ms / 1000)
            late = [t - returned for t in starts() if t > returned]
            worst_ms = max(late, default=0.0) * 1000
            (flushed if flush else plain).append(worst_ms)
            print(f"pause {n + 1:3d}{' (FLUSHDB + reconcile)' if flush else ''}: latest start "
                  f"{worst_ms:.1f} ms after the pause returned ({len(late)} late)", flush=True)
            pausing.resume_queue(QUEUE)
            wait_for_runs_after(time.time())
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        client.flushdb()
        QueuePause.objects.filter(queue=QUEUE).delete()
        Job.objects.filter(queue=QUEUE).delete()

    every = plain + flushed
    print(f"{len(every)} pauses ({len(flushed)} with FLUSHDB + reconcile), "
          f"{args.processes} runworker processes x {args.threads} threads, jobs of "
          f"{args.job_ms:g} ms: latest attempt start after the pause returned, p50 "
          f"{percentile(every, 0.5):.1f} ms, p99 {percentile(every, 0.99):.1f} ms, worst "
          f"{max(every):.1f} ms; with FLUSHDB + reconcile worst "
          f"{max(flushed, default=0.0):.1f} ms; starts more than 100 ms late: "
          f"{sum(v > 100 for v in every)}")


if __name__ == "__main__":
    main()
