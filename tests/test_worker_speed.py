"""The worker's speed cuts against real servers: wake markers, per-job connection closing.

The pure rules (queue skipping, start-mark groups, payload decode) are in
tests/fast/test_worker_speed_rules.py.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import redis

from reliable_jobs import mirror
from reliable_jobs.compat import task_backends
from reliable_jobs.keys import QueueKeys
from reliable_jobs.mirror import AttemptRecord
from reliable_jobs.models import Attempt, AttemptOutcome, Job, JobState
from reliable_jobs.worker import finisher
from testproject.demo import tasks as demo

from .helpers import drain_here


@pytest.mark.parametrize("lmpop", [True, False])
def test_woken_takes_the_markers_of_the_queues_that_have_one(
    lmpop: bool, rj_settings: Any, redis_client: redis.Redis
) -> None:
    # Given: three queues, a marker waiting on two of them (as enqueue leaves it)
    rj_settings(queues=["default", "q1", "q2"])
    broker = task_backends["default"].broker
    broker._no_lmpop = not lmpop  # the pipeline of LPOPs Redis < 7 gets
    for queue in ("default", "q2"):
        redis_client.rpush(QueueKeys("rj", queue).wake, "1")

    # When: a busy worker asks without blocking, twice
    first = broker.woken(["default", "q1", "q2"])
    second = broker.woken(["default", "q1", "q2"])

    # Then: it names those two once, and took their markers
    assert sorted(first) == ["default", "q2"]
    assert second == []
    assert not redis_client.exists(*(QueueKeys("rj", q).wake for q in ("default", "q1", "q2")))


@pytest.mark.django_db(transaction=True)
def test_a_thread_that_opened_a_connection_still_has_it_closed_after_each_job() -> None:
    # Given: an executor-like thread whose task opened a database connection
    # (CONN_MAX_AGE 0: close it when the job ends, as Django's request cycle does)
    from django.db import connection

    from reliable_jobs.worker.database import close_old_connections_if_opened

    seen: dict[str, Any] = {}

    def job() -> None:
        max_age = connection.settings_dict["CONN_MAX_AGE"]
        connection.settings_dict["CONN_MAX_AGE"] = 0
        try:
            connection.ensure_connection()
            seen["open_during_job"] = connection.connection is not None
            # When: the job ends
            close_old_connections_if_opened()
            seen["open_after_job"] = connection.connection is not None
        finally:
            connection.settings_dict["CONN_MAX_AGE"] = max_age
            connection.close()

    thread = threading.Thread(target=job)
    thread.start()
    thread.join(timeout=30)

    # Then: the connection was open during the job and closed after it
    assert seen == {"open_during_job": True, "open_after_job": False}


@pytest.mark.django_db(transaction=True)
def test_a_short_jobs_row_is_written_once_from_queued_to_succeeded(
        rj_settings: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    # Given a job, and start records held long enough for any machine (the
    # hold's length is not what is tested, only that a start joins its outcome)
    rj_settings()
    job = demo.add.enqueue(2, 3)
    monkeypatch.setattr(finisher, "START_HOLD_S", 30.0)
    batches: list[list[AttemptRecord]] = []
    record = mirror.record

    def counted(using: str, records: Any) -> None:
        records = list(records)
        if any(r.job_id == job.id for r in records):
            batches.append(records)
        record(using, records)

    monkeypatch.setattr(mirror, "record", counted)

    # When a burst worker runs it
    drain_here()

    # Then one mirror batch wrote it, its start and its outcome together, and
    # the row went straight from queued to succeeded with its start recorded
    assert len(batches) == 1, batches
    assert sorted(r.job_state for r in batches[0] if r.job_id == job.id) == [
        JobState.RUNNING, JobState.SUCCEEDED]
    attempt = Attempt.objects.get(job_id=job.id)
    assert attempt.outcome == AttemptOutcome.SUCCEEDED and attempt.started_at is not None
    assert Job.objects.get(pk=job.id).state == JobState.SUCCEEDED


@pytest.mark.django_db(transaction=True)
def test_a_start_held_for_its_outcome_is_written_alone_once_its_hold_is_over(
        rj_settings: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    # Given a job that runs well past a short hold
    rj_settings()
    job = demo.sleep_for.enqueue(0.5)
    monkeypatch.setattr(finisher, "START_HOLD_S", 0.05)
    states: list[str] = []
    record = mirror.record

    def watched(using: str, records: Any) -> None:
        records = list(records)
        states.extend(r.job_state for r in records if r.job_id == job.id)
        record(using, records)

    monkeypatch.setattr(mirror, "record", watched)

    # When a burst worker runs it
    drain_here()

    # Then the start went first, on its own, and the outcome after it
    assert states == [JobState.RUNNING, JobState.SUCCEEDED]
    assert Job.objects.get(pk=job.id).state == JobState.SUCCEEDED
