"""Unique jobs (``@task(unique_for_ms=...)``) against real Redis and the real database.

The database is the judge: the partial unique index over unfinished jobs'
keys, checked in the enqueuing transaction. These tests race real threads
and real processes at it, roll transactions back, end jobs every way a job
ends (a real worker included) and check that the key is free again. They
run on PostgreSQL and, in scripts/test's second run, on SQLite (the
mirror's portable path).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import redis
from asgiref.sync import async_to_sync
from django.db import connection, connections, transaction
from django.utils import timezone

from reliable_jobs import mirror, staff, unique
from reliable_jobs.backend import ReliableJobsBackend
from reliable_jobs.broker import Applied
from reliable_jobs.compat import InvalidTask, TaskContext, task, task_backends, task_enqueued
from reliable_jobs.mirror import AttemptRecord
from reliable_jobs.models import AttemptOutcome, Job, JobState
from reliable_jobs.sweep import Sweep
from testproject.demo import tasks as demo

from .helpers import Processes, backdate, wait_until
from .test_admin import make_dead, run_attempt

pytestmark = pytest.mark.django_db(transaction=True)

QUEUED = "rj:{default}:queued"


@task(unique_for_ms=60_000)
def report(account: int, month: str = "2026-12") -> str:
    return f"{account}:{month}"


@task(unique_for_ms=60_000, unique_by=["account"])
def report_by_account(account: int, month: str, **options: Any) -> str:
    return f"{account}:{month}"


@task(unique_for_ms=60_000, unique_by=lambda account, **_: account % 10)
def report_by_function(account: int, month: str = "") -> str:
    return month


@task(unique_for_ms=60_000, unique_while_running=True)
def report_while_running(account: int) -> int:
    return account


@task(unique_for_ms=60_000, takes_context=True, unique_by=["account"])
def report_with_context(context: TaskContext[[int], int], account: int) -> int:
    return account


#: The same function as ``report``, enqueued as plain jobs.
plain_report = dataclasses.replace(report, unique_for_ms=None)


@pytest.fixture
def backend(rj_settings: Any) -> ReliableJobsBackend:
    configured = task_backends["default"]
    assert isinstance(configured, ReliableJobsBackend)
    return configured


def jobs_of(task_path: str) -> list[Job]:
    return list(Job.objects.filter(task_path=task_path).order_by("enqueued_at"))


# -- equal calls ----------------------------------------------------------------


def test_an_equal_call_returns_the_queued_job_without_a_second_push(
    backend: ReliableJobsBackend, redis_client: redis.Redis
) -> None:
    # Given: a queued job of a unique task, and a listener for task_enqueued
    signalled: list[str] = []

    def receiver(sender: type, task_result: Any, **kwargs: Any) -> None:
        signalled.append(task_result.id)

    task_enqueued.connect(receiver, weak=False)
    try:
        first = report.enqueue(7)

        # When: the same call is enqueued again, spelled two other ways
        again = report.enqueue(7, "2026-12")
        by_keyword = report.enqueue(account=7)
    finally:
        task_enqueued.disconnect(receiver)

    # Then: both get the first job's result; one row, one push, one signal
    assert again.id == first.id == by_keyword.id
    assert again.args == [7]  # the existing job's arguments, as it was enqueued
    assert [str(job.pk) for job in jobs_of(report.module_path)] == [first.id]
    assert redis_client.lrange(QUEUED, 0, -1) == [first.id]
    assert signalled == [first.id]


def test_different_calls_are_different_jobs(backend: ReliableJobsBackend) -> None:
    # Given / When: calls that differ in an argument, or in the queue
    ids = {report.enqueue(1).id, report.enqueue(2).id, report.enqueue(1, "2027-01").id}

    # Then: three jobs
    assert len(ids) == 3 == Job.objects.filter(task_path=report.module_path).count()


def test_unique_by_names_the_arguments_that_count(backend: ReliableJobsBackend) -> None:
    # Given: a job keyed by account only (month and **options do not count)
    first = report_by_account.enqueue(1, "2026-12")

    # When: calls for the same account with another month, and another account
    same = report_by_account.enqueue(account=1, month="2027-01", style="short")
    other = report_by_account.enqueue(2, "2026-12")

    # Then
    assert same.id == first.id
    assert other.id != first.id


def test_unique_by_a_function_of_the_call(backend: ReliableJobsBackend) -> None:
    # Given / When: accounts 3 and 13 share a key (account % 10), 4 does not
    first = report_by_function.enqueue(3, month="a")

    # Then
    assert report_by_function.enqueue(13).id == first.id
    assert report_by_function.enqueue(4).id != first.id


def test_a_task_that_takes_its_context_is_keyed_by_its_callers_arguments(
    backend: ReliableJobsBackend
) -> None:
    first = report_with_context.enqueue(5)
    assert report_with_context.enqueue(account=5).id == first.id
    assert report_with_context.enqueue(6).id != first.id


def test_equal_calls_on_a_sharded_queue_are_one_job(
    rj_settings: Any, redis_client: redis.Redis
) -> None:
    # Given: the queue split into 4 shards (each enqueue picks one at random)
    rj_settings(SHARDS={"default": 4})

    # When: the same call is enqueued 12 times
    ids = {report.enqueue(3).id for _ in range(12)}

    # Then: one job, on one shard
    assert len(ids) == 1 == Job.objects.count()
    pushed = [job_id for shard in ("default", "default#1", "default#2", "default#3")
              for job_id in redis_client.lrange(f"rj:{{{shard}}}:queued", 0, -1)]
    assert pushed == list(ids)


def test_aenqueue_returns_the_same_job(backend: ReliableJobsBackend) -> None:
    first = async_to_sync(report.aenqueue)(8)
    assert async_to_sync(report.aenqueue)(account=8).id == first.id


def test_unique_and_plain_calls_of_one_task_mix(
    backend: ReliableJobsBackend, redis_client: redis.Redis
) -> None:
    # Given: a plain job of the function, then a unique one of the same call
    plain = plain_report.enqueue(9)
    unique_job = report.enqueue(9)

    # When: more of each are enqueued
    plain_again = plain_report.enqueue(9)
    unique_again = report.enqueue(9)

    # Then: plain calls are always new jobs and never the unique one's holder;
    # the unique call found its own job, not a plain one
    assert len({plain.id, unique_job.id, plain_again.id}) == 3
    assert unique_again.id == unique_job.id
    keys = dict(Job.objects.values_list("pk", "unique_key"))
    assert {str(pk) for pk, key in keys.items() if key is None} == {plain.id, plain_again.id}
    assert len(redis_client.lrange(QUEUED, 0, -1)) == 3


def test_enqueue_many_dedupes_within_the_batch_and_against_the_table(
    backend: ReliableJobsBackend, redis_client: redis.Redis
) -> None:
    # Given: one job already queued
    existing = report.enqueue(1)

    # When: a batch holds that call, a new call twice, and another new call
    results = backend.enqueue_many(report, [((1,), {}), ((2,), {}), ((), {"account": 2}),
                                            ((3,), {})])

    # Then: the existing job, one new job twice, one more; two pushes
    assert results[0].id == existing.id
    assert results[1].id == results[2].id != results[3].id
    assert Job.objects.count() == 3
    assert sorted(redis_client.lrange(QUEUED, 0, -1)) == sorted(
        [existing.id, results[1].id, results[3].id])


# -- when the key is free again ----------------------------------------------------


@pytest.mark.parametrize("ending", ["succeeded", "dead", "buried", "cancelled"])
def test_the_key_is_free_once_the_job_ends(backend: ReliableJobsBackend, ending: str) -> None:
    # Given: a unique job that ends through the mirror, as a worker (its outcome),
    # the sweep (a death Redis recorded) or staff (a cancel) end it
    first = report.enqueue(1)
    if ending == "succeeded":
        run_attempt(backend, first.id, outcome="succeeded")
    elif ending == "dead":
        make_dead(backend, first.id, attempts=3)
    elif ending == "buried":
        mirror.bury(backend.database, first.id, attempts=3, gen=0, error="boom")
        ending = "dead"
    else:
        assert staff.cancel(backend.parts, first.id).done

    # When: the same call is enqueued again
    second = report.enqueue(1)

    # Then: a new job; the ended one keeps its key as history
    assert second.id != first.id
    ended = Job.objects.get(pk=first.id)
    assert ended.state == ending
    assert ended.unique_key == Job.objects.get(pk=second.id).unique_key


@pytest.mark.slow
def test_the_key_is_free_once_a_real_worker_ran_the_job(
    rj_settings: Any, processes: Processes
) -> None:
    # Given: a unique job, and the same call returning it
    env = rj_settings()
    first = demo.unique_add.enqueue(20, 22)
    assert demo.unique_add.enqueue(20, 22).id == first.id

    # When: a worker runs it
    worker = processes.worker(env, "--burst")
    assert worker.wait(timeout=60) == 0, processes.log(worker)
    assert demo.unique_add.get_result(first.id).return_value == 42

    # Then: the same call is a new job
    assert demo.unique_add.enqueue(20, 22).id != first.id


def test_the_key_is_free_after_unique_for_ms(
    backend: ReliableJobsBackend, redis_client: redis.Redis
) -> None:
    # Given: a queued job enqueued longer ago than unique_for_ms (60 s)
    first = report.enqueue(1)
    Job.objects.filter(pk=first.id).update(enqueued_at=timezone.now() - timedelta(seconds=61))

    # When: the same call is enqueued again
    second = report.enqueue(1)

    # Then: a new job holds the key; the old one still waits, without it
    assert second.id != first.id
    old = Job.objects.get(pk=first.id)
    assert (old.state, old.unique_key) == (JobState.QUEUED, None)
    assert sorted(redis_client.lrange(QUEUED, 0, -1)) == sorted([first.id, second.id])
    assert report.enqueue(1).id == second.id


def test_a_scheduled_job_holds_its_key_for_unique_for_ms_after_its_run_after(
    backend: ReliableJobsBackend
) -> None:
    # Given: a job due in 10 minutes, enqueued (say) 5 minutes ago
    later = report.using(run_after=timezone.now() + timedelta(minutes=10))
    first = later.enqueue(1)
    Job.objects.filter(pk=first.id).update(enqueued_at=timezone.now() - timedelta(minutes=5))

    # When / Then: an equal call, scheduled or not, still gets it
    assert later.enqueue(1).id == first.id
    assert report.enqueue(1).id == first.id


def test_a_running_job_counts_only_with_unique_while_running(
    backend: ReliableJobsBackend
) -> None:
    # Given: a running job of each kind of unique task
    default = report.enqueue(1)
    run_attempt(backend, default.id, outcome="running")
    held = report_while_running.enqueue(1)
    run_attempt(backend, held.id, outcome="running")

    # When / Then: a call equal to the running job is a new job by default...
    fresh = report.enqueue(1)
    assert fresh.id != default.id
    assert Job.objects.get(pk=default.id).unique_key is None
    # ...and the running job with unique_while_running
    assert report_while_running.enqueue(1).id == held.id


def claim_and_start(backend: ReliableJobsBackend, job_id: str, *, start: bool = True) -> None:
    """Claim ``job_id`` (and mark it started) in Redis as a worker does, its
    start record not yet in the database (the worker writes it later, batched)."""
    claimed = backend.broker.claim("default", count=1, lease_ms=60_000)
    assert [job.id for job in claimed.jobs] == [job_id]
    if start:
        assert backend.broker.start("default", [claimed.jobs[0].fence]) == [Applied.DONE]
    assert Job.objects.get(pk=job_id).state == JobState.QUEUED


def test_a_job_a_worker_started_is_running_before_its_start_reaches_the_database(
    backend: ReliableJobsBackend, redis_client: redis.Redis
) -> None:
    # Given: a unique job a worker claimed and started; the database still says queued
    first = report.enqueue(1)
    claim_and_start(backend, first.id)

    # When: the same call is enqueued again
    second = report.enqueue(1)

    # Then: a new job (the started one may have read what the call wants seen),
    # pushed; the started job gave its key up
    assert second.id != first.id
    assert redis_client.lrange(QUEUED, 0, -1) == [second.id]
    assert Job.objects.get(pk=first.id).unique_key is None
    assert report.enqueue(1).id == second.id


def test_a_started_job_holds_its_key_with_unique_while_running(
    backend: ReliableJobsBackend
) -> None:
    # Given: a started job of a task whose running jobs count, the database still says queued
    first = report_while_running.enqueue(1)
    claim_and_start(backend, first.id)

    # When / Then: the same call returns it
    assert report_while_running.enqueue(1).id == first.id


def test_a_job_claimed_but_not_started_still_holds_its_key(
    backend: ReliableJobsBackend
) -> None:
    # Given: a unique job a worker claimed and has not started (its task has not begun)
    first = report.enqueue(1)
    claim_and_start(backend, first.id, start=False)

    # When / Then: the same call returns it: it runs after the call
    assert report.enqueue(1).id == first.id


def test_a_job_that_ends_while_its_key_is_judged_does_not_hold_it(
    backend: ReliableJobsBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given: a unique job a worker started; its start record did not reach the
    # database, and the worker ends the job (row written succeeded, then the
    # hash freed) between the producer's look-up of the holder and its question to Redis
    first = report.enqueue(1)
    claimed = backend.broker.claim("default", count=1, lease_ms=60_000).jobs[0]
    assert backend.broker.start("default", [claimed.fence]) == [Applied.DONE]
    ask = backend.broker.progress

    def ends_first(jobs: Any) -> Any:
        if Job.objects.get(pk=first.id).state == JobState.QUEUED:
            now = timezone.now()
            mirror.record(backend.database, [AttemptRecord(
                first.id, claimed.attempt, JobState.SUCCEEDED, worker_id="w", started_at=now,
                finished_at=now, outcome=AttemptOutcome.SUCCEEDED, gen=claimed.gen)])
            assert backend.broker.ack("default", [claimed.fence]) == [Applied.DONE]
        return ask(jobs)

    monkeypatch.setattr(backend.broker, "progress", ends_first)

    # When: the same call is enqueued
    second = report.enqueue(1)

    # Then: a new job: the holder ran (Redis no longer had it, the row says so now)
    assert second.id != first.id
    assert Job.objects.get(pk=first.id).state == JobState.SUCCEEDED


def test_a_holder_redis_does_not_have_yet_holds_its_key(
    backend: ReliableJobsBackend, redis_client: redis.Redis
) -> None:
    # Given: a unique job whose push has not happened (its transaction is open)
    with transaction.atomic():
        first = report.enqueue(1)

        # When / Then: the same call in that transaction returns it
        assert report.enqueue(1).id == first.id
    assert redis_client.lrange(QUEUED, 0, -1) == [first.id]


def test_with_redis_down_the_rows_decide(
    rj_settings: Any, app_log: list[logging.LogRecord]
) -> None:
    # Given: a backend whose Redis refuses connections, and a unique job
    # waiting in the database for its push
    rj_settings(REDIS_URL="redis://127.0.0.1:1/0")
    first = report.enqueue(1)

    # When: the same call is enqueued
    again = report.enqueue(1)

    # Then: the producer did not fail; the row (queued) holds the key; a warning says why
    assert again.id == first.id
    said = [r.getMessage() for r in app_log if r.levelno == logging.WARNING]
    assert any("their database rows decide" in message for message in said), said


@pytest.mark.parametrize("call", [report, report_while_running], ids=["default", "while_running"])
def test_a_job_redis_buried_does_not_hold_its_key(
    backend: ReliableJobsBackend, redis_client: redis.Redis, call: Any
) -> None:
    # Given: a unique job whose attempts were all spent by workers that were
    # lost, so the next claim buries it (the database learns it from the sweep)
    first = call.enqueue(1)
    spent = Job.objects.get(pk=first.id).max_attempts
    redis_client.hset(backend.broker.keys("default").job(first.id), "attempts", spent)
    assert backend.broker.claim("default", count=1, lease_ms=60_000).dead
    assert Job.objects.get(pk=first.id).state == JobState.QUEUED

    # When / Then: the same call is a new job (the buried one will not run)
    assert call.enqueue(1).id != first.id


def test_a_job_retried_by_staff_runs_without_the_key_a_new_job_holds(
    backend: ReliableJobsBackend
) -> None:
    # Given: a dead unique job, and a new job of the same call holding the key
    first = report.enqueue(1)
    make_dead(backend, first.id, attempts=3)
    second = report.enqueue(1)

    # When: staff retry the dead one
    outcome = staff.retry(backend.parts, first.id)

    # Then: it is queued again without a key (the index would refuse two holders)
    assert outcome.done, outcome.message
    retried = Job.objects.get(pk=first.id)
    assert (retried.state, retried.unique_key) == (JobState.QUEUED, None)
    assert report.enqueue(1).id == second.id


def test_a_rebuild_from_the_mirror_keeps_the_key(
    backend: ReliableJobsBackend, redis_client: redis.Redis
) -> None:
    # Given: a unique job that Redis lost (flushed), old enough for reconcile
    first = report.enqueue(1)
    redis_client.flushdb()
    backdate(first.id)

    # When: reconcile rebuilds it
    assert Sweep(backend.parts).reconcile().pushed == 1

    # Then: it still holds its key
    assert redis_client.lrange(QUEUED, 0, -1) == [first.id]
    assert report.enqueue(1).id == first.id


# -- transactions and races -----------------------------------------------------


def test_a_rolled_back_enqueue_frees_the_key(
    backend: ReliableJobsBackend, redis_client: redis.Redis
) -> None:
    # Given: an enqueue inside a transaction that rolls back
    class Abort(Exception):
        pass

    with pytest.raises(Abort), transaction.atomic():
        lost = report.enqueue(1)
        assert report.enqueue(1).id == lost.id  # the same transaction sees its own job
        raise Abort

    # When: the same call is enqueued again
    second = report.enqueue(1)

    # Then: a new job, the only one, the only push
    assert second.id != lost.id
    assert [str(pk) for pk in Job.objects.values_list("pk", flat=True)] == [second.id]
    assert redis_client.lrange(QUEUED, 0, -1) == [second.id]


def test_a_caller_waiting_on_a_transaction_that_rolls_back_gets_a_new_job(
    backend: ReliableJobsBackend, redis_client: redis.Redis
) -> None:
    # Given: a thread that enqueued a call inside a transaction still open
    entered, release = threading.Event(), threading.Event()
    held: list[str] = []
    errors: list[BaseException] = []

    def holder() -> None:
        try:
            with transaction.atomic():
                held.append(report.enqueue(1).id)
                entered.set()
                assert release.wait(timeout=30)
                transaction.set_rollback(True)
        except BaseException as exc:  # reported by the test thread
            errors.append(exc)
            entered.set()
        finally:
            connections.close_all()

    thread = threading.Thread(target=holder)
    thread.start()
    assert entered.wait(timeout=30)

    # When: another caller enqueues the same call (it waits for that
    # transaction), and the transaction rolls back
    waiter: list[str] = []

    def enqueue_same() -> None:
        try:
            waiter.append(report.enqueue(1).id)
        finally:
            connections.close_all()

    second = threading.Thread(target=enqueue_same)
    second.start()
    second.join(timeout=0.3)  # let it reach the insert (no assertion on timing)
    release.set()
    thread.join(timeout=30)
    second.join(timeout=30)
    assert not thread.is_alive() and not second.is_alive()
    assert not errors, errors

    # Then: the waiting caller got a job of its own, the only one
    assert waiter and waiter[0] != held[0]
    assert [str(pk) for pk in Job.objects.values_list("pk", flat=True)] == waiter
    assert redis_client.lrange(QUEUED, 0, -1) == waiter


@pytest.mark.parametrize("in_transaction", [True, False], ids=["atomic", "autocommit"])
def test_twenty_threads_enqueueing_one_call_make_one_job(
    backend: ReliableJobsBackend, redis_client: redis.Redis, in_transaction: bool
) -> None:
    # Given: 20 threads, each with its own database connection, lined up
    barrier = threading.Barrier(20, timeout=30)
    ids: list[str] = []
    errors: list[BaseException] = []

    def producer() -> None:
        try:
            barrier.wait()
            if not in_transaction:
                result = report.enqueue(42)
            else:
                with transaction.atomic():
                    result = report.enqueue(42)
                    # Hold the transaction a moment, so the others meet the
                    # uncommitted row, not only a committed one.
                    threading.Event().wait(0.05)
            ids.append(result.id)
        except BaseException as exc:  # reported by the test thread
            errors.append(exc)
        finally:
            connection.close()

    # When: they enqueue the same call at once
    threads = [threading.Thread(target=producer) for _ in range(20)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not any(thread.is_alive() for thread in threads)

    # Then: one job, which every producer got; one push
    assert not errors, errors
    assert len(ids) == 20 and len(set(ids)) == 1
    assert [str(pk) for pk in Job.objects.values_list("pk", flat=True)] == ids[:1]
    assert redis_client.lrange(QUEUED, 0, -1) == ids[:1]


def test_twenty_threads_taking_over_an_expired_key_make_one_new_job(
    backend: ReliableJobsBackend, redis_client: redis.Redis
) -> None:
    # Given: a queued job whose window has passed, and 20 threads lined up
    old = report.enqueue(42)
    Job.objects.filter(pk=old.id).update(enqueued_at=timezone.now() - timedelta(minutes=2))
    barrier = threading.Barrier(20, timeout=30)
    ids: list[str] = []
    errors: list[BaseException] = []

    def producer() -> None:
        try:
            barrier.wait()
            with transaction.atomic():
                ids.append(report.enqueue(42).id)
        except BaseException as exc:  # reported by the test thread
            errors.append(exc)
        finally:
            connection.close()

    # When: they all enqueue the same call at once (each finds the stale holder)
    threads = [threading.Thread(target=producer) for _ in range(20)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not any(thread.is_alive() for thread in threads)

    # Then: one new job, which every producer got; the old one waits on, keyless
    assert not errors, errors
    assert len(set(ids)) == 1 and ids[0] != old.id
    keys = dict(Job.objects.values_list("pk", "unique_key"))
    assert len(keys) == 2 and keys[Job.objects.get(pk=old.id).pk] is None
    assert sorted(redis_client.lrange(QUEUED, 0, -1)) == sorted([old.id, ids[0]])


#: Producers in one ``manage.py shell -c``: Django starts once, then 20 forked
#: processes (each with its own database session and Redis connection) line up
#: and enqueue. Twenty interpreters each starting Django cost about as much CPU
#: as the rest of the test, and the race is between processes either way.
PRODUCERS = """
import os, pathlib, sys, time, traceback
from django.db import connections, transaction
from testproject.demo.tasks import unique_add
out, go = pathlib.Path(os.environ["RJ_OUT"]), pathlib.Path(os.environ["RJ_GO"])
connections.close_all()  # each child opens its own session

def produce(n):
    (out / f"ready-{n}").write_text("")
    deadline = time.monotonic() + 120
    while not go.exists():
        if time.monotonic() > deadline:
            raise SystemExit("never told to go")
        time.sleep(0.005)
    with transaction.atomic():
        result = unique_add.enqueue(1, 2)
        time.sleep(0.05)
    (out / f"result-{n}").write_text(str(result.id))  # a file each: no interleaved lines

children = []
for n in range(int(os.environ["RJ_PRODUCERS"])):
    pid = os.fork()
    if pid == 0:
        status = 0
        try:
            produce(n)
        except BaseException:
            traceback.print_exc()
            status = 1
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(status)
    children.append(pid)
failed = [pid for pid in children if os.waitpid(pid, 0)[1] != 0]
sys.exit(f"producers {failed} failed" if failed else 0)
"""


@pytest.mark.slow
def test_twenty_processes_enqueueing_one_call_make_one_job(
    rj_settings: Any, processes: Processes, redis_client: redis.Redis, tmp_path: Path
) -> None:
    # Given: 20 producer processes, each started and waiting for the word
    env = rj_settings()
    go = tmp_path / "go"
    producers = processes.manage("shell", "-c", PRODUCERS, env=env, extra_env={
        "RJ_OUT": str(tmp_path), "RJ_GO": str(go), "RJ_PRODUCERS": "20"})
    wait_until(lambda: len(list(tmp_path.glob("ready-*"))) == 20
               or producers.poll() is not None,
               timeout=180, message="20 producers to start")

    # When: they all enqueue the same call at once
    go.write_text("")
    assert producers.wait(timeout=120) == 0, processes.log(producers)

    # Then: one job, which every producer got; one push
    ids = [path.read_text() for path in sorted(tmp_path.glob("result-*"))]
    assert len(ids) == 20 and len(set(ids)) == 1, ids
    assert [str(pk) for pk in Job.objects.values_list("pk", flat=True)] == ids[:1]
    assert redis_client.lrange(QUEUED, 0, -1) == ids[:1]


# -- bad options ----------------------------------------------------------------


def _noop(account: int, month: str = "") -> None:
    return None


@pytest.mark.parametrize(("options", "message"), [
    ({"unique_for_ms": 0}, "unique_for_ms must be a whole number >= 1, not 0."),
    ({"unique_for_ms": 1.5}, "unique_for_ms must be a whole number >= 1, not 1.5."),
    ({"unique_by": ["account"]}, "unique_by has no effect without unique_for_ms"),
    ({"unique_while_running": True}, "unique_while_running has no effect without unique_for_ms"),
    ({"unique_for_ms": 1000, "unique_by": "account"},
     "unique_by must be a function or a list of argument names, not 'account'."),
    ({"unique_for_ms": 1000, "unique_by": []}, "unique_by must name at least one argument"),
    ({"unique_for_ms": 1000, "unique_by": ["acount"]},
     "unique_by names 'acount', which is not an argument of _noop() (it takes account, month)."),
    ({"unique_for_ms": 1000, "unique_while_running": "yes"},
     "unique_while_running must be True or False, not 'yes'."),
])
def test_bad_unique_options_are_refused_when_the_task_is_defined(
    backend: ReliableJobsBackend, options: dict[str, Any], message: str
) -> None:
    with pytest.raises(InvalidTask) as raised:
        task(**options)(_noop)
    assert str(raised.value).startswith(message)


def test_a_key_that_cannot_be_computed_is_refused_at_enqueue(
    backend: ReliableJobsBackend, redis_client: redis.Redis
) -> None:
    # Given: a key function that returns something that is not JSON
    odd = dataclasses.replace(report_by_function, unique_by=lambda account, **_: {account})

    # When / Then: enqueue says why, and writes nothing
    with pytest.raises(InvalidTask, match="is not JSON"):
        odd.enqueue(1)
    with pytest.raises(InvalidTask, match="cannot be called with these arguments"):
        report.enqueue(1, 2, 3)
    assert Job.objects.count() == 0
    assert redis_client.dbsize() == 0


def test_the_key_names_backend_queue_task_and_call(rj_settings: Any) -> None:
    # The key is a digest of all four: any of them changing changes it.
    rj_settings(queues=["default", "emails"])
    keys = {
        unique.key_for(report, "default", [1], {}),
        unique.key_for(report, "other", [1], {}),
        unique.key_for(dataclasses.replace(report, queue_name="emails"), "default", [1], {}),
        unique.key_for(report_while_running, "default", [1], {}),
        unique.key_for(report, "default", [2], {}),
    }
    assert len(keys) == 5
    assert unique.key_for(report, "default", [1], {}) == unique.key_for(
        report, "default", [], {"account": 1, "month": "2026-12"})


def test_a_database_without_partial_indexes_is_refused_by_check_and_enqueue(
    backend: ReliableJobsBackend, monkeypatch: pytest.MonkeyPatch, redis_client: redis.Redis
) -> None:
    # Given: a mirror database that has no partial indexes (MySQL, Oracle: Django
    # would skip the unique index with only a warning). No such server runs
    # here, so the connection's feature flag says it.
    monkeypatch.setattr(connections["default"].features, "supports_partial_indexes", False)

    # When / Then: manage.py check names the unique tasks...
    errors = [m for m in backend.check() if m.id == "reliable_jobs.E015"]
    assert len(errors) == 1
    assert "has no partial unique indexes" in errors[0].msg
    assert report.module_path in (errors[0].hint or "")
    # ...and enqueue refuses a unique task before writing anything; plain tasks still go
    with pytest.raises(InvalidTask, match="has no partial unique indexes"):
        report.enqueue(1)
    assert Job.objects.count() == 0
    plain_report.enqueue(1)
    assert Job.objects.count() == 1


def test_check_is_silent_for_unique_tasks_on_postgresql_and_sqlite(
    backend: ReliableJobsBackend
) -> None:
    assert [m for m in backend.check() if m.id == "reliable_jobs.E015"] == []
