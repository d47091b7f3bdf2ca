#!/usr/bin/env python3
"""Checkpoint figure (issue 25): a long job SIGKILLed every few seconds redoes at most a checkpoint.

``python bench/checkpoint.py --items 1000000 --every 1000 --kill-every 10``
  enqueues one ``count_with_checkpoints`` job (testproject/demo/tasks.py:
  items 0 .. N-1, ``context.checkpoint({"next": i})`` every ``--every``
  items, one ledger line per item flushed to the OS, a pause of
  ``--pause-ms`` after each 100 items so the job outlasts several kills),
  starts a real ``manage.py runworker``, and SIGKILLs it every
  ``--kill-every`` seconds, starting a new one each time, until the job
  succeeds. From the ledger it prints the kills, the restarts that resumed
  the job, and the items done again at each restart (from the resumed
  checkpoint to the last item the killed attempt wrote): the acceptance
  figure is at most ``--every`` per kill.

Environment: DATABASE_URL (a database of its own, migrated here) and
REDIS_URL (a database index of its own: the keys under the bench prefix are
deleted before and after). Never point it at production.
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
QUEUE = "ckbench"
PREFIX = "rjckbench"
#: Short leases so a killed worker's job comes back within a couple of seconds.
OPTIONS: dict[str, Any] = {"LEASE_MS": 2_000, "RENEW_INTERVAL_MS": 500,
                           "SWEEP_INTERVAL_MS": 500, "RECONCILE_GRACE_MS": 2_000}


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update({"RJ_QUEUES": f"default,{QUEUE}", "RJ_PREFIX": PREFIX,
                "RJ_OPTIONS": json.dumps(OPTIONS), "PYTHONUNBUFFERED": "1",
                "RJ_LOG_LEVEL": "WARNING"})
    return env


def clean(broker: Any) -> None:
    for key in broker.client.scan_iter(match=f"{PREFIX}:*", count=1000):
        broker.client.delete(key)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--items", type=int, default=1_000_000)
    parser.add_argument("--every", type=int, default=1_000)
    parser.add_argument("--kill-every", type=float, default=10.0)
    parser.add_argument("--pause-ms", type=float, default=5.0,
                        help="sleep after each 100 items (%(default)r ms)")
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--logs", default="")
    args = parser.parse_args()

    os.environ.update(child_env())
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "testproject.settings")
    sys.path.insert(0, str(ROOT))
    import django

    django.setup()
    from django.core.management import call_command

    from reliable_jobs.compat import task_backends
    from reliable_jobs.models import Job
    from testproject.demo.tasks import count_with_checkpoints, redone_per_restart

    call_command("migrate", verbosity=0)
    backend = task_backends["default"]
    broker = backend.broker  # type: ignore[attr-defined]
    clean(broker)
    Job.objects.filter(queue=QUEUE).delete()
    logs = Path(args.logs or tempfile.mkdtemp(prefix="ckbench-"))
    ledger = logs / "ledger"
    ledger.unlink(missing_ok=True)
    result = count_with_checkpoints.using(queue_name=QUEUE).enqueue(
        args.items, args.every, str(ledger), pause_s=args.pause_ms / 1000)
    print(f"1 job of {args.items:,} items, a checkpoint every {args.every:,}, "
          f"a SIGKILL every {args.kill_every:g} s; logs in {logs}", flush=True)

    def start(n: int) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            [sys.executable, str(ROOT / "manage.py"), "runworker", "--queue", QUEUE],
            env=child_env(), cwd=ROOT, stdout=open(logs / f"w{n}.log", "wb"),
            stderr=subprocess.STDOUT)

    # A SIGTERM to this script still stops its worker (the finally below).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    began = time.monotonic()
    kills = 0
    worker = start(0)
    try:
        next_kill = time.monotonic() + args.kill_every
        while True:
            state = Job.objects.filter(pk=result.id).values_list("state", flat=True).first()
            if state in ("succeeded", "dead", "cancelled"):
                break
            if time.monotonic() - began > args.timeout:
                raise SystemExit(f"The job did not finish within {args.timeout:g} s.")
            if time.monotonic() >= next_kill:
                os.kill(worker.pid, signal.SIGKILL)
                worker.wait(timeout=30)
                kills += 1
                worker = start(kills)
                next_kill = time.monotonic() + args.kill_every
            time.sleep(0.1)
    finally:
        if worker.poll() is None:
            worker.send_signal(signal.SIGTERM)
            try:
                worker.wait(timeout=60)
            except subprocess.TimeoutExpired:
                worker.kill()
                worker.wait(timeout=10)
    took = time.monotonic() - began
    row = Job.objects.get(pk=result.id)
    redone, lines, items = redone_per_restart(str(ledger))
    complete = items == set(range(args.items))
    print(f"state {row.state}, attempts {row.attempts}, in {took:.1f} s; "
          f"every item done: {complete}", flush=True)
    print(f"kills: {kills}; restarts that resumed the job: {len(redone)}; items redone per "
          f"restart: max {max(redone, default=0):,}, mean "
          f"{sum(redone) / max(len(redone), 1):,.0f}, total {sum(redone):,} "
          f"({lines - args.items:,} extra ledger lines)", flush=True)
    clean(broker)
    if row.state != "succeeded" or not complete or max(redone, default=0) > args.every:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
