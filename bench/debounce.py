#!/usr/bin/env python3
"""Debounce and throttle figures (issue 24): real ``runworker`` processes, real calls.

``python bench/debounce.py debounce --calls 1000 --seconds 10``
  makes ``--calls`` equal calls of ``demo.tasks.debounced_note`` (debounce_ms
  2 s) spread evenly over ``--seconds`` from ``--producers`` threads, each
  call with the next number, while
  ``--processes`` workers run; then waits and prints how many runs there
  were, with which arguments, and how long after the last call (acceptance:
  exactly 1 run, the last call's arguments, 2.0 +/- 0.1 s).

``python bench/debounce.py throttle --seconds 60``
  calls ``demo.tasks.throttled_note`` (debounce_ms 2 s, max_wait_ms 5 s)
  every ``--interval-ms`` for ``--seconds``; prints the runs and the gaps
  between their starts (acceptance: 12 +/- 1 runs over 60 s).

Both take ``--sweep-interval-ms`` (the workers' SWEEP_INTERVAL_MS, default
1000, as in production): a worker sweeps again when the next scheduled job
is due, so the interval matters only for a debounce shorter than it.
Environment: DATABASE_URL (a database of its own, migrated here) and
REDIS_URL (a database index of its own: the keys under the bench prefix
are deleted before and after). Never point it at production.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
QUEUE = "debouncebench"
PREFIX = "rjdebouncebench"


def child_env(options: dict[str, Any]) -> dict[str, str]:
    env = dict(os.environ)
    env.update({"RJ_QUEUES": f"default,{QUEUE}", "RJ_PREFIX": PREFIX,
                "RJ_OPTIONS": json.dumps(options), "PYTHONUNBUFFERED": "1",
                "RJ_LOG_LEVEL": "WARNING"})
    return env


def setup(options: dict[str, Any]) -> Any:
    os.environ.update(child_env(options))
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "testproject.settings")
    sys.path.insert(0, str(ROOT))
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)
    from reliable_jobs.compat import task_backends

    return task_backends["default"]


def clean(backend: Any) -> None:
    from reliable_jobs.models import Job

    client = backend.broker.client
    for key in client.scan_iter(match=f"{PREFIX}:*", count=1_000):
        client.delete(key)
    Job.objects.filter(queue=QUEUE).delete()


class Workers:
    """``--processes`` runworker processes on the bench queue, always stopped."""

    def __init__(self, count: int, options: dict[str, Any]) -> None:
        logs = Path(tempfile.mkdtemp(prefix="debouncebench-"))
        self.procs = [subprocess.Popen(
            [sys.executable, str(ROOT / "manage.py"), "runworker", "--queue", QUEUE],
            env=child_env(options), cwd=ROOT, stdout=open(logs / f"w{i}.log", "wb"),  # noqa: SIM115
            stderr=subprocess.STDOUT) for i in range(count)]
        print(f"{count} worker(s), logs in {logs}", flush=True)

    def wait_ready(self, backend: Any) -> None:
        """Until a plain job on the queue ran: the workers are up."""
        from reliable_jobs.models import Job, JobState
        from testproject.demo.tasks import noop

        probe = noop.using(queue_name=QUEUE).enqueue()
        deadline = time.monotonic() + 120
        while not Job.objects.filter(pk=probe.id, state=JobState.SUCCEEDED).exists():
            if time.monotonic() > deadline:
                raise SystemExit("No worker ran a job within 120 s: see their logs.")
            time.sleep(0.1)
        Job.objects.filter(pk=probe.id).delete()

    def stop(self) -> None:
        for proc in self.procs:
            proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            proc.wait(timeout=90)


def call_evenly(task: Any, calls: int, seconds: float, producers: int = 1) -> tuple[float, int]:
    """Make ``calls`` calls ``task("bench", n)`` spread over ``seconds`` from ``producers``
    threads (call n from thread n % producers, each with its own database connection).

    Returns when the call that returned last returned, and its n: the
    enqueues of equal calls are serialized on the job's row lock, so the
    last to return is the last one Redis took.
    """
    from django.db import connection

    start = time.time()
    returned: list[tuple[float, int]] = []
    lock = threading.Lock()

    def produce(first: int) -> None:
        try:
            for n in range(first, calls, producers):
                pause = start + n * seconds / calls - time.time()
                if pause > 0:
                    time.sleep(pause)
                task.enqueue("bench", n)
                with lock:
                    returned.append((time.time(), n))
        finally:
            connection.close()

    threads = [threading.Thread(target=produce, args=(i,)) for i in range(producers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(returned) == calls, "a producer failed"
    return max(returned)


def runs() -> list[Any]:
    from reliable_jobs.models import Job

    return list(Job.objects.filter(queue=QUEUE).exclude(task_path__endswith=".noop")
                .order_by("started_at"))


def debounce(args: argparse.Namespace) -> None:
    options = {"SWEEP_INTERVAL_MS": args.sweep_interval_ms}
    backend = setup(options)
    from testproject.demo.tasks import debounced_note

    clean(backend)
    workers = Workers(args.processes, options)
    try:
        workers.wait_ready(backend)
        task = debounced_note.using(queue_name=QUEUE)
        began = time.time()
        last_at, last_n = call_evenly(task, args.calls, args.seconds, args.producers)
        print(f"{args.calls:,} calls in {last_at - began:.2f} s (last n={last_n})", flush=True)
        time.sleep(2.0 + 3.0)
    finally:
        workers.stop()
    done = runs()
    for job in done:
        delay = (job.started_at.timestamp() - last_at) if job.started_at else float("nan")
        print(f"run {job.pk}: state {job.state}, args {job.args}, started {delay:.3f} s after "
              "the last call")
    ran = [job for job in done if job.started_at is not None]
    ok = (len(done) == 1 and len(ran) == 1 and ran[0].args == ["bench", last_n]
          and abs(ran[0].started_at.timestamp() - last_at - 2.0) <= 0.1)
    print(f"RESULT debounce: {len(done)} job(s), {len(ran)} run(s); "
          f"{'PASS' if ok else 'FAIL'} (1 run, args of the last call, 2.0 +/- 0.1 s)")
    clean(backend)


def throttle(args: argparse.Namespace) -> None:
    options = {"SWEEP_INTERVAL_MS": args.sweep_interval_ms}
    backend = setup(options)
    from testproject.demo.tasks import throttled_note

    clean(backend)
    workers = Workers(args.processes, options)
    try:
        workers.wait_ready(backend)
        task = throttled_note.using(queue_name=QUEUE)
        calls = int(args.seconds * 1000 / args.interval_ms)
        began = time.time()
        last_at, _ = call_evenly(task, calls, args.seconds, args.producers)
        print(f"{calls:,} calls in {last_at - began:.2f} s", flush=True)
        time.sleep(2.0 + 5.0)
    finally:
        workers.stop()
    done = runs()
    starts = [job.started_at.timestamp() for job in done if job.started_at is not None]
    within = [t for t in starts if t <= last_at]
    gaps = [round(b - a, 3) for a, b in itertools.pairwise(starts)]
    print(f"runs started while calls came: {len(within)}; after the last call: "
          f"{len(starts) - len(within)}; gaps between starts (s): {gaps}")
    print(f"first run {starts[0] - began:.3f} s after the first call" if starts else "no run")
    ok = abs(len(starts) - args.seconds / 5.0) <= 1
    print(f"RESULT throttle: {len(starts)} runs from {args.seconds:g} s of calls ("
          f"{len(within)} while they came); {'PASS' if ok else 'FAIL'} "
          f"({args.seconds / 5.0:g} +/- 1)")
    clean(backend)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    one = sub.add_parser("debounce")
    one.add_argument("--calls", type=int, default=1_000)
    one.add_argument("--seconds", type=float, default=10.0)
    two = sub.add_parser("throttle")
    two.add_argument("--seconds", type=float, default=60.0)
    two.add_argument("--interval-ms", type=float, default=50.0)
    for each in (one, two):
        each.add_argument("--processes", type=int, default=2)
        each.add_argument("--sweep-interval-ms", type=int, default=1_000)
        each.add_argument("--producers", type=int, default=4)
    args = parser.parse_args()
    {"debounce": debounce, "throttle": throttle}[args.command](args)


if __name__ == "__main__":
    main()
