#!/usr/bin/env python3
"""Flow control figures (issue 24): a global rate limit held across processes, and its cost.

``python bench/flow.py rate --seconds 60 --processes 4 --threads 8 --rate 100/s``
  enqueues more no-op jobs than the limit lets through, starts N ``runworker``
  processes on one queue limited by ``OPTIONS["QUEUE_LIMITS"]``, and records
  every claim two ways: the claim script's own sliding log, polled every
  200 ms (server clock, ``TIME``), and the mirror's attempt rows
  (``started_at``, the workers' clock, after the claim: an independent
  witness). It prints the mean rate over the measured span and the busiest
  sliding 1-window on each clock.

``python bench/flow.py claimcost --jobs 50000 --runs 5``
  the claim script's CPU on a private redis-server per claimed job (Redis's
  own ``commandstats``), batches of 100 from a queue without limits, this
  tree against ``main``: less noisy than a drain on a shared machine.

``python bench/flow.py drain --jobs 20000 --runs 3``
  the drain of a queue with no limits, this tree against ``main``
  interleaved (``manage.py benchjobs`` from each, one after the other), so a
  limit-free queue is shown to pay nothing measurable for flow control.

Environment: DATABASE_URL (a database of its own, migrated here) and
REDIS_URL (a database index of its own: the keys under the bench prefix are
deleted before and after). Never point it at production.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
QUEUE = "flowbench"
PREFIX = "rjflowbench"


def child_env(options: dict[str, Any]) -> dict[str, str]:
    env = dict(os.environ)
    env.update({"RJ_QUEUES": f"default,{QUEUE}", "RJ_PREFIX": PREFIX,
                "RJ_OPTIONS": json.dumps(options), "PYTHONUNBUFFERED": "1",
                "RJ_LOG_LEVEL": "WARNING"})
    return env


def busiest(times_ms: list[float], window_ms: float) -> int:
    """The most claims in any half-open window [t, t + window_ms) starting at a claim."""
    times_ms = sorted(times_ms)
    most, j = 0, 0
    for i, start in enumerate(times_ms):
        j = max(j, i)
        while j < len(times_ms) and times_ms[j] < start + window_ms:
            j += 1
        most = max(most, j - i)
    return most


def rate(args: argparse.Namespace) -> None:
    options = {"QUEUE_LIMITS": {QUEUE: {"rate_limit": args.rate}}}
    os.environ.update(child_env(options))
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "testproject.settings")
    sys.path.insert(0, str(ROOT))
    import django

    django.setup()
    from reliable_jobs.compat import task_backends
    from reliable_jobs.flow import parse_rate
    from reliable_jobs.models import Attempt, Job
    from testproject.demo.tasks import noop

    limit = parse_rate(args.rate)
    backend = task_backends["default"]
    broker = backend.broker  # type: ignore[attr-defined]
    clean(broker)
    Job.objects.filter(queue=QUEUE).delete()
    total = int(limit.per_second * (args.seconds + args.warmup + 10))
    task = noop.using(queue_name=QUEUE)
    for start in range(0, total, 5_000):
        backend.enqueue_many(task, [((), {})] * min(5_000, total - start))  # type: ignore[attr-defined]
    print(f"{total:,} jobs queued; {args.processes} processes x {args.threads} threads, "
          f"limit {args.rate} ({limit})", flush=True)

    log_key = broker.keys(QUEUE).flow("log", "q")
    seen: dict[str, float] = {}
    stop = threading.Event()

    def poll() -> None:
        while not stop.is_set():
            for member, score in broker.client.zrange(log_key, 0, -1, withscores=True):
                seen[member] = score
            stop.wait(0.2)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    env = child_env(options)
    logs = args.logs or tempfile.mkdtemp(prefix="flowbench-")
    if True:
        procs = [subprocess.Popen(
            [sys.executable, str(ROOT / "manage.py"), "runworker", "--concurrency",
             str(args.threads), "--queue", QUEUE],
            env=env, cwd=ROOT, stdout=open(Path(logs) / f"w{i}.log", "wb"),  # noqa: SIM115
            stderr=subprocess.STDOUT) for i in range(args.processes)]
        try:
            deadline = time.monotonic() + 120
            while not seen and time.monotonic() < deadline:
                time.sleep(0.05)
            if not seen:
                raise SystemExit("No claim within 120 s: see the workers' logs.")
            time.sleep(args.warmup + args.seconds + 1.5)
        finally:
            for proc in procs:
                proc.send_signal(signal.SIGTERM)
            for proc in procs:
                proc.wait(timeout=90)
            stop.set()
            poller.join()
    server = sorted(seen.values())
    t0 = server[0] + args.warmup * 1000
    span = [t for t in server if t0 <= t < t0 + args.seconds * 1000]
    starts = sorted(a.started_at.timestamp() * 1000 for a in Attempt.objects.filter(
        job__queue=QUEUE).only("started_at") if a.started_at is not None)
    w0 = starts[0] + args.warmup * 1000 if starts else 0
    started_span = [t for t in starts if w0 <= t < w0 + args.seconds * 1000]
    window = limit.window_ms
    print(f"server clock (claim log): {len(span) / args.seconds:.2f}/s over {args.seconds} s "
          f"after {args.warmup} s warm-up ({len(span):,} claims); busiest {window} ms window "
          f"{busiest(span, window)} (whole run: {busiest(server, window)}); target "
          f"{limit.per_second:g}/s")
    print(f"workers' clock (attempt starts): {len(started_span) / args.seconds:.2f}/s; busiest "
          f"{window} ms window {busiest(started_span, window)} (whole run: "
          f"{busiest(starts, window)})")
    if args.histogram:
        for name, times in (("server", server), ("workers", starts)):
            buckets: dict[int, int] = {}
            for t in times:
                buckets[int(t // 100)] = buckets.get(int(t // 100), 0) + 1
            first = min(buckets)
            print(name, [buckets.get(b, 0) for b in range(first, first + 60)])
    clean(broker)
    Job.objects.filter(queue=QUEUE).delete()


def clean(broker: Any) -> None:
    for key in broker.client.scan_iter(match=f"{PREFIX}:*", count=1_000):
        broker.client.delete(key)


def drain(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as snapshot:
        # main as committed, unpacked (not checked out: its branch belongs to the lead).
        subprocess.run(f"git -C {ROOT} archive {args.ref} | tar -x -C {snapshot}",
                       shell=True, check=True)
        trees = {args.ref: Path(snapshot), "this tree": ROOT}
        rates: dict[str, list[float]] = {name: [] for name in trees}
        cpu: dict[str, list[float]] = {name: [] for name in trees}
        env = child_env({})
        for run in range(args.runs):
            for name, tree in (trees.items() if run % 2 == 0 else reversed(trees.items())):
                out = subprocess.run(
                    [sys.executable, str(tree / "manage.py"), "benchjobs", "--jobs",
                     str(args.jobs), "--runs", "1", "--singles", "0", "--latency-samples", "0",
                     "--lengths", "", "--ack-depths", "", "--many-queues", "0",
                     "--queue", QUEUE],
                    env={**env, "PYTHONPATH": str(tree)}, cwd=tree, capture_output=True,
                    text=True, check=True, timeout=1_800).stdout
                found = re.search(r"^drain \(1 process\)\s+([\d,]+) jobs/s", out, re.MULTILINE)
                used = re.search(r"^drain CPU µs/job\s+([\d,]+)", out, re.MULTILINE)
                assert found and used, out
                rates[name].append(float(found[1].replace(",", "")))
                cpu[name].append(float(used[1].replace(",", "")))
                print(f"run {run + 1} {name}: {rates[name][-1]:,.0f} jobs/s, "
                      f"{cpu[name][-1]:.0f} µs CPU/job", flush=True)
    base, ours = (statistics.median(rates[n]) for n in trees)
    base_cpu, our_cpu = (statistics.median(cpu[n]) for n in trees)
    print(f"median drain, {args.jobs:,} jobs, {args.runs} runs each, interleaved: {args.ref} "
          f"{base:,.0f}/s, this tree {ours:,.0f}/s ({ours / base - 1:+.1%}); worker CPU per "
          f"job {base_cpu:.0f} µs vs {our_cpu:.0f} µs ({our_cpu / base_cpu - 1:+.1%})")


#: Run in a child whose sys.path starts with one tree: claim N jobs in batches of 100 on a
#: private server, print the server's CPU per claimed job for the claim script (commandstats).
CLAIM_COST = """
import sys
from reliable_jobs.broker import Broker, NewJob
url, jobs = sys.argv[1], int(sys.argv[2])
b = Broker(url, "cost")
b.client.flushdb()
payload = '{"task":"myapp.tasks.noop","args":[],"kwargs":{}}'
for start in range(0, jobs, 1000):
    b.enqueue("q", [NewJob(f"j{i}", payload, 3) for i in range(start, min(start + 1000, jobs))])
b.client.config_resetstat()
claimed = 0
while True:
    got = len(b.claim("q", count=100, lease_ms=60_000).jobs)
    if not got:
        break
    claimed += got
stats = b.client.info("commandstats")
usec = sum(v["usec"] for k, v in stats.items() if k.startswith("cmdstat_evalsha"))
print(usec / claimed)
"""


def claim_cost(args: argparse.Namespace) -> None:
    """The claim script's CPU on the Redis server per job, this tree against main."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1",
                               "--save", "", "--appendonly", "no"], stdout=subprocess.DEVNULL)
    try:
        time.sleep(0.5)
        with tempfile.TemporaryDirectory() as snapshot:
            subprocess.run(f"git -C {ROOT} archive {args.ref} | tar -x -C {snapshot}",
                           shell=True, check=True)
            trees = {args.ref: Path(snapshot), "this tree": ROOT}
            cost: dict[str, list[float]] = {name: [] for name in trees}
            for run in range(args.runs):
                for name, tree in (trees.items() if run % 2 == 0
                                   else reversed(trees.items())):
                    out = subprocess.run(
                        [sys.executable, "-c", CLAIM_COST, f"redis://127.0.0.1:{port}/0",
                         str(args.jobs)], env={**os.environ, "PYTHONPATH": str(tree)},
                        cwd=tree, capture_output=True, text=True, check=True).stdout
                    cost[name].append(float(out.strip()))
                    print(f"run {run + 1} {name}: {cost[name][-1]:.2f} µs per claimed job",
                          flush=True)
        base, ours = (statistics.median(cost[n]) for n in trees)
        print(f"claim script CPU on Redis per job (batches of 100, {args.jobs:,} jobs, median "
              f"of {args.runs}): {args.ref} {base:.2f} µs, this tree {ours:.2f} µs "
              f"({ours / base - 1:+.1%})")
    finally:
        server.terminate()
        server.wait(timeout=10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    one = sub.add_parser("rate", help="a global rate limit across worker processes")
    one.add_argument("--rate", default="100/s")
    one.add_argument("--seconds", type=int, default=60)
    one.add_argument("--warmup", type=int, default=2)
    one.add_argument("--processes", type=int, default=4)
    one.add_argument("--threads", type=int, default=8)
    one.add_argument("--logs", default=None, help="folder for the workers' logs (default: a "
                     "new temporary folder)")
    one.add_argument("--histogram", action="store_true",
                     help="print claims per 100 ms for the first 6 s on each clock")
    two = sub.add_parser("drain", help="a queue without limits, against main, interleaved")
    two.add_argument("--jobs", type=int, default=20_000)
    two.add_argument("--runs", type=int, default=3)
    two.add_argument("--ref", default="main")
    three = sub.add_parser("claimcost", help="the claim script's Redis CPU per job, against "
                           "main, on a private redis-server")
    three.add_argument("--jobs", type=int, default=50_000)
    three.add_argument("--runs", type=int, default=5)
    three.add_argument("--ref", default="main")
    args = parser.parse_args()
    {"rate": rate, "drain": drain, "claimcost": claim_cost}[args.command](args)


if __name__ == "__main__":
    main()
