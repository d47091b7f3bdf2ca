"""Cancelling a job that a worker holds: staff or code ask, the holder stops it.

Real Redis and PostgreSQL, real ``runworker`` processes. The scripts: a
running job's hash is marked (cancel.lua), the holder learns it from its
lease renewal (extend.lua), and every script that ends the attempt (start,
ack, nack, release, recover) finishes the job as a 'cancelled' tombstone
instead of running, acking, retrying or requeuing it. The mirror: the row
lock orders a cancel and a finishing attempt, so the job ends exactly one of
succeeded or cancelled and its attempt says the same. The worker: a thread
task sees the cancel through its context (or runs to completion, recorded
cancelled), a child process is killed, a SIGKILLed holder's job is never
run again.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
from django.utils import timezone

from reliable_jobs import mirror, staff
from reliable_jobs.backend import ReliableJobsBackend
from reliable_jobs.broker import TOMBSTONE_MS, Applied, Broker, ClaimedJob, NewJob
from reliable_jobs.compat import TaskResultStatus
from reliable_jobs.keys import QueueKeys
from reliable_jobs.mirror import AttemptRecord
from reliable_jobs.models import Attempt, AttemptOutcome, Job, JobState
from reliable_jobs.sweep import Sweep
from testproject.demo import tasks as demo

from .helpers import REDIS_URL, Processes, wait_until
from .test_admin import configured_backend

Q = "default"
KEYS = QueueKeys("rj", Q)
TOMBSTONE = {"state": "cancelled", "gen": "0"}


# -- the scripts ------------------------------------------------------------------


@pytest.fixture
def broker(redis_client: redis.Redis) -> Iterator[Broker]:
    b = Broker(REDIS_URL, "rj")
    yield b
    b.close()


def running(broker: Broker, job_id: str = "a", *, lease_ms: int = 60_000,
            started: bool = True) -> ClaimedJob:
    """A job claimed (and, with ``started``, marked started) under ``lease_ms``."""
    broker.enqueue(Q, [NewJob(job_id, "{}", 3)])
    [job] = broker.claim(Q, count=1, lease_ms=lease_ms).jobs
    if started:
        assert broker.start(Q, [job.fence]) == [Applied.DONE]
    return job


def off_every_list(redis_client: redis.Redis, job_id: str) -> bool:
    return not any(job_id in found for found in (
        redis_client.lrange(KEYS.queued, 0, -1), redis_client.lrange(KEYS.landing, 0, -1),
        redis_client.zrange(KEYS.leases, 0, -1), redis_client.zrange(KEYS.scheduled, 0, -1),
        redis_client.zrange(KEYS.dead, 0, -1)))


def test_the_holder_learns_of_the_cancel_from_its_renewal(
    broker: Broker, redis_client: redis.Redis
) -> None:
    # Given: a running job, and another that is not cancelled
    job = running(broker, "a")
    other = running(broker, "b")
    lease_before = redis_client.zscore(KEYS.leases, "a")

    # When staff cancel the first, and its holder renews both leases
    assert broker.cancel(Q, "a") == (True, "running")
    replies = broker.extend(Q, [job.fence, other.fence], lease_ms=120_000)

    # Then the reply says "cancel" for it only, and its lease is still renewed
    # (its holder is alive and stopping it); a stale token is still refused
    assert replies == [Applied.CANCELLED, Applied.DONE]
    assert redis_client.zscore(KEYS.leases, "a") > lease_before
    assert broker.extend(Q, [("a", job.attempt + 1, 0)], lease_ms=1_000) == [Applied.REFUSED]


def test_a_claim_cancelled_before_it_started_is_not_started(
    broker: Broker, redis_client: redis.Redis
) -> None:
    # Given: a claimed job whose task has not started
    job = running(broker, started=False)

    # When it is cancelled, then its holder asks to start it
    broker.cancel(Q, "a")
    reply = broker.start(Q, [job.fence])

    # Then it is not marked started (the task must not run), and its ack
    # finishes it as cancelled
    assert reply == [Applied.CANCELLED]
    assert redis_client.hget(KEYS.job("a"), "started") is None
    assert broker.ack(Q, [job.fence]) == [Applied.CANCELLED]
    assert redis_client.hgetall(KEYS.job("a")) == TOMBSTONE


@pytest.mark.parametrize("end", ["ack", "retry", "dead", "release"])
def test_every_end_of_a_cancelled_attempt_finishes_it_as_cancelled(
    broker: Broker, redis_client: redis.Redis, end: str
) -> None:
    # Given: a running job cancelled while it runs
    job = running(broker)
    broker.cancel(Q, "a")

    # When its holder ends the attempt, however it ended
    reply = {
        "ack": lambda: broker.ack(Q, [job.fence]),
        "retry": lambda: broker.nack(Q, [(*job.fence, 0, "boom")]),
        "dead": lambda: broker.nack(Q, [(*job.fence, -1, "boom")]),
        "release": lambda: broker.release(Q, [(*job.fence, True)]),
    }[end]()

    # Then it is neither acked, retried, buried nor handed back: it is a
    # cancelled tombstone (which refuses a late push), off every list
    assert reply == [Applied.CANCELLED]
    assert redis_client.hgetall(KEYS.job("a")) == TOMBSTONE
    assert redis_client.pttl(KEYS.job("a")) > 0
    assert off_every_list(redis_client, "a")
    assert broker.enqueue(Q, [NewJob("a", "{}", 3)]) == 0
    assert broker.claim(Q, count=5, lease_ms=1_000).jobs == []


def test_a_stale_holder_cannot_end_a_cancelled_attempt(
    broker: Broker, redis_client: redis.Redis
) -> None:
    # Given: a cancelled running job
    job = running(broker)
    broker.cancel(Q, "a")
    before = redis_client.hgetall(KEYS.job("a"))

    # When a holder with another token acks it
    reply = broker.ack(Q, [("a", job.attempt, job.gen + 1)])

    # Then it is refused and nothing moved
    assert reply == [Applied.REFUSED]
    assert redis_client.hgetall(KEYS.job("a")) == before


@pytest.mark.parametrize("started", [True, False])
def test_recover_never_requeues_a_cancelled_job_whose_holder_died(
    broker: Broker, redis_client: redis.Redis, started: bool
) -> None:
    # Given: a job cancelled while running (or claimed), whose holder then died
    job = running(broker, lease_ms=50, started=started)
    broker.cancel(Q, "a")
    wait_until(lambda: broker.expired(Q) or not started, message="the lease to expire")
    wait_until(lambda: redis_client.zscore(KEYS.leases, "a") < broker.server_time_ms(),
               message="the lease to expire")

    # When the sweep recovers expired leases
    outcomes = broker.recover(Q, lease_ms=1_000).outcomes

    # Then it is not requeued: it ends a cancelled tombstone
    assert [(o.id, o.kind, o.attempts) for o in outcomes] == [("a", "cancelled", job.attempt)]
    assert redis_client.hgetall(KEYS.job("a")) == TOMBSTONE
    assert off_every_list(redis_client, "a")


# -- the mirror: cancel racing a finishing attempt ---------------------------------


@pytest.fixture
def backend(rj_settings: Callable[..., dict[str, str]]) -> ReliableJobsBackend:
    return configured_backend()


def claim_and_start(backend: ReliableJobsBackend, job_id: str, *,
                    lease_ms: int = 60_000) -> ClaimedJob:
    """What a worker does before the task runs: claim, start mark, start record."""
    [job] = backend.broker.claim(Q, count=1, lease_ms=lease_ms).jobs
    assert job.id == job_id
    assert backend.broker.start(Q, [job.fence]) == [Applied.DONE]
    mirror.record(backend.database, [AttemptRecord(
        job.id, job.attempt, JobState.RUNNING, worker_id="w", started_at=timezone.now(),
        gen=job.gen)])
    return job


def succeed(backend: ReliableJobsBackend, job: ClaimedJob) -> list[Applied]:
    """What the worker does when the task returned: mirror the success, then ack."""
    now = timezone.now()
    mirror.record(backend.database, [AttemptRecord(
        job.id, job.attempt, JobState.SUCCEEDED, worker_id="w", started_at=now,
        finished_at=now, outcome=AttemptOutcome.SUCCEEDED, return_value=42, gen=job.gen)])
    return backend.broker.ack(Q, [job.fence])


@pytest.mark.django_db(transaction=True)
def test_a_finish_that_reached_the_mirror_first_wins_over_the_cancel(
    backend: ReliableJobsBackend, redis_client: redis.Redis
) -> None:
    # Given: a running job whose success reached the mirror (its ack on the way)
    result = demo.add.enqueue(1, 1)
    job = claim_and_start(backend, result.id)
    now = timezone.now()
    mirror.record(backend.database, [AttemptRecord(
        job.id, job.attempt, JobState.SUCCEEDED, finished_at=now,
        outcome=AttemptOutcome.SUCCEEDED, return_value=2, gen=job.gen)])

    # When staff cancel it, then the ack lands
    outcome = backend.cancel(result.id)
    acked = backend.broker.ack(Q, [job.fence])

    # Then the cancel is refused (the job finished), nothing was marked, and
    # the job ends succeeded in the row, the attempt and Redis
    assert not outcome.done
    assert outcome.message == f"Job {result.id} has finished (succeeded): there is nothing " \
                              "to cancel."
    assert acked == [Applied.DONE]
    row = Job.objects.get(pk=result.id)
    assert (row.state, row.return_value) == (JobState.SUCCEEDED, 2)
    assert list(Attempt.objects.filter(job=row).values_list("outcome", flat=True)) == [
        AttemptOutcome.SUCCEEDED]
    assert not redis_client.exists(KEYS.job(result.id))


@pytest.mark.django_db(transaction=True)
def test_a_finish_after_the_cancel_is_recorded_cancelled_never_succeeded(
    backend: ReliableJobsBackend, redis_client: redis.Redis
) -> None:
    # Given: a running job, cancelled by code before its worker heard of it
    result = demo.add.enqueue(1, 1)
    job = claim_and_start(backend, result.id)
    outcome = backend.cancel(result.id)
    assert outcome.done
    assert demo.add.get_result(result.id).status == TaskResultStatus.FAILED

    # When the task returns anyway and its worker records a success and acks
    acked = succeed(backend, job)

    # Then the job ends cancelled everywhere: the row (no return value), its
    # one attempt (the success is noted as discarded), and Redis (a tombstone)
    assert acked == [Applied.CANCELLED]
    row = Job.objects.get(pk=result.id)
    assert (row.state, row.return_value, row.attempts) == (JobState.CANCELLED, None, 1)
    assert row.finished_at is not None
    [attempt] = Attempt.objects.filter(job=row)
    assert attempt.outcome == AttemptOutcome.CANCELLED
    assert attempt.error.startswith("reliable_jobs.exceptions.JobCancelled: the job was "
                                    "cancelled while it ran; the attempt then ended (succeeded)")
    assert redis_client.hgetall(KEYS.job(result.id)) == TOMBSTONE
    got = demo.add.get_result(result.id)
    assert got.status == TaskResultStatus.FAILED
    assert [e.exception_class_path for e in got.errors] == [
        "reliable_jobs.exceptions.JobCancelled"]


@pytest.mark.django_db(transaction=True)
def test_the_sweep_closes_a_cancelled_attempt_whose_worker_died(
    backend: ReliableJobsBackend, redis_client: redis.Redis
) -> None:
    # Given: a running job cancelled by staff, whose worker then died (its
    # lease runs out, nobody acks)
    backend = configured_backend()
    result = demo.add.enqueue(1, 1)
    job = claim_and_start(backend, result.id, lease_ms=100)
    assert staff.cancel(backend.parts, result.id).done
    wait_until(lambda: backend.broker.expired(Q), message="the lease to expire")

    # When the sweep runs
    report = Sweep(backend.parts).redis_pass()

    # Then the job is not run again, and its attempt is closed as cancelled
    assert report.cancelled == 1 and report.requeued == 0
    assert redis_client.hgetall(KEYS.job(result.id)) == TOMBSTONE
    assert off_every_list(redis_client, result.id)
    [attempt] = Attempt.objects.filter(job_id=result.id)
    assert (attempt.number, attempt.outcome) == (job.attempt, AttemptOutcome.CANCELLED)
    assert Job.objects.get(pk=result.id).state == JobState.CANCELLED


@pytest.mark.django_db(transaction=True)
def test_a_late_push_does_not_bring_back_a_job_cancelled_while_queued(
    backend: ReliableJobsBackend, redis_client: redis.Redis
) -> None:
    # Given: a queued job cancelled by staff, whose id a claim then reaches and drops
    result = demo.add.enqueue(1, 1)
    pushed = redis_client.hget(KEYS.job(result.id), "payload")
    assert staff.cancel(backend.parts, result.id).done
    assert backend.broker.claim(Q, count=10, lease_ms=60_000).jobs == []

    # When: the job's push arrives once more (a producer's on-commit push
    # that stalled, of the same generation)
    written = backend.broker.enqueue(Q, [NewJob(result.id, pushed, 3)])

    # Then: the tombstone the claim left refuses it, for as long as a
    # scheduled or running job's tombstone lives, and the job never runs
    assert written == 0
    assert redis_client.hgetall(KEYS.job(result.id)) == TOMBSTONE
    assert 0 < redis_client.pttl(KEYS.job(result.id)) <= TOMBSTONE_MS
    assert backend.broker.claim(Q, count=10, lease_ms=60_000).jobs == []
    assert off_every_list(redis_client, result.id)
    assert not Attempt.objects.filter(job_id=result.id).exists()
    assert Job.objects.get(pk=result.id).state == JobState.CANCELLED


# -- real workers ------------------------------------------------------------------


def running_row(job_id: str) -> bool:
    return Job.objects.filter(pk=job_id, state=JobState.RUNNING).exists()


def ended_cancelled(job_id: str) -> bool:
    return Attempt.objects.filter(job_id=job_id, outcome=AttemptOutcome.CANCELLED).exists()


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_thread_task_stops_at_its_checkpoint(
    rj_settings: Callable[..., dict[str, str]], processes: Processes, redis_client: redis.Redis
) -> None:
    # Given: a worker running a task that works in steps for two minutes,
    # checking for a cancel at each
    env = rj_settings()
    backend = configured_backend()
    result = demo.stop_when_cancelled.enqueue(120)
    worker = processes.worker(env)
    wait_until(lambda: running_row(result.id), message="the task to start")

    # When code cancels it
    assert backend.cancel(result.id).done

    # Then it stops at its next checkpoint, long before its two minutes: its
    # attempt is cancelled, the job is cancelled and never retried
    wait_until(lambda: ended_cancelled(result.id), timeout=30,
               message="the task to stop at its checkpoint")
    wait_until(lambda: redis_client.hgetall(KEYS.job(result.id)) == TOMBSTONE,
               message="the worker's ack to finish it as cancelled")
    [attempt] = Attempt.objects.filter(job_id=result.id)
    assert "stopped at a cancellation checkpoint" in attempt.error
    assert Job.objects.get(pk=result.id).state == JobState.CANCELLED
    assert processes.stop(worker) == 0
    assert "1 cancelled" in processes.log(worker)
    assert Attempt.objects.filter(job_id=result.id).count() == 1


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_thread_task_that_ignores_the_cancel_runs_to_completion_recorded_cancelled(
    rj_settings: Callable[..., dict[str, str]], processes: Processes, redis_client: redis.Redis
) -> None:
    # Given: a worker running a plain task that sleeps 3 s (it cannot be stopped)
    env = rj_settings()
    backend = configured_backend()
    result = demo.sleep_for.enqueue(3)
    worker = processes.worker(env)
    wait_until(lambda: running_row(result.id), message="the task to start")

    # When staff cancel it while it sleeps
    assert staff.cancel(backend.parts, result.id).done

    # Then it runs to its end, but its outcome is recorded as cancelled (no
    # return value) and it is never retried
    wait_until(lambda: ended_cancelled(result.id), message="the task to end")
    wait_until(lambda: redis_client.hgetall(KEYS.job(result.id)) == TOMBSTONE,
               message="the worker's ack to finish it as cancelled")
    row = Job.objects.get(pk=result.id)
    assert (row.state, row.return_value) == (JobState.CANCELLED, None)
    [attempt] = Attempt.objects.filter(job=row)
    assert "the task ran to completion anyway; its result was discarded" in attempt.error
    assert processes.stop(worker) == 0
    assert Attempt.objects.filter(job=row).count() == 1


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads /proc (Linux)")
def test_a_task_in_a_child_process_is_killed(
    rj_settings: Callable[..., dict[str, str]], processes: Processes, redis_client: redis.Redis,
    tmp_path: Path
) -> None:
    # Given: a worker running a task with a time limit (so in a child
    # process) that would sleep for a minute
    env = rj_settings()
    backend = configured_backend()
    pid_file = tmp_path / "child.pid"
    result = demo.report_pid_then_sleep.enqueue(str(pid_file), 60)
    worker = processes.worker(env)
    wait_until(pid_file.exists, message="the child to start")
    child = int(pid_file.read_text())

    # When staff cancel it
    assert staff.cancel(backend.parts, result.id).done

    # Then the child process is killed, and the job ends cancelled, not retried
    try:
        wait_until(lambda: not _alive(child), timeout=10, message="the child to be killed")
    finally:
        with contextlib.suppress(ProcessLookupError):
            if _alive(child):
                os.kill(child, signal.SIGKILL)
    wait_until(lambda: ended_cancelled(result.id), message="the attempt to be recorded")
    [attempt] = Attempt.objects.filter(job_id=result.id)
    assert "its process was killed" in attempt.error
    wait_until(lambda: redis_client.hgetall(KEYS.job(result.id)) == TOMBSTONE,
               message="the worker's ack to finish it as cancelled")
    assert Job.objects.get(pk=result.id).state == JobState.CANCELLED
    assert processes.stop(worker) == 0


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


@pytest.mark.slow
@pytest.mark.crash
@pytest.mark.django_db(transaction=True)
def test_a_cancelled_job_whose_worker_is_sigkilled_is_not_run_again(
    rj_settings: Callable[..., dict[str, str]], processes: Processes, redis_client: redis.Redis
) -> None:
    # Given: a worker running a job that ignores cancels; staff cancel it, and
    # the worker is SIGKILLed before the task ends
    env = rj_settings()
    backend = configured_backend()
    result = demo.sleep_for.enqueue(30)
    first = processes.worker(env)
    wait_until(lambda: running_row(result.id), message="the task to start")
    assert staff.cancel(backend.parts, result.id).done
    first.send_signal(signal.SIGKILL)
    first.wait(timeout=10)

    # When another worker (and its sweep) takes over once the lease expires
    second = processes.worker(env)

    # Then the job is not run again: its one attempt is closed as cancelled,
    # and Redis holds only the tombstone
    wait_until(lambda: ended_cancelled(result.id), message="the sweep to close the attempt")
    wait_until(lambda: redis_client.hgetall(KEYS.job(result.id)) == TOMBSTONE,
               message="the sweep to finish it as cancelled")
    assert off_every_list(redis_client, result.id)
    [attempt] = Attempt.objects.filter(job_id=result.id)
    assert "its worker then stopped renewing the lease" in attempt.error
    assert Job.objects.get(pk=result.id).state == JobState.CANCELLED
    assert processes.stop(second) == 0
    assert Attempt.objects.filter(job_id=result.id).count() == 1

