"""Fuzz every Lua script, and the job hashes they read, on a real Redis and Valkey.

Someone who can write to Redis can hand the scripts anything: garbage ids,
huge strings, numbers that are not numbers, job hashes with fields missing
or rewritten, a hash deleted under a running job or replaced by a key of
another type. Whatever they do, a script
either works or refuses with an error reply *before writing anything*, the
worker's calls never raise, and every real job still ends: acked (it ran)
or dead (with its reason) once a simulated worker and sweep have drained
the queue. That drain forces time forward by rewriting lease and due-time
scores, and plays reconcile as the database mirror would: a job whose hash
Redis lost is pushed again; a job whose hash is still there must not be
stranded off every list.

Out of scope, on purpose: rewriting a job's ``state`` to another *valid*
state (``scheduled`` while it sits on queued, say). The scripts trust the
state they wrote, so such a job can be stranded until staff act; docs/howto/security.md
says that Redis write access must be protected for this reason.

Hypothesis runs derandomized (the same examples on every run) without its
example database, with modest example counts and no deadline, so each test
takes a few seconds on a loaded 2-core machine.
"""

from __future__ import annotations

import contextlib
import re
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reliable_jobs import payload, scripts
from reliable_jobs.broker import Broker, ClaimedJob, NewJob
from reliable_jobs.exceptions import MalformedPayload

pytestmark = pytest.mark.slow

Q = "fz"
#: The mirror's integer columns (PostgreSQL ``integer``).
MAX_COUNT = 2**31 - 1
#: A lease nobody outlives during a test; the drain expires leases by hand.
LONG_LEASE_MS = 600_000
#: Drain rounds before a job that has not ended counts as stuck.
MAX_ROUNDS = 15
#: Rounds in which the simulated worker follows the drawn decisions; after
#: them it acks everything it can, so the drain must end.
HOSTILE_ROUNDS = 3
VALID_STATES = ("queued", "running", "scheduled", "dead", "finished", "cancelled")
KNOWN_FIELDS = ("state", "attempts", "max_attempts", "payload", "started", "last_error",
                "enqueued_ms", "started_ms", "finished_ms", "gen")

FUZZ = settings(
    max_examples=300, deadline=None, derandomize=True, database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                           HealthCheck.data_too_large],
)


# -- strategies ---------------------------------------------------------------

#: Text that looks like something: numbers that are not quite numbers, key
#: syntax, a huge string. (No lone surrogates: redis-py cannot send those.)
tricky_text = st.sampled_from([
    "", " ", "0", "-1", "1.5", "2.5", "nan", "-nan", "inf", "-inf", "1e400", "1e15", "0x10",
    " 3 ", "2147483647", "2147483648", "9007199254740993", "-9223372036854775809", "{", "}",
    ":", "rj:{fz}:queued", "job:", "\x00", "é", "☃" * 10, "x" * 100_000,
])
garbage_text = st.one_of(tricky_text, st.text(max_size=40))
numbers = st.one_of(st.integers(min_value=-(10**20), max_value=10**20),
                    st.floats(allow_nan=True, allow_infinity=True))
argv_value = st.one_of(garbage_text, numbers)
decisions = st.lists(
    st.sampled_from(["ack", "retry", "dead", "release_started", "release_unstarted", "crash"]),
    min_size=1, max_size=8)


def job_ids(ids: list[str]) -> st.SearchStrategy[str]:
    return st.one_of(st.sampled_from(ids), garbage_text)


# -- the world: one queue under a prefix of its own -------------------------------


def new_job(job_id: str, *, due_ms: int = 0, attempts: int = 0, gen: int = 0) -> NewJob:
    text = payload.encode("tests.tasks.noop_task", (job_id,), {}, max_bytes=10_000)
    return NewJob(job_id, text, 3, due_ms=due_ms, attempts=attempts, gen=gen)


@pytest.fixture
def broker(server_url: str) -> Iterator[Broker]:
    b = Broker(server_url, f"fz{uuid.uuid4().hex[:12]}")
    yield b
    for key in b.client.scan_iter(match=f"{b.prefix}:*", count=1_000):
        b.client.delete(key)
    b.close()


def fresh(broker: Broker) -> None:
    """Forget the previous example's keys (each example starts empty)."""
    for key in broker.client.scan_iter(match=f"{broker.prefix}:*", count=1_000):
        broker.client.delete(key)


def populate(broker: Broker, states: list[str]) -> list[str]:
    """One real job per entry of ``states`` (queued, running, started, scheduled, dead)."""
    ids = [f"job-{i}-{state}" for i, state in enumerate(states)]
    by_state = {s: [i for i, state in zip(ids, states, strict=True) if state == s]
                for s in ("queued", "running", "started", "scheduled", "dead")}
    held = by_state["running"] + by_state["started"]
    if held:
        broker.enqueue(Q, [new_job(i) for i in held])
        claimed = broker.claim(Q, count=len(held), lease_ms=LONG_LEASE_MS).jobs
        assert sorted(j.id for j in claimed) == sorted(held)
        broker.start(Q, [j.fence for j in claimed if j.id in by_state["started"]])
    if by_state["dead"]:
        broker.enqueue(Q, [new_job(i) for i in by_state["dead"]])
        claimed = broker.claim(Q, count=len(by_state["dead"]), lease_ms=LONG_LEASE_MS).jobs
        broker.nack(Q, [(*j.fence, -1, "doomed") for j in claimed])
    far = broker.server_time_ms() + 3_600_000
    broker.enqueue(Q, [new_job(i) for i in by_state["queued"]]
                   + [new_job(i, due_ms=far) for i in by_state["scheduled"]])
    return ids


def snapshot(broker: Broker) -> dict[str, Any]:
    """Every key under the broker's prefix with its value (the wake marker aside)."""
    client = broker.client
    state: dict[str, Any] = {}
    for key in client.scan_iter(match=f"{broker.prefix}:*", count=1_000):
        kind = client.type(key)
        if kind == "list":
            state[key] = client.lrange(key, 0, -1)
        elif kind == "zset":
            state[key] = client.zrange(key, 0, -1, withscores=True)
        elif kind == "hash":
            state[key] = client.hgetall(key)
        elif kind == "string":
            state[key] = client.get(key)
    return state


def script_keys(broker: Broker, name: str) -> list[str]:
    """The KEYS a script's header declares, as the broker would pass them for queue Q."""
    header = re.match(r"--\[\[(.*?)\]\]", scripts.source(name), flags=re.DOTALL)
    assert header
    prefixes = "job prefix|band prefix|flow prefix|rota prefix|group prefix"
    names = re.findall(rf"^\s*KEYS\[\d+\]\s+({prefixes}|\w+)", header.group(1),
                       flags=re.MULTILINE)
    keys = broker.keys(Q)
    return [getattr(keys, n.replace(" ", "_")) for n in names]


def call_raw(broker: Broker, name: str, argv: list[Any]) -> None:
    """Call a script with fuzzed ARGV: it works, or refuses having written nothing."""
    before = snapshot(broker)
    try:
        broker._scripts[name](keys=script_keys(broker, name), args=argv)
    except redis.ResponseError:
        assert snapshot(broker) == before, f"{name} failed half-way with ARGV {argv!r}"


# -- the drain: a worker and a sweep that must bring every job to an end ---------


@dataclass
class Drain:
    broker: Broker
    decisions: list[str]
    #: Jobs whose end the worker or the sweep saw (acked, or dead): the mirror
    #: has them finished, so reconcile leaves them alone from then on.
    ended: set[str] = field(default_factory=set)
    turn: int = 0

    def expire_everything(self) -> None:
        """Time passes: every lease and every due time is in the past."""
        k = self.broker.keys(Q)
        for key in (k.leases, k.scheduled):
            members = self.broker.client.zrange(key, 0, -1)
            if members:
                self.broker.client.zadd(key, dict.fromkeys(members, 0), xx=True)

    def busy(self) -> bool:
        c = self.broker.counts(Q)
        return bool(c.queued or c.running or c.scheduled
                    or self.broker.client.zcard(self.broker.keys(Q).leases))

    def run(self) -> None:
        for round_number in range(MAX_ROUNDS):
            self.expire_everything()
            recovered = self.broker.recover(Q, lease_ms=LONG_LEASE_MS)
            for job in recovered.outcomes:
                assert 0 <= job.attempts <= MAX_COUNT and 1 <= job.max_attempts <= MAX_COUNT
                if job.kind == "dead":
                    self.ended.add(job.id)
            self.broker.promote(Q)
            claimed = self.broker.claim(Q, count=100, lease_ms=LONG_LEASE_MS)
            self.ended.update(job_id for job_id, _, _ in claimed.dead)
            for job in claimed.jobs:
                self.handle(job, hostile=round_number < HOSTILE_ROUNDS)
            if not self.busy():
                return
        raise AssertionError(f"jobs still in flight after {MAX_ROUNDS} rounds: "
                             f"{snapshot(self.broker)!r}"[:3000])

    def handle(self, job: ClaimedJob, *, hostile: bool) -> None:
        # The fencing token and budget must fit the mirror's integer columns.
        assert 1 <= job.attempt <= MAX_COUNT and 1 <= job.max_attempts <= MAX_COUNT, job
        decision = self.decisions[self.turn % len(self.decisions)] if hostile else "ack"
        self.turn += 1
        if decision == "release_unstarted":
            self.broker.release(Q, [(*job.fence, False)])
            return
        if not self.broker.start(Q, [job.fence])[0]:
            return  # not ours any more: the worker drops it, recover brings it back
        try:
            payload.decode(job.payload)
        except MalformedPayload as exc:
            decision, error = "dead", f"MalformedPayload: {exc}"
        else:
            error = "no"
        if decision == "ack":
            if self.broker.ack(Q, [job.fence])[0]:
                self.ended.add(job.id)
        elif decision == "retry":
            self.broker.nack(Q, [(*job.fence, 0, "try again")])
        elif decision == "dead":
            if self.broker.nack(Q, [(*job.fence, -1, error)])[0]:
                self.ended.add(job.id)
        elif decision == "release_started":
            self.broker.release(Q, [(*job.fence, True)])
        # "crash": do nothing; the lease expires


def drain_and_reconcile(broker: Broker, ids: list[str], decisions: list[str],
                        ended: set[str] | None = None) -> None:
    """Drain, then play reconcile for each job the mirror would still call unfinished.

    Reconcile pushes a job again when Redis has no hash for it, as its next
    generation, and copies a death Redis recorded (or a cancel: staff write
    it to the mirror); any other hash left behind by an empty queue is a
    stranded job. In the end every real job has ended.
    """
    drain = Drain(broker, decisions, ended=set(ended or ()))
    generations: dict[str, int] = {}
    for _ in range(4):
        drain.run()
        lost = []
        for job_id in ids:
            if job_id in drain.ended:
                continue
            # As the sweep's reconcile reads it (a key of another type holds no job).
            state = broker.held_states(Q, [job_id]).get(job_id, {}).get("state")
            if state is None:
                generations[job_id] = generations.get(job_id, 0) + 1
                lost.append(new_job(job_id, attempts=1, gen=generations[job_id]))
            elif state in ("dead", "cancelled"):
                drain.ended.add(job_id)
            else:
                raise AssertionError(
                    f"job {job_id} is stranded: its hash says {state!r} but the queue is "
                    f"empty {snapshot(broker)!r}"[:3000])
        if not lost:
            break
        broker.enqueue(Q, lost)
    else:
        raise AssertionError("reconcile kept finding lost jobs")
    assert drain.ended >= set(ids)


# -- the tests ------------------------------------------------------------------

STATES = st.lists(st.sampled_from(["queued", "running", "started", "scheduled", "dead"]),
                  min_size=1, max_size=5)


@pytest.mark.parametrize("name", scripts.SCRIPT_NAMES)
def test_every_script_works_or_refuses_garbage_input_without_writing(
    broker: Broker, name: str
) -> None:
    @settings(FUZZ, max_examples=15)
    @given(states=STATES, data=st.data())
    def check(states: list[str], data: st.DataObject) -> None:
        # Given jobs in every state
        fresh(broker)
        ids = populate(broker, states)
        dead = {i for i in ids if i.endswith("-dead")}

        # When the script is called with garbage ARGV (ids, numbers, huge text, too few)
        argv = data.draw(st.lists(st.one_of(job_ids(ids), numbers), max_size=9), label="argv")
        call_raw(broker, name, argv)

        # Then it worked or wrote nothing (call_raw), and every job still ends
        drain_and_reconcile(broker, ids, ["ack"], ended=dead)

    check()


@FUZZ
@given(states=STATES, data=st.data(), choices=decisions)
def test_hostile_redis_contents_never_crash_lose_or_strand_a_job(
    broker: Broker, states: list[str], data: st.DataObject, choices: list[str]
) -> None:
    # Given jobs in every state
    fresh(broker)
    ids = populate(broker, states)
    k = broker.keys(Q)
    some_id = job_ids(ids)
    unknown_state = garbage_text.filter(lambda s: s not in VALID_STATES)

    # When someone with write access to Redis does up to four hostile things
    action = st.one_of(
        st.tuples(st.just("field"), some_id, st.sampled_from(KNOWN_FIELDS[1:]), argv_value),
        st.tuples(st.just("field"), some_id, st.just("state"), unknown_state),
        st.tuples(st.just("hdel"), some_id, st.sampled_from(KNOWN_FIELDS)),
        st.tuples(st.just("delete"), some_id),
        # (a key of another type under a job's name: every script reads it as
        # a damaged hash, reconcile as a lost job)
        st.tuples(st.just("retype"), some_id, st.sampled_from(["string", "list", "zset"])),
        # (an id pushed onto landing stands for a worker that died right after
        # its BLMOVE; recover leases and requeues it)
        st.tuples(st.just("push"), st.sampled_from(["queued", "landing", "leases",
                                                     "scheduled", "dead"]), some_id, numbers),
        st.tuples(st.just("script"), st.sampled_from(scripts.SCRIPT_NAMES),
                  st.lists(st.one_of(some_id, numbers), max_size=9)),
    )
    for step in data.draw(st.lists(action, max_size=4), label="actions"):
        kind = step[0]
        if kind == "field":
            with contextlib.suppress(redis.ResponseError):  # a key of another type
                broker.client.hset(k.job(step[1]), step[2], step[3])
        elif kind == "hdel":
            with contextlib.suppress(redis.ResponseError):
                broker.client.hdel(k.job(step[1]), step[2])
        elif kind == "delete":
            broker.client.delete(k.job(step[1]))
        elif kind == "retype":
            broker.client.delete(k.job(step[1]))
            if step[2] == "string":
                broker.client.set(k.job(step[1]), "not a hash")
            elif step[2] == "list":
                broker.client.rpush(k.job(step[1]), "not", "a hash")
            else:
                broker.client.zadd(k.job(step[1]), {"not a hash": 1})
        elif kind == "push":
            where, job_id, score = step[1], step[2], step[3]
            if where in ("queued", "landing"):
                broker.client.lpush(getattr(k, where), job_id)
            else:
                # NaN is not a score: Redis refuses it, and nothing changes.
                with contextlib.suppress(redis.ResponseError):
                    broker.client.zadd(getattr(k, where), {job_id: score})
        else:
            call_raw(broker, step[1], step[2])

    # Then the worker's and the sweep's calls never raise, and every job ends
    drain_and_reconcile(broker, ids, choices, ended={i for i in ids if i.endswith("-dead")})


def test_a_job_hash_deleted_under_a_running_job_is_rebuilt_and_runs(broker: Broker) -> None:
    # Given a job claimed and started by a worker
    broker.enqueue(Q, [new_job("victim")])
    job = broker.claim(Q, count=1, lease_ms=LONG_LEASE_MS).jobs[0]
    assert broker.start(Q, [job.fence]) == [True]

    # When its hash is deleted while it runs
    broker.client.delete(broker.keys(Q).job(job.id))

    # Then its worker's ack is refused (the job is not lost: it is still listed),
    assert broker.ack(Q, [job.fence]) == [False]
    assert broker.client.zrange(broker.keys(Q).leases, 0, -1) == [job.id]

    # and once its lease expires the sweep moves the id aside, reconcile pushes
    # the job again from the database, and it runs to the end
    drain_and_reconcile(broker, ["victim"], ["ack"])


@pytest.mark.parametrize(("field_name", "value"), [
    ("attempts", "1.5"), ("attempts", "nan"), ("attempts", "inf"), ("attempts", "1e400"),
    ("attempts", "-7"), ("max_attempts", "nan"), ("max_attempts", "9e99"),
    ("max_attempts", "0.5"), ("max_attempts", "many"), ("state", "QUEUED"), ("state", ""),
    ("gen", ""), ("gen", "1.5"), ("gen", "-1"), ("gen", "nan"), ("gen", "many"),
])
def test_a_damaged_counter_or_state_never_loops_a_job_forever(
    broker: Broker, field_name: str, value: str
) -> None:
    # Given a queued job whose hash field was overwritten with something odd
    broker.enqueue(Q, [new_job("odd")])
    broker.client.hset(broker.keys(Q).job("odd"), field_name, value)

    # When workers claim it, release it unstarted, crash, and the sweep recovers it
    # Then it still ends, with counters the mirror can store (checked in the drain)
    drain_and_reconcile(broker, ["odd"], ["release_unstarted", "crash", "retry"])


def test_release_of_a_job_with_a_damaged_budget_does_not_fail_half_way(broker: Broker) -> None:
    # Given a claimed job whose max_attempts field holds text (HINCRBY would refuse it)
    broker.enqueue(Q, [new_job("budget")])
    job = broker.claim(Q, count=1, lease_ms=LONG_LEASE_MS).jobs[0]
    broker.client.hset(broker.keys(Q).job("budget"), "max_attempts", "lots")

    # When its worker stops and hands it back unstarted
    assert broker.release(Q, [(*job.fence, False)]) == [True]

    # Then it is back on queued with a whole budget, one more than it had
    assert broker.client.lrange(broker.keys(Q).queued, 0, -1) == ["budget"]
    assert broker.client.hmget(broker.keys(Q).job("budget"), "state", "max_attempts") == [
        "queued", "2"]
