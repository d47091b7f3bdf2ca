"""Fair shares across tenants on a real Redis (and PostgreSQL for the rows and rebuilds).

Jobs carry a fair group; within a queue and a priority the claim takes the
groups in turn (weighted round robin, scripts/claim.lua). Each broker test
uses a key prefix of its own. Jobs are enqueued in order, so within a group
the first id is the oldest.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from reliable_jobs import conf, fairness
from reliable_jobs.backend import ReliableJobsBackend
from reliable_jobs.backendchecks import with_ids
from reliable_jobs.broker import Applied, Broker, NewJob
from reliable_jobs.compat import InvalidTask, task, task_backends
from reliable_jobs.models import Job
from reliable_jobs.sweep import Sweep

from .helpers import REDIS_URL, backdate

Q = "work"
LONG_LEASE_MS = 60_000


@pytest.fixture
def broker() -> Iterator[Broker]:
    b = Broker(REDIS_URL, f"f{uuid.uuid4().hex[:12]}", fair_weights={"heavy": 3})
    yield b
    for key in b.client.scan_iter(match=f"{b.prefix}:*", count=1_000):
        b.client.delete(key)
    b.close()


def job(job_id: str, group: str = "", priority: int = 0, **options: Any) -> NewJob:
    return NewJob(job_id, '{"task": "tests.noop", "args": [], "kwargs": {}}', 3,
                  priority=priority, group=group, **options)


def enqueue(broker: Broker, group: str, *ids: str, priority: int = 0, **options: Any) -> None:
    assert broker.enqueue(Q, [job(i, group, priority, **options) for i in ids]) == len(ids)


def claim_ids(broker: Broker, count: int = 1) -> list[str]:
    return [j.id for j in broker.claim(Q, count=count, lease_ms=LONG_LEASE_MS).jobs]


def drain(broker: Broker, count: int = 1) -> list[str]:
    """Claim ``count`` at a time until nothing is left (a dropped id may make a claim empty)."""
    order: list[str] = []
    for _ in range(2_000):  # bounded: no test enqueues that many
        result = broker.claim(Q, count=count, lease_ms=LONG_LEASE_MS)
        order += [j.id for j in result.jobs]
        if not result.jobs and not result.remaining:
            return order
    raise AssertionError("the queue never emptied")


def fair_keys(broker: Broker) -> set[str]:
    """The fair structures left in Redis (rotations, group lists, turns, fair bands)."""
    return {key for key in broker.client.scan_iter(match=f"{broker.prefix}:*", count=1_000)
            if any(part in key for part in (":rota:", ":group:", ":turn", ":fairbands"))}


# -- the turn order ---------------------------------------------------------------------


def test_a_small_tenant_is_not_stuck_behind_a_big_ones_backlog(broker: Broker) -> None:
    # Given tenant A's 100 jobs queued first, then tenant B's 3
    enqueue(broker, "A", *(f"a{i}" for i in range(100)))
    enqueue(broker, "B", "b0", "b1", "b2")

    # When a worker claims one job at a time
    order = drain(broker)

    # Then A and B take turns until B has none, each group in its own order
    assert order[:6] == ["a0", "b0", "a1", "b1", "a2", "b2"]
    assert order[6:] == [f"a{i}" for i in range(3, 100)]


@pytest.mark.parametrize("count", [1, 4, 7, 50])
def test_a_batch_claim_takes_the_same_turns_as_single_claims(broker: Broker, count: int) -> None:
    # Given three tenants with jobs waiting
    for group in ("A", "B", "C"):
        enqueue(broker, group, *(f"{group}{i}" for i in range(20)))

    # When claims of `count` jobs drain the queue
    order = drain(broker, count)

    # Then the order is the round robin, whatever the batch size
    assert order == [f"{g}{i}" for i in range(20) for g in ("A", "B", "C")]
    assert fair_keys(broker) == set()


@pytest.mark.parametrize("count", [1, 2, 5])
def test_a_weighted_group_takes_its_weight_per_turn(broker: Broker, count: int) -> None:
    # Given a group of weight 3 ("heavy", see the fixture) and one of weight 1
    enqueue(broker, "heavy", *(f"h{i}" for i in range(30)))
    enqueue(broker, "light", *(f"l{i}" for i in range(30)))

    # When 40 jobs are claimed, `count` at a time
    order: list[str] = []
    while len(order) < 40:
        order += claim_ids(broker, min(count, 40 - len(order)))

    # Then the starts are exactly 3 to 1, in turns of 3 and 1
    assert Counter(i[0] for i in order) == {"h": 30, "l": 10}
    assert order[:8] == ["h0", "h1", "h2", "l0", "h3", "h4", "h5", "l1"]


def test_jobs_without_a_group_take_one_turn_together(broker: Broker) -> None:
    # Given plain jobs waiting, then two tenants' jobs, then more plain jobs
    enqueue(broker, "", "p0", "p1")
    enqueue(broker, "A", "a0", "a1")
    enqueue(broker, "B", "b0")
    enqueue(broker, "", "p2")

    # When drained one by one
    order = drain(broker)

    # Then the plain list is one member of the turn (it came first), FIFO inside
    assert order == ["p0", "a0", "b0", "p1", "a1", "p2"]
    assert fair_keys(broker) == set()


def test_a_queue_without_groups_keeps_the_plain_path(broker: Broker) -> None:
    # Given a queue whose jobs have no group
    enqueue(broker, "", "p0", "p1")

    # When claimed
    result = broker.claim(Q, count=5, lease_ms=LONG_LEASE_MS)

    # Then it is the plain claim: no band, no fair key ever written
    assert [j.id for j in result.jobs] == ["p0", "p1"] and result.banded == 0
    assert fair_keys(broker) == set()


def test_a_group_that_comes_back_joins_the_end_of_the_turn(broker: Broker) -> None:
    # Given A and B waiting, and B drained
    enqueue(broker, "A", *(f"a{i}" for i in range(6)))
    enqueue(broker, "B", "b0")
    assert claim_ids(broker, 3) == ["a0", "b0", "a1"]

    # When B and C enqueue again
    enqueue(broker, "C", "c0")
    enqueue(broker, "B", "b1")

    # Then they queue behind A's turn, in the order they came
    assert drain(broker) == ["a2", "c0", "b1", "a3", "a4", "a5"]


# -- priorities and FAIR_SHARE --------------------------------------------------------


def test_priorities_come_first_and_groups_take_turns_within_each(broker: Broker) -> None:
    # Given tenants at priority 0 and at priority 5, and plain jobs at 5
    enqueue(broker, "A", "a0", "a1")
    enqueue(broker, "B", "b0")
    enqueue(broker, "A", "A0", "A1", priority=5)
    enqueue(broker, "B", "B0", priority=5)
    enqueue(broker, "", "P0", priority=5)

    # When drained one by one
    order = drain(broker)

    # Then priority 5 is emptied first (its groups in turn), then priority 0
    assert order == ["A0", "B0", "P0", "A1", "a0", "b0", "a1"]
    assert fair_keys(broker) == set()
    assert broker.client.exists(broker.keys(Q).bands) == 0


def test_the_fair_share_across_priorities_reaches_a_low_priority_group(broker: Broker) -> None:
    # Given a backlog at priority 10 and one old grouped job at priority -5
    share = Broker(REDIS_URL, broker.prefix, fair_share=4)
    try:
        enqueue(share, "low", "old", priority=-5)
        enqueue(share, "A", *(f"a{i}" for i in range(20)), priority=10)

        # When 4 jobs are claimed
        order = [j.id for j in share.claim(Q, count=4, lease_ms=LONG_LEASE_MS).jobs]
    finally:
        share.close()

    # Then one of every 4 went to the job that waited longest, in its group
    assert "old" in order and len(order) == 4


# -- every way back onto a list keeps the group ---------------------------------------


def test_a_retry_goes_back_to_its_group(broker: Broker) -> None:
    # Given A's job claimed and failed without delay, while A and B wait
    enqueue(broker, "A", "a0", "a1")
    enqueue(broker, "B", "b0", "b1")
    [claimed] = broker.claim(Q, count=1, lease_ms=LONG_LEASE_MS).jobs
    assert claimed.id == "a0"
    assert broker.nack(Q, [(claimed.id, claimed.attempt, claimed.gen, 0, "boom")]) == [
        Applied.DONE]

    # Then it waits behind a1 on A's list, and the turns go on
    assert drain(broker) == ["b0", "a1", "b1", "a0"]
    assert broker.client.hget(broker.keys(Q).job("a0"), "fair") == "A"


def test_a_group_whose_only_job_is_retried_gets_its_turn_back(broker: Broker) -> None:
    # Given A's only job claimed (A leaves the turn) while B's jobs wait
    enqueue(broker, "A", "a0")
    enqueue(broker, "B", "b0", "b1")
    [claimed] = broker.claim(Q, count=1, lease_ms=LONG_LEASE_MS).jobs

    # When it fails and is retried at once
    broker.nack(Q, [(claimed.id, claimed.attempt, claimed.gen, 0, "boom")])

    # Then A is back in the turn, behind B
    assert drain(broker) == ["b0", "a0", "b1"]


def test_a_plain_job_that_comes_after_the_plain_list_emptied_gets_a_turn(
        broker: Broker) -> None:
    # Given A's backlog and one plain job, which is claimed (the plain list empties)
    enqueue(broker, "A", *(f"a{i}" for i in range(5)))
    enqueue(broker, "", "p0")
    assert claim_ids(broker, 2) == ["a0", "p0"]

    # When another plain job comes
    enqueue(broker, "", "p1")

    # Then it takes the next turn after A's, not the end of A's backlog
    assert drain(broker) == ["a1", "p1", "a2", "a3", "a4"]


def test_a_released_job_runs_next_in_its_group(broker: Broker) -> None:
    # Given A's first job claimed and handed back (graceful stop)
    enqueue(broker, "A", "a0", "a1")
    enqueue(broker, "B", "b0")
    [claimed] = broker.claim(Q, count=1, lease_ms=LONG_LEASE_MS).jobs
    assert broker.release(Q, [(claimed.id, claimed.attempt, claimed.gen, False)]) == [
        Applied.DONE]

    # Then it is A's next job again
    assert drain(broker) == ["b0", "a0", "a1"]


def test_an_expired_lease_is_recovered_into_its_group(broker: Broker) -> None:
    # Given A's job claimed with a lease that has run out
    enqueue(broker, "A", "a0", "a1")
    enqueue(broker, "B", "b0")
    [claimed] = broker.claim(Q, count=1, lease_ms=1).jobs
    broker.client.zadd(broker.keys(Q).leases, {claimed.id: 0})

    # When the sweep recovers it
    outcome = broker.recover(Q, lease_ms=LONG_LEASE_MS)
    assert [o.kind for o in outcome.outcomes] == ["unstarted"]

    # Then it runs next within A, and A and B still take turns
    assert drain(broker) == ["b0", "a0", "a1"]


def test_a_scheduled_job_is_promoted_into_its_group(broker: Broker) -> None:
    # Given B's job due in the past (scheduled), and A's backlog
    enqueue(broker, "A", *(f"a{i}" for i in range(5)))
    enqueue(broker, "B", "b0", due_ms=2**41)
    broker.client.zadd(broker.keys(Q).scheduled, {"b0": 1})  # due now

    # When promoted
    assert broker.promote(Q) == 1

    # Then B takes its turn right after A's current one
    assert drain(broker)[:3] == ["a0", "b0", "a1"]


def test_requeue_revive_and_reprioritize_keep_the_group(broker: Broker) -> None:
    # Given: a scheduled job of B's, a dead one of C's, and A's backlog
    enqueue(broker, "A", *(f"a{i}" for i in range(6)))
    enqueue(broker, "B", "b0", due_ms=2**41)
    enqueue(broker, "C", "c0")
    k = broker.keys(Q)
    dead = drain_until(broker, "c0")
    broker.nack(Q, [(dead.id, dead.attempt, dead.gen, -1, "gave up")])

    # When staff requeue B's, revive C's and raise one of A's to priority 9
    assert broker.requeue(Q, "b0") == (True, "scheduled")
    assert broker.revive(Q, "c0", extra_attempts=1)
    assert broker.reprioritize(Q, "a5", 9)[0]

    # Then a5 runs first (its group at priority 9), its stray copy is dropped,
    # and every job runs once
    order = drain(broker)
    assert order[0] == "a5"
    assert sorted(order) == sorted(["a1", "a2", "a3", "a4", "a5", "b0", "c0"])
    assert broker.client.hget(k.job("a5"), "fair") == "A"
    assert fair_keys(broker) == set()


def drain_until(broker: Broker, wanted: str) -> Any:
    """Claim one at a time until ``wanted`` is claimed; return it (the others stay claimed)."""
    for _ in range(100):
        [claimed] = broker.claim(Q, count=1, lease_ms=LONG_LEASE_MS).jobs
        if claimed.id == wanted:
            return claimed
    raise AssertionError(f"{wanted} was never claimed")


def test_a_cancelled_job_is_dropped_from_its_group(broker: Broker) -> None:
    # Given B's only job cancelled while it waits
    enqueue(broker, "A", "a0", "a1")
    enqueue(broker, "B", "b0")
    assert broker.cancel(Q, "b0") == (True, "queued")

    # When drained
    # Then it never runs, and the turns end clean
    assert drain(broker) == ["a0", "a1"]
    assert fair_keys(broker) == set()


def test_a_blmove_that_empties_the_plain_list_leaves_no_dead_turn(broker: Broker) -> None:
    # Given a plain job in a turn with A's jobs, taken off the plain list by
    # a worker's BLMOVE (a worker that has not seen groups yet waits that way)
    enqueue(broker, "", "p0")
    enqueue(broker, "A", "a0", "a1")
    assert broker.wait([Q], 0.1) == (Q, "p0")

    # When the worker stamps it and claims one more
    claimed = broker.claim(Q, count=2, lease_ms=LONG_LEASE_MS, moved_id="p0")

    # Then the plain list's empty turn is skipped, and the claim says groups wait
    assert [j.id for j in claimed.jobs] == ["p0", "a0"] and claimed.banded == 1
    assert drain(broker) == ["a1"]
    assert fair_keys(broker) == set()


def test_grouped_jobs_count_as_queued(broker: Broker) -> None:
    # Given plain, grouped and prioritized grouped jobs waiting
    enqueue(broker, "", "p0")
    enqueue(broker, "A", "a0", "a1")
    enqueue(broker, "B", "b0", priority=3)

    # Then the queue's counts see every one of them
    assert broker.counts(Q).queued == 4


# -- the task option and the rows --------------------------------------------------------


@task(fair_key="tenant")
def per_tenant(tenant: str, n: int) -> int:
    return n


@task(fair_key=lambda account_id, **_: account_id // 100)
def per_account_block(account_id: int) -> int:
    return account_id


def test_fair_key_names_an_argument_or_is_a_function() -> None:
    # Given the two forms
    # Then each call's group is found from its arguments (None: no group)
    assert fairness.group_for(per_tenant, ("acme", 1), {}) == "acme"
    assert fairness.group_for(per_tenant, (), {"tenant": None, "n": 1}) == ""
    assert fairness.group_for(per_account_block, (1234,), {}) == "12"


def test_fair_key_mistakes_are_refused() -> None:
    # When a task names an argument it does not take
    with pytest.raises(InvalidTask, match="not an argument"):
        dataclasses.replace(per_tenant, fair_key="account")
    # Or gives something that is neither a name nor a function
    with pytest.raises(InvalidTask, match="fair_key must be"):
        dataclasses.replace(per_tenant, fair_key=3)
    # Or a call's group is not a group name
    with pytest.raises(InvalidTask, match="fair group must be"):
        fairness.group_for(per_tenant, ("a,b", 1), {})


@pytest.mark.django_db(transaction=True)
def test_the_row_holds_the_group_and_a_rebuild_puts_the_job_back_in_it(
        rj_settings: Any, redis_client: redis.Redis) -> None:
    # Given tenant jobs enqueued (one, then many), and Redis flushed
    rj_settings()
    backend = task_backends["default"]
    assert isinstance(backend, ReliableJobsBackend)
    first = per_tenant.enqueue("acme", 1)
    many = backend.enqueue_many(per_tenant, [(("zeta", i), {}) for i in range(3)])
    assert Job.objects.get(pk=first.id).fair_key == "acme"
    assert {Job.objects.get(pk=r.id).fair_key for r in many} == {"zeta"}
    redis_client.flushdb()
    backdate(first.id, *(r.id for r in many))

    # When reconcile rebuilds them from the mirror
    assert Sweep(backend.parts).reconcile().pushed == 4

    # Then each is back in its group, and the groups take turns
    k = backend.broker.keys("default")
    assert redis_client.hget(k.job(first.id), "fair") == "acme"
    claimed = backend.broker.claim("default", count=2, lease_ms=LONG_LEASE_MS).jobs
    assert {redis_client.hget(k.job(j.id), "fair") for j in claimed} == {"acme", "zeta"}


@pytest.mark.django_db(transaction=True)
def test_the_admin_shows_a_jobs_fair_group(rj_settings: Any, admin_client: Any) -> None:
    # Given a job of tenant "acme"
    rj_settings()
    result = per_tenant.enqueue("acme", 1)

    # When staff open it in the admin
    page = admin_client.get(f"/admin/reliable_jobs/job/{result.id}/change/")

    # Then its fair group is shown
    assert page.status_code == 200
    assert b"fair group" in page.content.lower() and b"acme" in page.content


def test_bad_fair_weights_are_e027() -> None:
    # When FAIR_WEIGHTS holds a bad group or weight
    for bad in ({"a,b": 2}, {"a": 0}, {"a": 1001}, {"a": True}, ["a"]):
        options = conf.parse({"FAIR_WEIGHTS": bad})
        # Then the check says so, and the default (no weights) is used
        assert [i for i, _ in with_ids(options.problems)] == ["reliable_jobs.E027"]
        assert options.FAIR_WEIGHTS == {}
    assert conf.parse({"FAIR_WEIGHTS": {"acme": 3, "t-1": 1000}}).problems == ()


def test_claim_refuses_a_bad_weight_before_writing(broker: Broker) -> None:
    # Given a weight the options would never pass
    enqueue(broker, "A", "a0")
    bad = Broker(REDIS_URL, broker.prefix, fair_weights={"A": 0})
    try:
        # Then the claim refuses, and the job still waits
        with pytest.raises(redis.ResponseError, match="fair weight"):
            bad.claim(Q, count=1, lease_ms=LONG_LEASE_MS)
    finally:
        bad.close()
    assert claim_ids(broker) == ["a0"]

