"""G2/G3 with jobs that misbehave: poison, long-running, and a stalled worker."""

from __future__ import annotations

import signal
import time
from typing import Any

import pytest
import redis

from reliable_jobs.keys import QueueKeys
from reliable_jobs.models import Attempt, AttemptOutcome, Job, JobState
from testproject.demo import tasks as demo

from .helpers import Processes, wait_until

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow, pytest.mark.crash]
KEYS = QueueKeys("rj", "default")


def test_poison_job_that_kills_its_worker_dies_and_spares_its_neighbours(
    rj_settings: Any, processes: Processes, redis_client: redis.Redis
) -> None:
    # Given: a job that kills the worker process running it, queued ahead of ten others
    env = rj_settings()
    poison = demo.crash_worker.enqueue()
    neighbours = [demo.add.enqueue(i, 100) for i in range(10)]
    ids = [poison.id, *(n.id for n in neighbours)]

    def settled() -> bool:
        return (Job.objects.filter(pk__in=ids, state__in=[JobState.SUCCEEDED, JobState.DEAD])
                .count() == len(ids) and not redis_client.zcard(KEYS.leases)
                and not redis_client.llen(KEYS.queued))

    # When: workers keep being started as the poison keeps killing them
    deaths = 0
    deadline = time.monotonic() + 60
    while not settled():
        assert time.monotonic() < deadline, "jobs did not settle within 60 s"
        worker = processes.worker(env, "--prefetch", "20")
        while worker.poll() is None and not settled():
            time.sleep(0.05)
        if worker.poll() is None:
            assert processes.stop(worker) == 0
        else:
            assert worker.returncode == 13, processes.log(worker)
            deaths += 1

    # Then: the poison job is dead after exactly its three attempts (G3)...
    job = Job.objects.get(pk=poison.id)
    assert job.state == JobState.DEAD
    assert Attempt.objects.filter(job=job).count() == 3
    assert "LeaseExpired" in job.last_error
    assert deaths == 3
    # ...and every neighbour claimed with it succeeded: claims that never started
    # were given back, so none was charged for the poison's crashes
    for i, neighbour in enumerate(neighbours):
        row = Job.objects.get(pk=neighbour.id)
        assert (row.state, row.return_value) == (JobState.SUCCEEDED, i + 100)
        assert Attempt.objects.filter(job=row).count() <= 2


def test_job_three_times_longer_than_its_lease_runs_once(
    rj_settings: Any, processes: Processes
) -> None:
    # Given: a 1 s lease renewed every 200 ms, a job of 3.5 s, and two workers
    env = rj_settings(LEASE_MS=1_000, RENEW_INTERVAL_MS=200)
    result = demo.sleep_for.enqueue(3.5)
    workers = [processes.worker(env) for _ in range(2)]

    # When it runs to the end
    wait_until(lambda: Job.objects.filter(pk=result.id, state=JobState.SUCCEEDED).exists(),
               timeout=30, message="the long job to finish")

    # Then: it ran once: renewals kept it from being recovered
    assert list(Attempt.objects.filter(job_id=result.id).values_list("outcome", flat=True)) == [
        AttemptOutcome.SUCCEEDED]
    for worker, code in zip(workers, processes.stop_many(*workers), strict=True):
        assert code == 0, processes.log(worker)


def test_stalled_worker_loses_its_job_and_its_late_ack_is_refused(
    rj_settings: Any, processes: Processes, redis_client: redis.Redis
) -> None:
    # Given: worker A running a 2 s job
    env = rj_settings(LEASE_MS=1_000, RENEW_INTERVAL_MS=200)
    result = demo.sleep_for.enqueue(2.0)
    stalled = processes.worker(env, "--worker-id", "A")
    wait_until(lambda: Attempt.objects.filter(job_id=result.id, worker_id="A").exists(),
               message="worker A to start the job")

    # When: A is paused (SIGSTOP) past its lease, worker B takes the job over,
    # and A resumes while B still runs it: A's sleep is long over, so A
    # finishes at once and acks attempt 1 while B holds attempt 2
    stalled.send_signal(signal.SIGSTOP)
    try:
        other = processes.worker(env, "--worker-id", "B")
        wait_until(lambda: Attempt.objects.filter(job_id=result.id, worker_id="B").exists(),
                   timeout=30, message="worker B to start the job")
    finally:
        stalled.send_signal(signal.SIGCONT)
    wait_until(lambda: "Redis refused the outcome" in processes.log(stalled), timeout=30,
               message="worker A's late ack to be refused")
    wait_until(lambda: Attempt.objects.filter(
        job_id=result.id, worker_id="B", outcome=AttemptOutcome.SUCCEEDED).exists(),
        timeout=30, message="worker B to finish the job")

    # Then: A's late ack was refused (fencing); the mirror keeps the true history:
    # attempt 1 (A) lost its lease, attempt 2 (B) succeeded; the job succeeded once
    attempts = list(Attempt.objects.filter(job_id=result.id).order_by("number")
                    .values_list("number", "worker_id", "outcome"))
    assert attempts == [(1, "A", AttemptOutcome.LEASE_EXPIRED),
                        (2, "B", AttemptOutcome.SUCCEEDED)]
    job = Job.objects.get(pk=result.id)
    assert (job.state, job.attempts) == (JobState.SUCCEEDED, 2)
    assert not redis_client.exists(KEYS.job(result.id))
    for worker, code in zip((stalled, other), processes.stop_many(stalled, other), strict=True):
        assert code == 0, processes.log(worker)


def test_worker_whose_finisher_dies_hands_its_jobs_back_and_exits_non_zero(
    rj_settings: Any, processes: Processes, redis_client: redis.Redis
) -> None:
    # Given: a worker whose finisher thread dies of a bug on its first batch
    env = rj_settings()
    results = [demo.add.enqueue(i, 100) for i in range(5)]
    broken = processes.worker(env, extra_env={"RJ_CRASH_AT": "finisher_bug"})

    # When: it notices
    # Then: it exits non-zero at once instead of renewing leases of jobs nobody finishes
    assert broken.wait(timeout=30) == 1, processes.log(broken)
    assert "died; handing every job back" in processes.log(broken)
    assert redis_client.zcard(KEYS.leases) == 0
    assert redis_client.llen(KEYS.queued) == 5
    # and a healthy worker runs every job
    healthy = processes.worker(env, "--burst")
    assert healthy.wait(timeout=60) == 0, processes.log(healthy)
    for i, r in enumerate(results):
        assert demo.add.get_result(r.id).return_value == i + 100
