"""G1/G3: a worker or sweep that dies at any step loses nothing.

Each test arms a crash point (``RJ_CRASH_AT``, see reliable_jobs.faults:
the process ``os._exit``s there, like SIGKILL, with no cleanup), lets a real
``runworker`` or ``recoverjobs`` process die at it, then starts a healthy
worker and counts every job.
"""

from __future__ import annotations

from typing import Any

import pytest
import redis

from reliable_jobs.faults import POINTS
from reliable_jobs.keys import QueueKeys
from reliable_jobs.models import Attempt, Job, JobState
from testproject.demo import tasks as demo

from .helpers import REDIS_URL, Processes, wait_until

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow, pytest.mark.crash]
KEYS = QueueKeys("rj", "default")
JOBS = 10
CRASHED = 86  # faults.crash_point's exit code

WORKER_POINTS = ["after_blmove", "after_claim", "in_task", "before_ack", "after_ack"]


def assert_all_succeeded(results: list[Any], client: redis.Redis) -> None:
    """Every job succeeded with its own return value, within its attempts; Redis is clean."""
    for i, result in enumerate(results):
        job = Job.objects.get(pk=result.id)
        assert job.state == JobState.SUCCEEDED, (i, job.state, job.last_error)
        assert job.return_value == i + 100
        assert 1 <= job.attempts <= job.max_attempts
        # no attempt is left looking as if it were still running
        assert not Attempt.objects.filter(job=job, outcome="").exists()
    assert not Job.objects.filter(state=JobState.RUNNING).exists()
    assert client.llen(KEYS.queued) == 0
    assert client.zcard(KEYS.leases) == 0


def all_finished(results: list[Any]) -> bool:
    """Every job is finished in the mirror AND Redis holds nothing more for it.

    A worker that died after the mirror write but before its ack leaves a
    succeeded row while Redis still holds the job: it runs again (at least
    once) and only then is Redis clean.
    """
    ids = [r.id for r in results]
    client = redis.Redis.from_url(REDIS_URL)
    try:
        if client.llen(KEYS.queued) or client.llen(KEYS.landing) or client.zcard(KEYS.leases):
            return False
    finally:
        client.close()
    return Job.objects.filter(pk__in=ids, state__in=[JobState.SUCCEEDED, JobState.DEAD]
                              ).count() == len(ids)


def test_every_worker_crash_point_is_declared() -> None:
    assert set(WORKER_POINTS) <= set(POINTS)


@pytest.mark.parametrize("point", WORKER_POINTS)
def test_worker_killed_at_each_step_loses_nothing(
    point: str, rj_settings: Any, processes: Processes, redis_client: redis.Redis
) -> None:
    # Given: a worker armed to die at `point` (after a few passes for in-task)
    env = rj_settings()
    crash = {"RJ_CRASH_AT": point, "RJ_CRASH_AFTER": "3" if point == "in_task" else "0"}
    if point == "after_blmove":
        # BLMOVE is only used by an idle worker: start it before the jobs exist.
        # Wait until it blocks in BLMOVE: a worker still in its first claim round
        # would claim the first jobs with the claim script and die holding them.
        victim = processes.worker(env, extra_env=crash)
        # (its own connection, named after its pid: a client another test left
        # blocked in BLMOVE on this database must not count)
        name = f"reliable_jobs:{victim.pid}"
        wait_until(lambda: any(client.get("cmd") == "blmove" and client.get("name") == name
                               for client in redis_client.client_list()),
                   message="the worker to wait in BLMOVE")
        results = [demo.add.enqueue(i, 100) for i in range(JOBS)]
    else:
        results = [demo.add.enqueue(i, 100) for i in range(JOBS)]
        victim = processes.worker(env, extra_env=crash)

    # When: it dies there, and a healthy worker takes over
    assert victim.wait(timeout=30) == CRASHED, processes.log(victim)
    survivor = processes.worker(env, "--concurrency", "2")
    wait_until(lambda: all_finished(results), timeout=40, message="every job to finish")

    # Then: nothing lost, nothing stuck, attempts within bounds
    assert_all_succeeded(results, redis_client)
    if point == "after_blmove":
        # The id moved by BLMOVE was never claimed: the sweep's first-seen lease
        # brought it back without charging it an attempt.
        assert sorted(Job.objects.values_list("attempts", flat=True)) == [1] * JOBS
    assert processes.stop(survivor) == 0


@pytest.mark.parametrize("point", ["sweep_after_recover", "sweep_after_promote"])
def test_sweep_killed_between_its_steps_loses_nothing(
    point: str, rj_settings: Any, processes: Processes, redis_client: redis.Redis
) -> None:
    # Given: jobs held by a worker that died mid-task (their leases will expire)
    env = rj_settings()
    results = [demo.add.enqueue(i, 100) for i in range(JOBS)]
    victim = processes.worker(env, extra_env={"RJ_CRASH_AT": "in_task"})
    assert victim.wait(timeout=30) == CRASHED
    wait_until(lambda: redis_client.zrangebyscore(KEYS.leases, "-inf", "+inf") and all(
        score < int(redis_client.time()[0]) * 1000 for _, score in
        redis_client.zrange(KEYS.leases, 0, -1, withscores=True)), message="leases to expire")

    # When: a sweep dies between its steps, then workers take over
    sweep = processes.manage("recoverjobs", env=env, extra_env={"RJ_CRASH_AT": point})
    assert sweep.wait(timeout=30) == CRASHED, processes.log(sweep)
    survivor = processes.worker(env, "--concurrency", "2")
    wait_until(lambda: all_finished(results), timeout=40, message="every job to finish")

    # Then
    assert_all_succeeded(results, redis_client)
    assert processes.stop(survivor) == 0


def test_three_sweeps_at_once_with_crashing_workers(
    rj_settings: Any, processes: Processes, redis_client: redis.Redis
) -> None:
    # Given: three sweeps looping every 100 ms, and workers that each die mid-task
    env = rj_settings()
    results = [demo.add.enqueue(i, 100) for i in range(30)]
    sweeps = [processes.manage("recoverjobs", "--interval", "0.1", env=env) for _ in range(3)]
    for _ in range(3):
        victim = processes.worker(env, extra_env={"RJ_CRASH_AT": "in_task",
                                                  "RJ_CRASH_AFTER": "2"})
        assert victim.wait(timeout=30) == CRASHED

    # When: a healthy worker finishes the work while the sweeps keep running
    survivor = processes.worker(env, "--concurrency", "2")
    wait_until(lambda: all_finished(results), timeout=60, message="every job to finish")

    # Then: nothing lost, and no job was ever queued twice by racing sweeps
    assert_all_succeeded(results, redis_client)
    # (claims that were never marked started are refunded and leave no attempt
    # row; the attempts that were charged stay within the job's budget)
    for result in results:
        job = Job.objects.get(pk=result.id)
        assert Attempt.objects.filter(job=job).count() <= job.max_attempts
    procs = (*sweeps, survivor)
    for proc, code in zip(procs, processes.stop_many(*procs), strict=True):
        assert code == 0, processes.log(proc)
