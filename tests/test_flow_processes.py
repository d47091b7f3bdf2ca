"""Concurrency caps with real worker processes, SIGKILLs included, read from the execution ledger.

The ledger (contrib/verify/chaos_ledger.py) is written by the task itself
into plain files the queue never touches, so it witnesses what ran when,
whatever the queue's own records say. A run whose process was SIGKILLed
has no end line: it ran until the kill.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from redis.crc import key_slot

from reliable_jobs.broker import Broker, NewJob
from reliable_jobs.compat import task_backends
from reliable_jobs.contrib.verify.chaos_ledger import LEDGER_ENV, Run, read_ledger
from reliable_jobs.contrib.verify.chaos_ledger import most_at_once as ledger_most_at_once
from reliable_jobs.contrib.verify.tasks import FLOW_CAP, chaos_job, flow_capped_job
from reliable_jobs.keys import QueueKeys
from reliable_jobs.models import Job, JobState
from tests.conftest import FAST_OPTIONS

from .helpers import Processes, wait_until
from .redis_cluster import RedisClusterHarness
from .test_chaos_run import table_value

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]


def most_at_once(runs: list[Run], deaths: dict[int, float]) -> int:
    """The most runs alive at one moment; a run without an end lived until its process died."""
    return ledger_most_at_once([(run.start, run.end if run.end is not None
                                 else deaths[run.pid]) for run in runs])


def all_succeeded(count: int) -> bool:
    return Job.objects.filter(state=JobState.SUCCEEDED).count() == count


@pytest.mark.parametrize("scope", ["queue", "task"])
def test_a_cap_of_5_across_4_processes_never_runs_a_6th_even_under_sigkills(
        rj_settings: Any, processes: Processes, tmp_path: Path, scope: str) -> None:
    # Given a cap of 5 (the queue's own, or the task's), 40 short jobs, and
    # 4 worker processes with 8 threads each
    options = {"QUEUE_LIMITS": {"default": {"concurrency": FLOW_CAP}}} if scope == "queue" else {}
    env = rj_settings(**options)
    ledger = tmp_path / "ledger"
    ledger.mkdir()
    job = chaos_job if scope == "queue" else flow_capped_job
    task_backends["default"].enqueue_many(job, [((0.3,), {}) for _ in range(40)])
    workers = [processes.worker(env, "--concurrency", "8", extra_env={LEDGER_ENV: str(ledger)})
               for _ in range(4)]
    deaths: dict[int, float] = {}

    # When two of them are SIGKILLed while they run jobs, and replaced
    for victim in workers[:2]:
        wait_until(lambda: len(read_ledger(ledger).runs) >= 5 + 5 * len(deaths), timeout=60,
                   message="jobs to run")
        victim.send_signal(signal.SIGKILL)
        deaths[victim.pid] = time.time()
        victim.wait(timeout=10)
        workers.append(processes.worker(env, "--concurrency", "8",
                                        extra_env={LEDGER_ENV: str(ledger)}))
    wait_until(lambda: all_succeeded(40), timeout=120, message="every job to succeed")

    # Then the ledger never shows a 6th run at once, and the cap was used
    runs = read_ledger(ledger).runs
    assert most_at_once(runs, deaths) == FLOW_CAP
    processes.stop_many(*[w for w in workers if w.poll() is None])


def test_a_killed_workers_slots_are_free_within_lease_and_sweep_interval(
        rj_settings: Any, processes: Processes, tmp_path: Path) -> None:
    # Given one worker holding all 5 slots of a capped task, a sixth job
    # waiting, and a second worker up and idle (its claims held by the cap)
    env = rj_settings()
    ledger = tmp_path / "ledger"
    ledger.mkdir()
    task_backends["default"].enqueue_many(flow_capped_job, [((2.0,), {})] * (FLOW_CAP + 1))
    holder = processes.worker(env, "--concurrency", "8", extra_env={LEDGER_ENV: str(ledger)})
    wait_until(lambda: len(read_ledger(ledger).runs) == FLOW_CAP, timeout=60,
               message="the first worker to fill the cap")
    waiter = processes.worker(env, "--concurrency", "8", extra_env={LEDGER_ENV: str(ledger)})
    wait_until(lambda: " serving " in processes.log(waiter), timeout=60,
               message="the second worker to serve")

    # When the holder is SIGKILLed
    holder.send_signal(signal.SIGKILL)
    killed_at = time.time()
    holder.wait(timeout=10)

    # Then the waiter starts a job once the leases expired and a sweep ran:
    # within LEASE_MS + SWEEP_INTERVAL_MS (plus a claim and a thread start)
    first = wait_until(lambda: [r for r in read_ledger(ledger).runs if r.pid == waiter.pid],
                       timeout=30, message="the waiter to start a job")
    delay_ms = (min(r.start for r in first) - killed_at) * 1000
    bound_ms = FAST_OPTIONS["LEASE_MS"] + FAST_OPTIONS["SWEEP_INTERVAL_MS"]
    print(f"slots free {delay_ms:.0f} ms after the SIGKILL (bound {bound_ms} ms)")
    assert delay_ms <= bound_ms + 250
    wait_until(lambda: all_succeeded(FLOW_CAP + 1), timeout=60, message="every job to succeed")
    assert most_at_once(read_ledger(ledger).runs, {holder.pid: killed_at}) == FLOW_CAP
    processes.stop(waiter)


# -- Redis Cluster ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisClusterHarness]:
    harness = RedisClusterHarness(tmp_path_factory.mktemp("cluster"), masters=3)
    harness.start()
    try:
        yield harness
    finally:
        harness.stop()


def test_on_a_cluster_limits_are_global_per_queue_and_never_shared_between_queues(
        cluster: RedisClusterHarness) -> None:
    # Given two queues on different masters, and two brokers (two workers' connections)
    cluster.client().flushall()
    queues = ["default", "emails"]
    assert cluster.master_port_of(QueueKeys("rj", "default").queued) != cluster.master_port_of(
        QueueKeys("rj", "emails").queued)
    one, two = Broker(cluster.url, "rj"), Broker(cluster.url, "rj")
    try:
        # Every flow key of a queue, a per-key limit's included, is in the queue's slot
        for queue in queues:
            k = QueueKeys("rj", queue)
            wire = "c:app.tasks.send#0123456789abcdef"
            keys = [k.queued, k.leases, k.holds, k.flow("log", "q"), k.flow("tat", wire),
                    k.flow("run", wire), k.flow("held", wire), k.flow("log", wire)]
            assert len({key_slot(key.encode()) for key in keys}) == 1

        # When each queue gets 6 jobs, each capped by one task limit (cap 2), and
        # both workers claim from both queues with a queue cap of 3 as well
        spec = "c/2/0/app.tasks.send"
        text = '{"flow":"' + spec + '","task":"app.tasks.send","args":[],"kwargs":{}}'
        for queue in queues:
            one.enqueue(queue, [NewJob(f"{queue}-{i}", text, 3) for i in range(6)])
        running: dict[str, list[str]] = {q: [] for q in queues}
        for broker in (one, two, one, two):
            for queue in queues:
                result = broker.claim(queue, count=5, lease_ms=60_000, limits=(0, 0, 3))
                running[queue] += [j.id for j in result.jobs]

        # Then the task's cap holds across both workers on each queue (2 each),
        # and each queue enforces it alone: 2 run on each, 4 in all
        assert {q: len(ids) for q, ids in running.items()} == {"default": 2, "emails": 2}
        assert one.counts("default").held == 4 and two.counts("emails").held == 4

        # And the queue's own cap (3) counts every job of the queue, from either worker
        plain = '{"task":"app.tasks.other","args":[],"kwargs":{}}'
        one.enqueue("default", [NewJob(f"plain-{i}", plain, 3) for i in range(5)])
        got = [j.id for b in (two, one) for j in
               b.claim("default", count=5, lease_ms=60_000, limits=(0, 0, 3)).jobs]
        assert got == ["plain-0"]
    finally:
        one.close()
        two.close()


def test_the_chaos_run_under_a_cap_never_runs_more_than_the_cap(
        rj_settings: Any, processes: Processes) -> None:
    # Given the chaos run's job under a cap of 5 (flow_capped_job), 4 workers
    # with 8 threads, one SIGKILLed every 1.5 s, planned failures and give-ups
    env = rj_settings()
    chaos = processes.manage(
        "chaosjobs", "--task", "reliable_jobs.contrib.verify.tasks.flow_capped_job",
        "--jobs", "200", "--workers", "4", "--concurrency", "8", "--kill-every", "1.5",
        "--duration", "6", "--task-ms", "100", "--drain-timeout", "90", "--fail-percent", "5",
        "--give-up-percent", "2", "--seed", "11", env=env)
    code = chaos.wait(timeout=180)
    output = processes.log(chaos)

    # Then nothing is lost, the ledger is clean, workers were killed mid-job,
    # and never more than 5 ran at once
    assert code == 0, output
    assert table_value(output, "lost (must be 0)") == "0"
    assert table_value(output, "ran concurrently (must be 0)") == "0", output
    assert int(table_value(output, "workers killed (SIGKILL)")) >= 2
    assert table_value(output, "most runs at once (a concurrency cap bounds it)") == str(
        FLOW_CAP), output
