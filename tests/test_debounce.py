"""Debounced tasks (``debounce_ms``, ``max_wait_ms``) against real Redis, Valkey and the database.

Redis decides whether a call joins the pending job (debounce.lua, atomic
with promote and claim); the database judges the key and keeps the last
call's arguments and run time on the row. These tests drive every state a
holder can be in when a call arrives (pending, made but not pushed, lost by
Redis, promoted, claimed, running), race the claim against a call whose
enqueue already read the row, and run a real worker.
"""

from __future__ import annotations

import json
import threading
import time
from datetime import timedelta
from typing import Any

import pytest
import redis
from django.db import connection, transaction
from django.utils import timezone

from reliable_jobs.backend import ReliableJobsBackend
from reliable_jobs.broker import Broker, DebounceOutcome, NewJob, epoch_ms
from reliable_jobs.compat import InvalidTask, task, task_backends
from reliable_jobs.models import Job, JobState
from reliable_jobs.sweep import Sweep
from testproject.demo import tasks as demo

from .helpers import Processes, backdate, wait_until
from .test_admin import run_attempt

pytestmark = pytest.mark.django_db(transaction=True)


@task(unique_for_ms=60_000, unique_by=["key"], debounce_ms=60_000)
def settle(key: str, n: int) -> int:
    return n


@task(unique_for_ms=60_000, unique_by=["key"], debounce_ms=30_000, max_wait_ms=45_000)
def settle_at_most(key: str, n: int) -> int:
    return n


def _noop(key: str, n: int = 0) -> None: ...


@pytest.fixture
def backend(rj_settings: Any) -> ReliableJobsBackend:
    configured = task_backends["default"]
    assert isinstance(configured, ReliableJobsBackend)
    return configured


def held(broker: Broker, job_id: str) -> tuple[list[Any], int | None, str | None]:
    """A job as Redis holds it: its call's args, its due time (None if not scheduled), state."""
    k = broker.keys("default")
    text, state = broker.client.hmget(k.job(job_id), "payload", "state")
    due = broker.client.zscore(k.scheduled, job_id)
    args = json.loads(text)["args"] if text else []
    return args, None if due is None else int(due), state


def make_due(broker: Broker, job_id: str) -> None:
    """Bring a pending job's due time to now, and promote it (as a sweep would)."""
    broker.client.zadd(broker.keys("default").scheduled, {job_id: 0})
    assert broker.promote("default") == 1


# -- options ----------------------------------------------------------------------


@pytest.mark.parametrize(("options", "message"), [
    ({"debounce_ms": 100}, "debounce_ms needs unique_for_ms"),
    ({"unique_for_ms": 1000, "debounce_ms": -5}, "debounce_ms must be a whole number >= 1"),
    ({"unique_for_ms": 1000, "debounce_ms": 0}, "debounce_ms must be a whole number >= 1"),
    ({"unique_for_ms": 1000, "debounce_ms": True}, "debounce_ms must be a whole number >= 1"),
    ({"unique_for_ms": 1000, "debounce_ms": 100, "max_wait_ms": -1},
     "max_wait_ms must be a whole number >= 1"),
    ({"unique_for_ms": 1000, "max_wait_ms": 100}, "max_wait_ms has no effect without debounce_ms"),
    ({"unique_for_ms": 1000, "debounce_ms": 200, "max_wait_ms": 100},
     "max_wait_ms (100) is shorter than debounce_ms (200)"),
    ({"unique_for_ms": 1000, "debounce_ms": 200, "unique_while_running": True},
     "debounce_ms cannot be used with unique_while_running=True"),
])
def test_bad_debounce_options_are_refused_when_the_task_is_defined(
    backend: ReliableJobsBackend, options: dict[str, Any], message: str
) -> None:
    with pytest.raises(InvalidTask) as raised:
        task(**options)(_noop)
    assert str(raised.value).startswith(message)


def test_a_debounced_call_takes_no_run_after(backend: ReliableJobsBackend) -> None:
    later = settle.using(run_after=timezone.now() + timedelta(minutes=5))
    with pytest.raises(InvalidTask, match="is debounced: its run time is debounce_ms after"):
        later.enqueue("a", 1)
    assert not Job.objects.exists()


# -- calls while the job is pending -----------------------------------------------------


def test_a_burst_of_calls_makes_one_pending_job_with_the_last_arguments(
    backend: ReliableJobsBackend, redis_client: redis.Redis
) -> None:
    # Given: a debounced job, pending
    broker = backend.broker
    first = settle.enqueue("a", 1)
    _, first_due, state = held(broker, first.id)
    assert state == "scheduled" and first_due is not None
    time.sleep(0.01)

    # When: equal calls (same key) follow, and one call with another key
    results = [settle.enqueue("a", n) for n in range(2, 6)]
    other = settle.enqueue("b", 1)

    # Then: every equal call got the first job, with its own (the last) arguments...
    assert {result.id for result in results} == {first.id} != {other.id}
    assert [result.args for result in results] == [["a", n] for n in range(2, 6)]
    # ...Redis holds one pending run of the last call, pushed back...
    args, due, state = held(broker, first.id)
    assert (args, state) == (["a", 5], "scheduled")
    assert due is not None and due > first_due
    # ...and the row says the same: arguments and run time (Redis's due time)
    row = Job.objects.get(pk=first.id)
    assert (row.args, row.state) == (["a", 5], JobState.SCHEDULED)
    assert row.run_after is not None and epoch_ms(row.run_after) == due
    assert Job.objects.filter(task_path=settle.module_path).count() == 2
    assert backend.get_result(first.id).args == ["a", 5]


def test_max_wait_bounds_how_far_calls_push_the_run_back(
    backend: ReliableJobsBackend, redis_client: redis.Redis
) -> None:
    # Given: a job made 40 s ago (per Redis) of a task with max_wait_ms=45 s
    broker = backend.broker
    first = settle_at_most.enqueue("a", 1)
    job_key = broker.keys("default").job(first.id)
    made = int(redis_client.hget(job_key, "enqueued_ms") or 0)
    redis_client.hset(job_key, "enqueued_ms", made - 40_000)

    # When: a call comes (debounce_ms=30 s would put it 30 s ahead)
    again = settle_at_most.enqueue("a", 2)

    # Then: it is due 45 s after the job was made, not 30 s after the call
    args, due, _ = held(broker, first.id)
    assert again.id == first.id and args == ["a", 2]
    assert due == made - 40_000 + 45_000
    assert epoch_ms(Job.objects.get(pk=first.id).run_after) == due  # type: ignore[arg-type]


def test_enqueue_many_of_equal_calls_keeps_the_last_one(
    backend: ReliableJobsBackend, redis_client: redis.Redis
) -> None:
    results = backend.enqueue_many(settle, [(("a", 1), {}), (("a", 2), {}), (("b", 7), {})])
    assert results[0].id == results[1].id != results[2].id
    assert Job.objects.get(pk=results[0].id).args == ["a", 2]
    assert held(backend.broker, results[0].id)[0] == ["a", 2]


def test_a_call_in_the_same_transaction_as_the_first_lands_before_its_push(
    backend: ReliableJobsBackend, redis_client: redis.Redis
) -> None:
    # Given / When: two equal calls in one transaction (the first is pushed on commit)
    with transaction.atomic():
        first = settle.enqueue("a", 1)
        again = settle.enqueue("a", 2)
        # Then (before the commit): the second made the job in Redis with its payload
        assert held(backend.broker, first.id)[0] == ["a", 2]

    # Then: the first's late push found the job there and left it alone
    assert again.id == first.id
    assert held(backend.broker, first.id)[:2][0] == ["a", 2]
    assert Job.objects.get(pk=first.id).args == ["a", 2]


def test_twenty_threads_calling_at_once_make_one_job_with_one_of_their_arguments(
    backend: ReliableJobsBackend, redis_client: redis.Redis
) -> None:
    # Given: 20 threads, each with its own database connection, lined up
    barrier = threading.Barrier(20, timeout=30)
    ids: list[str] = []
    errors: list[BaseException] = []

    def producer(n: int) -> None:
        try:
            barrier.wait()
            ids.append(settle.enqueue("a", n).id)
        except BaseException as exc:  # reported by the test thread
            errors.append(exc)
        finally:
            connection.close()

    # When: they make equal calls at once
    threads = [threading.Thread(target=producer, args=(n,)) for n in range(20)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not any(thread.is_alive() for thread in threads)

    # Then: one job, and Redis and the row agree on whose arguments it has
    assert not errors, errors
    assert len(set(ids)) == 1
    row = Job.objects.get()
    args, due, _ = held(backend.broker, ids[0])
    assert row.args == args and epoch_ms(row.run_after) == due  # type: ignore[arg-type]


def test_a_call_waits_for_the_row_of_an_equal_call_that_redis_already_took(
    backend: ReliableJobsBackend, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given: a pending job, and call A paused after Redis took it, before its
    # row is written (its transaction holds the row's lock)
    broker = backend.broker
    first = settle.enqueue("a", 0)
    ask_redis = Broker.debounce
    a_asked, b_done = threading.Event(), threading.Event()

    def pause_a(self: Broker, queue: str, job: NewJob, **kwargs: Any) -> Any:
        done = ask_redis(self, queue, job, **kwargs)
        if threading.current_thread().name == "A":
            a_asked.set()
            b_done.wait(timeout=1.0)  # B cannot finish while A holds the row's lock
        return done

    monkeypatch.setattr(Broker, "debounce", pause_a)  # each thread has its own backend
    errors: list[BaseException] = []

    def call(n: int, after: threading.Event | None, then: threading.Event | None) -> None:
        try:
            if after is not None:
                assert after.wait(timeout=10)
            settle.enqueue("a", n)
            if then is not None:
                then.set()
        except BaseException as exc:  # reported by the test thread
            errors.append(exc)
        finally:
            connection.close()

    # When: call B comes meanwhile
    threads = [threading.Thread(target=call, args=(1, None, None), name="A"),
               threading.Thread(target=call, args=(2, a_asked, b_done), name="B")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert not any(thread.is_alive() for thread in threads) and not errors, errors

    # Then: B went after A, in Redis and in the row: both hold B's arguments
    assert held(broker, first.id)[0] == ["a", 2]
    assert Job.objects.get(pk=first.id).args == ["a", 2]


# -- calls once the job left the pending state ---------------------------------------


def test_a_call_after_the_job_was_promoted_makes_the_next_run(
    backend: ReliableJobsBackend, redis_client: redis.Redis
) -> None:
    # Given: a debounced job that became due (promoted to queued, not claimed yet)
    broker = backend.broker
    first = settle.enqueue("a", 1)
    make_due(broker, first.id)

    # When: an equal call comes
    second = settle.enqueue("a", 2)

    # Then: a new pending job; the due one keeps its arguments and gave up its key
    assert second.id != first.id
    assert held(broker, first.id)[0] == ["a", 1]
    assert held(broker, second.id)[0] == ["a", 2]
    rows = {str(row.pk): row for row in Job.objects.all()}
    assert rows[first.id].args == ["a", 1] and rows[first.id].unique_key is None
    assert rows[second.id].unique_key is not None


def test_a_call_while_the_job_runs_makes_a_new_pending_run_and_never_changes_the_running_one(
    backend: ReliableJobsBackend, redis_client: redis.Redis
) -> None:
    # Given: a debounced job that a worker claimed and started
    broker = backend.broker
    first = settle.enqueue("a", 1)
    make_due(broker, first.id)
    run_attempt(backend, first.id, outcome="running")

    # When: equal calls come
    second = settle.enqueue("a", 2)
    third = settle.enqueue("a", 3)

    # Then: the running job is untouched; the calls make one new pending run
    assert second.id == third.id != first.id
    assert held(broker, first.id)[0] == ["a", 1]
    assert Job.objects.get(pk=first.id).args == ["a", 1]
    args, due, state = held(broker, second.id)
    assert (args, state) == (["a", 3], "scheduled") and due is not None


def test_a_call_arriving_while_the_job_is_being_claimed_never_joins_the_claimed_run(
    backend: ReliableJobsBackend, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given: a pending job, and a worker that claims it at the worst moment: after
    # the call's enqueue found and locked the job's row (still 'scheduled'),
    # before it asks Redis to replace the payload
    broker = backend.broker
    first = settle.enqueue("a", 1)
    ask_redis = broker.debounce
    claimed: list[str] = []

    def claim_first(queue: str, job: NewJob, **kwargs: Any) -> Any:
        if kwargs["replace"] and not claimed:
            make_due(broker, first.id)
            claimed.extend(j.id for j in broker.claim(queue, count=1, lease_ms=60_000).jobs)
            assert Job.objects.get(pk=first.id).state == JobState.SCHEDULED  # the row lags
        return ask_redis(queue, job, **kwargs)

    monkeypatch.setattr(broker, "debounce", claim_first)

    # When: the call goes on
    second = settle.enqueue("a", 2)

    # Then: the claimed run keeps the first call's arguments (Redis and row);
    # the call made a new pending run that holds the key
    assert claimed == [first.id]
    assert second.id != first.id
    args, _, state = held(broker, first.id)
    assert (args, state) == (["a", 1], "running")
    assert Job.objects.get(pk=first.id).args == ["a", 1]
    assert held(broker, second.id)[0] == ["a", 2]
    assert Job.objects.get(pk=second.id).unique_key is not None


# -- Redis loses the job ---------------------------------------------------------------


def test_the_row_is_the_truth_after_redis_loses_the_job(
    backend: ReliableJobsBackend, redis_client: redis.Redis
) -> None:
    # Given: a pending job that took a later call, then Redis lost everything
    first = settle.enqueue("a", 1)
    settle.enqueue("a", 2)
    due = held(backend.broker, first.id)[1]
    redis_client.flushdb()
    backdate(first.id)

    # When: reconcile rebuilds it from its row
    assert Sweep(backend.parts).reconcile().pushed == 1

    # Then: it is pending again, with the last call's arguments and due time
    args, rebuilt_due, state = held(backend.broker, first.id)
    assert (args, state, rebuilt_due) == (["a", 2], "scheduled", due)


def test_a_call_finding_the_job_lost_by_redis_makes_it_again_with_its_arguments(
    backend: ReliableJobsBackend, redis_client: redis.Redis
) -> None:
    # Given: a pending job Redis lost, not rebuilt yet
    first = settle.enqueue("a", 1)
    redis_client.flushdb()

    # When: an equal call comes
    again = settle.enqueue("a", 2)

    # Then: it is the same job, made again in Redis with the call's payload
    assert again.id == first.id
    args, due, state = held(backend.broker, first.id)
    assert (args, state) == (["a", 2], "scheduled")
    assert epoch_ms(Job.objects.get(pk=first.id).run_after) == due  # type: ignore[arg-type]


# -- the script, on Redis and Valkey ----------------------------------------------------


def test_the_debounce_script_makes_replaces_and_refuses(server_url: str) -> None:
    broker = Broker(server_url, "rjdebounce")
    try:
        k = broker.keys("q")
        job = NewJob("j1", '{"n":1}', 3, gen=0)
        # make: a new job, scheduled debounce_ms ahead on the server's clock
        made = broker.debounce("q", job, debounce_ms=5_000, max_wait_ms=0, replace=False)
        assert made.outcome is DebounceOutcome.MADE
        assert broker.client.zscore(k.scheduled, "j1") == made.due_ms
        # make again: left alone (a late push)
        late = broker.debounce("q", NewJob("j1", '{"n":0}', 3), debounce_ms=5_000,
                               max_wait_ms=0, replace=False)
        assert late.outcome is DebounceOutcome.REFUSED
        # replace: the payload, and a later due time
        time.sleep(0.01)
        replaced = broker.debounce("q", NewJob("j1", '{"n":2}', 3), debounce_ms=5_000,
                                   max_wait_ms=0, replace=True)
        assert replaced.outcome is DebounceOutcome.REPLACED and replaced.due_ms > made.due_ms
        assert broker.client.hget(k.job("j1"), "payload") == '{"n":2}'
        # another generation, or a claimed job: refused, untouched
        assert broker.debounce("q", NewJob("j1", '{"n":3}', 3, gen=1), debounce_ms=5_000,
                               max_wait_ms=0, replace=True).outcome is DebounceOutcome.REFUSED
        broker.client.zadd(k.scheduled, {"j1": 0})
        broker.promote("q")
        refused = broker.debounce("q", NewJob("j1", '{"n":4}', 3), debounce_ms=5_000,
                                  max_wait_ms=0, replace=True)
        assert (refused.outcome, refused.state) == (DebounceOutcome.REFUSED, "queued")
        assert broker.client.hget(k.job("j1"), "payload") == '{"n":2}'
        with pytest.raises(redis.ResponseError, match="out of range"):
            broker.debounce("q", NewJob("j2", "{}", 3), debounce_ms=0, max_wait_ms=0,
                            replace=True)
    finally:
        for key in broker.client.scan_iter(match="rjdebounce:*"):
            broker.client.delete(key)
        broker.close()


def test_the_sweep_learns_when_the_next_scheduled_job_is_due(server_url: str) -> None:
    broker = Broker(server_url, "rjdebounce")
    try:
        # Given: nothing scheduled, then jobs due in 60 s and 5 s on two queues
        assert broker.next_due_in_ms(["q", "r"]) is None
        for queue, job_id, debounce_ms in (("q", "later", 60_000), ("r", "sooner", 5_000)):
            broker.debounce(queue, NewJob(job_id, "{}", 3), debounce_ms=debounce_ms,
                            max_wait_ms=0, replace=False)

        # When / Then: the sooner one, on Redis's clock
        assert 4_000 < (broker.next_due_in_ms(["q", "r"]) or 0) <= 5_000
        broker.client.zadd(broker.keys("r").scheduled, {"sooner": 0})
        assert broker.next_due_in_ms(["q", "r"]) == 0
    finally:
        for key in broker.client.scan_iter(match="rjdebounce:*"):
            broker.client.delete(key)
        broker.close()


# -- a real worker ----------------------------------------------------------------------


def test_a_real_worker_runs_a_burst_once_with_the_last_arguments_after_the_quiet_period(
    rj_settings: Any, redis_client: redis.Redis, processes: Processes
) -> None:
    # Given: a worker up and sweeping every 2 s (it promotes a due job sooner,
    # when it is due), and a burst of equal calls
    env = rj_settings(SWEEP_INTERVAL_MS=2_000)
    worker = processes.worker(env)
    probe = demo.noop.enqueue()
    wait_until(lambda: Job.objects.filter(pk=probe.id, state=JobState.SUCCEEDED).exists(),
               timeout=60, message="the worker")
    Job.objects.filter(pk=probe.id).delete()
    for n in range(10):
        time.sleep(0.05)
        demo.debounced_note.enqueue("burst", n)
        last_call = timezone.now()

    # When: the quiet period passes
    job = wait_until(lambda: Job.objects.filter(state=JobState.SUCCEEDED).first(),
                     timeout=30, message="the debounced run")

    # Then: one run, with the last call's arguments, 2 s after the last call
    processes.stop(worker)
    assert Job.objects.count() == 1
    assert (job.args, job.return_value) == (["burst", 9], 9)
    waited = (job.started_at - last_call).total_seconds()
    assert 1.99 <= waited < 2.3, waited


# -- the system check --------------------------------------------------------------------


def test_a_debounce_shorter_than_the_sweep_interval_is_warned_about(rj_settings: Any) -> None:
    # Given: this module's tasks debounce for 30 s and 60 s
    rj_settings(SWEEP_INTERVAL_MS=1_000)
    assert [m for m in task_backends["default"].check() if m.id == "reliable_jobs.W029"] == []

    # When: the sweep runs less often than one of them asks
    rj_settings(SWEEP_INTERVAL_MS=45_000)
    warned = [m for m in task_backends["default"].check() if m.id == "reliable_jobs.W029"]

    # Then: W029 names it (and only it)
    assert len(warned) == 1
    assert settle_at_most.module_path in warned[0].msg
    assert f"{settle.module_path}," not in warned[0].msg
