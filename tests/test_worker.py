"""End-to-end: real ``manage.py runworker`` processes against Redis and PostgreSQL."""

from __future__ import annotations

import json
import signal
import uuid
from typing import Any

import pytest
import redis

from reliable_jobs.compat import TaskResultStatus, task_backends
from reliable_jobs.keys import QueueKeys
from reliable_jobs.models import Attempt, AttemptOutcome, Job, JobState
from testproject.demo import tasks as demo

from .helpers import Processes, wait_until

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]
KEYS = QueueKeys("rj", "default")


def finished(*job_ids: str) -> bool:
    return Job.objects.filter(pk__in=job_ids, state__in=[JobState.SUCCEEDED, JobState.DEAD]
                              ).count() == len(job_ids)


def test_burst_worker_runs_successes_retries_and_failures(
    rj_settings: Any, processes: Processes
) -> None:
    # Given: a job that succeeds, one that fails twice then succeeds, one that always fails
    env = rj_settings()
    ok = demo.add.enqueue(2, 3)
    flaky = demo.fail_times.enqueue("flaky", 2)
    doomed = demo.always_fail.enqueue("doomed")
    coroutine = demo.async_add.enqueue(4, 5)

    # When: a burst worker drains the queue
    worker = processes.worker(env, "--burst", "--concurrency", "2")
    assert worker.wait(timeout=60) == 0, processes.log(worker)

    # Then: each ends as its task says, with every attempt recorded
    ok_result = demo.add.get_result(ok.id)
    assert ok_result.status == TaskResultStatus.SUCCESSFUL
    assert ok_result.return_value == 5
    assert ok_result.attempts == 1

    flaky_result = demo.fail_times.get_result(flaky.id)
    assert flaky_result.status == TaskResultStatus.SUCCESSFUL
    assert flaky_result.return_value == "flaky"
    assert flaky_result.attempts == 3
    assert [e.exception_class_path for e in flaky_result.errors] == ["builtins.RuntimeError"] * 2

    doomed_result = demo.always_fail.get_result(doomed.id)
    assert doomed_result.status == TaskResultStatus.FAILED
    assert doomed_result.attempts == 3
    assert len(doomed_result.errors) == 3
    assert "doomed" in doomed_result.errors[-1].traceback
    job = Job.objects.get(pk=doomed.id)
    assert job.state == JobState.DEAD
    assert job.last_error == "builtins.RuntimeError: doomed"

    assert demo.async_add.get_result(coroutine.id).return_value == 9

    # And: Redis keeps only the dead job's hash, in the dead set
    client = redis.Redis.from_url(env["REDIS_URL"], decode_responses=True)
    assert client.llen(KEYS.queued) == 0
    assert client.zcard(KEYS.leases) == 0
    assert client.zrange(KEYS.dead, 0, -1) == [doomed.id]
    assert not client.exists(KEYS.job(ok.id))


def test_idle_worker_starts_a_new_job_without_polling(
    rj_settings: Any, processes: Processes
) -> None:
    # Given: an idle worker blocked on the queue
    env = rj_settings()
    worker = processes.worker(env)
    wait_until(lambda: "serving default" in processes.log(worker), message="worker start")

    # When: a job is enqueued
    result = demo.add.enqueue(20, 22)

    # Then: it runs (the bound is generous; speed is the benchmark's business)
    wait_until(lambda: finished(result.id), timeout=20, message="the job to finish")
    assert demo.add.get_result(result.id).return_value == 42
    assert processes.stop(worker) == 0


def test_retry_later_and_permanent_failure_from_task_code(
    rj_settings: Any, processes: Processes
) -> None:
    # Given: a task that asks for a retry in 100 ms once, and one that gives up at once
    env = rj_settings()
    later = demo.retry_once_later.enqueue(100)
    hopeless = demo.give_up.enqueue("no such customer")

    # When
    worker = processes.worker(env, "--burst")
    assert worker.wait(timeout=60) == 0, processes.log(worker)

    # Then: the retry used two attempts; the permanent failure one, and it is dead
    assert demo.retry_once_later.get_result(later.id).attempts == 2
    assert demo.retry_once_later.get_result(later.id).status == TaskResultStatus.SUCCESSFUL
    dead = Job.objects.get(pk=hopeless.id)
    assert (dead.state, dead.attempts) == (JobState.DEAD, 1)
    assert "PermanentFailure: no such customer" in dead.last_error


def test_payload_naming_an_unregistered_function_is_never_run(
    rj_settings: Any, processes: Processes, redis_client: redis.Redis
) -> None:
    # Given: jobs pushed straight into Redis naming os.system and a missing module,
    # then a normal job behind them
    env = rj_settings()
    broker = task_backends["default"].broker
    from reliable_jobs.broker import NewJob

    marker = f"/tmp/rj-pwned-{uuid.uuid4().hex}"
    evil = [
        NewJob(str(uuid.uuid4()), json.dumps({"task": "os.system", "args": [f"touch {marker}"],
                                              "kwargs": {}}), 3),
        NewJob(str(uuid.uuid4()), json.dumps({"task": "no.such.module.fn", "args": [],
                                              "kwargs": {}}), 3),
        NewJob(str(uuid.uuid4()), "this is not json", 3),
    ]
    broker.enqueue("default", evil)
    good = demo.add.enqueue(1, 1)

    # When
    worker = processes.worker(env, "--burst")
    assert worker.wait(timeout=60) == 0, processes.log(worker)

    # Then: each bad job is dead with its reason after ONE attempt, nothing was imported
    # or run, and the good job still ran
    import os

    assert not os.path.exists(marker)
    for job in evil:
        state = redis_client.hgetall(KEYS.job(job.id))
        assert state["state"] == "dead"
        assert state["attempts"] == "1"
    reasons = [redis_client.hget(KEYS.job(job.id), "last_error") for job in evil]
    assert "UnknownTask: 'os.system' is not a registered task" in reasons[0]
    assert "UnknownTask" in reasons[1]
    assert "MalformedPayload" in reasons[2]
    assert demo.add.get_result(good.id).return_value == 2


def test_garbage_on_the_queue_is_moved_aside(
    rj_settings: Any, processes: Processes, redis_client: redis.Redis
) -> None:
    # Given: garbage pushed onto the work list by hand, around a real job
    env = rj_settings()
    redis_client.lpush(KEYS.queued, "garbage-1")
    good = demo.add.enqueue(3, 4)
    redis_client.lpush(KEYS.queued, "\x00\xff not an id")

    # When
    worker = processes.worker(env, "--burst")
    assert worker.wait(timeout=60) == 0, processes.log(worker)

    # Then: the garbage sits in the dead set, the worker kept running, the job ran
    assert set(redis_client.zrange(KEYS.dead, 0, -1)) == {"garbage-1", "\x00\xff not an id"}
    assert redis_client.zcard(KEYS.leases) == 0
    assert demo.add.get_result(good.id).return_value == 7
    assert "Moved aside 'garbage-1'" in processes.log(worker)


def test_sigterm_lets_running_jobs_finish_and_hands_back_the_rest(
    rj_settings: Any, processes: Processes, redis_client: redis.Redis
) -> None:
    # Given: a worker with one thread running a 1.5 s job, and 5 claimed but unstarted
    env = rj_settings(PREFETCH=10)
    slow = demo.sleep_for.enqueue(1.5)
    waiting = [demo.add.enqueue(i, i) for i in range(5)]
    worker = processes.worker(env)
    wait_until(lambda: Job.objects.filter(pk=slow.id, state=JobState.RUNNING).exists(),
               message="the slow job to start")

    # When: SIGTERM arrives mid-job
    assert processes.stop(worker) == 0, processes.log(worker)

    # Then: the running job finished; the unstarted ones are back on queued, uncharged
    assert demo.sleep_for.get_result(slow.id).status == TaskResultStatus.SUCCESSFUL
    queued = set(redis_client.lrange(KEYS.queued, 0, -1))
    assert queued == {r.id for r in waiting}
    for r in waiting:
        # the claim is given back: one more attempt in the budget (the counter,
        # a fencing token, never goes down), in Redis and in the mirror
        assert redis_client.hmget(KEYS.job(r.id), "attempts", "max_attempts") == ["1", "4"]
        assert Job.objects.get(pk=r.id).max_attempts == 4
        assert not Attempt.objects.filter(job_id=r.id).exists()
    assert redis_client.zcard(KEYS.leases) == 0


@pytest.mark.crash
def test_sigkill_mid_job_runs_again_with_attempts_two(
    rj_settings: Any, processes: Processes, redis_client: redis.Redis
) -> None:
    # Given: a worker that will die inside its first job
    env = rj_settings()
    result = demo.sleep_for.enqueue(0.5)
    victim = processes.worker(env, extra_env={"RJ_CRASH_AT": "in_task"})

    # When: it dies mid-job (the crash point is a hard os._exit, like SIGKILL)
    assert victim.wait(timeout=30) != 0
    assert redis_client.hget(KEYS.job(result.id), "state") == "running"

    # Then: once the lease expires a fresh worker runs it: attempts == 2
    survivor = processes.worker(env)
    wait_until(lambda: finished(result.id), timeout=30, message="the job to be recovered")
    final = demo.sleep_for.get_result(result.id)
    assert final.status == TaskResultStatus.SUCCESSFUL
    assert final.attempts == 2
    outcomes = list(Attempt.objects.filter(job_id=result.id).order_by("number")
                    .values_list("outcome", flat=True))
    assert outcomes == [AttemptOutcome.LEASE_EXPIRED, AttemptOutcome.SUCCEEDED]
    assert processes.stop(survivor) == 0


@pytest.mark.crash
def test_real_sigkill_of_a_busy_worker_loses_nothing(
    rj_settings: Any, processes: Processes
) -> None:
    # Given: a worker busy with sleeping jobs
    env = rj_settings()
    results = [demo.sleep_for.enqueue(0.3) for _ in range(6)]
    victim = processes.worker(env, "--concurrency", "2")
    wait_until(lambda: Job.objects.filter(state=JobState.RUNNING).exists(),
               message="a job to start")

    # When: SIGKILL
    victim.send_signal(signal.SIGKILL)
    victim.wait(timeout=10)

    # Then: a new worker finishes every job; none ran more than twice
    survivor = processes.worker(env, "--concurrency", "2")
    wait_until(lambda: finished(*[r.id for r in results]), timeout=40,
               message="every job to finish")
    for r in results:
        final = demo.sleep_for.get_result(r.id)
        assert final.status == TaskResultStatus.SUCCESSFUL
        assert 1 <= final.attempts <= 2
    assert processes.stop(survivor) == 0


@pytest.mark.crash
def test_redis_flushed_then_recoverjobs_rebuilds_every_job(
    rj_settings: Any, processes: Processes, redis_client: redis.Redis
) -> None:
    # Given: jobs queued and scheduled, then Redis loses everything
    env = rj_settings()
    queued = [demo.add.enqueue(i, 1) for i in range(20)]
    redis_client.flushdb()  # this suite's database: other databases are not ours
    assert redis_client.dbsize() == 0

    # When: the grace period passes and the sweep runs once
    Job.objects.update(updated_at=Job.objects.first().updated_at.replace(year=2000))
    sweep = processes.manage("recoverjobs", env=env)
    assert sweep.wait(timeout=60) == 0, processes.log(sweep)
    assert "pushed 20" in processes.log(sweep)
    assert redis_client.llen(KEYS.queued) == 20

    # Then: a worker runs every one
    worker = processes.worker(env, "--burst")
    assert worker.wait(timeout=60) == 0, processes.log(worker)
    for i, r in enumerate(queued):
        assert demo.add.get_result(r.id).return_value == i + 1


def test_task_past_its_time_limit_is_killed_and_dies_after_its_attempts(
    rj_settings: Any, processes: Processes
) -> None:
    # Given: a task with timeout_ms=500 that sleeps 30 s, and a normal isolated task
    env = rj_settings()
    hung = demo.hang.enqueue(30)
    fine = demo.isolated_add.enqueue(2, 2)

    # When: a burst worker runs them
    worker = processes.worker(env, "--burst", "--concurrency", "2")
    assert worker.wait(timeout=60) == 0, processes.log(worker)

    # Then: each attempt of the hung task was killed and recorded as timed out; it is dead
    job = Job.objects.get(pk=hung.id)
    assert (job.state, job.attempts) == (JobState.DEAD, 2)
    assert "JobTimeout" in job.last_error
    assert set(Attempt.objects.filter(job=job).values_list("outcome", flat=True)) == {
        AttemptOutcome.TIMED_OUT}
    # And: the isolated task ran in its own process and returned
    assert demo.isolated_add.get_result(fine.id).return_value == 4


def test_task_that_kills_its_own_process_fails_only_its_attempt(
    rj_settings: Any, processes: Processes
) -> None:
    # Given: an isolated task that os._exit()s, and a job behind it
    env = rj_settings()
    poison = demo.kill_own_process.enqueue()
    after = demo.add.enqueue(5, 5)

    # When
    worker = processes.worker(env, "--burst")
    assert worker.wait(timeout=60) == 0, processes.log(worker)

    # Then: it is dead after max_attempts with the reason kept; the worker survived
    job = Job.objects.get(pk=poison.id)
    assert (job.state, job.attempts) == (JobState.DEAD, 3)
    assert "ChildDied" in job.last_error and "code 9" in job.last_error
    assert demo.add.get_result(after.id).return_value == 10


def test_a_burst_run_gives_up_when_redis_never_answers(
    rj_settings: Any, processes: Processes
) -> None:
    # Given: a burst worker whose Redis is a port where nothing listens
    env = {**rj_settings(), "REDIS_URL": "redis://127.0.0.1:1/0"}

    # When: it runs with a short give-up time
    worker = processes.worker(env, "--burst", "--burst-give-up", "1.5")

    # Then: it exits with an error that says why, instead of waiting for ever
    assert worker.wait(timeout=30) == 1, processes.log(worker)
    assert "Redis did not answer for 1.5 s" in processes.log(worker)
