"""Reconcile against the hot path: only jobs Redis really lost are pushed again."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
import redis
from django.utils import timezone

from reliable_jobs import mirror
from reliable_jobs.compat import task_backends
from reliable_jobs.keys import QueueKeys
from reliable_jobs.mirror import AttemptRecord
from reliable_jobs.models import AttemptOutcome, Job, JobState
from reliable_jobs.sweep import Sweep
from testproject.demo import tasks as demo

from .helpers import backdate

pytestmark = pytest.mark.django_db(transaction=True)
KEYS = QueueKeys("rj", "default")


def test_a_job_that_finishes_while_reconcile_looks_is_not_pushed_again(
    rj_settings: Any, redis_client: redis.Redis
) -> None:
    # Given: an old queued job that reconcile has just read as unfinished
    rj_settings()
    backend = task_backends["default"]
    result = demo.add.enqueue(1, 2)
    backdate(result.id)
    older_than = timezone.now() - timedelta(minutes=1)
    rows = mirror.reconcile_candidates("default", backend="default", older_than=older_than,
                                       after_id=None, limit=10)
    assert [str(row.pk) for row in rows] == [result.id]

    # When: before reconcile asks Redis, a worker runs it: mirror first, then the
    # ack frees the hash (what a worker does)
    claimed = backend.broker.claim("default", count=1, lease_ms=60_000).jobs
    mirror.record("default", [AttemptRecord(
        job_id=result.id, attempt=1, job_state=JobState.SUCCEEDED, worker_id="w",
        started_at=timezone.now(), finished_at=timezone.now(),
        outcome=AttemptOutcome.SUCCEEDED, return_value=3)])
    assert backend.broker.ack("default", [claimed[0].fence]) == [True]
    pushed, buried = Sweep(backend.parts)._reconcile_queue("default", rows, older_than)

    # Then: it is not pushed again, and its row stays succeeded
    assert (pushed, buried) == (0, 0)
    assert not redis_client.exists(KEYS.job(result.id))
    assert redis_client.llen(KEYS.queued) == 0
    assert Job.objects.get(pk=result.id).state == JobState.SUCCEEDED


def test_reconcile_pushes_only_lost_jobs_and_mirrors_deaths(
    rj_settings: Any, redis_client: redis.Redis
) -> None:
    # Given: three old jobs: one Redis still holds, one it lost, one it buried
    rj_settings()
    backend = task_backends["default"]
    held, lost, buried = (demo.add.enqueue(i, 0) for i in range(3))
    redis_client.delete(KEYS.job(lost.id))
    redis_client.lrem(KEYS.queued, 1, lost.id)
    redis_client.hset(KEYS.job(buried.id), mapping={"state": "dead", "attempts": "3",
                                                     "last_error": "boom"})
    redis_client.lrem(KEYS.queued, 1, buried.id)
    backdate(held.id, lost.id, buried.id)

    # When: a reconcile pass runs
    report = Sweep(backend.parts).reconcile()

    # Then: only the lost job is pushed again; the death is mirrored
    assert (report.checked, report.pushed, report.buried) == (3, 1, 1)
    assert sorted(redis_client.lrange(KEYS.queued, 0, -1)) == sorted([held.id, lost.id])
    dead = Job.objects.get(pk=buried.id)
    assert (dead.state, dead.attempts, dead.last_error) == (JobState.DEAD, 3, "boom")
    # and a second pass pushes nothing (the grace period restarted for the pushed one)
    assert Sweep(backend.parts).reconcile().pushed == 0


def test_heartbeats_drop_workers_that_stopped_long_ago(
    rj_settings: Any, redis_client: redis.Redis
) -> None:
    # Given: a worker SIGKILLed two hours ago left its id in the workers index
    rj_settings()
    broker = task_backends["default"].broker
    now_ms = broker.server_time_ms()
    redis_client.zadd("rj:workers", {"killed-long-ago": now_ms - 7_200_000})

    # When: a live worker beats
    broker.heartbeat("alive", {"id": "alive"}, ttl_ms=15_000)

    # Then: the index keeps the live worker only
    assert redis_client.zrange("rj:workers", 0, -1) == ["alive"]
