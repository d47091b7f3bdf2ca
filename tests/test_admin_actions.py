"""Staff actions in the admin: retry, cancel, requeue, each behind its own permission.

Every action goes through the broker (Redis first, atomically) and mirrors
what Redis did; one that cannot act writes nothing, in Redis or in the
database, and says why. Real Redis and PostgreSQL, Django's test client.
"""

from __future__ import annotations

import json
import signal
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import redis
from django.contrib.admin.models import LogEntry
from django.test import Client
from django.utils import timezone

from reliable_jobs import admin as rj_admin
from reliable_jobs import staff
from reliable_jobs.backend import ReliableJobsBackend
from reliable_jobs.broker import Applied
from reliable_jobs.keys import QueueKeys
from reliable_jobs.models import Attempt, Job, JobState
from testproject.demo import tasks as demo

from .helpers import Processes, wait_until
from .test_admin import (
    CHANGELIST,
    change_url,
    configured_backend,
    make_dead,
    run_attempt,
    staff_client,
)

pytestmark = pytest.mark.django_db(transaction=True)
KEYS = QueueKeys("rj", "default")
ALL_PERMS = ("view_job", "retry_job", "cancel_job", "requeue_job")


@pytest.fixture
def backend(rj_settings: Callable[..., dict[str, str]]) -> ReliableJobsBackend:
    return configured_backend()


def act(client: Client, action: str, *job_ids: str) -> list[str]:
    """Run a changelist action; return the admin messages shown after it."""
    response = client.post(CHANGELIST, {"action": action, "index": 0,
                                        "_selected_action": list(job_ids)}, follow=True)
    assert response.status_code == 200
    return [str(m) for m in response.context["messages"]]


def snapshot(redis_client: redis.Redis, *job_ids: str) -> dict[str, Any]:
    """Everything Redis and the database hold about some jobs, to prove nothing moved."""
    return {
        "rows": list(Job.objects.filter(pk__in=job_ids).order_by("pk").values()),
        "attempts": list(Attempt.objects.filter(job_id__in=job_ids).order_by("pk").values()),
        "hashes": {job_id: redis_client.hgetall(KEYS.job(job_id)) for job_id in job_ids},
        "queued": redis_client.lrange(KEYS.queued, 0, -1),
        "leases": redis_client.zrange(KEYS.leases, 0, -1),
        "scheduled": redis_client.zrange(KEYS.scheduled, 0, -1),
        "dead": redis_client.zrange(KEYS.dead, 0, -1),
    }


@pytest.fixture
def boss(django_user_model: Any) -> Client:
    return staff_client(django_user_model, *ALL_PERMS, username="boss")


# -- retry ---------------------------------------------------------------------


def test_retry_queues_a_dead_job_with_a_fresh_budget_and_keeps_its_history(
    backend: ReliableJobsBackend, boss: Client, redis_client: redis.Redis
) -> None:
    # Given: a job dead after its 3 attempts (always_fail: max_attempts=3)
    result = demo.always_fail.enqueue("x")
    make_dead(backend, result.id)

    # When staff retry it
    said = act(boss, "retry_jobs", result.id)

    # Then: queued in Redis and in the row, 3 more attempts numbered on from 3,
    # the three old attempts kept, and the admin says so and logs who did it
    assert said == [f"Job {result.id} is queued again with 3 more attempts (attempts 4 to 6)."]
    job = Job.objects.get(pk=result.id)
    assert (job.state, job.attempts, job.max_attempts, job.finished_at) == (
        JobState.QUEUED, 3, 6, None)
    assert redis_client.hgetall(KEYS.job(result.id))["state"] == "queued"
    assert redis_client.hget(KEYS.job(result.id), "max_attempts") == "6"
    assert redis_client.lrange(KEYS.queued, 0, -1) == [result.id]
    assert redis_client.zrange(KEYS.dead, 0, -1) == []
    assert Attempt.objects.filter(job_id=result.id).count() == 3
    assert LogEntry.objects.get(object_id=result.id).change_message == said[0]

    # And a worker's next claim is attempt 4, and its result lands on the row
    assert run_attempt(backend, result.id, outcome="succeeded") == 4
    assert Job.objects.get(pk=result.id).state == JobState.SUCCEEDED


def test_retry_rebuilds_a_dead_job_that_redis_lost(
    backend: ReliableJobsBackend, boss: Client, redis_client: redis.Redis
) -> None:
    # Given: a dead job, then Redis restarted empty
    result = demo.always_fail.enqueue("x")
    make_dead(backend, result.id, attempts=2)
    Job.objects.filter(pk=result.id).update(max_attempts=2)
    redis_client.flushdb()

    # When
    said = act(boss, "retry_jobs", result.id)

    # Then: rebuilt from the row with attempts kept, so numbering goes on at 3
    assert said == [f"Job {result.id} is queued again with 3 more attempts (attempts 3 to 5)."]
    held = redis_client.hgetall(KEYS.job(result.id))
    assert (held["state"], held["attempts"], held["max_attempts"]) == ("queued", "2", "5")
    assert json.loads(held["payload"]) == {"task": "testproject.demo.tasks.always_fail",
                                           "args": ["x"], "kwargs": {}}
    assert redis_client.lrange(KEYS.queued, 0, -1) == [result.id]
    assert Job.objects.get(pk=result.id).max_attempts == 5
    assert run_attempt(backend, result.id, outcome="dead") == 3


def test_retry_of_a_job_that_is_not_dead_writes_nothing(
    backend: ReliableJobsBackend, boss: Client, redis_client: redis.Redis
) -> None:
    # Given: a running job and a queued one
    running = demo.add.enqueue(1, 1)
    queued = demo.add.enqueue(2, 2)
    run_attempt(backend, running.id, outcome="running")
    before = snapshot(redis_client, queued.id, running.id)

    # When staff try to retry both
    said = act(boss, "retry_jobs", queued.id, running.id)

    # Then each is refused with its reason, and nothing changed anywhere
    assert sorted(said) == sorted([
        f"Job {queued.id} is queued, not dead: it was not retried.",
        f"Job {running.id} is running, not dead: it was not retried.",
    ])
    assert snapshot(redis_client, queued.id, running.id) == before
    assert not LogEntry.objects.exists()


def test_retry_refuses_when_redis_is_ahead_of_the_row(
    backend: ReliableJobsBackend, boss: Client, redis_client: redis.Redis
) -> None:
    # Given: the row says dead, Redis already holds the job as queued (retried
    # elsewhere, its mirror write not in yet)
    result = demo.always_fail.enqueue("x")
    make_dead(backend, result.id, attempts=1)
    backend.broker.revive("default", result.id, extra_attempts=1)
    before = snapshot(redis_client, result.id)

    # When
    said = act(boss, "retry_jobs", result.id)

    # Then
    assert said == [f"Job {result.id} is dead in the database but queued in Redis, which is "
                    "ahead: it was not retried."]
    assert snapshot(redis_client, result.id) == before


# -- cancel ----------------------------------------------------------------------


def test_cancel_takes_queued_and_scheduled_jobs_off_redis(
    backend: ReliableJobsBackend, boss: Client, redis_client: redis.Redis
) -> None:
    # Given: a queued job and one scheduled for tomorrow
    queued = demo.add.enqueue(1, 1)
    later = demo.add.using(run_after=timezone.now() + timedelta(days=1)).enqueue(2, 2)
    assert redis_client.zrange(KEYS.scheduled, 0, -1) == [later.id]

    # When staff cancel both
    said = act(boss, "cancel_jobs", queued.id, later.id)

    # Then both are cancelled in Redis: the scheduled one is off its set and its
    # hash is an expiring tombstone (a late push of it is refused); the queued
    # one is marked cancelled where it waits (cancel does not search the list)
    # and, once a worker reaches it, is off the list and never run, its hash
    # an expiring tombstone too; both are cancelled in the rows
    assert said == ["Cancelled 2 jobs: those waiting will not run, those running are being "
                    "stopped."]
    assert redis_client.zrange(KEYS.scheduled, 0, -1) == []
    assert redis_client.hget(KEYS.job(later.id), "state") == "cancelled"
    assert redis_client.pttl(KEYS.job(later.id)) > 0
    assert redis_client.hget(KEYS.job(queued.id), "state") == "cancelled"
    claimed = backend.broker.claim("default", count=10, lease_ms=60_000)
    assert (claimed.jobs, claimed.dead, claimed.garbage) == ([], [], [])
    assert redis_client.lrange(KEYS.queued, 0, -1) == []
    assert redis_client.zrange(KEYS.leases, 0, -1) == []
    assert redis_client.hget(KEYS.job(queued.id), "state") == "cancelled"
    assert redis_client.pttl(KEYS.job(queued.id)) > 0
    for job in Job.objects.filter(pk__in=[queued.id, later.id]):
        assert job.state == JobState.CANCELLED
        assert job.finished_at is not None
    assert LogEntry.objects.count() == 2


def test_cancel_marks_a_running_job_and_its_holder_finishes_it_cancelled(
    backend: ReliableJobsBackend, boss: Client, redis_client: redis.Redis
) -> None:
    # Given: a job a worker holds, whose row still says queued (the start
    # mark is a batch behind), and a finished one
    held = demo.add.enqueue(1, 1)
    [claim] = backend.broker.claim("default", count=1, lease_ms=60_000).jobs
    done = demo.add.enqueue(2, 2)
    run_attempt(backend, done.id, outcome="succeeded")
    assert Job.objects.get(pk=held.id).state == JobState.QUEUED
    before_done = snapshot(redis_client, done.id)

    # When staff cancel both
    said = act(boss, "cancel_jobs", held.id, done.id)

    # Then Redis decides: the running job is marked for cancellation where it
    # is (its worker stops it) and its row is cancelled; the finished one is
    # left as it was, and says so
    assert sorted(said) == sorted([
        f"Job {held.id} was cancelled while running: its worker stops it and it will not run "
        "again.",
        f"Job {done.id} has finished (succeeded): there is nothing to cancel.",
    ])
    assert redis_client.hget(KEYS.job(held.id), "cancel") == f"{claim.attempt}:{claim.gen}"
    assert redis_client.zrange(KEYS.leases, 0, -1) == [held.id]
    assert Job.objects.get(pk=held.id).state == JobState.CANCELLED
    assert snapshot(redis_client, done.id) == before_done
    assert LogEntry.objects.count() == 1
    # and when its holder acks, the job ends as cancelled, never acked or retried
    assert backend.broker.ack("default", [claim.fence]) == [Applied.CANCELLED]
    assert redis_client.hgetall(KEYS.job(held.id)) == {"state": "cancelled", "gen": "0"}
    assert not redis_client.zrange(KEYS.leases, 0, -1)


def test_cancel_of_a_job_redis_does_not_hold_writes_nothing(
    backend: ReliableJobsBackend, boss: Client, redis_client: redis.Redis
) -> None:
    # Given: a queued row whose Redis side is gone (the sweep will rebuild it)
    result = demo.add.enqueue(1, 1)
    redis_client.flushdb()
    before = snapshot(redis_client, result.id)

    # When
    said = act(boss, "cancel_jobs", result.id)

    # Then: not cancelled (reconcile could push it back), and it says to retry later
    assert said == [f"Job {result.id} is not in Redis yet (its push is on the way, or the "
                    "recovery sweep is rebuilding it): it was not cancelled; try again in a "
                    "minute."]
    assert snapshot(redis_client, result.id) == before


# -- requeue -----------------------------------------------------------------------


def test_requeue_runs_a_scheduled_job_now(
    backend: ReliableJobsBackend, boss: Client, redis_client: redis.Redis
) -> None:
    # Given: a job scheduled for tomorrow
    later = demo.add.using(run_after=timezone.now() + timedelta(days=1)).enqueue(2, 2)

    # When staff requeue it
    said = act(boss, "requeue_jobs", later.id)

    # Then it is queued now, in Redis and in the row (no future run_after left)
    assert said == [f"Job {later.id} was scheduled and is queued now."]
    assert redis_client.lrange(KEYS.queued, 0, -1) == [later.id]
    assert redis_client.zrange(KEYS.scheduled, 0, -1) == []
    job = Job.objects.get(pk=later.id)
    assert (job.state, job.run_after) == (JobState.QUEUED, None)
    assert run_attempt(backend, later.id, outcome="succeeded") == 1


def test_requeue_puts_a_cancelled_job_back(
    backend: ReliableJobsBackend, boss: Client, redis_client: redis.Redis
) -> None:
    # Given: a cancelled job
    result = demo.add.enqueue(1, 1)
    act(boss, "cancel_jobs", result.id)

    # When
    said = act(boss, "requeue_jobs", result.id)

    # Then it is queued again with the attempts it had
    assert said == [f"Job {result.id} was cancelled and is queued again (3 attempts left)."]
    assert redis_client.hget(KEYS.job(result.id), "state") == "queued"
    assert Job.objects.get(pk=result.id).state == JobState.QUEUED
    assert run_attempt(backend, result.id, outcome="succeeded") == 1


def test_requeue_refuses_what_it_cannot_run_now(
    backend: ReliableJobsBackend, boss: Client, redis_client: redis.Redis
) -> None:
    # Given: a dead job, a succeeded one and a queued one
    dead = demo.always_fail.enqueue("x")
    make_dead(backend, dead.id, attempts=1)
    done = demo.add.enqueue(1, 1)
    run_attempt(backend, done.id, outcome="succeeded")
    queued = demo.add.enqueue(2, 2)
    before = snapshot(redis_client, dead.id, done.id, queued.id)

    # When
    said = act(boss, "requeue_jobs", dead.id, done.id, queued.id)

    # Then
    assert sorted(said) == sorted([
        f"Job {dead.id} is dead: use the retry action, which gives it a fresh attempt budget.",
        f"Job {done.id} succeeded: it was not requeued.",
        f"Job {queued.id} is queued, not scheduled: only a waiting job can be run now; it "
        "was not requeued.",
    ])
    assert snapshot(redis_client, dead.id, done.id, queued.id) == before


# -- permissions -------------------------------------------------------------------


def test_a_viewer_sees_no_action_and_cannot_forge_one(
    backend: ReliableJobsBackend, django_user_model: Any, redis_client: redis.Redis
) -> None:
    # Given: a dead job, and staff who may only view jobs
    result = demo.always_fail.enqueue("x")
    make_dead(backend, result.id, attempts=1)
    viewer = staff_client(django_user_model, "view_job", username="viewer")
    before = snapshot(redis_client, result.id)

    # When they open the list and the job, then post the actions anyway
    listing = viewer.get(CHANGELIST).content.decode()
    page = viewer.get(change_url(result.id)).content.decode()
    said = [act(viewer, name, result.id) for name in ("retry_jobs", "cancel_jobs",
                                                      "requeue_jobs")]

    # Then no action is offered, and a forged one is ignored: the list is
    # shown again, no message, nothing changed
    for text in (listing, page):
        assert "retry_jobs" not in text and "cancel_jobs" not in text
    assert said == [[]] * 3
    assert snapshot(redis_client, result.id) == before


def test_each_action_needs_its_own_permission(
    backend: ReliableJobsBackend, django_user_model: Any, redis_client: redis.Redis
) -> None:
    # Given: a dead job and a queued one, and staff who may cancel but not retry
    dead = demo.always_fail.enqueue("x")
    make_dead(backend, dead.id, attempts=1)
    queued = demo.add.enqueue(1, 1)
    canceller = staff_client(django_user_model, "view_job", "cancel_job")
    before = snapshot(redis_client, dead.id)

    # When they try to retry, then to cancel
    retried = act(canceller, "retry_jobs", dead.id)
    after_retry = snapshot(redis_client, dead.id)
    cancelled = act(canceller, "cancel_jobs", queued.id)

    # Then only the cancel ran
    assert retried == ["No action selected."]
    assert after_retry == before
    assert cancelled == [f"Job {queued.id} was cancelled (queued, taken off Redis): it will "
                         "not run."]
    options = canceller.get(CHANGELIST).content.decode()
    assert 'value="cancel_jobs"' in options and 'value="retry_jobs"' not in options
    assert 'value="requeue_jobs"' not in options


def test_actions_run_from_the_job_page(
    backend: ReliableJobsBackend, boss: Client, redis_client: redis.Redis
) -> None:
    # Given: a dead job's page, which offers the actions
    result = demo.always_fail.enqueue("x")
    make_dead(backend, result.id, attempts=1)
    page = boss.get(change_url(result.id)).content.decode()
    assert 'name="CHANGE_FORM-action"' in page and 'value="retry_jobs"' in page

    # When staff pick "retry" there
    response = boss.post(change_url(result.id), {
        "CHANGE_FORM-action": "retry_jobs", "_selected_action": result.id, "index": 0,
    }, follow=True)

    # Then they are back on the job's page, which shows it queued
    assert response.status_code == 200
    assert response.redirect_chain[-1][0].endswith(change_url(result.id))
    assert [str(m) for m in response.context["messages"]] == [
        f"Job {result.id} is queued again with 3 more attempts (attempts 2 to 4)."]
    assert '<span class="rj-badge rj-state-queued">Queued</span>' in response.content.decode()


def test_a_big_selection_is_handled_in_bounded_steps(
    backend: ReliableJobsBackend, boss: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given: more selected jobs than one click handles (limit lowered for the test)
    monkeypatch.setattr(rj_admin, "ACTION_LIMIT", 3)
    results = backend.enqueue_many(demo.noop, [((), {})] * 5)

    # When staff cancel all of them
    said = act(boss, "cancel_jobs", *[r.id for r in results])

    # Then three are cancelled, and the message says how to do the rest
    assert said == ["Cancelled 3 jobs: those waiting will not run, those running are being "
                    "stopped.",
                    "Only 3 of the 5 selected jobs were handled; select the rest (the state "
                    "filter helps) and run the action again."]
    assert Job.objects.filter(state=JobState.CANCELLED).count() == 3
    rest = Job.objects.filter(state=JobState.QUEUED).values_list("pk", flat=True)
    assert act(boss, "cancel_jobs", *map(str, rest)) == [
        "Cancelled 2 jobs: those waiting will not run, those running are being stopped."]


def test_redis_down_changes_nothing_and_says_so(
    rj_settings: Callable[..., dict[str, str]], django_user_model: Any
) -> None:
    # Given: a queued job, then the backend pointed at a Redis that is not there
    result = demo.add.enqueue(1, 1)
    rj_settings(REDIS_URL="redis://127.0.0.1:1/0")
    boss = staff_client(django_user_model, *ALL_PERMS, username="boss")
    before = Job.objects.values().get(pk=result.id)

    # When
    said = act(boss, "cancel_jobs", result.id)

    # Then
    assert len(said) == 1 and said[0].startswith("Redis did not answer (")
    assert said[0].endswith(f"job {result.id} was not changed.")
    assert Job.objects.values().get(pk=result.id) == before


@pytest.mark.slow
def test_cancel_racing_a_real_worker_ends_each_job_succeeded_or_cancelled_never_both(
    rj_settings: Callable[..., dict[str, str]], processes: Processes, redis_client: redis.Redis
) -> None:
    # Given: 300 jobs of 20 ms each, and a worker (2 threads) already draining them
    env = rj_settings()
    backend = configured_backend()
    results = backend.enqueue_many(demo.sleep_for, [((0.02,), {})] * 300)
    worker = processes.worker(env, "--concurrency", "2")
    wait_until(lambda: Job.objects.filter(state=JobState.SUCCEEDED).exists(), timeout=30,
               message="the worker to start")

    # When staff cancel every one of them, oldest first, while it drains:
    # queued ones, running ones, and ones finishing at that very moment
    outcomes = [staff.cancel(backend.parts, result.id) for result in results]

    # Then each job ends exactly one of succeeded (the cancel was refused) or
    # cancelled (never run, or its attempt recorded cancelled, no result),
    # and its history says the same: none both, none lost, none left waiting
    wait_until(lambda: not Job.objects.exclude(
        state__in=[JobState.SUCCEEDED, JobState.CANCELLED]).exists(), timeout=60,
        message="every job to end")
    # (a cancelled job's id waits on queued until the worker reaches it and drops it)
    wait_until(lambda: not redis_client.llen(KEYS.queued) and not redis_client.llen(
        KEYS.landing) and not redis_client.zcard(KEYS.leases), timeout=60,
        message="the worker to reach every cancelled id")
    cancelled = {o.job_id for o in outcomes if o.done}
    for job in Job.objects.all():
        outcomes_of_job = list(Attempt.objects.filter(job=job).values_list("outcome", flat=True))
        if str(job.pk) in cancelled:
            assert (job.state, job.return_value) == (JobState.CANCELLED, None)
            assert set(outcomes_of_job) <= {"cancelled"}, (job.pk, outcomes_of_job)
            assert redis_client.hgetall(KEYS.job(str(job.pk))) in (
                {}, {"state": "cancelled", "gen": "0"})
        else:
            assert (job.state, outcomes_of_job) == (JobState.SUCCEEDED, ["succeeded"]), job.pk
    assert 0 < len(cancelled) < 300, "the race did not happen; the test proved nothing"
    worker.send_signal(signal.SIGTERM)
    assert worker.wait(timeout=30) == 0
