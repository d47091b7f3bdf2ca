"""Rebuilds from the mirror (reconcile, staff retry and requeue) and what may undo them.

Each test stages one interleaving with real Redis and PostgreSQL: a rebuild
whose transaction dies while its push is slow, a late push that lands
between reconcile's look and its push, a cancel Redis lost, a prune racing
a job Redis still holds, and a queue whose scripts fail beside healthy ones.
Faults are injected by wrapping one broker method, or by the server ending
a session idle in its transaction (as the worker's own session limit does).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import pytest
import redis
from django.db import DatabaseError, InterfaceError, close_old_connections, connection
from django.utils import timezone

from reliable_jobs import mirror, staff
from reliable_jobs.broker import Broker, ClaimedJob, NewJob
from reliable_jobs.compat import task_backends
from reliable_jobs.keys import QueueKeys
from reliable_jobs.mirror import AttemptRecord
from reliable_jobs.models import Attempt, AttemptOutcome, Job, JobState
from reliable_jobs.retention import prune
from reliable_jobs.sweep import Sweep
from reliable_jobs.worker.finisher import FinishedAttempt, Finisher
from reliable_jobs.worker.shared import Shared
from testproject.demo import tasks as demo

from .helpers import Processes, backdate

pytestmark = pytest.mark.django_db(transaction=True)
KEYS = QueueKeys("rj", "default")
CRASHED = 86  # faults.crash_point's exit code


def ran(job: ClaimedJob) -> list[AttemptRecord]:
    """The start and success records a worker writes for ``job``."""
    now = timezone.now()
    return [AttemptRecord(job_id=job.id, attempt=job.attempt, gen=job.gen,
                          job_state=JobState.RUNNING, worker_id="w", started_at=now),
            AttemptRecord(job_id=job.id, attempt=job.attempt, gen=job.gen,
                          job_state=JobState.SUCCEEDED, worker_id="w", started_at=now,
                          finished_at=now, outcome=AttemptOutcome.SUCCEEDED, return_value=3)]


def run_to_the_end(broker: Broker, *, alone: bool = True) -> ClaimedJob:
    """Claim a job (the one job waiting, when ``alone``), mirror its run, ack it:
    what a worker does."""
    jobs = broker.claim("default", count=10 if alone else 1, lease_ms=60_000).jobs
    assert len(jobs) == 1, jobs
    assert broker.start("default", [jobs[0].fence]) == [True]
    mirror.record("default", ran(jobs[0]))
    assert broker.ack("default", [jobs[0].fence]) == [True]
    return jobs[0]


@contextmanager
def around_script(broker: Broker, name: str, before: Callable[[], Any]) -> Iterator[None]:
    """Run ``before`` each time ``broker`` is about to run the script ``name``
    (the script runs as usual for ``before`` itself)."""
    real = broker._run
    inside: list[bool] = []

    def run(script: str, keys: Any, args: Any) -> Any:
        if script == name and not inside:
            inside.append(True)
            try:
                before()
            finally:
                inside.clear()
        return real(script, keys, args)

    broker._run = run  # type: ignore[method-assign]
    try:
        yield
    finally:
        broker._run = real  # type: ignore[method-assign]


@contextmanager
def idle_in_transaction_timeout(ms: int) -> Iterator[None]:
    """This test's database session ends any transaction left idle for ``ms``
    (the worker's sessions carry the same limit: half a lease)."""
    with connection.cursor() as cursor:
        cursor.execute(f"SET idle_in_transaction_session_timeout = {int(ms)}")
    try:
        yield
    finally:
        connection.close()  # the next query opens a session without the limit


def as_the_maintenance_thread(action: Callable[[], Any]) -> None:
    """Run ``action`` as a worker's maintenance thread does: a database error is
    logged and retried at the next pass, the connection dropped."""
    try:
        action()
    except (DatabaseError, InterfaceError):
        connection.close()


needs_postgresql = pytest.mark.skipif(
    connection.vendor != "postgresql",
    reason="the session limit idle_in_transaction_session_timeout is PostgreSQL's")


# -- item 1: a rebuild commits its generation before it pushes ---------------


@needs_postgresql
def test_a_reconcile_whose_push_answers_slowly_still_leaves_row_and_redis_agreeing(
    rj_settings: Any, redis_client: redis.Redis
) -> None:
    # Given: a job Redis lost, and a push that answers slowly (Redis just
    # restarted), slower than the session may sit idle in a transaction
    rj_settings()
    backend = task_backends["default"]
    result = demo.add.enqueue(1, 2)
    redis_client.flushdb()
    backdate(result.id)

    # When: reconcile rebuilds it
    with idle_in_transaction_timeout(200), around_script(
            backend.broker, "enqueue", lambda: time.sleep(0.6)):
        as_the_maintenance_thread(Sweep(backend.parts).reconcile)

    # Then: the job runs once and its run is the job's history
    job = run_to_the_end(backend.broker)
    row = Job.objects.get(pk=result.id)
    assert (row.state, row.generation, row.return_value) == (JobState.SUCCEEDED, job.gen, 3)
    assert Attempt.objects.filter(job=row, outcome=AttemptOutcome.SUCCEEDED).count() == 1
    backdate(result.id)
    assert Sweep(backend.parts).reconcile().pushed == 0


@needs_postgresql
@pytest.mark.parametrize("action", ["retry", "requeue"])
def test_a_staff_rebuild_whose_push_answers_slowly_is_not_lost(
    action: str, rj_settings: Any, redis_client: redis.Redis
) -> None:
    # Given: a dead (for retry) or cancelled (for requeue) job Redis no
    # longer holds, and a push that answers slowly
    rj_settings()
    backend = task_backends["default"]
    result = demo.add.enqueue(1, 2)
    ended = JobState.DEAD if action == "retry" else JobState.CANCELLED
    Job.objects.filter(pk=result.id).update(state=ended, finished_at=timezone.now())
    redis_client.flushdb()

    # When: staff retry or requeue it
    with idle_in_transaction_timeout(200), around_script(
            backend.broker, "enqueue", lambda: time.sleep(0.6)):
        as_the_maintenance_thread(lambda: getattr(staff, action)(backend.parts, result.id))

    # Then: the job runs, and its run is the job's history (the row is not
    # left dead or cancelled under a job Redis runs)
    job = run_to_the_end(backend.broker)
    row = Job.objects.get(pk=result.id)
    assert (row.state, row.generation, row.return_value) == (JobState.SUCCEEDED, job.gen, 3)


@pytest.mark.parametrize("point", ["reconcile_before_push", "reconcile_after_push"])
def test_a_reconcile_killed_around_its_push_loses_nothing_and_runs_the_job_once(
    point: str, rj_settings: Any, processes: Processes, redis_client: redis.Redis
) -> None:
    # Given: jobs Redis lost
    env = rj_settings()
    backend = task_backends["default"]
    ids = [demo.add.enqueue(i, 0).id for i in range(3)]
    redis_client.flushdb()
    backdate(*ids)

    # When: a sweep dies just before or just after its push
    sweep = processes.manage("recoverjobs", env=env, extra_env={"RJ_CRASH_AT": point})
    assert sweep.wait(timeout=30) == CRASHED, processes.log(sweep)
    # ... and the next reconcile, after the grace, pushes what is missing
    backdate(*ids)
    Sweep(backend.parts).reconcile()

    # Then: each job runs once, and that run is its history
    for _ in ids:
        run_to_the_end(backend.broker, alone=False)
    assert backend.broker.claim("default", count=10, lease_ms=60_000).jobs == []
    assert set(Job.objects.filter(pk__in=ids).values_list("state", flat=True)) == {
        JobState.SUCCEEDED}
    assert Attempt.objects.filter(job_id__in=ids).count() == len(ids)


# -- item 2 and 13: only what Redis took moves the row, and is counted --------


def test_a_late_push_landing_before_reconciles_push_is_taken_over(
    rj_settings: Any, redis_client: redis.Redis
) -> None:
    # Given: a job whose on-commit push is held up past the grace, so
    # reconcile finds it missing
    rj_settings()
    backend = task_backends["default"]
    broker: Broker = backend.broker
    result = demo.add.enqueue(1, 2)
    row = Job.objects.get(pk=result.id)
    late = NewJob(str(row.pk), '{"task":"testproject.demo.tasks.add","args":[1,2],"kwargs":{}}', 3)
    redis_client.flushdb()
    backdate(result.id)

    # When: the late push (generation 0) lands between reconcile's look and its push
    with around_script(broker, "enqueue", lambda: broker._run(
            "enqueue", _enqueue_keys(broker), [late.id, late.payload, 3, 0, 0, 0, 0, ""])):
        report = Sweep(backend.parts).reconcile()

    # Then: one job waits, of the row's generation, and the run of it is the
    # job's history
    assert report.pushed == 1
    assert redis_client.lrange(KEYS.queued, 0, -1) == [result.id]
    job = run_to_the_end(broker)
    row.refresh_from_db()
    assert (job.gen, row.state, row.generation) == (1, JobState.SUCCEEDED, 1)


def _enqueue_keys(broker: Broker) -> tuple[str, ...]:
    k = broker.keys("default")
    return (k.queued, k.scheduled, k.wake, k.job_prefix, k.bands, k.band_prefix, *k.fair)


def test_a_late_push_claimed_before_reconciles_push_keeps_the_row_on_its_generation(
    rj_settings: Any, redis_client: redis.Redis
) -> None:
    # Given: a job whose on-commit push is held up past the grace
    rj_settings()
    backend = task_backends["default"]
    broker: Broker = backend.broker
    result = demo.add.enqueue(1, 2)
    payload = '{"task":"testproject.demo.tasks.add","args":[1,2],"kwargs":{}}'
    redis_client.flushdb()
    backdate(result.id)
    held: list[ClaimedJob] = []

    def late_push_claimed() -> None:
        if not held:
            broker._run("enqueue", _enqueue_keys(broker), [result.id, payload, 3, 0, 0, 0, 0, ""])
            held.extend(broker.claim("default", count=1, lease_ms=60_000).jobs)

    # When: the late push lands, and a worker claims it, between reconcile's
    # look and its push
    with around_script(broker, "enqueue", late_push_claimed):
        report = Sweep(backend.parts).reconcile()

    # Then: nothing was pushed, and the holder's run is the job's history
    assert report.pushed == 0
    (job,) = held
    assert broker.start("default", [job.fence]) == [True]
    mirror.record("default", ran(job))
    assert broker.ack("default", [job.fence]) == [True]
    row = Job.objects.get(pk=result.id)
    assert (row.state, row.generation, row.return_value) == (JobState.SUCCEEDED, 0, 3)
    backdate(result.id)
    assert Sweep(backend.parts).reconcile().pushed == 0


# -- item 6: one queue's script error never stops the sweep of the others -----


def test_a_queue_whose_scripts_fail_never_stops_the_sweep_of_the_others(
    rj_settings: Any, redis_client: redis.Redis, app_log: list[Any]
) -> None:
    # Given: queue "broken", swept first, whose keys hold a type no script
    # expects (promote and reconcile's push fail there), and queue "default"
    # with a job due for promotion and a job Redis lost
    rj_settings(queues=["broken", "default"])
    backend = task_backends["default"]
    broken = QueueKeys("rj", "broken")
    stranded = demo.add.using(queue_name="broken").enqueue(0, 0)
    lost = demo.add.enqueue(1, 2)
    due = demo.add.using(run_after=timezone.now() + timedelta(milliseconds=300)).enqueue(3, 4)
    redis_client.delete(KEYS.job(lost.id), broken.queued, broken.job(stranded.id))
    redis_client.lrem(KEYS.queued, 0, lost.id)
    redis_client.set(broken.scheduled, "not a sorted set")
    redis_client.set(broken.queued, "not a list")
    backdate(stranded.id, lost.id)
    time.sleep(0.4)

    # When: the sweep passes over both queues
    sweep = Sweep(backend.parts)
    redis_report = sweep.redis_pass()
    reconcile_report = sweep.reconcile()

    # Then: "default" was promoted and reconciled, and "broken" was logged
    assert redis_report.promoted == 1
    assert reconcile_report.pushed == 1
    assert sorted(redis_client.lrange(KEYS.queued, 0, -1)) == sorted([lost.id, due.id])
    assert [r for r in app_log if r.levelname == "ERROR" and "'broken'" in r.getMessage()]


# -- item 10: a cancel Redis lost is applied again -----------------------------


def lose_the_cancel(client: redis.Redis, job_id: str, state: str) -> None:
    """What a failover to a replica that missed the cancel's write leaves behind."""
    client.hset(KEYS.job(job_id), "state", state)
    client.hdel(KEYS.job(job_id), "cancel")


def running_job_whose_cancel_redis_lost(backend: Any, client: redis.Redis) -> ClaimedJob:
    """A job claimed and started, cancelled by staff, its cancel then lost by Redis."""
    broker: Broker = backend.broker
    result = demo.add.enqueue(1, 2)
    job = broker.claim("default", count=1, lease_ms=60_000).jobs[0]
    assert broker.start("default", [job.fence]) == [True]
    assert staff.cancel(backend.parts, result.id).done
    lose_the_cancel(client, result.id, "running")
    return job


def test_a_cancel_of_a_waiting_job_lost_by_redis_is_applied_again_by_reconcile(
    rj_settings: Any, redis_client: redis.Redis
) -> None:
    # Given: a queued job staff cancelled, whose cancel Redis then lost
    rj_settings()
    backend = task_backends["default"]
    result = demo.add.enqueue(1, 2)
    assert staff.cancel(backend.parts, result.id).done
    lose_the_cancel(redis_client, result.id, "queued")

    # When: reconcile runs
    Sweep(backend.parts).reconcile()

    # Then: no worker can claim the job
    assert backend.broker.claim("default", count=10, lease_ms=60_000).jobs == []
    assert Job.objects.get(pk=result.id).state == JobState.CANCELLED


def test_a_cancel_of_a_running_job_lost_by_redis_is_applied_again_by_reconcile(
    rj_settings: Any, redis_client: redis.Redis
) -> None:
    # Given: a running job staff cancelled, whose mark Redis then lost
    rj_settings()
    backend = task_backends["default"]
    broker: Broker = backend.broker
    job = running_job_whose_cancel_redis_lost(backend, redis_client)

    # When: reconcile runs
    Sweep(backend.parts).reconcile()

    # Then: its holder hears of the cancel at its next renewal, and its
    # finish ends the job cancelled in Redis
    assert broker.extend("default", [job.fence], lease_ms=60_000) == [2]


def test_the_finisher_acks_an_outcome_the_mirror_settled_as_cancelled(
    rj_settings: Any, redis_client: redis.Redis
) -> None:
    # Given: a job cancelled in the database while it ran, the cancel lost
    # by Redis, and its attempt failing with retries left
    rj_settings()
    backend = task_backends["default"]
    broker: Broker = backend.broker
    job = running_job_whose_cancel_redis_lost(backend, redis_client)
    shared = Shared()
    shared.in_hand.add([job])
    finisher = Finisher(broker=broker, database="default", shared=shared)
    now = timezone.now()
    failed = AttemptRecord(job_id=job.id, attempt=job.attempt, gen=job.gen,
                           job_state=JobState.SCHEDULED, worker_id="w", started_at=now,
                           finished_at=now, outcome=AttemptOutcome.FAILED,
                           error="builtins.ValueError: flaky")

    # When: the finisher mirrors it (the mirror records it as cancelled) and
    # applies it in Redis
    finisher.submit(FinishedAttempt(failed, job, delay_ms=50))
    finisher.close()
    finisher.run()

    # Then: Redis finished the job instead of scheduling a retry of it
    assert redis_client.zcard(KEYS.scheduled) == 0
    assert redis_client.hget(KEYS.job(job.id), "state") in (None, "finished", "cancelled")
    assert Attempt.objects.get(job_id=job.id).outcome == AttemptOutcome.CANCELLED
    assert Job.objects.get(pk=job.id).state == JobState.CANCELLED


# -- item 12: prune never deletes a row whose job Redis still holds ------------


def test_prune_with_no_age_keeps_a_job_that_finished_a_moment_ago(
    rj_settings: Any, redis_client: redis.Redis
) -> None:
    # Given: a job cancelled a moment ago
    rj_settings()
    backend = task_backends["default"]
    result = demo.add.enqueue(1, 2)
    assert staff.cancel(backend.parts, result.id).done

    # When: finished jobs "older than 0 days" are pruned
    report = prune(backend, older_than=timedelta(0))

    # Then: it is kept (younger than RECONCILE_GRACE_MS + LEASE_MS)
    assert report.jobs == 0
    assert Job.objects.filter(pk=result.id).exists()


def test_prune_keeps_a_finished_row_whose_job_redis_still_runs(
    rj_settings: Any, redis_client: redis.Redis
) -> None:
    # Given: a job cancelled long ago while it ran, whose worker has not
    # stopped it yet (Redis holds it running), and one that is done for good
    rj_settings()
    backend = task_backends["default"]
    broker: Broker = backend.broker
    running = demo.add.enqueue(1, 2)
    done = demo.add.enqueue(3, 4)
    job = broker.claim("default", count=1, lease_ms=60_000).jobs[0]
    assert job.id == running.id
    assert broker.start("default", [job.fence]) == [True]
    for result in (running, done):
        assert staff.cancel(backend.parts, result.id).done
    Job.objects.update(updated_at=timezone.now() - timedelta(days=2))

    # When: finished jobs older than a day are pruned
    report = prune(backend, older_than=timedelta(days=1))

    # Then: only the row whose job Redis no longer runs is gone
    assert list(Job.objects.values_list("pk", flat=True)) == [job_id(running.id)]
    assert (report.jobs, report.kept) == (1, 1)


def job_id(text: str) -> Any:
    return Job._meta.pk.to_python(text)  # type: ignore[union-attr]


# -- item 13: dead jobs with no row are forgotten after the grace --------------


def test_reconcile_forgets_dead_jobs_that_have_no_row_once_the_grace_has_passed(
    rj_settings: Any, redis_client: redis.Redis
) -> None:
    # Given: in the dead set, a job whose row is gone (long dead), one whose
    # row is gone that died a moment ago, an id with no hash, and a dead job
    # that has its row (staff may retry it)
    rj_settings()
    backend = task_backends["default"]
    kept = demo.add.enqueue(1, 2)
    redis_client.flushdb()
    now_ms = backend.broker.server_time_ms()
    long_ago = now_ms - 3_600_000
    for job_id, died in (("01a241c7-0000-7000-8000-000000000001", long_ago),
                         ("01a241c7-0000-7000-8000-000000000002", now_ms),
                         (kept.id, long_ago)):
        redis_client.hset(KEYS.job(job_id), mapping={"state": "dead", "attempts": 1})
        redis_client.zadd(KEYS.dead, {job_id: died})
    redis_client.zadd(KEYS.dead, {"garbage": long_ago})
    Job.objects.filter(pk=kept.id).update(state=JobState.DEAD)

    # When: reconcile runs
    report = Sweep(backend.parts).reconcile()

    # Then: only what has no row and died before the grace is gone
    assert sorted(redis_client.zrange(KEYS.dead, 0, -1)) == sorted(
        ["01a241c7-0000-7000-8000-000000000002", kept.id])
    assert not redis_client.exists(KEYS.job("01a241c7-0000-7000-8000-000000000001"))
    assert redis_client.hget(KEYS.job(kept.id), "state") == "dead"
    assert report.purged == 2


def test_a_reconcile_whose_push_is_slower_than_the_grace_never_queues_the_job_twice(
    rj_settings: Any, redis_client: redis.Redis
) -> None:
    # Given: a job Redis lost, and a first reconciler that has committed its
    # rebuild (generation 1) and stalls before its push, longer than the grace
    rj_settings()
    backend = task_backends["default"]
    broker: Broker = backend.broker
    result = demo.add.enqueue(1, 2)
    redis_client.flushdb()
    backdate(result.id)
    committed, go_on = threading.Event(), threading.Event()

    def stall() -> None:
        if threading.current_thread().name == "slow-reconciler":
            committed.set()
            go_on.wait(10)

    reports: dict[str, Any] = {}

    def slow() -> None:
        reports["slow"] = Sweep(backend.parts).reconcile()
        close_old_connections()

    with around_script(broker, "enqueue", stall):
        thread = threading.Thread(target=slow, name="slow-reconciler")
        thread.start()
        try:
            assert committed.wait(10)
            assert Job.objects.get(pk=result.id).generation == 1

            # When: the grace passes and a second reconciler rebuilds it again
            backdate(result.id)
            reports["second"] = Sweep(backend.parts).reconcile()
        finally:
            go_on.set()
            thread.join(10)

    # Then: Redis holds one copy, of the newest generation, which the row
    # holds too; the stalled push (older) was refused and changed nothing
    assert (reports["second"].pushed, reports["slow"].pushed) == (1, 0)
    assert redis_client.lrange(KEYS.queued, 0, -1) == [result.id]
    job = run_to_the_end(broker)
    row = Job.objects.get(pk=result.id)
    assert (job.gen, row.generation, row.state) == (2, 2, JobState.SUCCEEDED)


def test_a_second_reconciler_never_undoes_a_run_the_first_did_not_see(
    rj_settings: Any, redis_client: redis.Redis
) -> None:
    # Given: a job Redis lost, and a first reconciler that has looked at
    # Redis (the job is missing) and stalls before it rebuilds the row
    rj_settings()
    backend = task_backends["default"]
    broker: Broker = backend.broker
    result = demo.add.enqueue(1, 2)
    redis_client.flushdb()
    backdate(result.id)
    looked, go_on = threading.Event(), threading.Event()
    real_held_states = broker.held_states

    def held_states(queue: str, job_ids: Any) -> Any:
        found = real_held_states(queue, job_ids)
        if threading.current_thread().name == "first-reconciler":
            looked.set()
            go_on.wait(10)
        return found

    def first() -> None:
        Sweep(backend.parts).reconcile()
        close_old_connections()

    broker.held_states = held_states  # type: ignore[method-assign]
    thread = threading.Thread(target=first, name="first-reconciler")
    thread.start()
    try:
        assert looked.wait(10)

        # When: a second reconciler runs meanwhile, and what it pushed (if
        # anything) runs to the end before the first one goes on
        if Sweep(backend.parts).reconcile().pushed:
            run_to_the_end(broker)
    finally:
        go_on.set()
        thread.join(10)
        broker.held_states = real_held_states  # type: ignore[method-assign]
    if Job.objects.get(pk=result.id).state != JobState.SUCCEEDED:
        run_to_the_end(broker)

    # Then: the job ran once, and its row says so for good
    row = Job.objects.get(pk=result.id)
    assert (row.state, row.return_value) == (JobState.SUCCEEDED, 3)
    assert Attempt.objects.filter(job=row, outcome=AttemptOutcome.SUCCEEDED).count() == 1
    assert broker.claim("default", count=10, lease_ms=60_000).jobs == []


def test_a_staff_retry_whose_push_redis_refuses_to_answer_is_pushed_by_reconcile(
    rj_settings: Any, redis_client: redis.Redis
) -> None:
    # Given: a dead job Redis no longer holds, and a Redis that stops
    # answering just as the retry's push is sent
    rj_settings()
    backend = task_backends["default"]
    result = demo.add.enqueue(1, 2)
    Job.objects.filter(pk=result.id).update(state=JobState.DEAD, finished_at=timezone.now())
    redis_client.flushdb()

    def down() -> None:
        raise redis.ConnectionError("Connection refused")

    # When: staff retry it
    with around_script(backend.broker, "enqueue", down):
        said = staff.retry(backend.parts, result.id)

    # Then: staff are told the sweep will push it; the row is queued with its
    # new generation; reconcile pushes it after the grace, and it runs
    assert said.done and "the recovery sweep pushes it" in said.message
    assert Job.objects.get(pk=result.id).state == JobState.QUEUED
    backdate(result.id)
    assert Sweep(backend.parts).reconcile().pushed == 1
    job = run_to_the_end(backend.broker)
    row = Job.objects.get(pk=result.id)
    assert (row.state, row.generation, job.gen) == (JobState.SUCCEEDED, 2, 2)
