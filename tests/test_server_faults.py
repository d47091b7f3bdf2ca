"""G1 under server faults: Redis restarted empty, PostgreSQL cut off, connections killed.

Real servers and real sockets: a private redis-server that is SIGKILLed and
started again with nothing on disk, a TCP proxy between a worker and
PostgreSQL that drops every connection, and ``CLIENT KILL`` on the worker's
Redis connections.
"""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import redis
from django.utils import timezone

from reliable_jobs.contrib.verify.netfaults import CuttableProxy
from reliable_jobs.keys import QueueKeys
from reliable_jobs.models import Attempt, AttemptOutcome, Job, JobState
from testproject.demo import tasks as demo

from .faultinjection import PrivateRedis
from .helpers import Processes, wait_until

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow, pytest.mark.crash]
KEYS = QueueKeys("rj", "default")


def finished_count(ids: list[str]) -> int:
    return Job.objects.filter(pk__in=ids, state__in=[JobState.SUCCEEDED, JobState.DEAD]).count()


def redis_is_clean(url: str) -> bool:
    client = redis.Redis.from_url(url)
    try:
        return not (client.llen(KEYS.queued) or client.llen(KEYS.landing)
                    or client.zcard(KEYS.leases) or client.zcard(KEYS.scheduled))
    except redis.ConnectionError:
        return False
    finally:
        client.close()


def test_redis_restarted_empty_while_jobs_are_queued_scheduled_and_running(
    rj_settings: Any, processes: Processes, tmp_path: Path
) -> None:
    # Given: a private Redis; two jobs running, thirty queued, five scheduled
    server = PrivateRedis(tmp_path)
    server.start()
    try:
        env = rj_settings(REDIS_URL=server.url)
        running = [demo.sleep_for.enqueue(1.0) for _ in range(2)]
        queued = [demo.add.enqueue(i, 100) for i in range(30)]
        later = timezone.now() + timedelta(seconds=2)
        scheduled = [demo.add.using(run_after=later).enqueue(i, 200) for i in range(5)]
        worker = processes.worker(env, "--concurrency", "2", "--prefetch", "0")
        sweep = processes.manage("recoverjobs", "--interval", "0.3", env=env)
        wait_until(lambda: Job.objects.filter(state=JobState.RUNNING).count() == 2,
                   message="both slow jobs to run")

        # When: Redis dies and comes back with nothing (a new server process, nothing on
        # disk; its keys are not counted here, as the sweep may already be rebuilding)
        before = redis.Redis.from_url(server.url).info("server")["run_id"]
        server.restart_empty()
        assert redis.Redis.from_url(server.url).info("server")["run_id"] != before

        # Then: the sweep rebuilds Redis from the database and every job completes
        ids = [r.id for r in running + queued + scheduled]
        wait_until(lambda: finished_count(ids) == len(ids) and redis_is_clean(server.url),
                   timeout=60, message="every job to finish after the restart")
        for i, r in enumerate(queued):
            assert demo.add.get_result(r.id).return_value == i + 100
        for i, r in enumerate(scheduled):
            assert demo.add.get_result(r.id).return_value == i + 200
        for r in running:
            assert demo.sleep_for.get_result(r.id).status == "SUCCESSFUL"
        assert "pushed" in processes.log(sweep)
        procs = (worker, sweep)
        for proc, code in zip(procs, processes.stop_many(*procs), strict=True):
            assert code == 0, processes.log(proc)
    finally:
        server.kill()


def test_postgresql_unreachable_for_seconds_loses_and_double_counts_nothing(
    rj_settings: Any, processes: Processes
) -> None:
    # Given: a worker that reaches PostgreSQL only through a proxy we can cut
    proxy = CuttableProxy(5432)
    try:
        env = rj_settings()
        env["DATABASE_URL"] = env["DATABASE_URL"].replace(":5432/", f":{proxy.port}/")
        results = [demo.sleep_for.enqueue(0.01) for _ in range(200)]
        ids = [r.id for r in results]
        worker = processes.worker(env, "--concurrency", "2")
        wait_until(lambda: finished_count(ids) >= 20, message="the first jobs to finish")

        # When: the database is unreachable for four seconds mid-run
        proxy.cut()
        time.sleep(4)
        proxy.restore()

        # Then: the mirror catches up; each job ran once and is recorded once
        wait_until(lambda: finished_count(ids) == len(ids) and redis_is_clean(env["REDIS_URL"]),
                   timeout=60, message="every job to finish after the outage")
        assert Job.objects.filter(pk__in=ids, state=JobState.SUCCEEDED).count() == len(ids)
        assert Attempt.objects.filter(job_id__in=ids).count() == len(ids)
        assert Attempt.objects.filter(job_id__in=ids,
                                      outcome=AttemptOutcome.SUCCEEDED).count() == len(ids)
        log = processes.log(worker)
        assert log.count("The database is unavailable") == 1, log
        assert "The database is back" in log
        assert processes.stop(worker) == 0
    finally:
        proxy.close()


def test_worker_redis_connections_killed_mid_run(
    rj_settings: Any, processes: Processes, redis_client: redis.Redis
) -> None:
    # Given: a busy worker
    env = rj_settings()
    results = [demo.sleep_for.enqueue(0.01) for _ in range(200)]
    ids = [r.id for r in results]
    worker = processes.worker(env, "--concurrency", "2")
    wait_until(lambda: finished_count(ids) >= 20, message="the first jobs to finish")

    # When: every Redis connection of the worker is killed, three times
    name = f"reliable_jobs:{worker.pid}"
    killed = 0
    for _ in range(3):
        for client in redis_client.client_list():
            if client.get("name") == name:
                killed += redis_client.client_kill_filter(_id=client["id"])
        time.sleep(0.3)
    assert killed >= 3

    # Then: it reconnects and every job succeeds
    wait_until(lambda: finished_count(ids) == len(ids) and redis_is_clean(env["REDIS_URL"]),
               timeout=60, message="every job to finish")
    assert Job.objects.filter(pk__in=ids, state=JobState.SUCCEEDED).count() == len(ids)
    assert max(Job.objects.filter(pk__in=ids).values_list("attempts", flat=True)) <= 3
    assert processes.stop(worker) == 0
