"""Priorities on a real Redis: order, survival through every script, the fair share.

Each test uses a Broker under a key prefix of its own (no test sees another's
keys). Jobs are enqueued one call each, so the first id is the oldest.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from reliable_jobs import conf
from reliable_jobs.backend import ReliableJobsBackend
from reliable_jobs.backendchecks import with_ids
from reliable_jobs.broker import Broker, NewJob
from tests.helpers import REDIS_URL, queued_by_priority

Q = "work"
LONG_LEASE_MS = 60_000


@pytest.fixture
def broker() -> Iterator[Broker]:
    b = Broker(REDIS_URL, f"p{uuid.uuid4().hex[:12]}")
    yield b
    for key in b.client.scan_iter(match=f"{b.prefix}:*", count=1_000):
        b.client.delete(key)
    b.close()


def job(job_id: str, priority: int = 0, **options: Any) -> NewJob:
    return NewJob(job_id, '{"task": "tests.noop", "args": [], "kwargs": {}}', 3,
                  priority=priority, **options)


def enqueue(broker: Broker, *jobs: tuple[str, int], queue: str = Q, **options: Any) -> None:
    """Enqueue (id, priority) pairs, each in its own call, oldest first."""
    for job_id, priority in jobs:
        assert broker.enqueue(queue, [job(job_id, priority, **options)]) == 1


def claim_ids(broker: Broker, count: int = 1, queue: str = Q) -> list[str]:
    return [j.id for j in broker.claim(queue, count=count, lease_ms=LONG_LEASE_MS).jobs]


def drain_one_by_one(broker: Broker, queue: str = Q) -> list[str]:
    order: list[str] = []
    for _ in range(1_000):  # bounded: no test enqueues that many
        got = claim_ids(broker, queue=queue)
        if not got:
            return order
        order += got
    raise AssertionError("the queue never emptied")


def prefixed_keys(broker: Broker) -> set[str]:
    return set(broker.client.scan_iter(match=f"{broker.prefix}:*", count=1_000))


# -- order ----------------------------------------------------------------------


def test_higher_priorities_are_claimed_first_and_equal_ones_in_fifo_order(
        broker: Broker) -> None:
    # Given jobs of mixed priorities, enqueued in this order
    enqueue(broker, ("zero-a", 0), ("five-a", 5), ("minus", -5), ("five-b", 5),
            ("top", 100), ("zero-b", 0), ("bottom", -100), ("five-c", 5))

    # When a worker claims them one at a time
    order = drain_one_by_one(broker)

    # Then the highest priority comes first, and within one priority the oldest
    assert order == ["top", "five-a", "five-b", "five-c", "zero-a", "zero-b", "minus", "bottom"]


def test_one_batch_claim_takes_the_same_order_across_bands(broker: Broker) -> None:
    # Given the same mix
    enqueue(broker, ("zero-a", 0), ("five-a", 5), ("minus", -5), ("five-b", 5), ("zero-b", 0))

    # When one claim takes four of them
    first = claim_ids(broker, count=4)

    # Then it took the four best, best first, and left the lowest
    assert first == ["five-a", "five-b", "zero-a", "zero-b"]
    assert claim_ids(broker, count=4) == ["minus"]


def test_a_priority_zero_workload_uses_only_the_plain_keys(broker: Broker) -> None:
    # Given only priority 0 jobs, claimed and acked
    enqueue(broker, ("a", 0), ("b", 0), ("c", 0))
    claimed = broker.claim(Q, count=2, lease_ms=LONG_LEASE_MS)

    # Then no band key, band list, share counter or strays set was ever written,
    # the hashes hold no priority field, and the claim reports no band in use
    k = broker.keys(Q)
    assert claimed.banded == 0
    assert not any(key.startswith(k.band_prefix) for key in prefixed_keys(broker))
    assert not broker.client.exists(k.bands, k.share, k.strays)
    assert "priority" not in broker.client.hgetall(k.job("c"))
    assert broker.client.lrange(k.queued, 0, -1) == ["c"]


def test_bands_keep_their_hash_tag_and_are_forgotten_once_empty(broker: Broker) -> None:
    # Given a job at priority 7
    enqueue(broker, ("seven", 7))
    k = broker.keys(Q)
    assert broker.client.lrange(k.band(7), 0, -1) == ["seven"]
    assert broker.client.zrange(k.bands, 0, -1, withscores=True) == [("7", 7.0)]
    assert "{work}" in k.band(7) and "{work}" in k.bands

    # When it is claimed
    assert claim_ids(broker) == ["seven"]

    # Then its band is gone from the bands set (and its empty list with it)
    assert not broker.client.exists(k.bands, k.band(7))


def test_counts_add_up_every_band(broker: Broker) -> None:
    # Given jobs on three bands
    enqueue(broker, ("a", 0), ("b", 3), ("c", 3), ("d", -1))

    # Then counts show them all as queued, and by priority
    assert broker.counts(Q).queued == 4
    assert queued_by_priority(broker, Q) == {0: 1, 3: 2, -1: 1}


@pytest.mark.parametrize("priority", ["101", "-101", "1.5", "high", ""])
def test_a_priority_out_of_range_is_refused_before_anything_is_written(
        broker: Broker, priority: str) -> None:
    # When enqueue.lua gets a bad priority next to a good job
    k = broker.keys(Q)
    good = job("good")
    args = [good.id, good.payload, 3, 0, 0, 0, 0, "", "bad", good.payload, 3, 0, 0, 0, priority,
            ""]
    with pytest.raises(redis.ResponseError, match="priority must be a whole number"):
        broker._run("enqueue", (k.queued, k.scheduled, k.wake, k.job_prefix, k.bands,
                                k.band_prefix, *k.fair), args)

    # Then neither job was written
    assert prefixed_keys(broker) == set()


# -- priorities survive every way back onto a list ------------------------------


def test_a_retry_keeps_the_priority(broker: Broker) -> None:
    # Given a priority 5 job that failed, and a priority 0 job older than its retry
    enqueue(broker, ("urgent", 5))
    held = broker.claim(Q, count=1, lease_ms=LONG_LEASE_MS).jobs[0]
    enqueue(broker, ("plain", 0))

    # When its failure is retried at once
    assert broker.nack(Q, [(*held.fence, 0, "boom")]) == [True]

    # Then it is claimed before the older priority 0 job
    assert drain_one_by_one(broker) == ["urgent", "plain"]


def test_a_delayed_retry_and_a_deferred_job_come_back_at_their_priority(
        broker: Broker) -> None:
    # Given a priority 9 job retried later, a deferred priority 4 job, and a plain job
    enqueue(broker, ("retried", 9))
    held = broker.claim(Q, count=1, lease_ms=LONG_LEASE_MS).jobs[0]
    assert broker.nack(Q, [(*held.fence, 60_000, "later")]) == [True]
    enqueue(broker, ("deferred", 4), due_ms=broker.server_time_ms() + 60_000)
    enqueue(broker, ("plain", 0))

    # When both become due and promote runs
    k = broker.keys(Q)
    broker.client.zadd(k.scheduled, {"retried": 0, "deferred": 0}, xx=True)
    assert broker.promote(Q) == 2

    # Then they run in priority order, before the plain job
    assert drain_one_by_one(broker) == ["retried", "deferred", "plain"]


def test_recover_and_release_put_jobs_back_at_the_head_of_their_band(broker: Broker) -> None:
    # Given three priority 3 jobs, two claimed (one started, one not) and one waiting
    enqueue(broker, ("started", 3), ("unstarted", 3), ("waiting", 3), ("plain", 0))
    held = broker.claim(Q, count=2, lease_ms=LONG_LEASE_MS).jobs
    assert [j.id for j in held] == ["started", "unstarted"]
    broker.start(Q, [held[0].fence])

    # When their leases expire and recover runs
    k = broker.keys(Q)
    broker.client.zadd(k.leases, {"started": 0, "unstarted": 0}, xx=True)
    kinds = {o.id: o.kind for o in broker.recover(Q, lease_ms=LONG_LEASE_MS).outcomes}

    # Then both are back on band 3, ahead of the job that kept waiting there
    assert kinds == {"started": "expired", "unstarted": "unstarted"}
    order = claim_ids(broker, count=2)
    assert set(order) == {"started", "unstarted"}

    # When a worker stopping gracefully releases them
    again = broker.claim(Q, count=0, lease_ms=LONG_LEASE_MS)  # nothing new
    assert again.jobs == []
    fences = {j: (j, int(broker.client.hget(k.job(j), "attempts")), 0) for j in order}
    assert broker.release(Q, [(*fences[j], False) for j in order]) == [True, True]

    # Then they too go back ahead of "waiting", and every job is still before "plain"
    rest = drain_one_by_one(broker)
    assert set(rest[:2]) == {"started", "unstarted"}
    assert rest[2:] == ["waiting", "plain"]


def test_revive_and_staff_requeue_keep_the_priority(broker: Broker) -> None:
    # Given a dead priority 6 job, a scheduled priority 2 job and an older plain job
    enqueue(broker, ("plain", 0))
    enqueue(broker, ("dead", 6))
    held = next(j for j in broker.claim(Q, count=2, lease_ms=LONG_LEASE_MS).jobs
                if j.id == "dead")
    assert broker.nack(Q, [(*held.fence, -1, "buried")]) == [True]
    enqueue(broker, ("plain-2", 0))
    enqueue(broker, ("waiting", 2), due_ms=broker.server_time_ms() + 60_000)

    # When staff revive the dead job and run the scheduled one now
    assert broker.revive(Q, "dead", extra_attempts=1)
    assert broker.requeue(Q, "waiting") == (True, "scheduled")

    # Then both run before the plain job, in priority order
    assert drain_one_by_one(broker) == ["dead", "waiting", "plain-2"]


def test_an_orphan_on_landing_goes_back_to_its_band(broker: Broker) -> None:
    # Given a banded queue whose only priority 0 job was moved onto landing by a
    # worker that died before its claim (BLMOVE, then nothing)
    enqueue(broker, ("plain", 0), ("high", 8))
    k = broker.keys(Q)
    assert broker.client.lmove(k.queued, k.landing, "RIGHT", "LEFT") == "plain"

    # When recover stamps it, its lease runs out, and recover runs again
    assert broker.recover(Q, lease_ms=LONG_LEASE_MS).stamped == 1
    broker.client.zadd(k.leases, {"plain": 0}, xx=True)
    kinds = [o.kind for o in broker.recover(Q, lease_ms=LONG_LEASE_MS).outcomes]

    # Then it is back on queued (its priority 0), after the higher job
    assert kinds == ["orphan"]
    assert drain_one_by_one(broker) == ["high", "plain"]


# -- the fair share (starvation guard) --------------------------------------------


def flood(broker: Broker, count: int, start: int = 0) -> None:
    enqueue(broker, *((f"high-{i}", 50) for i in range(start, start + count)))


def test_strict_priority_lets_a_flood_starve_a_low_job(broker: Broker) -> None:
    # Given fair_share 0 (strict), a low job, then a flood that keeps coming
    broker.fair_share = 0
    enqueue(broker, ("low", -10))
    flood(broker, 5)

    # When the flood grows by one job per claim for 50 claims
    claimed = []
    for i in range(50):
        claimed += claim_ids(broker)
        flood(broker, 1, start=5 + i)

    # Then the low job never ran (this is what strict means, and what the
    # fair share is for)
    assert "low" not in claimed


@pytest.mark.parametrize("share", [2, 4, 10])
def test_the_fair_share_runs_the_longest_waiting_job_within_share_claims(
        broker: Broker, share: int) -> None:
    # Given one claim in `share` for the longest waiting job, a low job, then a
    # flood of higher jobs that keeps coming
    broker.fair_share = share
    enqueue(broker, ("low", -10))
    flood(broker, 20)

    # When claims run one job at a time while the flood grows
    claimed: list[str] = []
    for i in range(share):
        claimed += claim_ids(broker)
        flood(broker, 1, start=20 + i)

    # Then the low job ran within `share` claims, and every other claim took the
    # flood in its own FIFO order
    assert "low" in claimed
    others = [c for c in claimed if c != "low"]
    assert others == [f"high-{i}" for i in range(len(others))]


def test_the_fair_share_counts_jobs_not_claim_calls(broker: Broker) -> None:
    # Given one job in 5 for the longest waiting, a low job and a flood
    broker.fair_share = 5
    enqueue(broker, ("low", -10))
    flood(broker, 20)

    # When one claim takes five jobs
    batch = claim_ids(broker, count=5)

    # Then one of the five is the low job (it comes first: it waited longest)
    assert batch[0] == "low"
    assert batch[1:] == ["high-0", "high-1", "high-2", "high-3"]


def test_the_fair_share_never_reorders_jobs_older_than_the_low_one(broker: Broker) -> None:
    # Given a backlog of high jobs enqueued BEFORE the low one
    broker.fair_share = 2
    flood(broker, 4)
    enqueue(broker, ("low", -10))
    k = broker.keys(Q)
    newest = max(int(broker.client.hget(k.job(f"high-{i}"), "enqueued_ms")) for i in range(4))
    broker.client.hset(k.job("low"), "enqueued_ms", newest + 1)  # a later ms, however fast

    # When the queue drains
    order = drain_one_by_one(broker)

    # Then the fair share picked the older high jobs first (they waited longer),
    # and the low job came no later than its age allows
    assert order == ["high-0", "high-1", "high-2", "high-3", "low"]


# -- reprioritize ---------------------------------------------------------------


def test_reprioritize_moves_a_queued_job_and_its_old_copy_is_dropped(broker: Broker) -> None:
    # Given three plain jobs
    enqueue(broker, ("a", 0), ("b", 0), ("c", 0))

    # When staff raise the newest one to 10
    assert broker.reprioritize(Q, "c", 10) == (True, "queued", 0)

    # Then it runs first, exactly once, and its old copy is dropped without a
    # trace: no garbage, no dead entry, no stray count left
    k = broker.keys(Q)
    result = broker.claim(Q, count=10, lease_ms=LONG_LEASE_MS)
    assert [j.id for j in result.jobs] == ["c", "a", "b"]
    assert result.garbage == [] and result.dead == []
    assert broker.client.zcard(k.dead) == 0
    assert not broker.client.exists(k.strays)
    assert broker.client.zcard(k.leases) == 3


def test_a_copy_left_behind_is_dropped_after_its_job_finished(broker: Broker) -> None:
    # Given a plain job raised to 5, which runs and is acked while its old copy
    # still waits on queued behind another job
    enqueue(broker, ("older", 0), ("moved", 0))
    assert broker.reprioritize(Q, "moved", 5)[0]
    held = broker.claim(Q, count=1, lease_ms=LONG_LEASE_MS).jobs[0]
    assert held.id == "moved"
    assert broker.ack(Q, [held.fence]) == [True]

    # When the old copy is reached
    result = broker.claim(Q, count=10, lease_ms=LONG_LEASE_MS)

    # Then it is dropped silently (its hash is gone, strays counted it)
    k = broker.keys(Q)
    assert [j.id for j in result.jobs] == ["older"]
    assert result.garbage == []
    assert broker.client.zcard(k.dead) == 0
    assert not broker.client.exists(k.strays)
    assert broker.client.zrange(k.leases, 0, -1) == ["older"]


def test_moving_a_job_back_to_its_first_band_still_runs_it_once(broker: Broker) -> None:
    # Given a job moved from 0 to -3 and back to 0 (two copies on queued now)
    enqueue(broker, ("x", 0), ("y", 0))
    assert broker.reprioritize(Q, "x", -3)[0]
    assert broker.reprioritize(Q, "x", 0)[0]

    # When everything is claimed
    result = broker.claim(Q, count=10, lease_ms=LONG_LEASE_MS)

    # Then x ran once, y once, and no copy is left anywhere
    k = broker.keys(Q)
    assert sorted(j.id for j in result.jobs) == ["x", "y"]
    assert sorted(broker.client.zrange(k.leases, 0, -1)) == ["x", "y"]
    assert broker.counts(Q).queued == 0
    assert not broker.client.exists(k.strays)


def test_reprioritize_changes_a_scheduled_job_for_its_promotion(broker: Broker) -> None:
    # Given a scheduled job and a plain job
    enqueue(broker, ("plain", 0))
    enqueue(broker, ("later", 0), due_ms=broker.server_time_ms() + 60_000)

    # When its priority is raised, then it becomes due
    assert broker.reprioritize(Q, "later", 20) == (True, "scheduled", 0)
    k = broker.keys(Q)
    broker.client.zadd(k.scheduled, {"later": 0}, xx=True)
    assert broker.promote(Q) == 1

    # Then it goes to its new band (no stray copy: it was on no list)
    assert drain_one_by_one(broker) == ["later", "plain"]
    assert not broker.client.exists(k.strays)


@pytest.mark.parametrize("state", ["running", "dead", "missing"])
def test_reprioritize_leaves_a_job_that_does_not_wait_alone(broker: Broker, state: str) -> None:
    # Given a job that is running, dead, or not in Redis
    if state != "missing":
        enqueue(broker, ("j", 1))
        held = broker.claim(Q, count=1, lease_ms=LONG_LEASE_MS).jobs[0]
        if state == "dead":
            broker.nack(Q, [(*held.fence, -1, "buried")])
    before = {key: broker.client.dump(key) for key in prefixed_keys(broker)}

    # When staff try to change its priority
    changed, found, _ = broker.reprioritize(Q, "j", 9)

    # Then nothing changed, and the state found is reported
    assert not changed
    assert found == ("" if state == "missing" else state)
    assert {key: broker.client.dump(key) for key in prefixed_keys(broker)} == before


def test_reprioritize_refuses_a_priority_out_of_range(broker: Broker) -> None:
    enqueue(broker, ("j", 0))
    with pytest.raises(redis.ResponseError, match="priority must be a whole number"):
        broker.reprioritize(Q, "j", 101)
    assert broker.client.hget(broker.keys(Q).job("j"), "priority") is None


# -- waiting workers ---------------------------------------------------------------


def test_an_idle_worker_wakes_for_a_job_on_another_band(broker: Broker) -> None:
    # Given a worker that has seen bands in use on its one queue, and found it empty
    enqueue(broker, ("first", 5))
    assert claim_ids(broker) == ["first"]
    assert claim_ids(broker) == []
    broker.client.delete(broker.keys(Q).wake)

    # When it waits, and a priority 5 job arrives meanwhile
    woken: list[Any] = []
    waiter = threading.Thread(target=lambda: woken.append(broker.wait([Q], 10.0)))
    waiter.start()
    other = Broker(REDIS_URL, broker.prefix)
    try:
        enqueue(other, ("second", 5))
    finally:
        other.close()
    waiter.join(15.0)

    # Then it woke for it (on the wake marker, not a BLMOVE of queued), and claims it
    assert not waiter.is_alive()
    assert woken == [(Q, None)]
    assert claim_ids(broker) == ["second"]


# -- settings -----------------------------------------------------------------------


@pytest.mark.parametrize("value", [-1, 1.5, "10", True])
def test_a_bad_fair_share_is_reported_by_the_checks(value: object) -> None:
    # When OPTIONS holds a FAIR_SHARE that is not a whole number >= 0
    options = conf.parse({"FAIR_SHARE": value})

    # Then the system check reports it, and the default (10) is used meanwhile
    assert ("reliable_jobs.E003", f"OPTIONS['FAIR_SHARE'] must be a whole number >= 0, "
            f"not {value!r}.") in with_ids(options.problems)
    assert options.FAIR_SHARE == 10


def test_the_backend_hands_its_fair_share_to_the_broker() -> None:
    # Given a backend configured for strict priority
    backend = ReliableJobsBackend("prio", {"QUEUES": ["default"], "OPTIONS": {
        "REDIS_URL": REDIS_URL, "FAIR_SHARE": 0}})
    try:
        # Then its broker claims in strict order
        assert backend.broker.fair_share == 0
    finally:
        backend.broker.close()


# -- latency ------------------------------------------------------------------------


def test_latency_sees_the_oldest_ready_job_at_any_priority(broker: Broker) -> None:
    # Given a job waiting at priority -7, then newer ones at 0 and 4
    enqueue(broker, ("old-low", -7))
    k = broker.keys(Q)
    broker.client.hset(k.job("old-low"), "enqueued_ms", broker.server_time_ms() - 60_000)
    enqueue(broker, ("plain", 0), ("high", 4))

    # When the queue's latency is read
    latency = broker.latency(Q)

    # Then the oldest ready job is the low one (a minute old), and every list counts
    assert latency.oldest_ready_id == "old-low"
    assert latency.oldest_ready_ms is not None and latency.oldest_ready_ms >= 60_000
    assert latency.queued == 3
