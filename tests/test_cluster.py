"""Redis Cluster: a real 3-master cluster on loopback, the core paths and crashes on it.

Every key of a queue carries its ``{queue}`` hash tag, so each script runs in
one slot; queues here are chosen to live on different masters.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import redis
from django.db import transaction
from django.utils import timezone
from redis.crc import key_slot

from reliable_jobs.broker import Broker, NewJob
from reliable_jobs.compat import task_backends
from reliable_jobs.keys import QueueKeys
from reliable_jobs.models import Job, JobState
from reliable_jobs.sweep import Sweep
from testproject.demo import tasks as demo

from .helpers import Processes, queued_by_priority, wait_until
from .redis_cluster import RedisClusterHarness

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]
QUEUES = ["default", "emails"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisClusterHarness]:
    harness = RedisClusterHarness(tmp_path_factory.mktemp("cluster"), masters=3)
    harness.start()
    try:
        yield harness
    finally:
        harness.stop()


@pytest.fixture
def cluster_env(cluster: RedisClusterHarness, rj_settings: Any) -> dict[str, str]:
    """Backend settings pointing at the cluster, emptied before the test."""
    cluster.client().flushall()
    return rj_settings(REDIS_URL=cluster.url, queues=QUEUES)


def finished(ids: list[str]) -> bool:
    return Job.objects.filter(pk__in=ids, state__in=[JobState.SUCCEEDED, JobState.DEAD]
                              ).count() == len(ids)


def test_the_two_queues_live_on_different_masters(cluster: RedisClusterHarness) -> None:
    # Given the queues' hash tags
    # Then each queue's keys share one slot, and the two slots sit on different masters
    for queue in QUEUES:
        keys = QueueKeys("rj", queue)
        slots = {key_slot(k.encode()) for k in (keys.queued, keys.processing, keys.landing,
                                                 keys.leases, keys.scheduled, keys.dead,
                                                 keys.job("x"), keys.bands, keys.band(100),
                                                 keys.band(-100), keys.share, keys.strays)}
        assert len(slots) == 1
    assert cluster.master_port_of(QueueKeys("rj", "default").queued) != cluster.master_port_of(
        QueueKeys("rj", "emails").queued)


def test_broker_scripts_and_multi_queue_wait_on_the_cluster(
    cluster: RedisClusterHarness, cluster_env: dict[str, str]
) -> None:
    # Given a broker on the cluster
    broker = Broker(cluster.url, "rj")
    try:
        # When a job is enqueued on each queue
        assert broker.enqueue("default", [NewJob("a", '{"task":"x","args":[],"kwargs":{}}', 3)])
        assert broker.enqueue("emails", [NewJob("b", '{"task":"x","args":[],"kwargs":{}}', 3)])

        # Then one BLPOP over both queues' markers (one slot) wakes for each
        woken = {broker.wait(QUEUES, timeout_s=2)[0] for _ in range(2)}  # type: ignore[index]
        assert woken == set(QUEUES)
        # and the fenced scripts work as off a cluster
        claimed = broker.claim("emails", count=5, lease_ms=60_000).jobs
        assert [(j.id, j.attempt, j.gen) for j in claimed] == [("b", 1, 0)]
        assert broker.start("emails", [("b", 1, 0)]) == [True]
        assert broker.ack("emails", [("b", 0, 0)]) == [False]
        assert broker.ack("emails", [("b", 1, 1)]) == [False]
        assert broker.ack("emails", [("b", 1, 0)]) == [True]
        assert broker.counts("emails").running == 0
        assert broker.server_time_ms() > 0
    finally:
        broker.close()


def test_a_unique_holders_progress_is_read_across_masters_in_one_call(
    cluster: RedisClusterHarness, cluster_env: dict[str, str]
) -> None:
    # Given a job waiting on one queue and a started one on a queue of another master
    broker = Broker(cluster.url, "rj")
    try:
        payload = '{"task":"x","args":[],"kwargs":{}}'
        assert broker.enqueue("default", [NewJob("a", payload, 3)])
        assert broker.enqueue("emails", [NewJob("b", payload, 3)])
        claimed = broker.claim("emails", count=1, lease_ms=60_000).jobs
        assert broker.start("emails", [claimed[0].fence]) == [True]

        # When the unique judgement asks for both (and one Redis never had)
        progress = broker.progress([("default", "a"), ("emails", "b"), ("emails", "c")])

        # Then each is read from its own master
        assert {job_id: (p.state, p.started) for job_id, p in progress.items()} == {
            "a": ("queued", False), "b": ("running", True)}
    finally:
        broker.close()


def test_debounced_calls_on_two_masters_each_make_one_pending_run(
    cluster: RedisClusterHarness, cluster_env: dict[str, str]
) -> None:
    # Given a debounced task on two queues that live on different masters
    backend = task_backends["default"]
    broker = backend.broker  # type: ignore[attr-defined]
    tasks = [demo.debounced_note.using(queue_name=q) for q in QUEUES]

    # When a burst of equal calls goes to each queue
    results = [[task.enqueue("k", n) for n in range(5)] for task in tasks]

    # Then each queue has one pending run of its last call, on its own master
    for queue, burst in zip(QUEUES, results, strict=True):
        assert len({result.id for result in burst}) == 1
        job_id = burst[0].id
        k = broker.keys(queue)
        assert broker.client.hget(k.job(job_id), "state") == "scheduled"
        assert '"args":["k",4]' in broker.client.hget(k.job(job_id), "payload")
        assert broker.client.zscore(k.scheduled, job_id) is not None
        assert Job.objects.get(pk=job_id).args == ["k", 4]
    assert results[0][0].id != results[1][0].id


def test_priorities_on_the_cluster_every_script_in_its_queues_slot(
    cluster: RedisClusterHarness, cluster_env: dict[str, str]
) -> None:
    # Given a broker on the cluster (a script touching a key of another slot
    # would fail there), and jobs of mixed priorities on each queue
    broker = Broker(cluster.url, "rj")
    payload = '{"task":"x","args":[],"kwargs":{}}'
    try:
        for queue in QUEUES:
            for job_id, priority in (("plain", 0), ("high", 9), ("low", -4), ("high-2", 9)):
                assert broker.enqueue(queue, [NewJob(f"{queue}-{job_id}", payload, 3,
                                                     priority=priority)])
            assert broker.enqueue(queue, [NewJob(f"{queue}-later", payload, 3, priority=50,
                                                 due_ms=broker.server_time_ms() + 60_000)])

        for queue in QUEUES:
            # When the highest is claimed, fails and is retried, a plain job is
            # raised above everything, and the scheduled one comes due
            first = broker.claim(queue, count=1, lease_ms=60_000).jobs[0]
            assert first.id == f"{queue}-high"
            assert broker.nack(queue, [(*first.fence, 0, "boom")]) == [True]
            assert broker.reprioritize(queue, f"{queue}-plain", 60) == (True, "queued", 0)
            assert broker.requeue(queue, f"{queue}-later") == (True, "scheduled")

            # Then the order is by priority, FIFO within one, the retry behind
            # its equal, and the left-behind copy of the raised job dropped
            claimed = broker.claim(queue, count=10, lease_ms=60_000)
            assert [j.id for j in claimed.jobs] == [
                f"{queue}-{name}" for name in ("plain", "later", "high-2", "high", "low")]
            assert claimed.garbage == []
            assert broker.counts(queue).queued == 0

            # and recover puts an expired one back on its own band
            broker.client.zadd(broker.keys(queue).leases, {f"{queue}-low": 0}, xx=True)
            kinds = [o.kind for o in broker.recover(queue, lease_ms=60_000).outcomes]
            assert kinds == ["unstarted"]
            assert queued_by_priority(broker, queue) == {-4: 1}
    finally:
        broker.close()


def test_fair_groups_on_the_cluster_every_script_in_its_queues_slot(
    cluster: RedisClusterHarness, cluster_env: dict[str, str]
) -> None:
    # Given a broker on the cluster (a script touching a key of another slot
    # would fail there) with a weight, and two tenants' jobs on each queue,
    # some of them at priority 5
    broker = Broker(cluster.url, "rj", fair_weights={"big": 2})
    payload = '{"task":"x","args":[],"kwargs":{}}'
    try:
        for queue in QUEUES:
            broker.enqueue(queue, [NewJob(f"{queue}-big{i}", payload, 3, group="big")
                                   for i in range(6)])
            broker.enqueue(queue, [NewJob(f"{queue}-small{i}", payload, 3, group="small")
                                   for i in range(2)])
            broker.enqueue(queue, [NewJob(f"{queue}-urgent", payload, 3, group="small",
                                          priority=5)])

        for queue in QUEUES:
            # When the first job fails and is retried, and the rest is claimed in batches
            first = broker.claim(queue, count=1, lease_ms=60_000).jobs[0]
            assert first.id == f"{queue}-urgent"
            assert broker.nack(queue, [(*first.fence, 0, "boom")]) == [True]
            order: list[str] = []
            while jobs := broker.claim(queue, count=3, lease_ms=60_000).jobs:
                order += [j.id.removeprefix(f"{queue}-") for j in jobs]

            # Then priority 5 first, then the groups in turn (two of big's per turn)
            assert order == ["urgent", "big0", "big1", "small0", "big2", "big3", "small1",
                             "big4", "big5"]
            assert broker.counts(queue).queued == 0
    finally:
        broker.close()


def test_a_worker_serving_one_queue_runs_jobs_by_priority_on_the_cluster(
    cluster: RedisClusterHarness, cluster_env: dict[str, str], rj_settings: Any,
    processes: Processes
) -> None:
    # Given jobs of mixed priorities waiting on one queue, strict priority, and
    # a worker that claims one job at a time
    env = rj_settings(REDIS_URL=cluster.url, queues=QUEUES, FAIR_SHARE=0, PREFETCH=0)
    plain = [demo.add.enqueue(i, 0) for i in range(3)]
    high = [demo.add.using(priority=10).enqueue(i, 1) for i in range(3)]
    low = demo.add.using(priority=-10).enqueue(0, 2)

    # When the worker drains the queue, then goes idle, and one more raised job
    # arrives (its one-queue wait must see a band's push, not only queued's)
    worker = processes.worker(env, "--queue", "default", "--concurrency", "1")
    ids = [r.id for r in (*plain, *high, low)]
    wait_until(lambda: finished(ids), timeout=60, message="the first jobs")
    late = demo.add.using(priority=5).enqueue(9, 9)
    wait_until(lambda: finished([late.id]), timeout=30, message="the late job")
    assert processes.stop(worker) == 0

    # Then they started highest priority first, in enqueue order within one
    started = list(Job.objects.filter(pk__in=ids).order_by("started_at")
                   .values_list("pk", flat=True))
    assert [str(pk) for pk in started] == [r.id for r in (*high, *plain, low)]


def test_worker_serving_two_queues_runs_jobs_on_the_cluster(
    cluster_env: dict[str, str], processes: Processes
) -> None:
    # Given an idle worker serving both queues (one blocking wait for both)
    worker = processes.worker(cluster_env, "--concurrency", "2")
    wait_until(lambda: " serving " in processes.log(worker), message="worker start")

    # When jobs arrive on each queue
    results = [demo.add.using(queue_name=q).enqueue(i, 100) for i in range(5) for q in QUEUES]

    # Then every one runs
    wait_until(lambda: finished([r.id for r in results]), timeout=30, message="all jobs")
    for r in results:
        assert demo.add.get_result(r.id).status == "SUCCESSFUL"
    assert processes.stop(worker) == 0


@pytest.mark.crash
def test_sigkill_mid_job_on_the_cluster_runs_again(
    cluster_env: dict[str, str], processes: Processes
) -> None:
    # Given a worker killed in the middle of a job
    result = demo.sleep_for.enqueue(0.3)
    victim = processes.worker(cluster_env, extra_env={"RJ_CRASH_AT": "in_task"})
    assert victim.wait(timeout=30) == 86

    # When a fresh worker takes over
    survivor = processes.worker(cluster_env)
    wait_until(lambda: finished([result.id]), timeout=30, message="the job to be recovered")

    # Then it ran again as attempt 2
    final = demo.sleep_for.get_result(result.id)
    assert (final.status, final.attempts) == ("SUCCESSFUL", 2)
    assert processes.stop(survivor) == 0


@pytest.mark.crash
def test_cluster_flushed_then_recoverjobs_rebuilds_every_job(
    cluster: RedisClusterHarness, cluster_env: dict[str, str], processes: Processes
) -> None:
    # Given jobs on both queues, then every master loses its data
    results = [demo.add.using(queue_name=q).enqueue(i, 1) for i in range(10) for q in QUEUES]
    cluster.client().flushall()
    Job.objects.update(updated_at=Job.objects.first().updated_at.replace(year=2000))

    # When the sweep runs once, then a burst worker
    sweep = processes.manage("recoverjobs", env=cluster_env)
    assert sweep.wait(timeout=60) == 0, processes.log(sweep)
    assert "pushed 20" in processes.log(sweep)
    worker = processes.worker(cluster_env, "--burst")
    assert worker.wait(timeout=60) == 0, processes.log(worker)

    # Then every job ran
    assert all(demo.add.get_result(r.id).status == "SUCCESSFUL" for r in results)


@pytest.mark.crash
def test_failover_of_a_master_loses_no_job(
    rj_settings: Any, processes: Processes, tmp_path: Path
) -> None:
    # Given a cluster with a replica per master, and a worker draining jobs
    harness = RedisClusterHarness(tmp_path / "failover", masters=3, replicas=1)
    harness.start()
    try:
        env = rj_settings(REDIS_URL=harness.url, queues=QUEUES)
        results = [demo.sleep_for.using(queue_name=q).enqueue(0.01)
                   for _ in range(150) for q in QUEUES]
        ids = [r.id for r in results]
        worker = processes.worker(env, "--concurrency", "2")
        sweep = processes.manage("recoverjobs", "--interval", "0.5", env=env)
        wait_until(lambda: Job.objects.filter(state=JobState.SUCCEEDED).count() >= 20,
                   timeout=30, message="the first jobs to finish")

        # When the master that holds the "default" queue is SIGKILLed mid-run
        victim_port = harness.master_port_of(QueueKeys("rj", "default").queued)
        harness.kill(victim_port)
        time.sleep(0.5)
        harness.wait_ok(timeout=30)

        # Then its replica takes over, the worker reconnects, and whatever the
        # asynchronous replication dropped is pushed again from the database
        wait_until(lambda: finished(ids), timeout=90, message="every job to finish")
        assert Job.objects.filter(pk__in=ids, state=JobState.SUCCEEDED).count() == len(ids)
        for proc in (worker, sweep):  # together: each one's stop lasts about a second
            proc.send_signal(signal.SIGTERM)
        for proc in (worker, sweep):
            assert proc.wait(timeout=30) == 0, processes.log(proc)
    finally:
        harness.stop()
    assert isinstance(task_backends["default"].broker.client, redis.RedisCluster)


# -- a master that stops answering: enqueue never fails, workers never die ----------


def queue_master(cluster: RedisClusterHarness) -> int:
    return cluster.master_port_of(QueueKeys("rj", "default").queued)


def restart_node(cluster: RedisClusterHarness, port: int) -> None:
    """Start a killed node again (empty, same node id and slots) and wait for the cluster."""
    cluster._start_node(port)
    cluster.wait_ok(timeout=30)


@pytest.fixture
def healthy_cluster_after(cluster: RedisClusterHarness) -> Iterator[RedisClusterHarness]:
    """Whatever the test did to a node, the module's cluster is whole again afterwards."""
    yield cluster
    for port, proc in list(cluster.processes.items()):
        if proc.poll() is None:
            proc.send_signal(signal.SIGCONT)
        else:
            cluster._start_node(port)
    cluster.wait_ok(timeout=30)


@pytest.mark.crash
def test_a_killed_cluster_master_never_raises_into_enqueue(
    healthy_cluster_after: RedisClusterHarness, cluster_env: dict[str, str],
    app_log: list[logging.LogRecord],
) -> None:
    # Given: a producer whose cluster client already knows the cluster, and the
    # master that owns the queue's slot SIGKILLed
    cluster = healthy_cluster_after
    backend = task_backends["default"]
    warm = demo.add.enqueue(1, 1)
    victim = queue_master(cluster)
    cluster.kill(victim)

    # When: a job is enqueued in a transaction that commits
    began = time.monotonic()
    with transaction.atomic():
        result = demo.add.enqueue(2, 3)
    took = time.monotonic() - began

    # Then: enqueue() returned at once; the row is committed; a warning says so
    assert took < 20, f"enqueue took {took:.1f} s"
    assert Job.objects.get(pk=result.id).state == JobState.QUEUED
    warnings = [r.getMessage() for r in app_log if r.levelno == logging.WARNING]
    assert any("safe in the database" in message for message in warnings), warnings

    # When: the node is back (empty) and reconcile finds the rows old enough
    restart_node(cluster, victim)
    Job.objects.filter(pk__in=[warm.id, result.id]).update(
        updated_at=timezone.now() - timedelta(hours=1))
    report = Sweep(backend.parts).reconcile()  # type: ignore[attr-defined]

    # Then: it pushed both jobs the restart lost, and a worker can claim them
    assert report.pushed == 2
    claimed = backend.broker.claim("default", count=10, lease_ms=60_000).jobs
    assert sorted(job.id for job in claimed) == sorted([warm.id, result.id])


@pytest.mark.crash
def test_a_stopped_cluster_master_delays_enqueue_but_never_raises(
    healthy_cluster_after: RedisClusterHarness, cluster_env: dict[str, str]
) -> None:
    # Given: the master that owns the queue's slot SIGSTOPped for 3 s (shorter
    # than the client's 10 s socket timeout: a hung node, not a refusing one)
    cluster = healthy_cluster_after
    backend = task_backends["default"]
    demo.add.enqueue(1, 1)
    node = cluster.processes[queue_master(cluster)]
    node.send_signal(signal.SIGSTOP)
    resume = threading.Timer(3.0, node.send_signal, args=(signal.SIGCONT,))
    resume.start()
    try:
        # When: a job is enqueued in a transaction that commits
        began = time.monotonic()
        with transaction.atomic():
            result = demo.add.enqueue(2, 3)
        took = time.monotonic() - began
    finally:
        resume.join()

    # Then: the commit hook waited for the node, returned normally and pushed the job
    assert took < 20, f"enqueue took {took:.1f} s"
    assert Job.objects.get(pk=result.id).state == JobState.QUEUED
    claimed = backend.broker.claim("default", count=10, lease_ms=60_000).jobs
    assert result.id in {job.id for job in claimed}


@pytest.mark.crash
@pytest.mark.parametrize("fault", ["stop", "kill"])
def test_a_worker_outlives_its_queue_master_stopped_or_killed_for_seconds(
    healthy_cluster_after: RedisClusterHarness, cluster_env: dict[str, str],
    processes: Processes, fault: str,
) -> None:
    # Given: a worker on the cluster that has run a job
    cluster = healthy_cluster_after
    worker = processes.worker(cluster_env, "--concurrency", "2")
    first = demo.add.enqueue(1, 1)
    wait_until(lambda: finished([first.id]), timeout=30, message="the first job")

    # When: the master that owns the queue's slot is stopped (SIGSTOP) or
    # killed for 3 s, then resumed (SIGCONT) or started again empty
    victim = queue_master(cluster)
    if fault == "stop":
        cluster.processes[victim].send_signal(signal.SIGSTOP)
        time.sleep(3.0)
        cluster.processes[victim].send_signal(signal.SIGCONT)
    else:
        cluster.kill(victim)
        time.sleep(3.0)
        restart_node(cluster, victim)
    assert worker.poll() is None, processes.log(worker)

    # Then: the worker is alive and runs a job enqueued after the fault
    resumed = time.monotonic()
    later = demo.add.enqueue(2, 3)
    wait_until(lambda: finished([later.id]), timeout=60, message="a job after the fault")
    took = time.monotonic() - resumed
    assert demo.add.get_result(later.id).return_value == 5
    assert took < 20, f"the job after the fault took {took:.1f} s"
    log = processes.log(worker)
    assert worker.poll() is None and "died" not in log, log
    if fault == "kill":
        # the worker did see the node refuse, and recovered
        assert "Redis is unavailable" in log and "Redis is back" in log, log
    assert processes.stop(worker) == 0, log
