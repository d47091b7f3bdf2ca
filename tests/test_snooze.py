"""Snooze: a task runs again later without using an attempt, fenced like every outcome.

Real Redis (and Valkey for the script) and PostgreSQL, real workers. The
script (snooze.lua): only the holder's snooze applies; the job waits in
``scheduled`` until a due time on Redis's clock, and its max_attempts grows
by one, since the attempt number is the fencing token and never goes back.
The mirror: the attempt is recorded ``snoozed`` and its job's budget moves
with it, never for a stale holder. The worker: ``raise Snooze(...)`` from a
task, a thousand times over on a job with ``max_attempts=1``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from django.tasks import task_backends

from reliable_jobs import Snooze, mirror
from reliable_jobs.broker import Applied, Broker, ClaimedJob, NewJob
from reliable_jobs.compat import TaskResultStatus
from reliable_jobs.keys import QueueKeys
from reliable_jobs.mirror import AttemptRecord
from reliable_jobs.models import Attempt, AttemptOutcome, Job, JobState
from reliable_jobs.worker import Worker
from testproject.demo import tasks as demo

from .helpers import REDIS_URL, Processes, queued_by_priority, worker_in_thread
from .helpers import wait_until as wait_for

Q = "default"
KEYS = QueueKeys("rj", Q)


@pytest.fixture
def broker(redis_client: redis.Redis) -> Iterator[Broker]:
    b = Broker(REDIS_URL, "rj")
    yield b
    b.close()


def claimed(broker: Broker, *, lease_ms: int = 60_000) -> ClaimedJob:
    [job] = broker.claim(Q, count=1, lease_ms=lease_ms).jobs
    assert broker.start(Q, [job.fence]) == [Applied.DONE]
    return job


# -- Snooze itself ------------------------------------------------------------


def test_snooze_takes_milliseconds_or_seconds() -> None:
    assert Snooze(250).delay_ms == 250
    assert Snooze(seconds=1.5).delay_ms == 1500
    assert Snooze(0).delay_ms == 0
    for wrong in ((-1,), (1.5,), (True,)):
        with pytest.raises(ValueError):
            Snooze(*wrong)
    with pytest.raises(ValueError):
        Snooze(10, seconds=1)
    with pytest.raises(ValueError):
        Snooze()


# -- the script -----------------------------------------------------------------


def test_a_snooze_waits_until_a_due_time_on_redis_clock_and_gives_the_attempt_back(
    server_url: str,
) -> None:
    # Given: a job with one attempt, claimed and started
    broker = Broker(server_url, "rj")
    client = redis.Redis.from_url(server_url, decode_responses=True)
    try:
        broker.enqueue(Q, [NewJob("a", "{}", 1)])
        job = claimed(broker)
        seconds, micros = client.time()
        before_ms = seconds * 1000 + micros // 1000

        # When its task snoozes for 5 s
        assert broker.snooze(Q, [(*job.fence, 5_000)]) == [Applied.DONE]

        # Then it waits in scheduled, due 5 s from then on Redis's clock, its lease
        # dropped and its budget one more (attempts, the fence, unchanged)
        due = client.zscore(KEYS.scheduled, "a")
        assert due is not None and before_ms + 5_000 <= due <= before_ms + 6_000
        assert client.zscore(KEYS.leases, "a") is None
        assert client.hmget(KEYS.job("a"), "state", "attempts", "max_attempts") == [
            "scheduled", "1", "2"]
    finally:
        broker.close()
        client.close()


def test_a_snooze_of_zero_queues_the_job_at_once(broker: Broker,
                                                 redis_client: redis.Redis) -> None:
    broker.enqueue(Q, [NewJob("a", "{}", 1)])
    job = claimed(broker)

    assert broker.snooze(Q, [(*job.fence, 0)]) == [Applied.DONE]

    assert redis_client.lrange(KEYS.queued, 0, -1) == ["a"]
    [again] = broker.claim(Q, count=1, lease_ms=60_000).jobs
    assert (again.attempt, again.max_attempts) == (2, 2)


def test_a_snoozed_job_goes_back_at_its_priority_and_in_its_fair_group(
    broker: Broker, redis_client: redis.Redis
) -> None:
    broker.enqueue(Q, [NewJob("a", "{}", 1, priority=5), NewJob("b", "{}", 1, group="t1")])
    jobs = broker.claim(Q, count=2, lease_ms=60_000).jobs
    assert broker.start(Q, [j.fence for j in jobs]) == [Applied.DONE] * 2

    assert broker.snooze(Q, [(*j.fence, 0) for j in jobs]) == [Applied.DONE] * 2

    assert queued_by_priority(broker, Q) == {5: 1}
    assert redis_client.lrange(KEYS.group(0, "t1"), 0, -1) == ["b"]


def test_a_stale_worker_snoozing_after_its_lease_was_lost_is_refused(
    broker: Broker, redis_client: redis.Redis
) -> None:
    # Given: worker A's lease expired, the sweep requeued the job, worker B holds it now
    broker.enqueue(Q, [NewJob("a", "{}", 3)])
    stale = claimed(broker, lease_ms=200)
    time.sleep(0.25)
    recovered = broker.recover(Q, lease_ms=60_000)
    assert [o.kind for o in recovered.outcomes] == ["expired"]
    current = claimed(broker)
    assert current.attempt == stale.attempt + 1

    # When A's task, still running, snoozes
    refused = broker.snooze(Q, [(*stale.fence, 10_000)])

    # Then nothing changed: B still holds the job, on its lease, with its budget
    assert refused == [Applied.REFUSED]
    assert redis_client.hmget(KEYS.job("a"), "state", "attempts", "max_attempts") == [
        "running", "2", "3"]
    assert redis_client.zscore(KEYS.leases, "a") is not None
    assert redis_client.zscore(KEYS.scheduled, "a") is None
    assert broker.ack(Q, [current.fence]) == [Applied.DONE]


def test_a_job_marked_for_cancellation_is_finished_not_snoozed(
    broker: Broker, redis_client: redis.Redis
) -> None:
    broker.enqueue(Q, [NewJob("a", "{}", 3)])
    job = claimed(broker)
    broker.cancel(Q, "a")

    assert broker.snooze(Q, [(*job.fence, 0)]) == [Applied.CANCELLED]

    assert redis_client.hget(KEYS.job("a"), "state") == "cancelled"
    assert redis_client.zscore(KEYS.scheduled, "a") is None
    assert redis_client.lrange(KEYS.queued, 0, -1) == []


def test_a_thousand_snoozes_never_make_a_job_of_one_attempt_dead(
    broker: Broker, redis_client: redis.Redis
) -> None:
    # Given: a job allowed one attempt
    broker.enqueue(Q, [NewJob("a", "{}", 1)])

    # When it is claimed, started and snoozed a thousand times
    for n in range(1, 1001):
        job = claimed(broker)
        assert job.attempt == n
        assert broker.snooze(Q, [(*job.fence, 0)]) == [Applied.DONE]

    # Then it is still claimed to run, never buried, and can succeed
    result = broker.claim(Q, count=1, lease_ms=60_000)
    assert result.dead == [] and [j.attempt for j in result.jobs] == [1001]
    assert broker.start(Q, [result.jobs[0].fence]) == [Applied.DONE]
    assert broker.ack(Q, [result.jobs[0].fence]) == [Applied.DONE]
    assert redis_client.zcard(KEYS.dead) == 0


# -- the mirror -------------------------------------------------------------------


def a_row(max_attempts: int = 1, **fields: Any) -> Job:
    result = demo.add.using(queue_name=Q).enqueue(1, 2)
    Job.objects.filter(pk=result.id).update(max_attempts=max_attempts, **fields)
    return Job.objects.get(pk=result.id)


def snoozed(row: Job, attempt: int, *, claimed_max: int, delay_ms: int = 1_000,
            gen: int = 0) -> AttemptRecord:
    """The record of ``attempt`` snoozing, its claim having said ``claimed_max`` attempts."""
    return mirror.snoozed_record(str(row.pk), attempt, gen=gen, delay_ms=delay_ms,
                                 max_attempts=claimed_max, worker_id="w", started_at=None)


@pytest.mark.django_db(transaction=True)
def test_a_snoozed_attempt_is_mirrored_with_its_budget_given_back(rj_settings: Any) -> None:
    # Given: a job of one attempt
    row = a_row(max_attempts=1)

    # When its first attempt snoozes for a second
    mirror.record("default", [snoozed(row, 1, claimed_max=1)])

    # Then the attempt says snoozed, the job waits again with one more attempt
    row.refresh_from_db()
    assert (row.state, row.attempts, row.max_attempts) == (JobState.SCHEDULED, 1, 2)
    assert row.run_after is not None
    attempt = Attempt.objects.get(job=row, number=1)
    assert attempt.outcome == AttemptOutcome.SNOOZED
    # And the result reads as waiting, with no error
    result = task_backends["default"].get_result(str(row.pk))
    assert result.status == TaskResultStatus.READY and result.errors == []

    # When the same batch is written again (a commit whose reply was lost)
    mirror.record("default", [snoozed(row, 1, claimed_max=1)])
    row.refresh_from_db()
    assert row.max_attempts == 2


@pytest.mark.django_db(transaction=True)
def test_a_stale_holders_snooze_gives_nothing_back_in_the_mirror(rj_settings: Any) -> None:
    # Given: attempt 1 lost its lease (recorded lease_expired), attempt 2 runs
    row = a_row(max_attempts=3)
    mirror.record("default", [mirror.expired_record(str(row.pk), 1, dead=False, error="lost")])
    mirror.record("default", [AttemptRecord(job_id=str(row.pk), attempt=2,
                                            job_state=JobState.RUNNING, worker_id="b")])

    # When attempt 1's late snooze arrives
    mirror.record("default", [snoozed(row, 1, claimed_max=3)])

    # Then neither the job nor its budget moved, and the attempt stays lost
    row.refresh_from_db()
    assert (row.state, row.attempts, row.max_attempts) == (JobState.RUNNING, 2, 3)
    assert Attempt.objects.get(job=row, number=1).outcome == AttemptOutcome.LEASE_EXPIRED


@pytest.mark.django_db(transaction=True)
def test_a_snooze_of_an_attempt_the_sweep_expired_gives_nothing_back(rj_settings: Any) -> None:
    # Given: the sweep recorded attempt 1 as lease_expired (requeued, charged), before any
    # later attempt reached the row
    row = a_row(max_attempts=3)
    mirror.record("default", [AttemptRecord(job_id=str(row.pk), attempt=1,
                                            job_state=JobState.RUNNING, worker_id="a")])
    mirror.record("default", [mirror.expired_record(str(row.pk), 1, dead=False, error="lost")])

    # When attempt 1's late snooze arrives
    mirror.record("default", [snoozed(row, 1, claimed_max=3)])

    # Then the row follows Redis (queued, the attempt used), its budget untouched
    row.refresh_from_db()
    assert (row.state, row.attempts, row.max_attempts) == (JobState.QUEUED, 1, 3)
    assert Attempt.objects.get(job=row, number=1).outcome == AttemptOutcome.LEASE_EXPIRED


@pytest.mark.django_db(transaction=True)
def test_a_snooze_after_the_job_was_cancelled_is_recorded_cancelled(rj_settings: Any) -> None:
    # Given: staff cancelled the job while its attempt ran
    row = a_row(max_attempts=1)
    mirror.record("default", [AttemptRecord(job_id=str(row.pk), attempt=1,
                                            job_state=JobState.RUNNING, worker_id="w")])
    Job.objects.filter(pk=row.pk).update(state=JobState.CANCELLED)

    # When its task then snoozes
    record = snoozed(row, 1, claimed_max=1)
    mirror.record("default", [record])

    # Then the attempt is recorded cancelled (the finisher then acks it: cancel wins),
    # and the job neither waits again nor gets an attempt back
    assert record.outcome == AttemptOutcome.CANCELLED and record.budget is None
    row.refresh_from_db()
    assert (row.state, row.max_attempts) == (JobState.CANCELLED, 1)
    assert Attempt.objects.get(job=row, number=1).outcome == AttemptOutcome.CANCELLED


# -- the worker ---------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_task_snoozing_a_thousand_times_with_one_attempt_still_succeeds(
    rj_settings: Any,
) -> None:
    # Given: a task of max_attempts=1 that snoozes 1,000 times before it adds
    rj_settings()
    result = demo.snooze_then_add.enqueue(1000, 2, 3)

    # When a worker runs it
    with worker_in_thread(Worker(task_backends["default"], queues=[Q], concurrency=1)):
        done = wait_for(lambda: (r := demo.snooze_then_add.get_result(result.id)).is_finished
                        and r, timeout=120, message="the job to finish")

    # Then it succeeded, never dead, its 1,000 snoozes recorded as such
    assert done.status == TaskResultStatus.SUCCESSFUL and done.return_value == 5
    row = Job.objects.get(pk=result.id)
    assert (row.state, row.attempts, row.max_attempts) == (JobState.SUCCEEDED, 1001, 1001)
    outcomes = list(Attempt.objects.filter(job=row).values_list("outcome", flat=True))
    assert outcomes.count(AttemptOutcome.SNOOZED) == 1000
    assert outcomes.count(AttemptOutcome.SUCCEEDED) == 1
    assert row.checkpoint == 1000


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_snooze_in_a_time_limited_task_snoozes_too(rj_settings: Any,
                                                      processes: Processes) -> None:
    # Given: a task in a child process of its own (timeout_ms) that snoozes twice
    env = rj_settings()
    result = demo.snooze_then_add_in_child.enqueue(2, 1, 1, delay_ms=50)

    # When a real worker runs it (its child reaches the same database)
    processes.worker(env)
    done = wait_for(lambda: (r := demo.snooze_then_add_in_child.get_result(result.id))
                    .is_finished and r, timeout=60, message="the job to finish")

    # Then each snooze was one given-back attempt, and the checkpoint carried the count
    assert done.status == TaskResultStatus.SUCCESSFUL and done.return_value == 2
    outcomes = list(Attempt.objects.filter(job_id=result.id).order_by("number")
                    .values_list("outcome", flat=True))
    assert outcomes == ["snoozed", "snoozed", "succeeded"]
    assert Job.objects.get(pk=result.id).checkpoint == 2


@pytest.mark.slow
@pytest.mark.crash
@pytest.mark.django_db(transaction=True)
def test_a_worker_killed_between_mirroring_a_snooze_and_applying_it_still_uses_no_attempt(
    rj_settings: Any, processes: Processes
) -> None:
    # Given: a one-attempt job that snoozes once, on a worker that dies (like a SIGKILL)
    # once the snooze is in the mirror and before snooze.lua runs
    env = rj_settings()
    result = demo.snooze_then_add.enqueue(1, 2, 3)
    victim = processes.worker(env, extra_env={"RJ_CRASH_AT": "before_ack"})
    assert victim.wait(timeout=60) == 86, processes.log(victim)
    row = Job.objects.get(pk=result.id)
    assert (row.state, row.max_attempts) == (JobState.QUEUED, 2)  # the mirror has the snooze

    # When a healthy worker (and its sweep) takes over once the lease expired
    processes.worker(env)
    done = wait_for(lambda: (r := demo.snooze_then_add.get_result(result.id)).is_finished
                    and r, timeout=60, message="the job to finish")

    # Then the sweep settled the snooze from the mirror (queued again, attempt given
    # back) instead of burying the job as a lost last attempt
    assert done.status == TaskResultStatus.SUCCESSFUL and done.return_value == 5
    outcomes = list(Attempt.objects.filter(job_id=result.id).order_by("number")
                    .values_list("outcome", flat=True))
    assert outcomes == ["snoozed", "succeeded"]
