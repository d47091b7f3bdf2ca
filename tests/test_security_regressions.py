"""Hostile Redis contents and odd task results that used to stop workers.

Each test failed before the fix it names (in broker/, mirror/ or
worker.py). Without it the worker process died (UnicodeDecodeError in its
claim; a finisher thread killed by a DataError stops the worker), and so did
every worker that picked the same job up after a restart: a job whose claim
crashes is refunded as "never started", so it is never buried. The
oversized payload was run instead of being buried.
"""

from __future__ import annotations

import json
import pickle
import uuid
from typing import Any

import pytest
import redis
from django.utils import timezone

from reliable_jobs import mirror
from reliable_jobs.broker import NewJob
from reliable_jobs.compat import TaskResultStatus, task_backends
from reliable_jobs.keys import QueueKeys
from reliable_jobs.mirror import AttemptRecord
from reliable_jobs.models import Attempt, Job, JobState
from testproject.demo import tasks as demo

from .helpers import REDIS_URL, Processes

pytestmark = pytest.mark.django_db(transaction=True)
KEYS = QueueKeys("rj", "default")


def add_payload(*args: Any) -> str:
    return json.dumps({"task": "testproject.demo.tasks.add", "args": list(args), "kwargs": {}})


@pytest.mark.slow
def test_bytes_that_are_not_utf8_never_crash_a_worker(
    rj_settings: Any, processes: Processes, redis_client: redis.Redis
) -> None:
    # Given raw bytes in Redis (broker.py: replies are decoded with surrogateescape):
    # an id on the work list, a job whose payload is not UTF-8, a binary pickle,
    # and a job hash whose own id is not UTF-8
    env = rj_settings()
    raw = redis.Redis.from_url(REDIS_URL)
    raw.lpush(KEYS.queued, b"\xff\xfe garbage id")
    bad_payload, pickled = str(uuid.uuid4()), str(uuid.uuid4())
    broker = task_backends["default"].broker
    broker.enqueue("default", [NewJob(bad_payload, "{}", 3), NewJob(pickled, "{}", 3)])
    raw.hset(KEYS.job(bad_payload), "payload",
             b'{"task": "testproject.demo.tasks.add", "args": ["\xff", "x"]}')
    raw.hset(KEYS.job(pickled), "payload", pickle.dumps(object(), protocol=5))
    bytes_id = b"\xc3\x28-job"
    raw.hset(KEYS.job("").encode() + bytes_id, mapping={
        "state": "queued", "attempts": 0, "max_attempts": 3, "payload": add_payload(1, 2)})
    raw.lpush(KEYS.queued, bytes_id)
    good = demo.add.enqueue(20, 22)

    # When a worker drains the queue
    worker = processes.worker(env, "--burst")

    # Then it finishes cleanly, buries what cannot be read, and runs the good job
    assert worker.wait(timeout=60) == 0, processes.log(worker)
    assert demo.add.get_result(good.id).return_value == 42
    for job_id in (bad_payload, pickled):
        assert redis_client.hget(KEYS.job(job_id), "state") == "dead"
        assert "MalformedPayload" in redis_client.hget(KEYS.job(job_id), "last_error")
    assert raw.zscore(KEYS.dead, b"\xff\xfe garbage id") is not None
    assert not raw.exists(KEYS.job("").encode() + bytes_id)  # it ran, and was acked
    assert raw.llen(KEYS.queued) == raw.zcard(KEYS.leases) == 0


@pytest.mark.slow
def test_a_job_id_that_is_not_a_uuid_does_not_stall_the_worker(
    rj_settings: Any, processes: Processes, redis_client: redis.Redis
) -> None:
    # Given a job written into Redis by hand under an id no row can have
    # (mirror/records.py: such records are skipped instead of failing the batch)
    env = rj_settings()
    task_backends["default"].broker.enqueue("default", [NewJob("not-a-uuid", add_payload(1, 2),
                                                               3)])
    good = demo.add.enqueue(1, 1)

    # When a worker drains the queue
    worker = processes.worker(env, "--burst")

    # Then both ran and were acked: the mirror write did not fail over and over
    assert worker.wait(timeout=60) == 0, processes.log(worker)
    assert demo.add.get_result(good.id).return_value == 2
    assert not redis_client.exists(KEYS.job("not-a-uuid"))


@pytest.mark.slow
def test_a_task_returning_infinity_does_not_stall_the_worker(
    rj_settings: Any, processes: Processes
) -> None:
    # Given a task whose result is not finite (1e308 + 1e308), beside an ordinary one
    # (mirror/records.py: a result JSON cannot spell is stored as the string "Infinity")
    env = rj_settings()
    overflow = demo.add.enqueue(1e308, 1e308)
    good = demo.add.enqueue(2, 2)

    # When a worker runs them
    worker = processes.worker(env, "--burst")

    # Then both are SUCCESSFUL
    assert worker.wait(timeout=60) == 0, processes.log(worker)
    assert demo.add.get_result(overflow.id).return_value == "Infinity"
    assert demo.add.get_result(good.id).status == TaskResultStatus.SUCCESSFUL


@pytest.mark.slow
def test_an_oversized_payload_found_in_redis_is_buried_not_run(
    rj_settings: Any, processes: Processes, redis_client: redis.Redis
) -> None:
    # Given a payload over MAX_PAYLOAD_BYTES written straight into Redis
    # (worker.py: decode with the limit that enqueue enforces)
    env = rj_settings(MAX_PAYLOAD_BYTES=1_024)
    big = str(uuid.uuid4())
    task_backends["default"].broker.enqueue("default", [NewJob(big, add_payload("x" * 2_000,
                                                                                "y"), 3)])
    good = demo.add.enqueue(3, 4)

    # When a worker drains the queue
    worker = processes.worker(env, "--burst")

    # Then the big one is dead, naming the limit; the good one ran
    assert worker.wait(timeout=60) == 0, processes.log(worker)
    error = redis_client.hget(KEYS.job(big), "last_error")
    assert "MalformedPayload" in error and "over the limit of 1024 bytes" in error
    assert redis_client.hget(KEYS.job(big), "state") == "dead"
    assert demo.add.get_result(good.id).return_value == 7


def test_the_mirror_stores_what_a_task_produced_even_when_postgresql_could_not(
    rj_settings: Any
) -> None:
    # Given a job row, and records the database would refuse as they are: NUL and a
    # lone surrogate in the error, NaN in the result, an id that is not a UUID and an
    # attempt beyond the integer column (mirror/records.py: make_storable)
    result = demo.add.enqueue(1, 1)
    now = timezone.now()
    records = [
        AttemptRecord(job_id=result.id, attempt=1, job_state=JobState.QUEUED,
                      worker_id="w\x00", started_at=now, finished_at=now, outcome="failed",
                      error="boom\x00\udcff", traceback="tb\x00"),
        AttemptRecord(job_id=result.id, attempt=2, job_state=JobState.SUCCEEDED,
                      started_at=now, finished_at=now, outcome="succeeded",
                      return_value={"mean": float("nan"), "k\x00": ["\ud800"]}),
        AttemptRecord(job_id="not-a-uuid", attempt=1, job_state=JobState.DEAD),
        AttemptRecord(job_id=str(uuid.uuid4()).upper(), attempt=1, job_state=JobState.DEAD),
        AttemptRecord(job_id=result.id, attempt=2**31, job_state=JobState.DEAD),
    ]

    # When the batch is written
    mirror.record("default", records)

    # Then it landed, with the unstorable characters replaced and the rest skipped
    job = Job.objects.get(pk=result.id)
    assert (job.state, job.attempts) == (JobState.SUCCEEDED, 2)
    assert job.return_value == {"mean": "NaN", "k\ufffd": ["\ufffd"]}
    first = Attempt.objects.get(job=job, number=1)
    assert (first.error, first.traceback, first.worker_id) == ("boom\ufffd\ufffd", "tb\ufffd",
                                                                "w\ufffd")
