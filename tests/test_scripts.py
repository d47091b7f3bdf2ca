"""Each Lua script alone, through the Broker, on a real Redis and a real Valkey.

Every test builds its own :class:`Broker` under a key prefix of its own, so
tests never see each other's keys. Deadlines are checked against the
server's ``TIME`` read before and after the call (G4: one clock), never
against this process's clock. Leases are tens of milliseconds and every
wait is bounded by ``wait_until``.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import redis
from redis.crc import key_slot

from reliable_jobs import scripts
from reliable_jobs.broker import (
    TOMBSTONE_MS,
    Applied,
    Broker,
    ClaimedJob,
    DebounceOutcome,
    NewJob,
    QueueCounts,
    RecoveredJob,
    Settlement,
)
from tests.helpers import REDIS_URL, wait_until
from tests.luakeys import ALL_KEY_COMMANDS, KEYLESS_COMMANDS, header_keys

Q = "work"
#: A lease nobody outlives during a test.
LONG_LEASE_MS = 60_000
#: A lease that expires while the test waits for it.
SHORT_LEASE_MS = 50


# -- helpers ------------------------------------------------------------------


@pytest.fixture
def broker(server_url: str) -> Iterator[Broker]:
    """A broker on the server under test, under a key prefix no other test uses."""
    b = Broker(server_url, f"t{uuid.uuid4().hex[:12]}")
    yield b
    b.close()


def new_job(job_id: str, *, max_attempts: int = 3, due_ms: int = 0, attempts: int = 0,
            gen: int = 0) -> NewJob:
    payload = json.dumps({"task": "tests.noop", "args": [job_id], "kwargs": {}})
    return NewJob(job_id, payload, max_attempts, due_ms=due_ms, attempts=attempts, gen=gen)


def enqueue(broker: Broker, *job_ids: str, queue: str = Q, **options: Any) -> None:
    """Enqueue each id in its own call, so the first id is the oldest."""
    for job_id in job_ids:
        assert broker.enqueue(queue, [new_job(job_id, **options)]) == 1


def claim_one(broker: Broker, *, lease_ms: int = LONG_LEASE_MS, queue: str = Q) -> ClaimedJob:
    result = broker.claim(queue, count=1, lease_ms=lease_ms)
    assert len(result.jobs) == 1, result
    return result.jobs[0]


def hash_of(broker: Broker, job_id: str, queue: str = Q) -> dict[str, str]:
    return broker.client.hgetall(broker.keys(queue).job(job_id))


def queued(broker: Broker, queue: str = Q) -> list[str]:
    """The queued list, left (newest) to right (next to run)."""
    return broker.client.lrange(broker.keys(queue).queued, 0, -1)


def in_flight(broker: Broker, queue: str = Q) -> list[str]:
    """Ids claimed and not yet acked: the leases set, less orphans leased on landing."""
    on_landing = set(landing(broker, queue))
    return [job_id for job_id in broker.client.zrange(broker.keys(queue).leases, 0, -1)
            if job_id not in on_landing]


def landing(broker: Broker, queue: str = Q) -> list[str]:
    """Ids a worker moved off queued with BLMOVE and has not claimed yet."""
    return broker.client.lrange(broker.keys(queue).landing, 0, -1)


def zset(broker: Broker, key: str) -> dict[str, int]:
    return {member: int(score) for member, score in broker.client.zrange(key, 0, -1,
                                                                          withscores=True)}


def leases(broker: Broker, queue: str = Q) -> dict[str, int]:
    return zset(broker, broker.keys(queue).leases)


def scheduled(broker: Broker, queue: str = Q) -> dict[str, int]:
    return zset(broker, broker.keys(queue).scheduled)


def dead(broker: Broker, queue: str = Q) -> dict[str, int]:
    return zset(broker, broker.keys(queue).dead)


def wake_markers(broker: Broker, queue: str = Q) -> int:
    return int(broker.client.llen(broker.keys(queue).wake))


def snapshot(broker: Broker, job_ids: list[str], queue: str = Q) -> dict[str, Any]:
    """Everything a script could change about a queue and some jobs."""
    return {
        "queued": queued(broker, queue),
        "in_flight": in_flight(broker, queue),
        "landing": landing(broker, queue),
        "leases": leases(broker, queue),
        "scheduled": scheduled(broker, queue),
        "dead": dead(broker, queue),
        "wake": wake_markers(broker, queue),
        "jobs": {job_id: hash_of(broker, job_id, queue) for job_id in job_ids},
    }


def wait_past(broker: Broker, deadline_ms: int) -> None:
    """Wait until the server's clock has passed ``deadline_ms``."""
    wait_until(lambda: broker.server_time_ms() > deadline_ms, timeout=5.0, interval=0.01,
               message=f"the server clock to pass {deadline_ms} ms")


def assert_consistent(broker: Broker, queue: str = Q) -> None:
    """Each job hash sits exactly where its state says, and nowhere else."""
    k = broker.keys(queue)
    on_queued, on_processing = queued(broker, queue), in_flight(broker, queue)
    on_landing = landing(broker, queue)
    held, waiting, buried = leases(broker, queue), scheduled(broker, queue), dead(broker, queue)
    for key in broker.client.scan_iter(match=f"{k.job_prefix}*", count=1_000):
        job_id = key[len(k.job_prefix):]
        state = broker.client.hget(key, "state")
        where = (on_queued.count(job_id), on_landing.count(job_id), on_processing.count(job_id),
                 job_id in waiting, job_id in buried)
        if state == "running":
            assert where == (0, 0, 1, False, False), (job_id, state, where)
            assert job_id in held, f"running job {job_id} has no lease"
        elif state == "cancelled" and broker.client.pttl(key) > 0:
            # A tombstone (a claim dropped the id, or the job was cancelled while
            # scheduled or running and then ended): on no list, and it expires.
            assert where == (0, 0, 0, False, False), (job_id, state, where)
            assert job_id not in held, f"cancelled job {job_id} still has a lease"
        elif state in ("queued", "cancelled"):
            # On landing: moved by BLMOVE, not yet claimed. A job cancelled while
            # queued keeps its id where it was (its hash whole, no expiry) until a
            # claim drops it.
            assert where in ((1, 0, 0, False, False), (0, 1, 0, False, False)), (
                job_id, state, where)
        elif state == "scheduled":
            assert where == (0, 0, 0, True, False), (job_id, state, where)
        elif state == "dead":
            assert where == (0, 0, 0, False, True), (job_id, state, where)
            assert job_id not in held, f"dead job {job_id} still has a lease"
        elif state == "finished":
            # A rebuilt job's tombstone: on no list, and it expires.
            assert where == (0, 0, 0, False, False), (job_id, state, where)
            assert job_id not in held, f"finished job {job_id} still has a lease"
            assert broker.client.pttl(key) > 0, f"tombstone {job_id} never expires"
        else:
            raise AssertionError(f"job {job_id} has the unknown state {state!r}")


# -- enqueue ------------------------------------------------------------------


def test_enqueue_queues_due_jobs_and_schedules_future_ones(broker: Broker) -> None:
    # Given the server's clock
    now_ms = broker.server_time_ms()

    # When three jobs are enqueued: one for now, one overdue, one in a minute
    written = broker.enqueue(Q, [
        new_job("now"),
        new_job("overdue", due_ms=now_ms - 1_000),
        new_job("later", due_ms=now_ms + 60_000, max_attempts=7),
    ])
    after_ms = broker.server_time_ms()

    # Then the two due jobs are queued, oldest on the right, and the third is scheduled
    assert written == 3
    assert queued(broker) == ["overdue", "now"]
    assert scheduled(broker) == {"later": now_ms + 60_000}
    assert hash_of(broker, "now")["state"] == "queued"
    later = hash_of(broker, "later")
    assert later["state"] == "scheduled"
    assert later["max_attempts"] == "7"
    assert later["attempts"] == "0"
    assert json.loads(later["payload"])["args"] == ["later"]
    assert now_ms <= int(later["enqueued_ms"]) <= after_ms
    assert in_flight(broker) == []
    assert_consistent(broker)


def test_enqueue_keeps_an_existing_job_untouched(broker: Broker) -> None:
    # Given a queued job
    enqueue(broker, "a")
    before = snapshot(broker, ["a"])

    # When the same id is enqueued again (a reconcile push racing the on-commit push),
    # with another payload, and twice within one call
    again = NewJob("a", '{"task":"other","args":[],"kwargs":{}}', 9)
    written = broker.enqueue(Q, [again, again])

    # Then nothing is written and the job is queued once, as it was
    assert written == 0
    assert snapshot(broker, ["a"]) == before
    assert queued(broker) == ["a"]


def test_enqueue_of_one_id_twice_in_one_call_writes_it_once(broker: Broker) -> None:
    # When one call carries the same new id twice
    written = broker.enqueue(Q, [new_job("a"), new_job("a")])

    # Then it is written and queued once
    assert written == 1
    assert queued(broker) == ["a"]


def test_enqueue_carries_spent_attempts_over(broker: Broker) -> None:
    # Given a job the sweep rebuilds from the mirror, two of its three attempts spent
    enqueue(broker, "a", attempts=2, max_attempts=3)

    # When a worker claims it
    job = claim_one(broker)

    # Then the hash kept the count, and the claim is attempt three
    assert job.attempt == 3
    assert job.max_attempts == 3
    assert hash_of(broker, "a")["attempts"] == "3"


def test_enqueue_wakes_waiting_workers_with_at_most_one_marker(broker: Broker) -> None:
    # Given a queue whose only job is scheduled: nothing to wake anybody for
    enqueue(broker, "later", due_ms=broker.server_time_ms() + 60_000)
    assert wake_markers(broker) == 0

    # When ready jobs arrive in several calls
    enqueue(broker, "a", "b", "c")

    # Then one marker is waiting, however many calls pushed work
    assert wake_markers(broker) == 1


# -- claim --------------------------------------------------------------------


def test_claim_takes_the_oldest_jobs_and_stamps_each(broker: Broker) -> None:
    # Given four queued jobs, "a" the oldest, and no wake marker left
    enqueue(broker, "a", "b", "c", "d")
    broker.client.delete(broker.keys(Q).wake)

    # When a worker claims three of them
    before_ms = broker.server_time_ms()
    result = broker.claim(Q, count=3, lease_ms=5_000)
    after_ms = broker.server_time_ms()

    # Then it gets the three oldest, oldest first, each at attempt one
    assert [(j.id, j.attempt, j.max_attempts) for j in result.jobs] == [
        ("a", 1, 3), ("b", 1, 3), ("c", 1, 3)]
    assert json.loads(result.jobs[0].payload) == {"task": "tests.noop", "args": ["a"],
                                                  "kwargs": {}}
    assert result.dead == [] and result.garbage == [] and result.remaining == 1
    # and each one is running, on processing, leased until server TIME + lease_ms
    for job in result.jobs:
        stored = hash_of(broker, job.id)
        assert stored["state"] == "running"
        assert stored["attempts"] == "1"
        assert before_ms <= int(stored["started_ms"]) <= after_ms
    assert sorted(in_flight(broker)) == ["a", "b", "c"]
    assert queued(broker) == ["d"]
    lease_table = leases(broker)
    assert set(lease_table) == {"a", "b", "c"}
    for deadline in lease_table.values():
        assert before_ms + 5_000 <= deadline <= after_ms + 5_000
    # and a marker says that work is left for another worker
    assert wake_markers(broker) == 1
    assert_consistent(broker)


def test_claim_of_the_last_jobs_leaves_no_wake_marker(broker: Broker) -> None:
    # Given two queued jobs and no marker
    enqueue(broker, "a", "b")
    broker.client.delete(broker.keys(Q).wake)

    # When one claim takes them all
    result = broker.claim(Q, count=10, lease_ms=LONG_LEASE_MS)

    # Then nobody is woken for an empty queue
    assert [j.id for j in result.jobs] == ["a", "b"]
    assert result.remaining == 0
    assert wake_markers(broker) == 0


def test_claim_of_an_empty_queue_returns_nothing(broker: Broker) -> None:
    # When a worker claims from a queue that never had a job
    result = broker.claim(Q, count=5, lease_ms=LONG_LEASE_MS)

    # Then it gets nothing, and nothing was written
    assert (result.jobs, result.dead, result.garbage, result.remaining) == ([], [], [], 0)
    assert broker.client.keys(f"{broker.prefix}:*") == []


def test_each_claim_increments_attempts(broker: Broker) -> None:
    # Given a job claimed once and put back at once after a failure
    enqueue(broker, "a", max_attempts=5)
    first = claim_one(broker)
    assert broker.nack(Q, [("a", first.attempt, 0, 0, "boom")]) == [True]

    # When it is claimed again
    second = claim_one(broker)

    # Then the attempt number (the fencing token) went up by one
    assert (first.attempt, second.attempt) == (1, 2)
    assert hash_of(broker, "a")["attempts"] == "2"


def test_claim_buries_a_job_with_no_attempt_left(broker: Broker) -> None:
    # Given a job that already used both of its attempts, and a healthy one behind it
    enqueue(broker, "spent", attempts=2, max_attempts=2)
    enqueue(broker, "fresh")

    # When a worker claims both
    before_ms = broker.server_time_ms()
    result = broker.claim(Q, count=2, lease_ms=LONG_LEASE_MS)
    after_ms = broker.server_time_ms()

    # Then the spent job is reported dead instead of run (G3), and the other runs
    assert result.dead == [("spent", 2, 0)]
    assert [j.id for j in result.jobs] == ["fresh"]
    stored = hash_of(broker, "spent")
    assert stored["state"] == "dead"
    assert stored["attempts"] == "2"
    assert stored["last_error"].startswith("reliable_jobs.exceptions.AttemptsExhausted: ")
    assert before_ms <= dead(broker)["spent"] <= after_ms
    assert in_flight(broker) == ["fresh"]
    assert "spent" not in leases(broker)
    assert_consistent(broker)


def test_claim_moves_an_id_with_no_job_hash_aside(broker: Broker) -> None:
    # Given a real job and, pushed behind it, an id whose hash does not exist
    enqueue(broker, "real")
    broker.client.lpush(broker.keys(Q).queued, "ghost")

    # When a worker claims both
    result = broker.claim(Q, count=5, lease_ms=LONG_LEASE_MS)

    # Then the ghost is reported as garbage, put in dead, and never leased
    assert result.garbage == ["ghost"]
    assert [j.id for j in result.jobs] == ["real"]
    assert "ghost" in dead(broker)
    assert in_flight(broker) == ["real"]
    assert set(leases(broker)) == {"real"}
    assert queued(broker) == []


def test_claim_stamps_the_id_blmove_moved(broker: Broker) -> None:
    # Given two queued jobs, and a worker that moved the oldest with BLMOVE
    enqueue(broker, "a", "b")
    woken = broker.wait([Q], timeout_s=1.0)
    assert woken == (Q, "a")
    assert (landing(broker), in_flight(broker)) == (["a"], [])
    assert hash_of(broker, "a")["state"] == "queued"

    # When it claims with that moved id and room for one job only
    result = broker.claim(Q, count=1, lease_ms=LONG_LEASE_MS, moved_id="a")

    # Then the moved job is stamped, taken off landing onto processing once,
    # and "b" still waits
    assert [(j.id, j.attempt, j.gen) for j in result.jobs] == [("a", 1, 0)]
    assert (landing(broker), in_flight(broker)) == ([], ["a"])
    assert set(leases(broker)) == {"a"}
    assert queued(broker) == ["b"]
    assert result.remaining == 1
    assert_consistent(broker)


def test_claim_stamps_the_moved_id_first_then_takes_a_batch(broker: Broker) -> None:
    # Given three queued jobs, the oldest moved by BLMOVE
    enqueue(broker, "a", "b", "c")
    assert broker.wait([Q], timeout_s=1.0) == (Q, "a")

    # When the worker claims with room for three
    result = broker.claim(Q, count=3, lease_ms=LONG_LEASE_MS, moved_id="a")

    # Then it holds all three, the moved one first
    assert [j.id for j in result.jobs] == ["a", "b", "c"]
    assert sorted(in_flight(broker)) == ["a", "b", "c"]
    assert (queued(broker), landing(broker)) == ([], [])
    assert_consistent(broker)


def test_claim_skips_a_moved_id_that_a_sweep_requeued_meanwhile(broker: Broker) -> None:
    # Given a worker that moved "a" with BLMOVE and then stalled, so that the
    # sweep leased it as an orphan and requeued it when that lease expired
    enqueue(broker, "a")
    assert broker.wait([Q], timeout_s=1.0) == (Q, "a")
    assert broker.recover(Q, lease_ms=SHORT_LEASE_MS).stamped == 1
    wait_past(broker, leases(broker)["a"])
    assert broker.recover(Q, lease_ms=SHORT_LEASE_MS).outcomes == [
        RecoveredJob("a", 0, "orphan")]
    assert (queued(broker), landing(broker)) == (["a"], [])

    # When the stalled worker wakes up and claims the id it moved
    result = broker.claim(Q, count=1, lease_ms=LONG_LEASE_MS, moved_id="a")

    # Then the stale moved id is not stamped where it lies (on queued, where a
    # running job would be out of recover's reach); the job is claimed the
    # ordinary way instead: moved onto processing, at its first attempt
    assert [(j.id, j.attempt) for j in result.jobs] == [("a", 1)]
    assert (queued(broker), landing(broker)) == ([], [])
    assert in_flight(broker) == ["a"]
    assert_consistent(broker)
    # and when that worker dies, the sweep gets the job back
    assert broker.start(Q, [("a", 1, 0)]) == [True]
    assert broker.extend(Q, [("a", 1, 0)], lease_ms=SHORT_LEASE_MS) == [True]
    wait_past(broker, leases(broker)["a"])
    assert broker.recover(Q, lease_ms=LONG_LEASE_MS).outcomes == [
        RecoveredJob("a", 1, "expired")]


def test_claim_keeps_the_only_copy_of_a_job_another_worker_holds(broker: Broker) -> None:
    # Given "a" requeued as an orphan, moved again by worker two, and claimed
    # first by the stalled worker one (whose moved id it also is)
    enqueue(broker, "a")
    assert broker.wait([Q], timeout_s=1.0) == (Q, "a")
    broker.recover(Q, lease_ms=SHORT_LEASE_MS)
    wait_past(broker, leases(broker)["a"])
    broker.recover(Q, lease_ms=SHORT_LEASE_MS)
    two = Broker(broker.url, broker.prefix)
    try:
        assert two.wait([Q], timeout_s=1.0) == (Q, "a")
        held = broker.claim(Q, count=1, lease_ms=SHORT_LEASE_MS, moved_id="a")
        assert [(j.id, j.attempt) for j in held.jobs] == [("a", 1)]
        assert broker.start(Q, [("a", 1, 0)]) == [True]

        # When worker two claims its moved id too
        second = two.claim(Q, count=1, lease_ms=LONG_LEASE_MS, moved_id="a")
    finally:
        two.close()

    # Then worker two gets nothing, and the one copy on processing stays,
    # so the job is recovered if worker one dies
    assert second.jobs == []
    assert (in_flight(broker), landing(broker)) == (["a"], [])
    assert_consistent(broker)
    wait_past(broker, leases(broker)["a"])
    assert broker.recover(Q, lease_ms=LONG_LEASE_MS).outcomes == [
        RecoveredJob("a", 1, "expired")]
    assert queued(broker) == ["a"]


def test_claim_drops_a_stray_second_copy_of_a_running_job(broker: Broker) -> None:
    # Given a running job and a stray copy of its id on queued
    enqueue(broker, "a", "b")
    claim_one(broker)
    broker.client.rpush(broker.keys(Q).queued, "a")
    before = hash_of(broker, "a")

    # When a worker claims the stray copy (and "b" behind it)
    result = broker.claim(Q, count=2, lease_ms=LONG_LEASE_MS)

    # Then only "b" is claimed and "a" is still held once, as it was
    assert [j.id for j in result.jobs] == ["b"]
    assert sorted(in_flight(broker)) == ["a", "b"]
    assert hash_of(broker, "a") == before
    assert_consistent(broker)


def test_claim_of_a_batch_beyond_luas_unpack_limit(broker: Broker) -> None:
    # Given more jobs than Lua's unpack() can spread in one call (about 8,000 values)
    ids = [f"j{i}" for i in range(9_000)]
    assert broker.enqueue(Q, [new_job(job_id) for job_id in ids]) == len(ids)

    # When one claim takes all of them
    result = broker.claim(Q, count=len(ids), lease_ms=LONG_LEASE_MS)

    # Then every job is claimed and leased, oldest first
    assert [j.id for j in result.jobs] == ids
    assert len(leases(broker)) == len(ids)
    assert len(in_flight(broker)) == len(ids)

    # When one ack finishes all of them
    acked = broker.ack(Q, [(job_id, 1, 0) for job_id in ids])

    # Then nothing is left behind
    assert acked == [True] * len(ids)
    assert broker.counts(Q) == QueueCounts(queued=0, running=0, scheduled=0, dead=0)
    assert leases(broker) == {}
    assert list(broker.client.scan_iter(match=f"{broker.keys(Q).job_prefix}*")) == []


# -- fencing: ack, nack, extend, release ---------------------------------------


FencedOp = Callable[[Broker, str, int, int], list[bool]]

FENCED_OPS: dict[str, FencedOp] = {
    "start": lambda b, job_id, attempt, gen: b.start(Q, [(job_id, attempt, gen)]),
    "ack": lambda b, job_id, attempt, gen: b.ack(Q, [(job_id, attempt, gen)]),
    "nack-dead": lambda b, job_id, attempt, gen: b.nack(Q, [(job_id, attempt, gen, -1, "boom")]),
    "nack-now": lambda b, job_id, attempt, gen: b.nack(Q, [(job_id, attempt, gen, 0, "boom")]),
    "nack-later": lambda b, job_id, attempt, gen: b.nack(Q, [(job_id, attempt, gen, 5_000,
                                                               "boom")]),
    "extend": lambda b, job_id, attempt, gen: b.extend(Q, [(job_id, attempt, gen)],
                                                       lease_ms=90_000),
    "release-unstarted": lambda b, job_id, attempt, gen: b.release(Q, [(job_id, attempt, gen,
                                                                        False)]),
    "release-started": lambda b, job_id, attempt, gen: b.release(Q, [(job_id, attempt, gen,
                                                                      True)]),
}


@pytest.mark.parametrize("op_name", sorted(FENCED_OPS))
def test_a_stale_attempt_is_refused_and_changes_nothing(broker: Broker, op_name: str) -> None:
    # Given a job whose first attempt failed and whose second attempt is now held
    op = FENCED_OPS[op_name]
    enqueue(broker, "a", max_attempts=5)
    enqueue(broker, "other")
    stale = claim_one(broker)
    assert broker.nack(Q, [("a", stale.attempt, 0, 0, "first failure")]) == [True]
    broker.claim(Q, count=2, lease_ms=LONG_LEASE_MS)
    assert hash_of(broker, "a")["attempts"] == "2"
    before = snapshot(broker, ["a", "other"])

    # When the worker of attempt one (or a confused one claiming attempt three,
    # or attempt two of another generation) acts
    refused = [op(broker, "a", 1, 0), op(broker, "a", 3, 0), op(broker, "a", 2, 1),
               op(broker, "unknown", 1, 0)]

    # Then each is refused and nothing changed: hash, lists and sorted sets
    assert refused == [[False], [False], [False], [False]]
    assert snapshot(broker, ["a", "other"]) == before

    # When the holder of attempt two does the same
    # Then it is applied, so the refusal above was the fence at work
    assert op(broker, "a", 2, 0) == [True]
    assert snapshot(broker, ["a", "other"]) != before


def test_a_fenced_batch_answers_each_job_on_its_own(broker: Broker) -> None:
    # Given two running jobs
    enqueue(broker, "a", "b")
    broker.claim(Q, count=2, lease_ms=LONG_LEASE_MS)
    b_before = hash_of(broker, "b")

    # When one ack carries a current attempt for "a" and a stale one for "b"
    result = broker.ack(Q, [("a", 1, 0), ("b", 0, 0)])

    # Then only "a" is acked
    assert result == [True, False]
    assert hash_of(broker, "a") == {}
    assert hash_of(broker, "b") == b_before
    assert in_flight(broker) == ["b"]


def test_ack_frees_the_job(broker: Broker) -> None:
    # Given two running jobs
    enqueue(broker, "a", "b")
    broker.claim(Q, count=2, lease_ms=LONG_LEASE_MS)

    # When "a" is acked, twice
    first = broker.ack(Q, [("a", 1, 0)])
    second = broker.ack(Q, [("a", 1, 0)])

    # Then the first ack frees it (history lives in the mirror), the second is refused
    assert (first, second) == ([True], [False])
    assert hash_of(broker, "a") == {}
    assert in_flight(broker) == ["b"]
    assert set(leases(broker)) == {"b"}
    assert_consistent(broker)


def test_nack_with_delay_minus_one_buries_the_job(broker: Broker) -> None:
    # Given a running job with attempts left
    enqueue(broker, "a", max_attempts=5)
    job = claim_one(broker)

    # When its worker reports a non-retryable failure
    before_ms = broker.server_time_ms()
    assert broker.nack(Q, [("a", job.attempt, 0, -1, "PermanentFailure: no such user")]) == [True]
    after_ms = broker.server_time_ms()

    # Then it is dead with the error recorded, and off processing and leases
    stored = hash_of(broker, "a")
    assert stored["state"] == "dead"
    assert stored["last_error"] == "PermanentFailure: no such user"
    assert before_ms <= int(stored["finished_ms"]) <= after_ms
    assert before_ms <= dead(broker)["a"] <= after_ms
    assert (in_flight(broker), leases(broker), queued(broker)) == ([], {}, [])
    assert_consistent(broker)


def test_nack_with_delay_zero_queues_the_job_at_once(broker: Broker) -> None:
    # Given a running job and another job waiting on queued, and no wake marker
    enqueue(broker, "a")
    job = claim_one(broker)
    enqueue(broker, "waiting")
    broker.client.delete(broker.keys(Q).wake)

    # When its worker asks for an immediate retry
    assert broker.nack(Q, [("a", job.attempt, 0, 0, "ValueError: flaky")]) == [True]

    # Then it is queued behind the job that was already waiting, error kept
    stored = hash_of(broker, "a")
    assert stored["state"] == "queued"
    assert stored["last_error"] == "ValueError: flaky"
    assert stored["attempts"] == "1"
    assert queued(broker) == ["a", "waiting"]
    assert (in_flight(broker), leases(broker)) == ([], {})
    assert wake_markers(broker) == 1
    assert_consistent(broker)


def test_nack_with_a_delay_schedules_the_job_at_server_time_plus_delay(broker: Broker) -> None:
    # Given a running job
    enqueue(broker, "a")
    job = claim_one(broker)

    # When its worker asks for a retry in 30 s
    before_ms = broker.server_time_ms()
    assert broker.nack(Q, [("a", job.attempt, 0, 30_000, "TimeoutError")]) == [True]
    after_ms = broker.server_time_ms()

    # Then it is scheduled at server TIME + 30 s, with the error kept
    stored = hash_of(broker, "a")
    assert stored["state"] == "scheduled"
    assert stored["last_error"] == "TimeoutError"
    due_ms = scheduled(broker)["a"]
    assert before_ms + 30_000 <= due_ms <= after_ms + 30_000
    assert (in_flight(broker), leases(broker), queued(broker)) == ([], {}, [])
    assert_consistent(broker)


def test_extend_pushes_the_lease_to_server_time_plus_lease(broker: Broker) -> None:
    # Given a job leased for a short while
    enqueue(broker, "a")
    job = claim_one(broker, lease_ms=1_000)
    old_deadline = leases(broker)["a"]

    # When its worker renews the lease for a minute
    before_ms = broker.server_time_ms()
    assert broker.extend(Q, [job.fence], lease_ms=LONG_LEASE_MS) == [True]
    after_ms = broker.server_time_ms()

    # Then the deadline is server TIME + one minute, and nothing else changed
    new_deadline = leases(broker)["a"]
    assert before_ms + LONG_LEASE_MS <= new_deadline <= after_ms + LONG_LEASE_MS
    assert new_deadline > old_deadline
    assert hash_of(broker, "a")["attempts"] == "1"


def test_release_of_an_unstarted_job_gives_its_attempt_back(broker: Broker) -> None:
    # Given a claimed job that never started, and another job waiting
    enqueue(broker, "a")
    job = claim_one(broker)
    enqueue(broker, "waiting")
    broker.client.delete(broker.keys(Q).wake)

    # When the worker shuts down gracefully
    assert broker.release(Q, [("a", job.attempt, 0, False)]) == [True]

    # Then the job is queued on the right, to run next, and the attempt is
    # returned: the budget grows by one (the counter itself never goes down,
    # so the fencing token 1 is never handed out again)
    stored = hash_of(broker, "a")
    assert (stored["state"], stored["attempts"], stored["max_attempts"]) == ("queued", "1", "4")
    assert queued(broker) == ["waiting", "a"]
    assert (in_flight(broker), leases(broker)) == ([], {})
    assert wake_markers(broker) == 1
    assert claim_one(broker).id == "a"


def test_release_of_an_interrupted_job_keeps_its_attempt(broker: Broker) -> None:
    # Given a claimed job that had started
    enqueue(broker, "a")
    job = claim_one(broker)

    # When the worker shuts down in the middle of it
    assert broker.release(Q, [("a", job.attempt, 0, True)]) == [True]

    # Then the job is queued again, and the attempt it used still counts
    stored = hash_of(broker, "a")
    assert (stored["state"], stored["attempts"]) == ("queued", "1")
    assert queued(broker) == ["a"]
    assert claim_one(broker).attempt == 2


# -- start ----------------------------------------------------------------------


def test_start_marks_only_the_attempt_still_held(broker: Broker) -> None:
    # Given a job claimed twice: attempt 1's lease was lost, attempt 2 holds it
    enqueue(broker, "a")
    first = claim_one(broker, lease_ms=SHORT_LEASE_MS)
    wait_past(broker, leases(broker)["a"])
    broker.recover(Q, lease_ms=LONG_LEASE_MS)
    second = claim_one(broker)
    assert (first.attempt, second.attempt) == (1, 2)

    # When both workers try to start it
    # Then only the holder of attempt 2 may run it
    assert broker.start(Q, [first.fence]) == [False]
    assert broker.start(Q, [second.fence, ("missing", 1, 0)]) == [True, False]
    assert hash_of(broker, "a")["started"] == "2"
    assert_consistent(broker)


def test_recover_refunds_an_expired_claim_that_never_started(broker: Broker) -> None:
    # Given two jobs claimed together by a worker that started only the first
    # before it died (a poison job and a neighbour waiting behind it)
    enqueue(broker, "poison", "neighbour")
    jobs = broker.claim(Q, count=2, lease_ms=SHORT_LEASE_MS).jobs
    assert [j.id for j in jobs] == ["poison", "neighbour"]
    assert broker.start(Q, [("poison", 1, 0)]) == [True]
    wait_past(broker, max(leases(broker).values()))

    # When the sweep recovers both
    result = broker.recover(Q, lease_ms=LONG_LEASE_MS)

    # Then the one that ran is charged; the one that never started gets its
    # attempt back (its budget grows, its attempt counter never goes down)
    by_id = {r.id: r for r in result.outcomes}
    assert (by_id["poison"].kind, by_id["poison"].max_attempts) == ("expired", 3)
    assert (by_id["neighbour"].kind, by_id["neighbour"].max_attempts) == ("unstarted", 4)
    neighbour = hash_of(broker, "neighbour")
    assert (neighbour["state"], neighbour["attempts"], neighbour["max_attempts"]) == (
        "queued", "1", "4")
    assert sorted(queued(broker)) == ["neighbour", "poison"]
    assert_consistent(broker)


def test_a_job_killing_its_worker_every_time_dies_without_taking_neighbours(
    broker: Broker
) -> None:
    # Given a poison job (max 3 attempts) always claimed in one batch with a neighbour
    enqueue(broker, "poison", "neighbour")
    for _ in range(3):
        jobs = broker.claim(Q, count=2, lease_ms=SHORT_LEASE_MS).jobs
        assert {j.id for j in jobs} == {"poison", "neighbour"}
        poison = next(j for j in jobs if j.id == "poison")
        # When its worker starts it and dies, three times over
        assert broker.start(Q, [poison.fence]) == [True]
        wait_past(broker, max(leases(broker).values()))
        broker.recover(Q, lease_ms=LONG_LEASE_MS)

    # Then the poison job is dead after its three attempts, and the neighbour,
    # never started, is still queued with its whole budget of runs ahead
    assert hash_of(broker, "poison")["state"] == "dead"
    assert set(dead(broker)) == {"poison"}
    neighbour = hash_of(broker, "neighbour")
    assert neighbour["state"] == "queued"
    assert int(neighbour["max_attempts"]) - int(neighbour["attempts"]) == 3
    assert_consistent(broker)


# -- recover ------------------------------------------------------------------


def test_recover_requeues_an_expired_lease_on_the_right(broker: Broker) -> None:
    # Given a job whose lease is about to expire, one safely leased, and one waiting
    enqueue(broker, "lost", "alive")
    lost = claim_one(broker, lease_ms=SHORT_LEASE_MS)
    assert broker.start(Q, [lost.fence]) == [True]
    claim_one(broker, lease_ms=LONG_LEASE_MS)
    enqueue(broker, "waiting")
    broker.client.delete(broker.keys(Q).wake)
    assert lost.id == "lost"
    wait_past(broker, leases(broker)["lost"])

    # When the sweep runs
    result = broker.recover(Q, lease_ms=LONG_LEASE_MS)

    # Then the expired job is back on the right of queued (it runs next), still
    # counting the attempt it used, and the live one is untouched
    assert result.outcomes == [RecoveredJob("lost", 1, "expired")]
    assert result.stamped == 0
    assert queued(broker) == ["waiting", "lost"]
    stored = hash_of(broker, "lost")
    assert (stored["state"], stored["attempts"]) == ("queued", "1")
    assert in_flight(broker) == ["alive"]
    assert set(leases(broker)) == {"alive"}
    assert wake_markers(broker) == 1
    assert_consistent(broker)
    # and the next claim is the second attempt of the expired job
    again = claim_one(broker)
    assert (again.id, again.attempt) == ("lost", 2)


def test_recover_buries_an_expired_job_with_no_attempt_left(broker: Broker) -> None:
    # Given a one-attempt job whose lease expired
    enqueue(broker, "a", max_attempts=1)
    job = claim_one(broker, lease_ms=SHORT_LEASE_MS)
    assert broker.start(Q, [job.fence]) == [True]
    wait_past(broker, leases(broker)["a"])

    # When the sweep runs
    before_ms = broker.server_time_ms()
    result = broker.recover(Q, lease_ms=LONG_LEASE_MS)
    after_ms = broker.server_time_ms()

    # Then the job is dead with the reason recorded
    assert result.outcomes == [RecoveredJob("a", 1, "dead")]
    stored = hash_of(broker, "a")
    assert stored["state"] == "dead"
    assert stored["last_error"].startswith("reliable_jobs.exceptions.LeaseExpired: ")
    assert before_ms <= dead(broker)["a"] <= after_ms
    assert (queued(broker), in_flight(broker), leases(broker)) == ([], [], {})
    assert_consistent(broker)


def test_recover_leases_an_orphan_then_requeues_it_without_charging(broker: Broker) -> None:
    # Given a job a worker moved with BLMOVE before dying (no claim, no lease)
    enqueue(broker, "a")
    assert broker.wait([Q], timeout_s=1.0) == (Q, "a")
    broker.client.delete(broker.keys(Q).wake)

    # When the sweep first sees it
    before_ms = broker.server_time_ms()
    first = broker.recover(Q, lease_ms=100)
    after_ms = broker.server_time_ms()

    # Then it gets a first lease, which is not an attempt
    assert (first.outcomes, first.stamped) == ([], 1)
    deadline = leases(broker)["a"]
    assert before_ms + 100 <= deadline <= after_ms + 100
    assert hash_of(broker, "a")["attempts"] == "0"
    assert (landing(broker), in_flight(broker)) == (["a"], [])
    # and a second pass before it expires leaves that lease alone
    assert broker.recover(Q, lease_ms=100).stamped == 0
    assert leases(broker) == {"a": deadline}

    # When that lease expires and the sweep runs again
    wait_past(broker, deadline)
    result = broker.recover(Q, lease_ms=100)

    # Then the job is requeued as an orphan, its attempts unchanged
    assert result.outcomes == [RecoveredJob("a", 0, "orphan")]
    stored = hash_of(broker, "a")
    assert (stored["state"], stored["attempts"]) == ("queued", "0")
    assert queued(broker) == ["a"]
    assert (landing(broker), in_flight(broker), leases(broker)) == ([], [], {})
    assert wake_markers(broker) == 1
    assert claim_one(broker).attempt == 1


@pytest.mark.parametrize("value", ["a string", ["a", "list"]], ids=["string", "list"])
def test_a_key_of_another_type_under_a_jobs_name_is_garbage_not_an_error(
    broker: Broker, value: str | list[str]
) -> None:
    # Given two real jobs and, queued between them, an id whose job key is not
    # a hash (written by hand: HMGET on it fails with WRONGTYPE)
    enqueue(broker, "first")
    key = broker.keys(Q).job("odd")
    if isinstance(value, str):
        broker.client.set(key, value)
    else:
        broker.client.rpush(key, *value)
    broker.client.lpush(broker.keys(Q).queued, "odd")
    enqueue(broker, "last")

    # When a worker claims them all
    result = broker.claim(Q, count=5, lease_ms=SHORT_LEASE_MS)

    # Then the claim does not fail half-way: both jobs are leased, the odd id
    # is garbage, put in dead, and its key deleted (reconcile rebuilds the job
    # from its row, if it has one)
    assert [j.id for j in result.jobs] == ["first", "last"]
    assert result.garbage == ["odd"]
    assert "odd" in dead(broker) and not broker.client.exists(key)
    assert sorted(in_flight(broker)) == ["first", "last"]

    # And given such a key under the name of a job in flight, the sweep
    # buries it as garbage too, and goes on with the other expired leases
    broker.client.delete(broker.keys(Q).job("first"))
    broker.client.set(broker.keys(Q).job("first"), "not a hash")
    wait_past(broker, max(leases(broker).values()))
    recovered = broker.recover(Q, lease_ms=SHORT_LEASE_MS)
    assert {(o.id, o.kind) for o in recovered.outcomes} == {("first", "garbage"),
                                                             ("last", "unstarted")}
    assert queued(broker) == ["last"]


def test_start_refuses_a_claim_whose_lease_expired(broker: Broker) -> None:
    # Given a job claimed under a short lease that has expired (the worker
    # stalled before its start mark; no sweep has run yet)
    enqueue(broker, "a")
    job = claim_one(broker, lease_ms=SHORT_LEASE_MS)
    wait_past(broker, leases(broker)["a"])

    # When its holder marks it started
    replies = broker.start(Q, [job.fence])

    # Then it is refused as expired (a reply of its own: do not run it), not
    # marked started, and the sweep requeues it as a claim that never started
    assert replies == [Applied.EXPIRED] and not replies[0]
    assert "started" not in hash_of(broker, "a")
    result = broker.recover(Q, lease_ms=LONG_LEASE_MS)
    assert result.outcomes == [RecoveredJob("a", 1, "unstarted", max_attempts=4)]
    assert queued(broker) == ["a"]


def test_a_key_of_another_type_at_a_bands_head_does_not_fail_the_fair_share(
    broker: Broker
) -> None:
    # Given a queue with two priorities waiting, claims under a fair share,
    # an id at the head of queued whose job key is not a hash, and a real job
    # a waiting worker moved onto landing
    broker.fair_share = 1
    enqueue(broker, "real")
    assert broker.enqueue(Q, [NewJob("high", "{}", 3, priority=5)]) == 1
    assert broker.wait([Q], timeout_s=1.0) == (Q, "real")
    broker.client.set(broker.keys(Q).job("odd"), "not a hash")
    broker.client.rpush(broker.keys(Q).queued, "odd")

    # When that worker claims with the moved id
    result = broker.claim(Q, count=5, lease_ms=LONG_LEASE_MS, moved_id="real")

    # Then the claim does not fail half-way: the moved job and the other
    # priority's job are leased, the odd id is garbage, and nothing is left
    # on no list
    assert sorted(j.id for j in result.jobs) == ["high", "real"]
    assert result.garbage == ["odd"]
    assert sorted(in_flight(broker)) == ["high", "real"]
    assert (queued(broker), landing(broker)) == ([], [])


def _odd_calls(broker: Broker, held: ClaimedJob) -> dict[str, Callable[[], Any]]:
    """Each script that reads a job hash, called with "odd" where a job id goes, and
    (for the batch scripts) the real job ``held`` beside it; what each must return."""
    fence = held.fence
    return {
        "ack": lambda: broker.ack(Q, [("odd", 1, 0), fence]) == [0, 1],
        "cancel": lambda: broker.cancel(Q, "odd") == (False, ""),
        "enqueue": lambda: broker.enqueue(Q, [new_job("odd"), new_job("new")]) == 2,
        "expired": lambda: broker.expired(Q) == [],
        "extend": lambda: broker.extend(Q, [("odd", 1, 0), fence],
                                        lease_ms=LONG_LEASE_MS) == [0, 1],
        "latency": lambda: broker.latency(Q).oldest_ready_ms is None,
        "nack": lambda: broker.nack(Q, [("odd", 1, 0, 0, "x"), (*fence, 0, "x")]) == [0, 1],
        "promote": lambda: broker.promote(Q) == 0,
        "purge": lambda: broker.purge(Q, ["odd"]) == 0,
        "recover": lambda: broker.recover(
            Q, lease_ms=LONG_LEASE_MS, settle=[Settlement("odd", 1, 0, "succeeded")]
        ).outcomes == [RecoveredJob("odd", 0, "garbage")],
        "release": lambda: broker.release(Q, [("odd", 1, 0, True), (*fence, False)]) == [0, 1],
        "snooze": lambda: broker.snooze(Q, [("odd", 1, 0, 0), (*fence, 0)]) == [0, 1],
        "reprioritize": lambda: broker.reprioritize(Q, "odd", 5)[:2] == (False, ""),
        "requeue": lambda: broker.requeue(Q, "odd") == (False, ""),
        "revive": lambda: broker.revive(Q, "odd", extra_attempts=1) is False,
        "start": lambda: broker.start(Q, [("odd", 1, 0), fence]) == [0, 1],
        "claim": lambda: broker.claim(Q, count=5, lease_ms=LONG_LEASE_MS).garbage == ["odd"],
        # (no job id: the flag is set and removed whatever the lists hold)
        "pause": lambda: broker.set_paused(Q, True) and broker.set_paused(Q, False),
        "debounce": lambda: broker.debounce(Q, new_job("odd"), debounce_ms=1_000, max_wait_ms=0,
                                            replace=True).outcome is DebounceOutcome.REFUSED,
    }


@pytest.mark.parametrize("name", [n for n in scripts.SCRIPT_NAMES if n != "wake"])
def test_a_key_of_another_type_under_a_jobs_name_fails_no_script(
    broker: Broker, name: str
) -> None:
    # Given a real job held by a worker, and an id on every list and set whose
    # job key is not a hash (written by hand), its lease and due time past
    enqueue(broker, "real")
    held = claim_one(broker)
    k = broker.keys(Q)
    broker.client.set(k.job("odd"), "not a hash")
    broker.client.rpush(k.queued, "odd")
    broker.client.zadd(k.leases, {"odd": 0})
    broker.client.zadd(k.scheduled, {"odd": 0})
    broker.client.zadd(k.dead, {"odd": 0})
    calls = _odd_calls(broker, held)

    # When the script is called with that id (beside the real job, for a batch)
    # Then it does not fail: the odd id reads as no job (or garbage), and the
    # real job is handled as if the odd id were not there
    assert calls[name]() is True
    assert name != "enqueue" or hash_of(broker, "odd")["state"] == "queued"


def test_recover_moves_garbage_on_landing_aside(broker: Broker) -> None:
    # Given an id on landing whose job hash does not exist
    broker.client.lpush(broker.keys(Q).landing, "ghost")

    # When the sweep leases it and finds it again after that lease expired
    assert broker.recover(Q, lease_ms=SHORT_LEASE_MS).stamped == 1
    wait_past(broker, leases(broker)["ghost"])
    result = broker.recover(Q, lease_ms=SHORT_LEASE_MS)

    # Then it is reported as garbage, put in dead, and removed from landing
    assert result.outcomes == [RecoveredJob("ghost", 0, "garbage")]
    assert "ghost" in dead(broker)
    assert (landing(broker), in_flight(broker), leases(broker), queued(broker)) == (
        [], [], {}, [])


def test_recover_moves_garbage_in_flight_aside(broker: Broker) -> None:
    # Given a claimed job whose hash was lost while it was in flight
    enqueue(broker, "ghost")
    claim_one(broker, lease_ms=SHORT_LEASE_MS)
    broker.client.delete(broker.keys(Q).job("ghost"))

    # When the sweep finds it after that lease expired
    wait_past(broker, leases(broker)["ghost"])
    result = broker.recover(Q, lease_ms=SHORT_LEASE_MS)

    # Then it is reported as garbage, put in dead, and its lease removed
    assert result.outcomes == [RecoveredJob("ghost", 0, "garbage")]
    assert "ghost" in dead(broker)
    assert (in_flight(broker), leases(broker), queued(broker)) == ([], {}, [])


def test_recover_drops_a_stray_copy_of_a_job_that_lives_elsewhere(broker: Broker) -> None:
    # Given a scheduled job whose id also, wrongly, sits on landing
    enqueue(broker, "a", due_ms=broker.server_time_ms() + 60_000)
    broker.client.lpush(broker.keys(Q).landing, "a")
    before = hash_of(broker, "a")

    # When the sweep leases the stray and finds it again after that lease expired
    broker.recover(Q, lease_ms=SHORT_LEASE_MS)
    wait_past(broker, leases(broker)["a"])
    result = broker.recover(Q, lease_ms=SHORT_LEASE_MS)

    # Then the stray copy is dropped and the scheduled job is untouched
    assert result.outcomes == [RecoveredJob("a", 0, "dropped")]
    assert (landing(broker), in_flight(broker), leases(broker), queued(broker)) == (
        [], [], {}, [])
    assert hash_of(broker, "a") == before
    assert "a" in scheduled(broker)
    assert_consistent(broker)


# -- promote, cancel, revive --------------------------------------------------


def test_promote_queues_only_due_jobs_earliest_first(broker: Broker) -> None:
    # Given two jobs due soon, one due in a minute, and a stray id with no hash
    now_ms = broker.server_time_ms()
    enqueue(broker, "second", due_ms=now_ms + 150)
    enqueue(broker, "first", due_ms=now_ms + 100)
    enqueue(broker, "later", due_ms=now_ms + 60_000)
    broker.client.zadd(broker.keys(Q).scheduled, {"ghost": 1})

    # When the sweep promotes before anything real is due
    # Then only the stray goes (dropped, not counted)
    assert broker.promote(Q) == 0
    assert set(scheduled(broker)) == {"second", "first", "later"}
    assert queued(broker) == []
    assert wake_markers(broker) == 0

    # When it promotes once the two are due
    wait_past(broker, now_ms + 150)
    promoted = broker.promote(Q)

    # Then both are queued, the earliest due on the right, and "later" waits on
    assert promoted == 2
    assert queued(broker) == ["second", "first"]
    assert hash_of(broker, "first")["state"] == "queued"
    assert set(scheduled(broker)) == {"later"}
    assert wake_markers(broker) == 1
    assert_consistent(broker)


def test_cancel_removes_a_queued_job(broker: Broker) -> None:
    # Given two queued jobs
    enqueue(broker, "a", "b")

    # When staff cancel one
    result = broker.cancel(Q, "a")

    # Then it is marked cancelled where it waits, the other is untouched
    assert result == (True, "queued")
    assert hash_of(broker, "a")["state"] == "cancelled"
    assert_consistent(broker)

    # and once a worker reaches it, it is gone and never ran (its hash a
    # tombstone that expires, as a cancelled scheduled job's); the other runs
    claimed = broker.claim(Q, count=2, lease_ms=LONG_LEASE_MS)
    assert [j.id for j in claimed.jobs] == ["b"]
    assert (claimed.dead, claimed.garbage) == ([], [])
    assert hash_of(broker, "a") == {"state": "cancelled", "gen": "0"}
    assert 0 < broker.client.pttl(broker.keys(Q).job("a")) <= TOMBSTONE_MS
    assert (queued(broker), in_flight(broker)) == ([], ["b"])
    assert "a" not in dead(broker)


def test_cancel_removes_a_scheduled_job(broker: Broker) -> None:
    # Given a scheduled job
    enqueue(broker, "a", due_ms=broker.server_time_ms() + 60_000)

    # When staff cancel it
    result = broker.cancel(Q, "a")

    # Then it is off scheduled, and its hash is a tombstone that expires, so a
    # late push of the same generation is refused meanwhile
    assert result == (True, "scheduled")
    assert hash_of(broker, "a") == {"state": "cancelled", "gen": "0"}
    assert 0 < broker.client.pttl(broker.keys(Q).job("a")) <= TOMBSTONE_MS
    assert scheduled(broker) == {}
    assert broker.enqueue(Q, [new_job("a")]) == 0


def test_cancel_marks_a_running_job_where_it_is(broker: Broker) -> None:
    # Given a running job
    enqueue(broker, "a")
    job = claim_one(broker)
    before = snapshot(broker, ["a"])

    # When staff cancel it, twice, and a job that does not exist
    result = broker.cancel(Q, "a")
    again = broker.cancel(Q, "a")
    missing = broker.cancel(Q, "nope")

    # Then the running job is marked with the token it was cancelled under and
    # left where it is (its holder stops it, see tests/test_cancel_running.py);
    # the missing one is refused, saying nothing was found
    assert result == again == (True, "running")
    assert missing == (False, "")
    after = snapshot(broker, ["a"])
    assert after["jobs"]["a"].pop("cancel") == f"{job.attempt}:{job.gen}"
    assert after == before


def test_revive_queues_a_dead_job_with_more_attempts(broker: Broker) -> None:
    # Given a job buried after its first of three attempts
    enqueue(broker, "a", max_attempts=3)
    job = claim_one(broker)
    broker.nack(Q, [("a", job.attempt, 0, -1, "PermanentFailure: bad input")])
    broker.client.delete(broker.keys(Q).wake)

    # When staff revive it with two more attempts
    revived = broker.revive(Q, "a", extra_attempts=2)

    # Then it is queued with max_attempts = attempts + 2 and counting on from there
    assert revived is True
    stored = hash_of(broker, "a")
    assert (stored["state"], stored["attempts"], stored["max_attempts"]) == ("queued", "1", "3")
    assert "finished_ms" not in stored
    assert dead(broker) == {}
    assert queued(broker) == ["a"]
    assert wake_markers(broker) == 1
    again = claim_one(broker)
    assert (again.attempt, again.max_attempts) == (2, 3)


def test_revive_refuses_a_job_that_is_not_dead(broker: Broker) -> None:
    # Given a queued job
    enqueue(broker, "a")
    before = snapshot(broker, ["a"])

    # When staff try to revive it, and a job that does not exist
    # Then both are refused and nothing changed
    assert broker.revive(Q, "a", extra_attempts=2) is False
    assert broker.revive(Q, "nope", extra_attempts=2) is False
    assert snapshot(broker, ["a"]) == before


def test_the_wake_marker_never_exceeds_one(broker: Broker) -> None:
    # Given a marker already waiting
    enqueue(broker, "a", "b", "c", "d")
    assert wake_markers(broker) == 1

    # When every script that pushes work runs while no worker takes the marker
    jobs = broker.claim(Q, count=3, lease_ms=SHORT_LEASE_MS).jobs
    broker.nack(Q, [(jobs[0].id, 1, 0, 0, "retry now")])
    broker.release(Q, [(jobs[1].id, 1, 0, False)])
    broker.nack(Q, [(jobs[2].id, 1, 0, -1, "dead")])
    broker.revive(Q, jobs[2].id, extra_attempts=1)
    enqueue(broker, "soon", due_ms=broker.server_time_ms() + 50)
    wait_past(broker, scheduled(broker)["soon"])
    broker.promote(Q)
    moved = broker.wait([Q], timeout_s=1.0)
    assert moved is not None
    broker.recover(Q, lease_ms=SHORT_LEASE_MS)
    wait_past(broker, max(leases(broker).values()))
    assert broker.recover(Q, lease_ms=SHORT_LEASE_MS).outcomes != []

    # Then one marker is waiting, never a pile of them
    assert wake_markers(broker) == 1


# -- generations: a rebuild from the mirror fences out older holders -------------


@pytest.mark.parametrize("mirrored_attempts", [1, 0], ids=["mirror-current", "mirror-lagging"])
def test_a_holder_from_before_redis_lost_the_job_is_refused_after_a_rebuild(
    broker: Broker, mirrored_attempts: int
) -> None:
    # Given a job claimed as attempt 1 of generation 0
    enqueue(broker, "a")
    stale = claim_one(broker)
    assert stale.fence == ("a", 1, 0)
    # and Redis then lost everything, and the sweep rebuilt the job from the
    # mirror as generation 1 with the attempts the mirror had seen (1, or 0
    # when the mirror lagged behind the claim)
    broker.client.flushdb()
    assert broker.enqueue(Q, [new_job("a", attempts=mirrored_attempts, gen=1)]) == 1

    # When another worker claims the rebuilt job
    current = claim_one(broker)

    # Then its token is new, even when its attempt number is the stale one's
    assert current.fence == ("a", mirrored_attempts + 1, 1)
    before = snapshot(broker, ["a"])

    # When the stale holder starts, extends, acks, nacks or releases with its old fence
    # Then each is refused, and nothing changed
    assert broker.start(Q, [stale.fence]) == [False]
    assert broker.extend(Q, [stale.fence], lease_ms=LONG_LEASE_MS) == [False]
    assert broker.ack(Q, [stale.fence]) == [False]
    assert broker.nack(Q, [(*stale.fence, -1, "stale")]) == [False]
    assert broker.release(Q, [(*stale.fence, True)]) == [False]
    assert snapshot(broker, ["a"]) == before

    # When the current holder does the same with its fence
    # Then it is accepted, and the ack of the rebuilt job leaves a tombstone
    assert broker.start(Q, [current.fence]) == [True]
    assert broker.extend(Q, [current.fence], lease_ms=LONG_LEASE_MS) == [True]
    assert broker.ack(Q, [current.fence]) == [True]
    assert hash_of(broker, "a") == {"state": "finished", "gen": "1"}
    assert (queued(broker), in_flight(broker), leases(broker)) == ([], [], {})
    assert_consistent(broker)


def test_a_late_push_after_the_ack_of_a_rebuilt_job_is_refused(broker: Broker) -> None:
    # Given a job rebuilt from the mirror (generation 1), claimed and acked
    assert broker.enqueue(Q, [new_job("a", attempts=1, gen=1)]) == 1
    job = claim_one(broker)
    assert job.fence == ("a", 2, 1)
    assert broker.ack(Q, [job.fence]) == [True]

    # Then its hash is a tombstone that expires
    key = broker.keys(Q).job("a")
    assert hash_of(broker, "a") == {"state": "finished", "gen": "1"}
    assert 0 < broker.client.pttl(key) <= TOMBSTONE_MS
    tombstone = snapshot(broker, ["a"])

    # When the on-commit push from before the rebuild arrives late (generation
    # 0), and a second push of generation 1
    late = broker.enqueue(Q, [new_job("a")])
    again = broker.enqueue(Q, [new_job("a", attempts=1, gen=1)])

    # Then both are refused: the job does not run again
    assert (late, again) == (0, 0)
    assert snapshot(broker, ["a"]) == tombstone

    # When a later rebuild (generation 2) pushes it, next to a new job, in one call
    k = broker.keys(Q)
    rebuilt, fresh = new_job("a", attempts=2, gen=2), new_job("b")
    args = [x for j in (new_job("a"), rebuilt, fresh)
            for x in (j.id, j.payload, j.max_attempts, j.due_ms, j.attempts, j.gen, j.priority,
                      j.group)]
    written = broker._run("enqueue", (k.queued, k.scheduled, k.wake, k.job_prefix, k.bands,
                                      k.band_prefix, *k.fair), args)

    # Then the script answers per job: the stale push refused, the newer
    # generation replacing the tombstone (no expiry left), the new job written
    assert written == [0, 1, 1]
    stored = hash_of(broker, "a")
    assert (stored["state"], stored["attempts"], stored["gen"]) == ("queued", "2", "2")
    assert broker.client.pttl(key) == -1
    assert queued(broker) == ["b", "a"]
    assert claim_one(broker).fence == ("a", 3, 2)
    assert_consistent(broker)


# -- cancel of a queued job: O(1), taking effect at the claim ------------------------


def test_a_cancelled_queued_job_stays_listed_until_a_claim_drops_it(broker: Broker) -> None:
    # Given three queued jobs, the middle one cancelled by staff
    enqueue(broker, "a", "b", "c")
    assert broker.cancel(Q, "b") == (True, "queued")

    # Then its id stays where it waits, and its hash says cancelled
    assert queued(broker) == ["c", "b", "a"]
    assert hash_of(broker, "b")["state"] == "cancelled"
    # and a second cancel, or a late push of the job, is refused
    assert broker.cancel(Q, "b") == (False, "cancelled")
    assert broker.enqueue(Q, [new_job("b")]) == 0
    assert_consistent(broker)

    # When workers claim one job at a time until the queue is empty
    results = []
    while queued(broker):
        results.append(broker.claim(Q, count=1, lease_ms=LONG_LEASE_MS))

    # Then the cancelled job is never returned, neither dead nor garbage, its
    # id is gone and its hash a tombstone; the others run
    assert [j.id for r in results for j in r.jobs] == ["a", "c"]
    assert [(r.dead, r.garbage) for r in results] == [([], [])] * 3
    assert hash_of(broker, "b") == {"state": "cancelled", "gen": "0"}
    assert sorted(in_flight(broker)) == ["a", "c"]
    assert set(leases(broker)) == {"a", "c"}
    assert "b" not in dead(broker)
    assert_consistent(broker)


def test_a_cancelled_id_moved_by_blmove_is_dropped_by_the_claim(broker: Broker) -> None:
    # Given a queued job cancelled, then moved onto landing by a waiting worker
    enqueue(broker, "a")
    assert broker.cancel(Q, "a") == (True, "queued")
    assert broker.wait([Q], timeout_s=1.0) == (Q, "a")

    # When that worker claims with the moved id
    result = broker.claim(Q, count=1, lease_ms=LONG_LEASE_MS, moved_id="a")

    # Then nothing is claimed, the id is gone from everywhere, its hash a tombstone
    assert (result.jobs, result.dead, result.garbage) == ([], [], [])
    assert hash_of(broker, "a") == {"state": "cancelled", "gen": "0"}
    assert (queued(broker), landing(broker), in_flight(broker)) == ([], [], [])
    assert "a" not in leases(broker) and "a" not in dead(broker)


def test_a_cancelled_id_whose_worker_died_on_landing_leaves_a_tombstone(broker: Broker) -> None:
    # Given a queued job moved onto landing by a worker that died before its
    # claim, leased there by the sweep, then cancelled (the lease expires)
    enqueue(broker, "a")
    assert broker.wait([Q], timeout_s=1.0) == (Q, "a")
    assert broker.recover(Q, lease_ms=SHORT_LEASE_MS).stamped == 1
    assert broker.cancel(Q, "a") == (True, "queued")
    wait_past(broker, leases(broker)["a"])

    # When the sweep recovers it
    result = broker.recover(Q, lease_ms=SHORT_LEASE_MS)

    # Then the id is dropped from everywhere, its hash a tombstone that
    # refuses a late push of the job
    assert_dropped_as_a_tombstone(broker, result.outcomes)


def test_a_cancelled_id_on_landing_leaves_at_once_as_a_tombstone(broker: Broker) -> None:
    # Given a queued job cancelled, then moved onto landing by a worker that
    # died before its claim
    enqueue(broker, "a")
    assert broker.cancel(Q, "a") == (True, "queued")
    assert broker.wait([Q], timeout_s=1.0) == (Q, "a")

    # When the sweep first sees it
    result = broker.recover(Q, lease_ms=SHORT_LEASE_MS)

    # Then it is not leased (a lease would count it in a concurrency cap's
    # running set) but dropped at once, its hash a tombstone
    assert result.stamped == 0
    assert_dropped_as_a_tombstone(broker, result.outcomes)


def test_a_landing_copy_of_a_finished_job_is_dropped_unleased(broker: Broker) -> None:
    # Given a rebuilt job (generation 1) run from queued (claimed, acked: a
    # 'finished' tombstone) while a stale copy of its id waits on landing, as
    # a reconcile push and a dead worker's BLMOVE leave it
    enqueue(broker, "a", gen=1)
    claimed = broker.claim(Q, count=1, lease_ms=60_000).jobs
    broker.client.lpush(broker.keys(Q).landing, "a")
    broker.ack(Q, [claimed[0].fence])

    # When the sweep sees the landing copy
    result = broker.recover(Q, lease_ms=SHORT_LEASE_MS)

    # Then it leaves landing without a lease, the tombstone kept
    assert result.stamped == 0
    assert (landing(broker), leases(broker)) == ([], {})
    assert hash_of(broker, "a") == {"state": "finished", "gen": "1"}


def assert_dropped_as_a_tombstone(broker: Broker, outcomes: list[RecoveredJob]) -> None:
    assert outcomes == [RecoveredJob("a", 0, "dropped")]
    assert (queued(broker), landing(broker), leases(broker)) == ([], [], {})
    assert hash_of(broker, "a") == {"state": "cancelled", "gen": "0"}
    assert 0 < broker.client.pttl(broker.keys(Q).job("a")) <= TOMBSTONE_MS
    assert broker.enqueue(Q, [new_job("a")]) == 0


def test_cancel_among_ten_thousand_queued_jobs_does_not_search_the_list(broker: Broker) -> None:
    # Given 10,000 queued jobs
    ids = [f"j{i}" for i in range(10_000)]
    assert broker.enqueue(Q, [new_job(job_id) for job_id in ids]) == len(ids)
    queued_key = broker.keys(Q).queued

    # When staff cancel one in the middle
    assert broker.cancel(Q, "j5000") == (True, "queued")

    # Then the list was not searched or changed: same length, the id in its place
    assert broker.client.llen(queued_key) == len(ids)
    assert broker.client.lindex(queued_key, len(ids) - 1 - 5000) == "j5000"
    assert hash_of(broker, "j5000")["state"] == "cancelled"

    # and when a worker claims them all, the cancelled one is dropped, not run
    result = broker.claim(Q, count=len(ids), lease_ms=LONG_LEASE_MS)
    assert [j.id for j in result.jobs] == [job_id for job_id in ids if job_id != "j5000"]
    assert (result.dead, result.garbage, result.remaining) == ([], [], 0)
    assert hash_of(broker, "j5000") == {"state": "cancelled", "gen": "0"}
    assert len(in_flight(broker)) == len(ids) - 1


# -- settling: the mirror already holds an expired attempt's outcome -----------------


def started_and_expired(broker: Broker, job_id: str, **options: Any) -> ClaimedJob:
    """Enqueue and claim ``job_id`` with a short lease, start it, and let the lease expire."""
    enqueue(broker, job_id, **options)
    job = claim_one(broker, lease_ms=SHORT_LEASE_MS)
    assert job.id == job_id
    assert broker.start(Q, [job.fence]) == [True]
    wait_past(broker, leases(broker)[job_id])
    return job


@pytest.mark.parametrize("gen", [0, 1])
def test_recover_settles_an_expired_attempt_the_mirror_saw_succeed(
    broker: Broker, gen: int
) -> None:
    # Given a started attempt whose worker wrote success to the mirror, then
    # died before its ack, so its lease expired
    job = started_and_expired(broker, "a", gen=gen)
    assert broker.expired(Q) == [("a", 1, gen)]

    # When the sweep recovers, passing the outcome it found in the mirror
    result = broker.recover(Q, lease_ms=LONG_LEASE_MS,
                            settle=[Settlement("a", job.attempt, gen, "succeeded")])

    # Then the job is finished like an ack: not requeued, not buried
    assert result.outcomes == [RecoveredJob("a", 1, "settled")]
    assert result.outcomes[0].gen == gen
    if gen == 0:
        assert hash_of(broker, "a") == {}
    else:
        assert hash_of(broker, "a") == {"state": "finished", "gen": str(gen)}
    assert (queued(broker), in_flight(broker), leases(broker), dead(broker)) == (
        [], [], {}, {})
    assert broker.expired(Q) == []
    assert_consistent(broker)


def test_recover_settles_an_expired_attempt_the_mirror_saw_die(broker: Broker) -> None:
    # Given a started attempt (attempts left) whose worker recorded its death in
    # the mirror, then died before its nack
    job = started_and_expired(broker, "a", max_attempts=5)

    # When the sweep recovers, passing that outcome
    before_ms = broker.server_time_ms()
    result = broker.recover(Q, lease_ms=LONG_LEASE_MS, settle=[
        Settlement("a", job.attempt, 0, "dead", "builtins.ValueError: bad input")])
    after_ms = broker.server_time_ms()

    # Then it is buried with that error instead of being run again
    assert result.outcomes == [RecoveredJob("a", 1, "settled")]
    stored = hash_of(broker, "a")
    assert (stored["state"], stored["attempts"], stored["last_error"]) == (
        "dead", "1", "builtins.ValueError: bad input")
    assert before_ms <= int(stored["finished_ms"]) <= after_ms
    assert before_ms <= dead(broker)["a"] <= after_ms
    assert (queued(broker), in_flight(broker), leases(broker)) == ([], [], {})
    assert_consistent(broker)


def test_a_settlement_that_does_not_fit_the_attempt_changes_nothing(broker: Broker) -> None:
    # Given "a" started with its lease expired, and "b" started and still leased
    started_and_expired(broker, "a")
    enqueue(broker, "b")
    b = claim_one(broker)
    assert broker.start(Q, [b.fence]) == [True]
    before = snapshot(broker, ["a", "b"])

    # When recover (handling no expired lease: limit 0) is told to settle "a"
    # with the wrong generation or attempt, "b" whose lease has not expired,
    # or an outcome that is not final
    result = broker.recover(Q, lease_ms=LONG_LEASE_MS, limit=0, settle=[
        Settlement("a", 1, 1, "succeeded"), Settlement("a", 2, 0, "succeeded"),
        Settlement("a", 0, 0, "dead", "x"), Settlement("b", 1, 0, "succeeded"),
        Settlement("a", 1, 0, "running"), Settlement("missing", 1, 0, "succeeded")])

    # Then nothing was settled and nothing changed
    assert result.outcomes == []
    assert snapshot(broker, ["a", "b"]) == before

    # When the settlement fits
    # Then it is applied, so the refusals above were the fence at work
    assert broker.recover(Q, lease_ms=LONG_LEASE_MS, limit=0, settle=[
        Settlement("a", 1, 0, "succeeded")]).outcomes == [RecoveredJob("a", 1, "settled")]
    assert hash_of(broker, "a") == {}
    assert hash_of(broker, "b") == before["jobs"]["b"]


def test_expired_lists_only_started_running_attempts_whose_lease_expired(
    broker: Broker
) -> None:
    # Given, with short leases: an orphan on landing whose first lease
    # expired, a started attempt, one of generation 2, and one that never
    # started; and a started attempt leased for long
    enqueue(broker, "orphan")
    assert broker.wait([Q], timeout_s=1.0) == (Q, "orphan")
    assert broker.recover(Q, lease_ms=SHORT_LEASE_MS).stamped == 1
    started_and_expired(broker, "started")
    started_and_expired(broker, "rebuilt", attempts=1, gen=2)
    enqueue(broker, "unstarted")
    claim_one(broker, lease_ms=SHORT_LEASE_MS)
    enqueue(broker, "alive")
    alive = claim_one(broker)
    assert broker.start(Q, [alive.fence]) == [True]
    wait_past(broker, max(leases(broker)[i] for i in ("unstarted", "orphan")))
    before = snapshot(broker, ["started", "rebuilt", "unstarted", "alive", "orphan"])

    # When the sweep asks which attempts expired
    found = broker.expired(Q)

    # Then only the started, running, expired ones, each with its token, and
    # nothing changed (read-only)
    assert sorted(found) == [("rebuilt", 2, 2), ("started", 1, 0)]
    # (limit bounds the expired leases inspected, listed or not)
    assert broker.expired(Q, limit=0) == []
    assert snapshot(broker, ["started", "rebuilt", "unstarted", "alive", "orphan"]) == before


# -- landing: orphans of BLMOVE, found whatever processing holds ----------------------


def monitor_lines(broker: Broker, action: Callable[[], Any]) -> tuple[Any, list[str]]:
    """Run ``action`` while a MONITOR connection records every command the server runs.

    Returns the action's result and the raw MONITOR lines up to a marker
    echoed right after it.
    """
    end = f"end-of-action-{uuid.uuid4().hex}"
    monitor_client = redis.Redis.from_url(broker.url, decode_responses=True, socket_timeout=20)
    ready = threading.Event()

    def record() -> list[str]:
        lines: list[str] = []
        with monitor_client.monitor() as monitor:
            ready.set()
            while end not in (line := monitor.connection.read_response()):
                lines.append(line)
        return lines

    try:
        with ThreadPoolExecutor(max_workers=1) as pool:
            recording = pool.submit(record)
            assert ready.wait(timeout=10)
            result = action()
            broker.client.echo(end)
            return result, recording.result(timeout=30)
    finally:
        monitor_client.close()


def lua_commands(broker: Broker, action: Callable[[], Any]) -> tuple[Any, list[list[str]]]:
    """Run ``action`` under MONITOR; return its result and the commands its scripts ran.

    Only commands run inside a script called with keys under this broker's
    prefix count (other clients may share the server).
    """
    result, lines = monitor_lines(broker, action)
    commands: list[list[str]] = []
    ours = False
    for line in lines:
        client, arguments = parse_monitor_line(line)
        if client != "lua":
            ours = (arguments[0].upper() == "EVALSHA" and int(arguments[2]) > 0
                    and arguments[3].startswith(f"{broker.prefix}:"))
        elif ours:
            commands.append([arguments[0].upper(), *arguments[1:]])
    return result, commands


def test_an_orphan_on_landing_behind_twenty_thousand_claimed_jobs_is_requeued(
    broker: Broker
) -> None:
    # Given 20,000 claimed jobs, leased for long
    ids = [f"j{i}" for i in range(20_000)]
    assert broker.enqueue(Q, [new_job(job_id) for job_id in ids]) == len(ids)
    assert len(broker.claim(Q, count=len(ids), lease_ms=LONG_LEASE_MS).jobs) == len(ids)
    # and one more job, moved onto landing by a worker that died before its claim
    enqueue(broker, "orphan")
    assert broker.wait([Q], timeout_s=1.0) == (Q, "orphan")
    leases_key = broker.keys(Q).leases

    # When the sweep runs
    first, stamping = lua_commands(broker, lambda: broker.recover(Q, lease_ms=SHORT_LEASE_MS))

    # Then the orphan gets a lease, and the leases set was read only through
    # its expired end, LIMITed, never whole
    assert (first.outcomes, first.stamped) == ([], 1)
    assert set(leases(broker)) == {*ids, "orphan"}
    reads = [c for c in stamping if leases_key in c and c[0] not in ("ZADD", "ZREM")]
    assert reads and all(c[0] == "ZRANGEBYSCORE" and "LIMIT" in c for c in reads), reads

    # When that lease expires and the sweep runs again
    wait_past(broker, leases(broker)["orphan"])
    second, requeueing = lua_commands(broker, lambda: broker.recover(Q,
                                                                     lease_ms=SHORT_LEASE_MS))

    # Then the orphan is back on queued, not charged an attempt, and the claimed
    # jobs are untouched: only the orphan's own lease was removed
    assert second.outcomes == [RecoveredJob("orphan", 0, "orphan")]
    assert (queued(broker), landing(broker)) == (["orphan"], [])
    stored = hash_of(broker, "orphan")
    assert (stored["state"], stored["attempts"]) == ("queued", "0")
    assert set(leases(broker)) == set(ids)
    assert [c for c in requeueing if leases_key in c and c[0] == "ZREM"] == [
        ["ZREM", leases_key, "orphan"]]
    assert claim_one(broker).fence == ("orphan", 1, 0)


def test_recover_stamps_at_most_limit_ids_on_landing(broker: Broker) -> None:
    # Given three ids moved onto landing by workers that died before claiming
    enqueue(broker, "a", "b", "c")
    for expected in ("a", "b", "c"):
        assert broker.wait([Q], timeout_s=1.0) == (Q, expected)
    assert landing(broker) == ["c", "b", "a"]

    # When the sweep runs with a limit of two, twice
    first = broker.recover(Q, lease_ms=LONG_LEASE_MS, limit=2)
    second = broker.recover(Q, lease_ms=LONG_LEASE_MS, limit=2)

    # Then the first pass stamps two and the second none (NX: the two newest
    # keep their leases)
    assert (first.stamped, second.stamped) == (2, 0)
    assert set(leases(broker)) == {"b", "c"}
    assert_consistent(broker)


# -- two clients at once ------------------------------------------------------


def test_two_workers_claiming_at_once_claim_each_job_exactly_once(broker: Broker) -> None:
    # Given many queued jobs and two workers, one claiming batches, the other
    # moving with BLMOVE and claiming with the moved id
    ids = [f"j{i}" for i in range(600)]
    broker.enqueue(Q, [new_job(job_id) for job_id in ids])
    start = threading.Barrier(2)

    def batch_worker(b: Broker) -> list[ClaimedJob]:
        held: list[ClaimedJob] = []
        start.wait(timeout=10)
        while True:
            result = b.claim(Q, count=7, lease_ms=LONG_LEASE_MS)
            held += result.jobs
            if not result.jobs and result.remaining == 0:
                return held

    def blmove_worker(b: Broker) -> list[ClaimedJob]:
        held: list[ClaimedJob] = []
        start.wait(timeout=10)
        while (woken := b.wait([Q], timeout_s=0.2)) is not None:
            held += b.claim(Q, count=3, lease_ms=LONG_LEASE_MS, moved_id=woken[1]).jobs
        return held

    # When both drain the queue at once
    brokers = [Broker(broker.url, broker.prefix) for _ in range(2)]
    try:
        with ThreadPoolExecutor(max_workers=2) as pool:
            futures = [pool.submit(batch_worker, brokers[0]),
                       pool.submit(blmove_worker, brokers[1])]
            claimed = [job for future in futures for job in future.result(timeout=30)]
    finally:
        for b in brokers:
            b.close()

    # Then every job was claimed exactly once, as attempt one, and is held
    assert sorted(j.id for j in claimed) == sorted(ids)
    assert {j.attempt for j in claimed} == {1}
    assert sorted(in_flight(broker)) == sorted(ids)
    assert set(leases(broker)) == set(ids)
    assert queued(broker) == []
    assert_consistent(broker)


def claim_and_expire(broker: Broker, count: int) -> list[str]:
    """Enqueue and claim ``count`` jobs with a short lease, and let it expire."""
    ids = [f"j{i}" for i in range(count)]
    broker.enqueue(Q, [new_job(job_id) for job_id in ids])
    jobs = broker.claim(Q, count=count, lease_ms=SHORT_LEASE_MS).jobs
    assert len(jobs) == count
    assert broker.start(Q, [j.fence for j in jobs]) == [True] * count
    wait_past(broker, max(leases(broker).values()))
    return ids


def test_recover_racing_ack_ends_each_job_acked_or_requeued_never_both(broker: Broker) -> None:
    # Given many running jobs whose leases just expired while their worker finished them
    ids = claim_and_expire(broker, 300)
    start = threading.Barrier(2)

    def acker(b: Broker) -> dict[str, bool]:
        start.wait(timeout=10)
        return {job_id: b.ack(Q, [(job_id, 1, 0)])[0] for job_id in ids}

    def sweeper(b: Broker) -> list[RecoveredJob]:
        outcomes: list[RecoveredJob] = []
        start.wait(timeout=10)
        while batch := b.recover(Q, lease_ms=LONG_LEASE_MS, limit=3).outcomes:
            outcomes += batch
        return outcomes

    # When the worker acks them one by one while the sweep recovers them
    brokers = [Broker(broker.url, broker.prefix) for _ in range(2)]
    try:
        with ThreadPoolExecutor(max_workers=2) as pool:
            acks_future = pool.submit(acker, brokers[0])
            recovered_future = pool.submit(sweeper, brokers[1])
            acks, recovered = acks_future.result(timeout=30), recovered_future.result(timeout=30)
    finally:
        for b in brokers:
            b.close()

    # Then each job is either acked (gone) or requeued (refused ack), never both
    acked = {job_id for job_id, ok in acks.items() if ok}
    requeued = {r.id for r in recovered}
    assert {r.kind for r in recovered} <= {"expired"}
    assert len(requeued) == len(recovered)
    assert acked.isdisjoint(requeued)
    assert acked | requeued == set(ids)
    assert sorted(queued(broker)) == sorted(requeued)
    for job_id in acked:
        assert hash_of(broker, job_id) == {}
    for job_id in requeued:
        assert hash_of(broker, job_id)["state"] == "queued"
    assert (in_flight(broker), leases(broker)) == ([], {})
    assert_consistent(broker)


def test_two_sweeps_at_once_requeue_each_expired_job_once(broker: Broker) -> None:
    # Given many running jobs whose leases expired
    ids = claim_and_expire(broker, 300)
    start = threading.Barrier(2)

    def sweeper(b: Broker) -> list[RecoveredJob]:
        outcomes: list[RecoveredJob] = []
        start.wait(timeout=10)
        while batch := b.recover(Q, lease_ms=LONG_LEASE_MS, limit=4).outcomes:
            outcomes += batch
        return outcomes

    # When two sweeps recover the queue at the same time
    brokers = [Broker(broker.url, broker.prefix) for _ in range(2)]
    try:
        with ThreadPoolExecutor(max_workers=2) as pool:
            futures = [pool.submit(sweeper, b) for b in brokers]
            recovered = [r for future in futures for r in future.result(timeout=30)]
    finally:
        for b in brokers:
            b.close()

    # Then each job was requeued exactly once
    assert sorted(r.id for r in recovered) == sorted(ids)
    assert sorted(queued(broker)) == sorted(ids)
    assert (in_flight(broker), leases(broker)) == ([], {})
    assert_consistent(broker)


# -- every key through KEYS (the scripts' text alone: tests/fast/test_script_keys.py) --


def parse_monitor_line(line: str) -> tuple[str, list[str]]:
    """Split a MONITOR line into its client ('lua' for a script) and arguments."""
    match = re.match(r"[\d.]+ \[\d+ (\S*)\] (.*)$", line, flags=re.DOTALL)
    assert match, line
    arguments = [re.sub(r"\\(.)", r"\1", raw)
                 for raw in re.findall(r'"((?:[^"\\]|\\.)*)"', match.group(2))]
    return match.group(1), arguments


def run_every_script(broker: Broker, queue: str) -> None:
    """Call every Broker method that runs a script, on one queue."""
    now_ms = broker.server_time_ms()
    broker.enqueue(queue, [new_job("a"), new_job("b"), new_job("c"), new_job("d"),
                           new_job("later", due_ms=now_ms + 60_000),
                           new_job("soon", due_ms=now_ms - 1)])
    broker.promote(queue)
    broker.latency(queue)
    jobs = broker.claim(queue, count=3, lease_ms=SHORT_LEASE_MS).jobs
    broker.start(queue, [jobs[0].fence])
    broker.extend(queue, [jobs[0].fence], lease_ms=SHORT_LEASE_MS)
    broker.ack(queue, [jobs[0].fence])
    broker.nack(queue, [(jobs[1].id, 1, 0, -1, "dead")])
    broker.release(queue, [(jobs[2].id, 1, 0, True)])
    broker.expired(queue)
    broker.recover(queue, lease_ms=SHORT_LEASE_MS)
    broker.cancel(queue, "later")
    broker.revive(queue, jobs[1].id, extra_attempts=1)
    # The admin's scripts (staff requeue, retention purge).
    broker.enqueue(queue, [new_job("waiting", due_ms=now_ms + 60_000)])
    broker.requeue(queue, "waiting")
    broker.purge(queue, [jobs[1].id, "gone"])
    # Priorities: a job on a band of its own, moved to another, then claimed.
    broker.enqueue(queue, [NewJob("urgent", "{}", 3, priority=5)])
    broker.reprioritize(queue, "urgent", -5)
    # Pause: a claim on the paused queue, then the resume, with work waiting.
    broker.set_paused(queue, True)
    broker.claim(queue, count=10, lease_ms=SHORT_LEASE_MS)
    broker.set_paused(queue, False)
    claimed = broker.claim(queue, count=10, lease_ms=SHORT_LEASE_MS).jobs
    # A task that snoozes: back to wait, its attempt given back.
    broker.snooze(queue, [(*job.fence, 0) for job in claimed])
    # Debounce: a debounced job made, then pushed back.
    for replace in (False, True):
        broker.debounce(queue, new_job("debounced"), debounce_ms=60_000, max_wait_ms=0,
                        replace=replace)


def test_every_key_the_broker_passes_shares_the_queues_slot(broker: Broker) -> None:
    # Given two queues that hash to different cluster slots, and a MONITOR
    # connection recording every command the server runs, scripts' included
    queues = ["alpha", "beta.2"]
    assert key_slot(b"alpha") != key_slot(b"beta.2")
    by_sha = {hashlib.sha1(scripts.source(n).encode()).hexdigest(): n
              for n in scripts.SCRIPT_NAMES}
    # When every script runs on each queue
    _, lines = monitor_lines(broker, lambda: [run_every_script(broker, q) for q in queues])

    # Then each script call named, in header order, the queue's own keys, all
    # in the queue's slot, and each command it ran touched only those keys
    seen: set[str] = set()
    current: tuple[str, list[str]] | None = None
    for line in lines:
        client, arguments = parse_monitor_line(line)
        if client != "lua":
            current = None
            if arguments[0].upper() == "EVALSHA" and arguments[1] in by_sha:
                keys = arguments[3:3 + int(arguments[2])]
                if keys and keys[0].startswith(f"{broker.prefix}:"):
                    current = (by_sha[arguments[1]], keys)
            continue
        if current is None or arguments[0].upper() in KEYLESS_COMMANDS:
            continue
        name, keys = current
        seen.add(name)
        tag = re.search(r"\{(.+?)\}", keys[0])
        assert tag, keys
        queue = tag.group(1)
        expected = [getattr(broker.keys(queue), key.replace(" ", "_"))
                    for _, key in header_keys(scripts.source(name))]
        assert keys == expected, (name, keys)
        assert {key_slot(key.encode()) for key in keys} == {key_slot(queue.encode())}
        touched = arguments[1:] if arguments[0].upper() in ALL_KEY_COMMANDS else arguments[1:2]
        job_prefix = broker.keys(queue).job_prefix
        band_prefix = broker.keys(queue).band_prefix
        for key in touched:
            assert key in keys or key.startswith((job_prefix, band_prefix)), (name, arguments)
            assert key_slot(key.encode()) == key_slot(queue.encode()), (name, key)
    # (wake.lua runs only on a cluster, on the shared wake slot: test_cluster.py)
    assert seen == set(scripts.SCRIPT_NAMES) - {"wake"}


def test_ids_left_on_the_legacy_processing_list_are_moved_into_leases(broker: Broker) -> None:
    # Given 250 claimed jobs, and the processing list version 0.1 kept claimed
    # ids on, left by an upgrade: one id with a lease of its own, 150 without
    # (one of them with no job hash at all)
    ids = [f"j{i}" for i in range(250)]
    assert broker.enqueue(Q, [new_job(job_id) for job_id in ids]) == len(ids)
    assert len(broker.claim(Q, count=len(ids), lease_ms=LONG_LEASE_MS).jobs) == len(ids)
    processing_key = broker.keys(Q).processing
    legacy = [f"old{i}" for i in range(149)]
    for job_id in legacy:
        enqueue(broker, job_id)
    assert len(broker.claim(Q, count=len(legacy), lease_ms=LONG_LEASE_MS).jobs) == len(legacy)
    broker.client.zrem(broker.keys(Q).leases, *legacy)
    broker.client.rpush(processing_key, "j0", *legacy, "stray")

    # When the sweep runs: it moves at most 100 ids a call
    stamped = [broker.recover(Q, lease_ms=SHORT_LEASE_MS).stamped for _ in range(3)]

    # Then every id without a lease got one (j0 kept its own), and the legacy
    # list is gone
    assert stamped == [99, 51, 0]
    assert broker.client.exists(processing_key) == 0
    assert leases(broker)["j0"] == max(leases(broker)[job_id] for job_id in ids)
    # and once those leases expire the sweep requeues the jobs (never
    # started: not charged) and buries the id with no hash as garbage
    wait_past(broker, max(leases(broker)[job_id] for job_id in [*legacy, "stray"]))
    result = broker.recover(Q, lease_ms=SHORT_LEASE_MS)
    kinds = {(o.id, o.kind) for o in result.outcomes}
    assert kinds == {*((job_id, "unstarted") for job_id in legacy), ("stray", "garbage")}
    assert "stray" not in in_flight(broker) and "stray" in dead(broker)
    assert sorted(queued(broker)) == sorted(legacy)


def test_spliced_scripts_compile_on_a_real_server() -> None:
    # Given a real server, when each spliced script is loaded, then it compiles
    # (SCRIPT LOAD parses the Lua without running it).
    client = redis.Redis.from_url(REDIS_URL)
    try:
        for name in scripts.SCRIPT_NAMES:
            sha = client.script_load(scripts.source(name))
            assert re.fullmatch(r"[0-9a-f]{40}", sha), name
    finally:
        client.close()

