"""``ReliableJobsBackend`` against the ``django.tasks`` contract, real Redis and PostgreSQL.

No worker runs here: jobs are enqueued, and their rows are moved by hand to
each state to check what ``get_result()`` reports. Redis keys are spelled
out literally, as docs/design.md's key table fixes them (default prefix ``rj``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import redis
from asgiref.sync import async_to_sync
from django.db import transaction
from django.db.models import F
from django.utils import timezone

from reliable_jobs import payload
from reliable_jobs.backend import ReliableJobsBackend
from reliable_jobs.compat import (
    TASKS_LOGGER,
    InvalidTask,
    TaskResult,
    TaskResultDoesNotExist,
    TaskResultMismatch,
    TaskResultStatus,
    task,
    task_backends,
    task_enqueued,
)
from reliable_jobs.exceptions import InvalidJobArguments, PayloadTooLarge
from reliable_jobs.models import TASK_STATUS, Attempt, AttemptOutcome, Job, JobState
from reliable_jobs.newjobs import NEW_JOB_STATUS
from reliable_jobs.sweep import Sweep
from tests import tasks as test_tasks

Configure = Callable[..., dict[str, str]]

QUEUED = "rj:{default}:queued"
SCHEDULED = "rj:{default}:scheduled"
#: A port where no Redis listens: the connection is refused at once.
REDIS_DOWN_URL = "redis://127.0.0.1:1/0"


def job_key(job_id: str) -> str:
    return f"rj:{{default}}:job:{job_id}"


@pytest.fixture
def backend(rj_settings: Configure) -> ReliableJobsBackend:
    """The default backend, configured by ``rj_settings`` on the suite's Redis."""
    configured = task_backends["default"]
    assert isinstance(configured, ReliableJobsBackend)
    return configured


@pytest.fixture
def enqueued() -> Iterator[list[dict[str, Any]]]:
    """Every ``task_enqueued`` signal sent during the test: sender and keyword arguments."""
    received: list[dict[str, Any]] = []

    def receiver(sender: type, **kwargs: Any) -> None:
        received.append({"sender": sender, **kwargs})

    task_enqueued.connect(receiver, weak=False)
    yield received
    task_enqueued.disconnect(receiver)


def assert_nothing_written(client: redis.Redis) -> None:
    assert Job.objects.count() == 0
    assert Attempt.objects.count() == 0
    assert client.dbsize() == 0


# -- the backend's declared features -------------------------------------------


def test_backend_declares_each_feature(backend: ReliableJobsBackend) -> None:
    # Given: the default backend
    # Then: deferral, coroutines, results and priorities are supported
    assert backend.supports_defer is True
    assert backend.supports_async_task is True
    assert backend.supports_get_result is True
    assert backend.supports_priority is True


@pytest.mark.django_db(transaction=True)
def test_a_priority_is_stored_in_the_row_and_in_redis(
    backend: ReliableJobsBackend, redis_client: redis.Redis
) -> None:
    # When: a task is enqueued at priority 7 (using()) and one at -5 (decorated)
    raised = test_tasks.noop_task.using(priority=7).enqueue(1)
    lowered = task(priority=-5)(test_tasks.plain_function).enqueue()

    # Then: each row and each job hash holds its priority, on its band's list
    assert Job.objects.get(pk=raised.id).priority == 7
    assert Job.objects.get(pk=lowered.id).priority == -5
    assert redis_client.hget(job_key(raised.id), "priority") == "7"
    assert redis_client.lrange("rj:{default}:band:7", 0, -1) == [raised.id]
    assert redis_client.lrange("rj:{default}:band:-5", 0, -1) == [lowered.id]
    assert redis_client.llen(QUEUED) == 0


def test_a_priority_outside_djangos_range_is_refused(backend: ReliableJobsBackend) -> None:
    # When / Then: Django's own validation refuses 101 and -101
    with pytest.raises(InvalidTask, match="priority must be a whole number"):
        test_tasks.noop_task.using(priority=101)
    with pytest.raises(InvalidTask, match="priority must be a whole number"):
        task(priority=-101)(test_tasks.plain_function)


def test_async_task_is_accepted(backend: ReliableJobsBackend) -> None:
    # When / Then: a coroutine task validates (supports_async_task)
    backend.validate_task(test_tasks.noop_task_async)


# -- enqueue ---------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_enqueue_returns_a_ready_result_and_writes_row_and_redis(
    backend: ReliableJobsBackend, redis_client: redis.Redis
) -> None:
    # Given: nothing queued
    before = timezone.now()

    # When: a task is enqueued outside any transaction
    result = test_tasks.noop_task.enqueue(1, two=[3, "four"])

    # Then: the result is READY, unstarted, with a uuid id
    assert isinstance(result, TaskResult)
    assert str(uuid.UUID(result.id)) == result.id
    assert result.status == TaskResultStatus.READY
    assert result.is_finished is False
    assert result.task == test_tasks.noop_task
    assert result.backend == "default"
    assert result.args == [1]
    assert result.kwargs == {"two": [3, "four"]}
    assert result.enqueued_at is not None and before <= result.enqueued_at <= timezone.now()
    assert result.started_at is None
    assert result.finished_at is None
    assert result.last_attempted_at is None
    assert result.errors == []
    assert result.worker_ids == []
    assert result.attempts == 0
    with pytest.raises(ValueError, match="Task has not finished yet"):
        _ = result.return_value

    # Then: one row mirrors it
    job = Job.objects.get()
    assert str(job.pk) == result.id
    assert job.state == JobState.QUEUED
    assert job.queue == "default"
    assert job.backend == "default"
    assert job.task_path == "tests.tasks.noop_task"
    assert job.args == [1]
    assert job.kwargs == {"two": [3, "four"]}
    assert job.priority == 0
    assert job.attempts == 0
    assert job.max_attempts == 3
    assert job.run_after is None
    assert job.enqueued_at == result.enqueued_at

    # Then: Redis holds the job hash and the id on the work list
    assert redis_client.lrange(QUEUED, 0, -1) == [result.id]
    fields = redis_client.hgetall(job_key(result.id))
    assert fields["state"] == "queued"
    assert fields["attempts"] == "0"
    assert fields["max_attempts"] == "3"
    assert json.loads(fields["payload"]) == {
        "task": "tests.tasks.noop_task", "args": [1], "kwargs": {"two": [3, "four"]},
    }
    assert redis_client.zcard(SCHEDULED) == 0


@pytest.mark.django_db(transaction=True)
def test_jobs_are_pushed_on_the_left_so_workers_take_the_oldest_first(
    backend: ReliableJobsBackend, redis_client: redis.Redis
) -> None:
    # When: three jobs are enqueued in order
    ids = [test_tasks.noop_task.enqueue(n).id for n in range(3)]

    # Then: the right end of the list (where workers move from) is the oldest
    assert redis_client.lrange(QUEUED, 0, -1) == list(reversed(ids))


@pytest.mark.django_db(transaction=True)
def test_run_after_in_the_future_is_scheduled(
    backend: ReliableJobsBackend, redis_client: redis.Redis
) -> None:
    # Given: a task deferred by an hour
    run_after = timezone.now() + timedelta(hours=1)
    deferred = test_tasks.calculate_meaning_of_life.using(run_after=run_after)

    # When: it is enqueued
    result = deferred.enqueue()

    # Then: it waits in the scheduled set, due at run_after, and not on the work list
    assert result.status == TaskResultStatus.READY
    assert result.task.run_after == run_after
    assert redis_client.llen(QUEUED) == 0
    assert redis_client.zscore(SCHEDULED, result.id) == int(run_after.timestamp() * 1000)
    assert redis_client.hget(job_key(result.id), "state") == "scheduled"
    job = Job.objects.get(pk=result.id)
    assert job.state == JobState.SCHEDULED
    assert job.run_after == run_after


@pytest.mark.django_db(transaction=True)
def test_run_after_in_the_past_is_queued_at_once(
    backend: ReliableJobsBackend, redis_client: redis.Redis
) -> None:
    # Given: a task whose run_after has already passed
    overdue = test_tasks.noop_task.using(run_after=timezone.now() - timedelta(minutes=1))

    # When: it is enqueued
    result = overdue.enqueue()

    # Then: it is runnable now
    assert redis_client.lrange(QUEUED, 0, -1) == [result.id]
    assert redis_client.zcard(SCHEDULED) == 0
    assert Job.objects.get(pk=result.id).state == JobState.QUEUED


@pytest.mark.django_db(transaction=True)
def test_enqueue_sends_task_enqueued_with_the_result(
    backend: ReliableJobsBackend, enqueued: list[dict[str, Any]]
) -> None:
    # When: a task is enqueued
    result = test_tasks.noop_task.enqueue()

    # Then: Django's signal went out once, from the backend class, with that result
    assert len(enqueued) == 1
    assert enqueued[0]["sender"] is ReliableJobsBackend
    assert enqueued[0]["task_result"] == result


# -- per-task options ----------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_per_task_max_attempts_is_stored_on_row_and_hash(
    backend: ReliableJobsBackend, redis_client: redis.Redis
) -> None:
    # Given: a task declared with @task(max_attempts=5, ...)
    assert test_tasks.task_with_options.max_attempts == 5
    assert test_tasks.task_with_options.retry_base_ms == 10
    assert test_tasks.task_with_options.retry_max_ms == 100
    assert test_tasks.task_with_options.timeout_ms == 60_000

    # When: it and a task without options are enqueued
    own = test_tasks.task_with_options.enqueue()
    default = test_tasks.noop_task.enqueue()

    # Then: its own max_attempts wins; the other takes OPTIONS['MAX_ATTEMPTS']
    assert Job.objects.get(pk=own.id).max_attempts == 5
    assert redis_client.hget(job_key(own.id), "max_attempts") == "5"
    assert Job.objects.get(pk=default.id).max_attempts == 3
    assert redis_client.hget(job_key(default.id), "max_attempts") == "3"


@pytest.mark.django_db(transaction=True)
def test_backend_max_attempts_option_is_the_default(
    rj_settings: Configure, redis_client: redis.Redis
) -> None:
    # Given: OPTIONS['MAX_ATTEMPTS'] = 7
    rj_settings(MAX_ATTEMPTS=7)

    # When: a task without its own max_attempts is enqueued
    result = test_tasks.noop_task.enqueue()

    # Then: the row and the hash carry 7
    assert Job.objects.get(pk=result.id).max_attempts == 7
    assert redis_client.hget(job_key(result.id), "max_attempts") == "7"


def test_parts_are_what_the_sweep_and_staff_take_of_the_backend(
    backend: ReliableJobsBackend,
) -> None:
    # Given the backend, When its parts are asked for twice
    parts = backend.parts

    # Then they are one object holding its alias, settings, queues and broker
    assert parts is backend.parts
    assert (parts.alias, parts.config, parts.queues, parts.broker) == (
        "default", backend.config, frozenset(backend.queues), backend.broker)
    # And a per-task option is the task's own, else the backend's default
    assert parts.task_option(test_tasks.task_with_options, "max_attempts") == 5
    assert parts.task_option(test_tasks.noop_task, "max_attempts") == backend.config.MAX_ATTEMPTS


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("max_attempts", 0),
        ("max_attempts", -1),
        ("max_attempts", True),
        ("max_attempts", "3"),
        ("max_attempts", 2.5),
        ("retry_base_ms", -1),
        ("retry_max_ms", -1),
        ("timeout_ms", 0),
        ("timeout_ms", 1.5),
    ],
)
def test_bad_per_task_option_is_refused_at_decoration(
    backend: ReliableJobsBackend, option: str, value: Any
) -> None:
    # When / Then: decorating with the bad value raises InvalidTask naming the option
    with pytest.raises(InvalidTask, match=rf"^{option} must be a whole number >= \d+, not "):
        task(**{option: value})(test_tasks.plain_function)


def test_good_per_task_options_are_accepted_at_their_minimum(
    backend: ReliableJobsBackend,
) -> None:
    # When: every option is set to its smallest allowed value
    made = task(max_attempts=1, retry_base_ms=0, retry_max_ms=0, timeout_ms=1)(
        test_tasks.plain_function
    )

    # Then: the task keeps them
    assert (made.max_attempts, made.retry_base_ms, made.retry_max_ms, made.timeout_ms) == (
        1, 0, 0, 1,
    )


# -- bad input writes nothing -----------------------------------------------------


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    ("args", "kwargs", "names"),
    [
        ((datetime(2024, 1, 1, tzinfo=UTC),), {}, "Argument args[0] is of type datetime"),
        ((), {"when": datetime(2024, 1, 1, tzinfo=UTC)}, "Argument kwargs['when'] is of type"),
        ((object(),), {}, "Argument args[0] is of type object"),
        ((1, {1, 2}), {}, "Argument args[1] is of type set"),
        ((math.nan,), {}, "Argument args[0] is nan, which JSON cannot represent"),
        ((), {"x": math.inf}, "Argument kwargs['x'] is inf"),
        (({1: "one"},), {}, "Argument args[0] has the key 1 of type int"),
        ((1, [2, {"deep": b"bytes"}]), {}, "Argument args[1][1]['deep'] is of type bytes"),
    ],
)
def test_unserialisable_arguments_are_refused_and_nothing_is_written(
    backend: ReliableJobsBackend, redis_client: redis.Redis,
    args: tuple[Any, ...], kwargs: dict[str, Any], names: str,
) -> None:
    # When: a task is enqueued with an argument JSON cannot carry
    with pytest.raises(InvalidJobArguments) as caught:
        test_tasks.noop_task.enqueue(*args, **kwargs)

    # Then: the error is an InvalidTask (and a TypeError) naming the argument
    assert isinstance(caught.value, InvalidTask)
    assert isinstance(caught.value, TypeError)
    assert str(caught.value).startswith(names)
    assert str(caught.value).endswith(".")

    # Then: no row, no Redis key
    assert_nothing_written(redis_client)


@pytest.mark.django_db(transaction=True)
def test_payload_over_the_limit_is_refused_and_nothing_is_written(
    rj_settings: Configure, redis_client: redis.Redis
) -> None:
    # Given: a 256-byte payload limit
    rj_settings(MAX_PAYLOAD_BYTES=256)

    # When: the encoded arguments exceed it
    with pytest.raises(PayloadTooLarge, match="over the limit of 256 bytes") as caught:
        test_tasks.noop_task.enqueue("x" * 300)

    # Then: it is an InvalidTask, and nothing is written
    assert isinstance(caught.value, InvalidTask)
    assert_nothing_written(redis_client)

    # Then: a payload within the limit still goes through
    test_tasks.noop_task.enqueue("x" * 100)
    assert Job.objects.count() == 1


@pytest.mark.django_db(transaction=True)
def test_queue_not_in_queues_is_refused_and_nothing_is_written(
    rj_settings: Configure, redis_client: redis.Redis
) -> None:
    # Given: a task bound to queue "reports" while the backend serves it
    rj_settings(queues=["default", "reports"])
    reports_task = test_tasks.noop_task.using(queue_name="reports")

    # When: the backend stops serving "reports" and the task is enqueued
    rj_settings(queues=["default"])
    with pytest.raises(InvalidTask, match="Queue 'reports' is not valid for backend"):
        reports_task.enqueue()

    # Then: nothing is written; and binding to an unknown queue fails at once
    assert_nothing_written(redis_client)
    with pytest.raises(InvalidTask, match="Queue 'elsewhere' is not valid for backend"):
        test_tasks.noop_task.using(queue_name="elsewhere")


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("queue", ["bad{name}", "a:b", "x" * 101, "with space"])
def test_queue_name_unusable_in_redis_keys_is_refused(
    rj_settings: Configure, redis_client: redis.Redis, queue: str
) -> None:
    # Given: the backend lists the queue (so Django's own queue check passes)
    rj_settings(queues=["default", queue])

    # When / Then: a task bound to it is refused, saying why
    with pytest.raises(InvalidTask, match="cannot be used in Redis keys"):
        test_tasks.noop_task.using(queue_name=queue)
    assert_nothing_written(redis_client)


# -- get_result --------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_get_result_returns_what_enqueue_returned(backend: ReliableJobsBackend) -> None:
    # Given: an enqueued job and a deferred one
    plain = test_tasks.noop_task.enqueue(1, two=3)
    deferred = test_tasks.noop_task.using(run_after=timezone.now() + timedelta(days=1)).enqueue()

    # When: each is read back, through the backend and through the task
    # Then: the same data comes back
    assert backend.get_result(plain.id) == plain
    assert test_tasks.noop_task.get_result(plain.id) == plain
    assert backend.get_result(deferred.id) == deferred
    assert backend.get_result(deferred.id).task.run_after == deferred.task.run_after


@pytest.mark.django_db
@pytest.mark.parametrize(
    "result_id",
    [str(uuid.uuid4()), "123", "", "not-a-uuid", "x" * 1000, "' OR 1=1 --", "\x00"],
)
def test_get_result_of_unknown_or_garbage_id_raises_does_not_exist(
    backend: ReliableJobsBackend, result_id: str
) -> None:
    # Given: one real job, so the table is not empty
    test_tasks.noop_task.enqueue()

    # When / Then: an id no job has raises TaskResultDoesNotExist
    with pytest.raises(TaskResultDoesNotExist):
        backend.get_result(result_id)
    with pytest.raises(TaskResultDoesNotExist):
        test_tasks.noop_task.get_result(result_id)


@pytest.mark.django_db
def test_get_result_of_another_backends_job_raises_does_not_exist(
    backend: ReliableJobsBackend,
) -> None:
    # Given: a row written by a backend under another alias
    result = test_tasks.noop_task.enqueue()
    Job.objects.filter(pk=result.id).update(backend="other")

    # When / Then: this backend does not claim it
    with pytest.raises(TaskResultDoesNotExist):
        backend.get_result(result.id)


@pytest.mark.django_db
def test_get_result_of_a_row_naming_no_task_raises_does_not_exist(
    backend: ReliableJobsBackend,
) -> None:
    # Given: rows whose task path names nothing importable, and a plain function
    missing = test_tasks.noop_task.enqueue()
    Job.objects.filter(pk=missing.id).update(task_path="tests.tasks.does_not_exist")
    not_a_task = test_tasks.noop_task.enqueue()
    Job.objects.filter(pk=not_a_task.id).update(task_path="tests.tasks.plain_function")

    # When / Then: both raise TaskResultDoesNotExist, not ImportError
    with pytest.raises(TaskResultDoesNotExist, match="no longer a task"):
        backend.get_result(missing.id)
    with pytest.raises(TaskResultDoesNotExist, match="no longer a task"):
        backend.get_result(not_a_task.id)


@pytest.mark.django_db
def test_get_result_survives_the_queue_leaving_queues(rj_settings: Configure) -> None:
    # Given: a job enqueued on "reports", and "reports" later removed from QUEUES
    rj_settings(queues=["default", "reports"])
    result = test_tasks.noop_task.using(queue_name="reports").enqueue()
    rj_settings(queues=["default"])

    # When: its result is read
    fetched = task_backends["default"].get_result(result.id)

    # Then: the stored job is reported as enqueued, not validated again
    assert fetched.task.queue_name == "reports"
    assert fetched == result


@pytest.mark.django_db
def test_get_result_reports_the_run_after_the_job_was_enqueued_with(
    backend: ReliableJobsBackend,
) -> None:
    # Given: a deferred job, and the task's registered form (no run_after)
    run_after = timezone.now() + timedelta(minutes=10)
    result = test_tasks.noop_task.using(run_after=run_after).enqueue()

    # When: the row's run_after is cleared (a staff "run now") and the result read
    Job.objects.filter(pk=result.id).update(run_after=None)
    fetched = backend.get_result(result.id)

    # Then: the result says what the row says
    assert fetched.task.run_after is None
    assert fetched.task == test_tasks.noop_task


@pytest.mark.django_db
def test_task_get_result_of_another_tasks_job_raises_mismatch(
    backend: ReliableJobsBackend,
) -> None:
    # Given: a job of noop_task
    result = test_tasks.noop_task.enqueue()

    # When / Then: asking another task for it raises TaskResultMismatch
    with pytest.raises(TaskResultMismatch, match=r"tests\.tasks\.noop_task"):
        test_tasks.calculate_meaning_of_life.get_result(result.id)


# -- status mapping (docs/design.md: States) -----------------------------------------


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("state", "status"),
    [
        (JobState.WAITING, TaskResultStatus.READY),
        (JobState.SCHEDULED, TaskResultStatus.READY),
        (JobState.QUEUED, TaskResultStatus.READY),
        (JobState.RUNNING, TaskResultStatus.RUNNING),
        (JobState.SUCCEEDED, TaskResultStatus.SUCCESSFUL),
        (JobState.DEAD, TaskResultStatus.FAILED),
        (JobState.CANCELLED, TaskResultStatus.FAILED),
    ],
)
def test_each_job_state_maps_to_its_django_status(
    backend: ReliableJobsBackend, state: JobState, status: TaskResultStatus
) -> None:
    # Given: a job whose row is in ``state``
    result = test_tasks.noop_task.enqueue()
    Job.objects.filter(pk=result.id).update(state=state)

    # When: its result is read
    # Then: the status is the one docs/design.md maps it to
    assert backend.get_result(result.id).status == status


def test_every_job_state_has_a_mapping() -> None:
    # Then: the parametrised mapping above covers every JobState
    assert {s.value for s in JobState} == {
        "waiting", "scheduled", "queued", "running", "succeeded", "dead", "cancelled",
    }


def test_enqueue_reports_the_status_of_a_queued_or_scheduled_job() -> None:
    # Then: the status enqueue gives every new job is the one both new states map to
    assert {TASK_STATUS[JobState.QUEUED], TASK_STATUS[JobState.SCHEDULED]} == {NEW_JOB_STATUS}


@pytest.mark.django_db
def test_succeeded_job_reports_its_return_value_times_and_worker(
    backend: ReliableJobsBackend,
) -> None:
    # Given: a job a worker ran once and finished
    result = test_tasks.calculate_meaning_of_life.enqueue()
    started = timezone.now() - timedelta(seconds=3)
    finished = started + timedelta(seconds=1)
    Job.objects.filter(pk=result.id).update(
        state=JobState.SUCCEEDED, attempts=1, started_at=started, finished_at=finished,
        return_value={"answer": 42, "list": [1, 2]},
    )
    Attempt.objects.create(job_id=result.id, number=1, worker_id="worker-a",
                           started_at=started, finished_at=finished,
                           outcome=AttemptOutcome.SUCCEEDED)

    # When: the result is read through its task
    fetched = test_tasks.calculate_meaning_of_life.get_result(result.id)

    # Then: it is successful, with its value, times and one worker
    assert fetched.status == TaskResultStatus.SUCCESSFUL
    assert fetched.is_finished is True
    assert fetched.return_value == {"answer": 42, "list": [1, 2]}
    assert fetched.started_at == started
    assert fetched.finished_at == finished
    assert fetched.last_attempted_at == started
    assert fetched.worker_ids == ["worker-a"]
    assert fetched.attempts == 1
    assert fetched.errors == []


@pytest.mark.django_db
def test_dead_job_reports_one_error_per_failed_attempt(backend: ReliableJobsBackend) -> None:
    # Given: a dead job: attempt 1 released at shutdown, 2 raised, 3 lost its lease,
    # 4 timed out (written out of order: the result sorts by attempt number)
    result = test_tasks.failing_task_value_error.enqueue()
    base = timezone.now() - timedelta(minutes=1)
    Job.objects.filter(pk=result.id).update(
        state=JobState.DEAD, attempts=4, started_at=base, finished_at=base + timedelta(seconds=40),
        last_error="reliable_jobs.exceptions.JobTimeout: attempt 4 ran past 1000 ms",
    )
    rows = [
        (4, "worker-d", AttemptOutcome.TIMED_OUT,
         "reliable_jobs.exceptions.JobTimeout: attempt 4 ran past 1000 ms", ""),
        (1, "worker-a", AttemptOutcome.RELEASED, "", ""),
        (3, "worker-c", AttemptOutcome.LEASE_EXPIRED,
         "reliable_jobs.exceptions.LeaseExpired: attempt 3 stopped renewing its lease", ""),
        (2, "worker-b", AttemptOutcome.FAILED,
         "builtins.ValueError: This Task failed due to ValueError",
         "Traceback (most recent call last):\nValueError: This Task failed due to ValueError\n"),
    ]
    for number, worker, outcome, error, traceback in rows:
        Attempt.objects.create(
            job_id=result.id, number=number, worker_id=worker,
            started_at=base + timedelta(seconds=10 * number),
            finished_at=base + timedelta(seconds=10 * number + 1),
            outcome=outcome, error=error, traceback=traceback,
        )

    # When: the result is read
    fetched = backend.get_result(result.id)

    # Then: it failed, with one TaskError per failed attempt, in attempt order
    assert fetched.status == TaskResultStatus.FAILED
    assert fetched.is_finished is True
    with pytest.raises(ValueError, match="Task failed"):
        _ = fetched.return_value
    assert [e.exception_class_path for e in fetched.errors] == [
        "builtins.ValueError",
        "reliable_jobs.exceptions.LeaseExpired",
        "reliable_jobs.exceptions.JobTimeout",
    ]
    assert fetched.errors[0].exception_class is ValueError
    assert "Traceback (most recent call last)" in fetched.errors[0].traceback
    # An attempt with no traceback reports its error line instead.
    assert "stopped renewing its lease" in fetched.errors[1].traceback

    # Then: one worker id per attempt, released ones included
    assert fetched.worker_ids == ["worker-a", "worker-b", "worker-c", "worker-d"]
    assert fetched.attempts == 4
    assert fetched.last_attempted_at == base + timedelta(seconds=40)


@pytest.mark.django_db
def test_running_job_reports_running_with_its_workers_and_no_value(
    backend: ReliableJobsBackend,
) -> None:
    # Given: a job whose first attempt was released and whose second is running
    result = test_tasks.sleep_for.enqueue(10)
    started = timezone.now() - timedelta(seconds=5)
    Job.objects.filter(pk=result.id).update(state=JobState.RUNNING, attempts=2,
                                            started_at=started)
    Attempt.objects.create(job_id=result.id, number=1, worker_id="worker-a",
                           started_at=started, finished_at=started + timedelta(seconds=1),
                           outcome=AttemptOutcome.RELEASED)
    Attempt.objects.create(job_id=result.id, number=2, worker_id="worker-b",
                           started_at=started + timedelta(seconds=2))

    # When: the result is read
    fetched = backend.get_result(result.id)

    # Then: it is running, not finished, with no errors and both workers
    assert fetched.status == TaskResultStatus.RUNNING
    assert fetched.is_finished is False
    assert fetched.started_at == started
    assert fetched.finished_at is None
    assert fetched.last_attempted_at == started + timedelta(seconds=2)
    assert fetched.errors == []
    assert fetched.worker_ids == ["worker-a", "worker-b"]
    with pytest.raises(ValueError, match="Task has not finished yet"):
        _ = fetched.return_value


@pytest.mark.django_db
def test_refresh_picks_up_the_new_state(backend: ReliableJobsBackend) -> None:
    # Given: a result held by the caller, and the job finishing meanwhile
    result = test_tasks.calculate_meaning_of_life.enqueue()
    Job.objects.filter(pk=result.id).update(state=JobState.SUCCEEDED, return_value=42,
                                            finished_at=timezone.now())

    # When: the caller refreshes it
    assert result.status == TaskResultStatus.READY
    result.refresh()

    # Then: it sees the new status and value
    assert result.status == TaskResultStatus.SUCCESSFUL
    assert result.return_value == 42


# -- transactional enqueue (G5) ----------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_enqueue_in_a_transaction_reaches_redis_only_at_commit(
    backend: ReliableJobsBackend, redis_client: redis.Redis
) -> None:
    # Given: an open transaction
    with transaction.atomic():
        # When: a job is enqueued inside it
        result = test_tasks.noop_task.enqueue()

        # Then: its row exists in the transaction, but Redis has not seen it
        assert Job.objects.filter(pk=result.id).exists()
        assert redis_client.dbsize() == 0

    # Then: the commit pushed it
    assert redis_client.lrange(QUEUED, 0, -1) == [result.id]
    assert redis_client.hget(job_key(result.id), "state") == "queued"


@pytest.mark.django_db(transaction=True)
def test_rollback_leaves_no_row_and_no_redis_key(
    backend: ReliableJobsBackend, redis_client: redis.Redis
) -> None:
    # Given: a transaction that enqueues a job and then fails
    class Abort(Exception):
        pass

    # When: it rolls back
    with contextlib.suppress(Abort), transaction.atomic():
        test_tasks.noop_task.enqueue()
        test_tasks.noop_task.using(run_after=timezone.now() + timedelta(hours=1)).enqueue()
        raise Abort

    # Then: the job never existed, in the database or in Redis
    assert_nothing_written(redis_client)


@pytest.mark.django_db(transaction=True)
def test_savepoint_rollback_inside_a_committed_transaction_pushes_nothing(
    backend: ReliableJobsBackend, redis_client: redis.Redis
) -> None:
    # Given: an outer transaction that commits, and an inner block that rolls back
    class Abort(Exception):
        pass

    with transaction.atomic():
        kept = test_tasks.noop_task.enqueue("kept")
        with contextlib.suppress(Abort), transaction.atomic():
            test_tasks.noop_task.enqueue("dropped")
            raise Abort

    # Then: only the job of the committed part exists and was pushed
    assert [str(pk) for pk in Job.objects.values_list("pk", flat=True)] == [kept.id]
    assert redis_client.lrange(QUEUED, 0, -1) == [kept.id]


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("in_transaction", [True, False], ids=["atomic", "autocommit"])
def test_redis_down_at_commit_keeps_the_job_for_reconcile(
    rj_settings: Configure, redis_client: redis.Redis, app_log: list[logging.LogRecord],
    in_transaction: bool,
) -> None:
    # Given: the backend points at a Redis that refuses connections
    rj_settings(REDIS_URL=REDIS_DOWN_URL, RECONCILE_GRACE_MS=10_000)

    # When: a job is enqueued and its transaction commits
    with transaction.atomic() if in_transaction else contextlib.nullcontext():
        result = test_tasks.calculate_meaning_of_life.enqueue()

    # Then: the producer did not fail; the job waits in the database; a warning says so
    assert result.status == TaskResultStatus.READY
    assert Job.objects.get(pk=result.id).state == JobState.QUEUED
    assert redis_client.dbsize() == 0
    warnings = [r.getMessage() for r in app_log if r.levelno == logging.WARNING]
    assert any("safe in the database" in message for message in warnings), warnings

    # Given: Redis is back
    rj_settings(RECONCILE_GRACE_MS=10_000)
    sweep = Sweep(task_backends["default"].parts)  # type: ignore[attr-defined]

    # When: reconcile runs within the grace period
    # Then: it leaves the row alone (its push might still be on its way)
    assert sweep.reconcile().pushed == 0
    assert redis_client.dbsize() == 0

    # When: the row is older than the grace period and reconcile runs again
    Job.objects.filter(pk=result.id).update(updated_at=F("updated_at") - timedelta(seconds=11))
    report = sweep.reconcile()

    # Then: the job is pushed, with its payload, exactly once
    assert report.pushed == 1
    assert redis_client.lrange(QUEUED, 0, -1) == [result.id]
    fields = redis_client.hgetall(job_key(result.id))
    assert fields["state"] == "queued"
    assert json.loads(fields["payload"]) == {
        "task": "tests.tasks.calculate_meaning_of_life", "args": [], "kwargs": {},
    }
    Job.objects.filter(pk=result.id).update(updated_at=F("updated_at") - timedelta(seconds=11))
    assert sweep.reconcile().pushed == 0
    assert redis_client.llen(QUEUED) == 1
    assert Job.objects.get(pk=result.id).state == JobState.QUEUED


# -- enqueue_many --------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_enqueue_many_writes_every_row_and_pushes_every_id(
    backend: ReliableJobsBackend, redis_client: redis.Redis, enqueued: list[dict[str, Any]]
) -> None:
    # Given: more calls than one script call carries (1,000)
    calls = [((n,), {"n": n}) for n in range(1_001)]

    # When: they are enqueued at once
    results = backend.enqueue_many(test_tasks.noop_task, calls)

    # Then: every call has a READY result, in order, with its own arguments
    assert len(results) == 1_001
    assert all(r.status == TaskResultStatus.READY for r in results)
    assert [(r.args, r.kwargs) for r in results[:2]] == [([0], {"n": 0}), ([1], {"n": 1})]
    ids = [r.id for r in results]
    assert len(set(ids)) == 1_001

    # Then: every row is written and every id is on the work list with its hash
    assert {str(pk) for pk in Job.objects.values_list("pk", flat=True)} == set(ids)
    assert sorted(redis_client.lrange(QUEUED, 0, -1)) == sorted(ids)
    assert redis_client.exists(*[job_key(i) for i in ids]) == 1_001

    # Then: one task_enqueued signal per job
    assert [s["task_result"].id for s in enqueued] == ids


@pytest.mark.django_db(transaction=True)
def test_enqueue_many_deferred_goes_to_scheduled(
    backend: ReliableJobsBackend, redis_client: redis.Redis
) -> None:
    # Given: a deferred task
    run_after = timezone.now() + timedelta(minutes=5)

    # When: several calls are enqueued at once
    results = backend.enqueue_many(
        test_tasks.noop_task.using(run_after=run_after), [((n,), {}) for n in range(3)]
    )

    # Then: each is scheduled for run_after
    assert redis_client.llen(QUEUED) == 0
    assert redis_client.zrange(SCHEDULED, 0, -1, withscores=True) == sorted(
        (r.id, float(int(run_after.timestamp() * 1000))) for r in results
    )
    assert set(Job.objects.values_list("state", flat=True)) == {JobState.SCHEDULED}


@pytest.mark.django_db(transaction=True)
def test_enqueue_many_in_a_transaction_waits_for_the_commit(
    backend: ReliableJobsBackend, redis_client: redis.Redis
) -> None:
    # Given: an outer transaction
    class Abort(Exception):
        pass

    # When: a batch is enqueued and the transaction rolls back
    with contextlib.suppress(Abort), transaction.atomic():
        backend.enqueue_many(test_tasks.noop_task, [((1,), {}), ((2,), {})])
        assert Job.objects.count() == 2
        assert redis_client.dbsize() == 0
        raise Abort

    # Then: nothing is left
    assert_nothing_written(redis_client)

    # When: a batch is enqueued and the transaction commits
    with transaction.atomic():
        results = backend.enqueue_many(test_tasks.noop_task, [((1,), {}), ((2,), {})])
        assert redis_client.dbsize() == 0

    # Then: both are pushed
    assert sorted(redis_client.lrange(QUEUED, 0, -1)) == sorted(r.id for r in results)


@pytest.mark.django_db(transaction=True)
def test_enqueue_many_with_one_bad_call_writes_nothing(
    backend: ReliableJobsBackend, redis_client: redis.Redis
) -> None:
    # When: the last of three calls carries an unserialisable argument
    calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = [
        ((1,), {}), ((2,), {}), ((), {"when": timezone.now()}),
    ]
    with pytest.raises(InvalidJobArguments, match=r"kwargs\['when'\]"):
        backend.enqueue_many(test_tasks.noop_task, calls)

    # Then: none of the three is written
    assert_nothing_written(redis_client)


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("outer_transaction", [False, True])
def test_enqueue_many_with_a_bad_call_after_rows_were_sent_writes_nothing(
    backend: ReliableJobsBackend, redis_client: redis.Redis, outer_transaction: bool
) -> None:
    # Given: a batch whose bad call comes after more rows than one COPY write
    # carries (1,000), so rows reached the database before the check failed
    calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = [((n,), {}) for n in range(2_500)]
    calls.append(((), {"when": timezone.now()}))

    # When: it is enqueued, alone or in a transaction that goes on afterwards
    with transaction.atomic() if outer_transaction else contextlib.nullcontext():
        kept = test_tasks.noop_task.enqueue("kept")
        with pytest.raises(InvalidJobArguments, match=r"kwargs\['when'\]"):
            backend.enqueue_many(test_tasks.noop_task, calls)
        assert list(Job.objects.values_list("pk", flat=True)) == [uuid.UUID(kept.id)]

    # Then: none of the batch is written or pushed; the job before it is
    assert list(Job.objects.values_list("pk", flat=True)) == [uuid.UUID(kept.id)]
    assert redis_client.lrange(QUEUED, 0, -1) == [kept.id]
    assert redis_client.keys("rj:{default}:job:*") == [job_key(kept.id)]


@pytest.mark.django_db(transaction=True)
def test_enqueue_many_logs_each_job_when_djangos_tasks_logger_shows_debug(
    backend: ReliableJobsBackend, caplog: pytest.LogCaptureFixture
) -> None:
    # Given: no receiver of task_enqueued but Django's own, which logs at DEBUG,
    # and its logger showing DEBUG
    caplog.set_level(logging.DEBUG, logger=TASKS_LOGGER)

    # When: a batch is enqueued
    results = backend.enqueue_many(test_tasks.noop_task, [((n,), {}) for n in range(3)])

    # Then: Django's receiver logged each job
    assert [r.getMessage() for r in caplog.records if "enqueued" in r.getMessage()] == [
        f"Task id={r.id} path=tests.tasks.noop_task enqueued backend=default" for r in results
    ]


@pytest.mark.django_db(transaction=True)
def test_a_backend_alias_holding_a_quote_and_a_percent_is_stored_as_it_is(
    backend: ReliableJobsBackend, settings: Any, redis_client: redis.Redis
) -> None:
    # Given: a second backend whose alias holds what SQL and the driver read specially
    alias = "it's 100%"
    settings.TASKS = {**settings.TASKS, alias: settings.TASKS["default"]}
    task = test_tasks.noop_task.using(backend=alias, priority=-5)

    # When: a job is enqueued through it, alone and in bulk
    single = task.enqueue(1)
    [bulk] = task_backends[alias].enqueue_many(task, [((2,), {})])

    # Then: each row names that backend, and each result reads back
    for result, args in ((single, [1]), (bulk, [2])):
        job = Job.objects.get(pk=result.id)
        assert (job.backend, job.priority, job.args) == (alias, -5, args)
        assert task_backends[alias].get_result(result.id).args == args


@pytest.mark.django_db(transaction=True)
def test_enqueue_many_stores_text_copy_would_misread_and_real_uuid7_ids(
    backend: ReliableJobsBackend, redis_client: redis.Redis
) -> None:
    # Given: arguments holding what COPY's text format treats specially
    # (backslashes, tabs, newlines, a literal \N) and text beyond ASCII
    tricky = ["back\\slash", "tab\there", "new\nline\r", "\\N", "quote\"d", "ünï €", "\\\\t"]
    calls = [((text,), {"k": text, "nested": [text, {"x": text}]}) for text in tricky]

    # When: they are enqueued at once
    results = backend.enqueue_many(test_tasks.noop_task, calls)

    # Then: each row and each Redis payload holds exactly the arguments given
    for result, text in zip(results, tricky, strict=True):
        job = Job.objects.get(pk=result.id)
        assert (job.args, job.kwargs) == ([text], {"k": text, "nested": [text, {"x": text}]})
        stored = payload.decode(redis_client.hget(job_key(result.id), "payload"))
        assert (stored.args, stored.kwargs) == (job.args, job.kwargs)
        # and every id is a version 7 UUID in its canonical text
        assert str(uuid.UUID(result.id)) == result.id
        assert uuid.UUID(result.id).version == 7
        assert uuid.UUID(result.id).variant == uuid.RFC_4122


# -- async API ------------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_aenqueue_aget_result_and_arefresh(
    backend: ReliableJobsBackend, redis_client: redis.Redis
) -> None:
    # pytest-asyncio is not a dependency: async_to_sync drives the coroutine,
    # and its thread-sensitive sync_to_async calls come back to this thread's
    # database connection.
    async def enqueue_and_read() -> tuple[TaskResult, TaskResult]:
        result = await test_tasks.noop_task_async.aenqueue(1, two=3)
        return result, await test_tasks.noop_task_async.aget_result(result.id)

    # When: a coroutine task is enqueued and read back through the async API
    result, fetched = async_to_sync(enqueue_and_read)()

    # Then: it behaves as the sync API does
    assert result.status == TaskResultStatus.READY
    assert fetched == result
    assert redis_client.lrange(QUEUED, 0, -1) == [result.id]

    # When: the job finishes and the caller refreshes asynchronously
    Job.objects.filter(pk=result.id).update(state=JobState.SUCCEEDED, return_value=None)
    async_to_sync(result.arefresh)()

    # Then: the refreshed result is successful
    assert result.status == TaskResultStatus.SUCCESSFUL
    assert result.return_value is None

    # Then: aget_result of an unknown id raises like get_result
    with pytest.raises(TaskResultDoesNotExist):
        async_to_sync(backend.aget_result)(str(uuid.uuid4()))
