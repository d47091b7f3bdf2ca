"""Flow control on a real Redis and database: rate limits and concurrency caps in the claim.

Script-level tests use a Broker under a key prefix of their own; a payload
names its limits as ``flow.TaskFlow.spec`` writes them. Backend-level tests
enqueue limited tasks through Django's API. Real processes, SIGKILLs and the
figures are in tests/test_flow_processes.py and bench/flow.py.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from io import StringIO
from typing import Any

import pytest
from django.core import checks
from django.core.management import call_command

from reliable_jobs import flow, mirror
from reliable_jobs.backend import ReliableJobsBackend
from reliable_jobs.broker import Applied, Broker, NewJob
from reliable_jobs.compat import InvalidTask, task, task_backends
from reliable_jobs.models import Job
from tests.helpers import REDIS_URL

Q = "work"
LONG_LEASE_MS = 60_000
NO_FLOW = '{"task":"tests.tasks.noop_task","args":[],"kwargs":{}}'


@pytest.fixture
def broker() -> Iterator[Broker]:
    b = Broker(REDIS_URL, f"f{uuid.uuid4().hex[:12]}")
    yield b
    for key in b.client.scan_iter(match=f"{b.prefix}:*", count=1_000):
        b.client.delete(key)
    b.close()


def payload(spec: str = "") -> str:
    return '{"flow":"' + spec + '",' + NO_FLOW[1:] if spec else NO_FLOW


def enqueue(broker: Broker, ids: list[str], spec: str = "", queue: str = Q) -> None:
    for job_id in ids:  # one call each: the first id is the oldest
        assert broker.enqueue(queue, [NewJob(job_id, payload(spec), 3)]) == 1


def claim(broker: Broker, count: int = 10, *, limits: tuple[int, int, int] = (0, 0, 0),
          lease_ms: int = LONG_LEASE_MS, queue: str = Q, moved_id: str | None = None
          ) -> list[str]:
    result = broker.claim(queue, count=count, lease_ms=lease_ms, limits=limits,
                          moved_id=moved_id)
    return [j.id for j in result.jobs]


def ack(broker: Broker, *ids: str) -> None:
    assert broker.ack(Q, [(i, 1, 0) for i in ids]) == [Applied.DONE] * len(ids)


def recheck() -> None:
    """Wait until a limit held by its cap is looked at again (flow.CAP_RECHECK_MS)."""
    time.sleep(flow.CAP_RECHECK_MS / 1000 + 0.002)


def attempts(broker: Broker, job_id: str) -> int:
    return int(broker.client.hget(broker.keys(Q).job(job_id), "attempts") or 0)


# -- parsing ---------------------------------------------------------------------


@pytest.mark.parametrize(("text", "rate"), [
    ("100/s", flow.Rate(100, 1_000)), ("6000/m", flow.Rate(6_000, 60_000)),
    ("50/h", flow.Rate(50, 3_600_000)), ("10/500ms", flow.Rate(10, 500)),
    (" 2 / 3s ", flow.Rate(2, 3_000)),
])
def test_rates_are_count_per_period(text: str, rate: flow.Rate) -> None:
    assert flow.parse_rate(text) == rate


@pytest.mark.parametrize("text", ["100", "0/s", "1/0s", "x/s", "1/d", "100001/s", "1/25h", 100])
def test_a_bad_rate_is_refused_with_a_sentence(text: object) -> None:
    with pytest.raises(ValueError, match=r"\.$"):
        flow.parse_rate(text)


def test_queue_limits_report_every_problem() -> None:
    limits, problems = flow.parse_queue_limits({
        "emails": {"rate_limit": "100/s", "concurrency": 5},
        "bad": {"rate_limit": "fast", "concurrency": 0, "burst": 3},
        "{x}": {"concurrency": 1},
    })
    assert limits == {"emails": flow.Limits(flow.Rate(100, 1_000), 5)}
    assert len(problems) == 4
    assert all(p.endswith(".") for p in problems)


# -- the queue's own limits ------------------------------------------------------------


def test_a_queue_cap_counts_its_leases_and_an_ack_frees_a_slot(broker: Broker) -> None:
    # Given 5 jobs on a queue capped at 2
    enqueue(broker, [f"j{i}" for i in range(5)])

    # When workers claim, one batch after another
    first = claim(broker, limits=(0, 0, 2))
    blocked = broker.claim(Q, count=10, lease_ms=LONG_LEASE_MS, limits=(0, 0, 2))

    # Then 2 run, the next claim gets none and is told to come back soon
    assert first == ["j0", "j1"]
    assert blocked.jobs == [] and blocked.remaining == 3
    assert 0 <= blocked.hold_ms <= flow.CAP_RECHECK_MS and blocked.hold_by_cap
    assert attempts(broker, "j2") == 0  # held back without burning an attempt

    # When one of the two ends, exactly one more starts, the next in order
    ack(broker, "j0")
    assert claim(broker, limits=(0, 0, 2)) == ["j2"]


def test_a_moved_id_at_the_cap_goes_back_to_the_head_of_the_queue(broker: Broker) -> None:
    # Given a queue at its cap of 1, and an idle worker's BLMOVE that moved the next id
    enqueue(broker, ["a", "b", "c"])
    assert claim(broker, limits=(0, 0, 1)) == ["a"]
    k = broker.keys(Q)
    moved = broker.client.lmove(k.queued, k.landing, "RIGHT", "LEFT")
    assert moved == "b"

    # When its claim runs
    got = claim(broker, 1, limits=(0, 0, 1), moved_id="b")

    # Then nothing is leased, and b is next again (landing empty, order kept)
    assert got == []
    assert broker.client.llen(k.landing) == 0
    assert broker.client.lrange(k.queued, 0, -1) == ["c", "b"]


def test_a_queue_rate_spaces_its_claims_and_says_when_the_next_may_go(broker: Broker) -> None:
    # Given 10 jobs on a queue limited to 3 per second
    enqueue(broker, [f"j{i}" for i in range(10)])

    # When a worker claims twice in a row
    first = claim(broker, limits=(3, 1_000, 0))
    second = broker.claim(Q, count=10, lease_ms=LONG_LEASE_MS, limits=(3, 1_000, 0))

    # Then one starts, and the next may go a third of a second later (less
    # the pacing's tolerance), not in a burst of 3
    assert first == ["j0"]
    assert second.jobs == [] and not second.hold_by_cap
    assert 333 - 20 - 5 <= second.hold_ms <= 334 - 20


def test_a_fast_rate_admits_a_small_batch_within_its_tolerance(broker: Broker) -> None:
    # Given a queue limited to 100 per second (one per 10 ms, 20 ms of tolerance)
    enqueue(broker, [f"j{i}" for i in range(20)])

    # When a worker claims a batch
    got = claim(broker, 20, limits=(100, 1_000, 0))

    # Then the tolerance's worth starts at once: 20 / 10 + 1
    assert len(got) == 3


def test_a_sliding_window_never_holds_more_than_n_on_the_server_clock(broker: Broker) -> None:
    # Given many jobs on a queue limited to 100 per second
    enqueue_fast(broker, 200)
    k = broker.keys(Q)

    # When a worker claims as fast as it may for 1.3 s, sleeping on holds
    # (early: the pacing's tolerance alone would let 102 through in the first second)
    deadline = time.monotonic() + 1.3
    while time.monotonic() < deadline:
        result = broker.claim(Q, count=10, lease_ms=LONG_LEASE_MS, limits=(100, 1_000, 0))
        if result.hold_ms >= 0:
            time.sleep(result.hold_ms / 1000)

    # Then, on the claim's own clock (started_ms, from TIME), no 1 s window
    # holds more than 100 claims, and the limit was used
    with broker.client.pipeline(transaction=False) as pipe:
        for i in range(200):
            pipe.hget(k.job(f"j{i}"), "started_ms")
        starts = sorted(int(ms) for ms in pipe.execute() if ms)
    assert len(starts) >= 110
    assert 90 <= max(sum(1 for s in starts if t <= s < t + 1_000) for t in starts) <= 100


def test_the_log_caps_every_window_whatever_the_pacing_allows(broker: Broker) -> None:
    # Given a rate of 100 per second whose log already holds 100 claims of
    # the last half second, and whose pacing has long caught up
    enqueue(broker, ["late"])
    now = broker.server_time_ms()
    broker.client.zadd(broker.keys(Q).flow("log", "q"),
                       {f"{now - 500}:x{i}": now - 500 for i in range(100)})

    # When a worker claims
    result = broker.claim(Q, count=10, lease_ms=LONG_LEASE_MS, limits=(100, 1_000, 0))

    # Then nothing starts until those claims leave the window
    assert result.jobs == []
    assert 450 <= result.hold_ms <= 500


def enqueue_fast(broker: Broker, n: int, spec: str = "") -> None:
    broker.enqueue(Q, [NewJob(f"j{i}", payload(spec), 3) for i in range(n)])


def test_a_new_job_of_a_limit_waits_behind_the_jobs_it_holds(broker: Broker) -> None:
    # Given a cap of 1 running one job and holding the next until later
    enqueue(broker, ["c0", "c1"], "c/1/0/tests.t")
    assert claim(broker) == ["c0"]
    k = broker.keys(Q)
    broker.client.zadd(k.holds, {"c:tests.t": broker.server_time_ms() + 60_000})

    # When the running one ends and a new job of the limit arrives
    ack(broker, "c0")
    enqueue(broker, ["c2"], "c/1/0/tests.t")

    # Then the new one does not pass the held one: it queues behind it
    assert claim(broker) == []
    assert broker.client.lrange(k.flow("held", "c:tests.t"), 0, -1) == ["c2", "c1"]


# -- a task's and a key's limits -------------------------------------------------------


def test_a_task_cap_holds_its_jobs_in_order_and_lets_others_pass(broker: Broker) -> None:
    # Given capped jobs (cap 2) interleaved with unlimited ones
    for i in range(6):
        enqueue(broker, [f"c{i}"], "c/2/0/tests.capped")
        enqueue(broker, [f"u{i}"])

    # When a worker claims everything it can
    got = claim(broker, 20)

    # Then 2 capped jobs run, every unlimited one passes the held ones, and
    # the held ones wait in order on their limit's held list, no attempt spent
    assert got == ["c0", "u0", "c1", "u1", "u2", "u3", "u4", "u5"]
    k = broker.keys(Q)
    assert broker.client.lrange(k.flow("held", "c:tests.capped"), 0, -1) == [
        "c5", "c4", "c3", "c2"]
    assert all(attempts(broker, f"c{i}") == 0 for i in range(2, 6))
    assert broker.counts(Q).queued == 4 and broker.counts(Q).held == 4

    # When the capped ones end, the held ones start in order, two at a time
    ack(broker, "c0", "c1")
    recheck()
    assert claim(broker, 20) == ["c2", "c3"]
    ack(broker, "c2")
    recheck()
    assert claim(broker, 20) == ["c4"]


def test_per_key_limits_are_independent(broker: Broker) -> None:
    # Given two keys of one task, cap 1 each
    enqueue(broker, ["a1", "a2"], "c/1/0/tests.t#aaaa")
    enqueue(broker, ["b1", "b2"], "c/1/0/tests.t#bbbb")

    # When claimed
    got = claim(broker, 10)

    # Then one per key runs
    assert got == ["a1", "b1"]
    ack(broker, "b1")
    recheck()
    assert claim(broker, 10) == ["b2"]


def test_a_job_with_a_rate_and_a_cap_needs_both(broker: Broker) -> None:
    # Given jobs limited to 2 per second (one per 500 ms) and 1 at a time
    enqueue(broker, ["j0", "j1"], "c/1/0/tests.t|r/2/1000/tests.t")

    # Then the cap holds the second while the first runs
    assert claim(broker) == ["j0"]
    held = broker.keys(Q).flow("held", "c:tests.t")
    assert broker.client.lrange(held, 0, -1) == ["j1"]

    # And once it ended, the rate still holds it until 500 ms after the first
    ack(broker, "j0")
    recheck()
    moved = broker.claim(Q, count=10, lease_ms=LONG_LEASE_MS)
    assert moved.jobs == [] and moved.hold_ms == -1  # moved to the rate's held list
    assert broker.client.lrange(broker.keys(Q).flow("held", "r:tests.t"), 0, -1) == ["j1"]
    blocked = broker.claim(Q, count=10, lease_ms=LONG_LEASE_MS)
    assert blocked.jobs == [] and 430 <= blocked.hold_ms <= 480 and not blocked.hold_by_cap


def test_a_killed_workers_slot_comes_back_when_recover_takes_its_expired_lease(
        broker: Broker) -> None:
    # Given a capped job claimed with a short lease, whose worker then died
    enqueue(broker, ["dies", "next"], "c/1/0/tests.t")
    assert claim(broker, lease_ms=100) == ["dies"]
    assert claim(broker) == []

    # When the lease expires and the sweep recovers it
    time.sleep(0.15)
    assert claim(broker) == []  # expired, not yet recovered: the slot is still held
    outcome = broker.recover(Q, lease_ms=LONG_LEASE_MS)
    assert [o.id for o in outcome.outcomes] == ["dies"]

    # Then the slot is free: the next job in order (the recovered one is
    # back on the queue, behind the held one) starts
    recheck()
    assert claim(broker, 1) == ["next"]


def test_a_cancelled_job_on_a_held_list_is_dropped_when_reached(broker: Broker) -> None:
    enqueue(broker, ["run", "gone", "after"], "c/1/0/tests.t")
    assert claim(broker) == ["run"]
    assert broker.cancel(Q, "gone") == (True, "queued")
    ack(broker, "run")
    recheck()
    assert claim(broker) == ["after"]
    assert broker.client.hget(broker.keys(Q).job("gone"), "state") == "cancelled"


def test_a_claim_does_bounded_work_however_many_limited_jobs_wait_ahead(
        broker: Broker) -> None:
    # Given 5,000 capped jobs ahead of one unlimited job
    k = broker.keys(Q)
    spec = "c/1/0/tests.t"
    broker.enqueue(Q, [NewJob(f"c{i}", payload(spec), 3) for i in range(5_000)])
    broker.enqueue(Q, [NewJob("free", payload(), 3)])

    # When a worker claims batches of 100
    first = claim(broker, 100)

    # Then one call takes exactly its count off the list (one runs, 99 are
    # held), and the unlimited job starts after 5,001 / 100 calls, not later
    assert first == ["c0"]
    assert broker.client.llen(k.queued) == 5_001 - 100
    calls, found = 1, False
    while not found and calls < 60:
        calls += 1
        found = "free" in claim(broker, 100)
    assert found and calls == 51


def test_limits_no_enqueue_writes_are_ignored_not_held_for_ever(broker: Broker) -> None:
    # Given payloads someone wrote by hand: a cap of 0, a rate with no window
    enqueue(broker, ["zero"], "c/0/0/tests.t")
    enqueue(broker, ["nowindow"], "r/5/0/tests.t")

    # Then they run, as if unlimited
    assert claim(broker) == ["zero", "nowindow"]


# -- the admin's view ---------------------------------------------------------------------


def test_limit_use_reports_running_recent_and_held(broker: Broker) -> None:
    enqueue(broker, ["a", "b", "c"], "r/10/1000/tests.t|c/1/0/tests.t")
    assert claim(broker) == ["a"]
    use = broker.limit_use(Q, [("q", 1_000), ("r:tests.t", 1_000), ("c:tests.t", 0)])
    # (the rate's pacing, one per 100 ms, holds b and c before the cap is looked at)
    assert [(u.running, u.recent, u.held) for u in use] == [(1, 0, 0), (0, 1, 2), (1, 0, 0)]
    assert broker.held_back(Q) == {"r:tests.t": 2}


# -- through Django's API ------------------------------------------------------------------


def flow_target(customer: int, note: str = "") -> int:
    return customer


def capped_target(customer: int) -> int:
    return customer


def keyed_target(customer: int, note: str = "") -> int:
    return customer


capped = task(concurrency=3)(capped_target)
per_customer = task(rate_limit="10/s", rate_key=lambda customer, **_: customer)(
    keyed_target)


@pytest.mark.django_db(transaction=True)
def test_a_limited_tasks_payload_names_its_limits_and_a_rebuild_keeps_them(
        rj_settings: Any) -> None:
    # Given a capped task and a per-key rate, enqueued
    backend = task_backends["default"]
    assert isinstance(backend, ReliableJobsBackend)
    first = capped.enqueue(1)
    keyed = per_customer.enqueue(7, note="x")
    k = backend.broker.keys("default")

    # Then each payload opens with its limits
    text = backend.broker.client.hget(k.job(first.id), "payload")
    assert flow.job_spec(text) == f"c/3/0/{capped.module_path}"
    spec = flow.job_spec(backend.broker.client.hget(k.job(keyed.id), "payload"))
    assert spec.startswith(f"r/10/1000/{per_customer.module_path}#")
    assert spec != flow.job_spec(payload_of(per_customer.enqueue(8)))

    # And a rebuild from the mirror spells them again
    row = Job.objects.get(pk=keyed.id)
    rebuilt = mirror.rebuilt_job(row, max_attempts=3, flow=backend.parts.flow_of)
    assert flow.job_spec(rebuilt.payload) == spec


def payload_of(result: Any) -> str:
    backend = task_backends["default"]
    assert isinstance(backend, ReliableJobsBackend)
    return str(backend.broker.client.hget(backend.broker.keys("default").job(result.id),
                                          "payload"))


def test_bad_task_options_are_refused_when_the_task_is_made() -> None:
    with pytest.raises(InvalidTask, match="rate"):
        task(rate_limit="lots")(flow_target)
    with pytest.raises(InvalidTask, match="no effect without concurrency"):
        task(concurrency_key=lambda **_: 1)(flow_target)


@pytest.mark.django_db(transaction=True)
def test_a_key_that_is_not_json_is_an_invalid_task_at_enqueue(rj_settings: Any) -> None:
    bad = task(concurrency=1, concurrency_key=lambda customer, **_: {customer})(
        flow_target)
    with pytest.raises(InvalidTask, match="flow key"):
        bad.enqueue(1)


@pytest.mark.django_db(transaction=True)
def test_task_options_in_settings_win_over_the_tasks_own(rj_settings: Any) -> None:
    rj_settings(TASK_OPTIONS={capped.module_path: {"concurrency": 1}})
    result = capped.enqueue(1)
    assert flow.job_spec(payload_of(result)) == f"c/1/0/{capped.module_path}"


def check_ids(rj_settings: Any, **options: Any) -> list[str]:
    rj_settings(**options)
    backend = task_backends["default"]
    assert isinstance(backend, ReliableJobsBackend)
    from reliable_jobs.backendchecks import check_backend

    return sorted(m.id for m in check_backend(backend) if m.level >= checks.ERROR and m.id)


def test_e017_a_malformed_limit(rj_settings: Any) -> None:
    assert "reliable_jobs.E017" in check_ids(
        rj_settings, QUEUE_LIMITS={"default": {"rate_limit": "often"}})
    assert "reliable_jobs.E017" in check_ids(
        rj_settings, TASK_OPTIONS={"tests.tasks.noop_task": {"concurrency": -1}})


def test_e018_a_limit_naming_no_queue_or_task(rj_settings: Any) -> None:
    assert "reliable_jobs.E018" in check_ids(
        rj_settings, QUEUE_LIMITS={"other": {"concurrency": 1}})
    assert "reliable_jobs.E018" in check_ids(
        rj_settings, TASK_OPTIONS={"tests.tasks.no_such_task": {"concurrency": 1}})


def test_e019_a_limit_on_a_sharded_queue(rj_settings: Any) -> None:
    assert "reliable_jobs.E019" in check_ids(
        rj_settings, SHARDS={"default": 2}, QUEUE_LIMITS={"default": {"concurrency": 1}})


def test_good_limits_raise_no_flow_check(rj_settings: Any) -> None:
    ids = check_ids(rj_settings, QUEUE_LIMITS={"default": {"rate_limit": "5/s"}},
                    TASK_OPTIONS={"testproject.demo.tasks.noop": {"concurrency": 2}})
    assert not {"reliable_jobs.E017", "reliable_jobs.E018", "reliable_jobs.E019"} & set(ids)


# -- the dashboard and jobstats ----------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_the_dashboard_and_jobstats_show_each_limits_use(rj_settings: Any, admin_client: Any
                                                         ) -> None:
    # Given a queue with a cap of 4 and a rate, running a plain job and two
    # jobs of a task capped at 2, which holds back its third
    rj_settings(QUEUE_LIMITS={"default": {"concurrency": 4, "rate_limit": "1000/s"}})
    from testproject.demo import tasks as demo

    demo.noop.enqueue()
    demo.capped_add.enqueue(1, 2)
    demo.capped_add.enqueue(3, 4)
    demo.capped_add.enqueue(5, 6)
    backend = task_backends["default"]
    assert isinstance(backend, ReliableJobsBackend)
    claimed = backend.broker.claim("default", count=10, lease_ms=LONG_LEASE_MS,
                                   limits=(1_000, 1_000, 4))
    assert len(claimed.jobs) == 3

    # When staff look
    from reliable_jobs.dashboard import snapshot

    lines = {(line.scope, line.kind, line.name): line for line in snapshot(backend).limits}
    page = admin_client.get("/admin/reliable_jobs/job/dashboard/default/").content.decode()
    out = StringIO()
    call_command("jobstats", stdout=out)

    # Then each limit shows its running jobs or recent claims, and what it holds back
    cap = lines[("task", "concurrency", demo.capped_add.module_path)]
    assert (cap.running, cap.limit, cap.held) == (2, "2", 1)
    queue_cap = lines[("queue", "concurrency", "default")]
    assert (queue_cap.running, queue_cap.limit, queue_cap.held) == (3, "4", 0)
    assert lines[("queue", "rate", "default")].recent == 3
    assert 'id="rj-limits"' in page and demo.capped_add.module_path in page
    assert f"task {demo.capped_add.module_path}  concurrency  running 2/2  held back 1" in (
        out.getvalue())
