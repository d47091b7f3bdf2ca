"""G1-G5 in the interleavings the crash tests never tried.

Each test stages one race with real Redis and PostgreSQL (and real worker
processes where the race needs them) and checks the sentence of docs/explanation/guarantees.md
it used to break: a job that runs twice without a crash, runs concurrently
under one fencing token, ends with the wrong outcome, or runs after it was
cancelled.
"""

from __future__ import annotations

import itertools
import signal
import threading
import time
import uuid
from datetime import timedelta
from typing import Any

import pytest
import redis
from django.db import OperationalError, close_old_connections, connection, transaction
from django.utils import timezone

from reliable_jobs import mirror
from reliable_jobs.broker import Broker, ClaimedJob, NewJob
from reliable_jobs.compat import task_backends
from reliable_jobs.keys import QueueKeys
from reliable_jobs.logformat import printable
from reliable_jobs.mirror import AttemptRecord
from reliable_jobs.models import UNFINISHED_STATES, Attempt, AttemptOutcome, Job, JobState
from reliable_jobs.retention import prune
from reliable_jobs.sweep import Sweep
from reliable_jobs.worker import Worker
from reliable_jobs.worker.finisher import FinishedAttempt
from reliable_jobs.worker.leases import LeaseKeeper
from reliable_jobs.worker.registry import InHand
from reliable_jobs.worker.shared import Shared
from testproject.demo import tasks as demo

from .helpers import Processes, backdate, drain_here, wait_until, worker_in_thread

pytestmark = pytest.mark.django_db(transaction=True)
KEYS = QueueKeys("rj", "default")
CRASHED = 86  # faults.crash_point's exit code


def success(job: ClaimedJob, worker: str = "w") -> AttemptRecord:
    now = timezone.now()
    return AttemptRecord(job_id=job.id, attempt=job.attempt, gen=job.gen,
                         job_state=JobState.SUCCEEDED, worker_id=worker, started_at=now,
                         finished_at=now, outcome=AttemptOutcome.SUCCEEDED, return_value=1)


def lease_of(client: redis.Redis, job_id: str) -> float | None:
    return client.zscore(KEYS.leases, job_id)


# -- 1. an outcome in the mirror is final --------------------------------------


@pytest.mark.slow
@pytest.mark.crash
@pytest.mark.parametrize("max_attempts", [1, 3])
def test_a_success_mirrored_before_a_crash_is_settled_not_rerun_or_buried(
    max_attempts: int, rj_settings: Any, processes: Processes, redis_client: redis.Redis
) -> None:
    # Given: a worker that dies after writing its outcomes to the mirror and
    # before its ack reaches Redis, with max_attempts jobs of budget each
    # (a lease of 5 s, not the suite's 1 s: on a loaded machine a 1-s lease can lapse
    # before the victim's outcome is written, and a fenced-out outcome is refused)
    env = rj_settings(MAX_ATTEMPTS=max_attempts, LEASE_MS=5_000, RECONCILE_GRACE_MS=5_000)
    results = [demo.add.enqueue(i, 100) for i in range(5)]
    victim = processes.worker(env, extra_env={"RJ_CRASH_AT": "before_ack"})
    assert victim.wait(timeout=60) == CRASHED, processes.log(victim)

    mirrored = set(Attempt.objects.filter(outcome=AttemptOutcome.SUCCEEDED)
                   .values_list("job_id", flat=True))
    assert mirrored, "the victim mirrored at least one success before it died"

    # When: another worker's sweep finds their leases expired
    # (until the rows say so too: a sweep whose mirror write failed, as SQLite's
    # one writer makes likely, leaves a death Redis recorded for reconcile)
    survivor = processes.worker(env)
    wait_until(lambda: redis_client.zcard(KEYS.leases) == 0
               and redis_client.llen(KEYS.landing) == 0
               and redis_client.llen(KEYS.queued) == 0
               and not Job.objects.filter(pk__in=[r.id for r in results],
                                          state__in=UNFINISHED_STATES).exists(), timeout=60,
               message="the expired attempts to be settled")

    # Then: every job whose success reached the mirror succeeded exactly once,
    # as the mirror said: it was neither buried (its last attempt) nor run
    # again (an earlier one); the others ran again or were buried, as G2/G3 say
    for i, result in enumerate(results):
        job = Job.objects.get(pk=result.id)
        if job.pk in mirrored:
            assert (job.state, job.return_value, job.attempts) == (
                JobState.SUCCEEDED, i + 100, 1)
            assert list(Attempt.objects.filter(job=job).values_list("outcome", flat=True)
                        ) == [AttemptOutcome.SUCCEEDED]
            assert demo.add.get_result(result.id).status == "SUCCESSFUL"
        else:
            assert job.state in (JobState.SUCCEEDED, JobState.DEAD)
    assert not redis_client.zrange(KEYS.dead, 0, -1) or not mirrored & {
        uuid.UUID(job_id) for job_id in redis_client.zrange(KEYS.dead, 0, -1)}
    assert processes.stop(survivor) == 0


def test_a_lease_expired_record_never_overwrites_the_outcome_of_its_attempt(
    rj_settings: Any, redis_client: redis.Redis
) -> None:
    # Given: attempt 1 of a job mirrored as succeeded
    rj_settings()
    backend = task_backends["default"]
    result = demo.add.enqueue(1, 2)
    job = backend.broker.claim("default", count=1, lease_ms=60_000).jobs[0]
    mirror.record("default", [success(job)])

    # When: a sweep's record says attempt 1's lease expired (dead, or queued again)
    for dead in (True, False):
        mirror.record("default", [mirror.expired_record(job.id, 1, dead=dead, gen=0,
                                                        error="LeaseExpired: late")])

    # Then: the row and the attempt still say succeeded
    row = Job.objects.get(pk=result.id)
    assert (row.state, row.return_value) == (JobState.SUCCEEDED, 1)
    assert Attempt.objects.get(job=row, number=1).outcome == AttemptOutcome.SUCCEEDED


def test_a_late_outcome_waits_for_the_sweep_that_expired_its_attempt(
    rj_settings: Any, redis_client: redis.Redis
) -> None:
    # Given: a started attempt whose worker stalled past its lease, and a sweep
    # that has just requeued it and not yet mirrored that (it holds the row)
    rj_settings()
    backend = task_backends["default"]
    broker: Broker = backend.broker
    result = demo.add.enqueue(1, 2)
    job = broker.claim("default", count=1, lease_ms=50).jobs[0]
    assert broker.start("default", [job.fence]) == [True]
    time.sleep(0.1)
    recovered, go_on = threading.Event(), threading.Event()
    real_recover = broker.recover

    def recover(*args: Any, **kwargs: Any) -> Any:
        found = real_recover(*args, **kwargs)
        if threading.current_thread().name == "sweeper":
            recovered.set()
            go_on.wait(10)
        return found

    def sweep() -> None:
        Sweep(backend.parts).redis_pass()
        close_old_connections()

    def late_success() -> None:
        mirror.record("default", [success(job, "A")])
        close_old_connections()
        written.set()

    broker.recover = recover  # type: ignore[method-assign]
    written = threading.Event()
    sweeper = threading.Thread(target=sweep, name="sweeper")
    writer = threading.Thread(target=late_success)
    try:
        sweeper.start()
        assert recovered.wait(10)

        # When: the stalled worker wakes and mirrors its success meanwhile
        writer.start()

        # Then: its write waits for the sweep's transaction ...
        assert not written.wait(0.5)
    finally:
        go_on.set()
        sweeper.join(10)
        writer.join(10)
        broker.recover = real_recover  # type: ignore[method-assign]
    # ... and then cannot finish the job Redis gave away: it waits for its
    # next attempt, and the history keeps the late result in attempt 1's error
    assert written.is_set()
    row = Job.objects.get(pk=result.id)
    assert row.state == JobState.QUEUED
    first = Attempt.objects.get(job=row, number=1)
    assert first.outcome == AttemptOutcome.LEASE_EXPIRED
    assert "finished this attempt late" in first.error
    assert redis_client.lrange(KEYS.queued, 0, -1) == [job.id]


# -- 2. tokens survive rebuilds ------------------------------------------------


@pytest.mark.parametrize("start_mirrored", [False, True])
def test_a_holder_from_before_redis_lost_the_job_is_refused_after_the_rebuild(
    start_mirrored: bool, rj_settings: Any, redis_client: redis.Redis
) -> None:
    # Given: worker A holds a job (its start maybe mirrored, maybe not yet)
    rj_settings()
    backend = task_backends["default"]
    broker: Broker = backend.broker
    result = demo.add.enqueue(1, 2)
    stale = broker.claim("default", count=1, lease_ms=60_000).jobs[0]
    if start_mirrored:
        mirror.record("default", [AttemptRecord(job_id=stale.id, attempt=1, gen=0,
                                                job_state=JobState.RUNNING, worker_id="A",
                                                started_at=timezone.now())])

    # When: Redis loses everything, reconcile rebuilds the job from its row,
    # and worker B claims it
    redis_client.flushdb()
    backdate(result.id)
    assert Sweep(backend.parts).reconcile().pushed == 1
    fresh = broker.claim("default", count=1, lease_ms=60_000).jobs[0]

    # Then: B's token is new (the attempt number never repeats one the
    # history knows, and the generation moved on) ...
    assert fresh.gen == 1 == Job.objects.get(pk=result.id).generation
    assert fresh.fence != stale.fence
    assert fresh.attempt == (2 if start_mirrored else 1)
    # ... and A's is refused everywhere, while B's is accepted
    assert broker.start("default", [stale.fence]) == [False]
    assert broker.extend("default", [stale.fence], lease_ms=60_000) == [False]
    assert broker.ack("default", [stale.fence]) == [False]
    assert broker.nack("default", [(*stale.fence, 0, "late")]) == [False]
    assert broker.start("default", [fresh.fence]) == [True]
    # ... and in the mirror, A's late success does not finish B's attempt
    mirror.record("default", [success(stale, "A")])
    row = Job.objects.get(pk=result.id)
    assert row.state != JobState.SUCCEEDED
    mirror.record("default", [success(fresh, "B")])
    row.refresh_from_db()
    assert (row.state, row.attempts, row.generation) == (JobState.SUCCEEDED, fresh.attempt, 1)
    assert broker.ack("default", [fresh.fence]) == [True]


def rebuilt_after_a_loss(redis_client: redis.Redis) -> tuple[Broker, Any]:
    """Enqueue a job, lose Redis, and let reconcile rebuild it (generation 1)."""
    backend = task_backends["default"]
    result = demo.add.enqueue(1, 2)
    redis_client.flushdb()
    backdate(result.id)
    assert Sweep(backend.parts).reconcile().pushed == 1
    return backend.broker, result


def test_a_late_push_from_before_a_rebuild_does_not_run_the_job_again(
    rj_settings: Any, redis_client: redis.Redis
) -> None:
    # Given: a job reconcile rebuilt (its on-commit push had not arrived),
    # which then ran and was acked
    rj_settings()
    broker, result = rebuilt_after_a_loss(redis_client)
    job = broker.claim("default", count=1, lease_ms=60_000).jobs[0]
    mirror.record("default", [success(job)])
    assert broker.ack("default", [job.fence]) == [True]

    # When: the original push (generation 0) arrives late
    row = Job.objects.get(pk=result.id)
    written = broker.enqueue("default", [NewJob(str(row.pk), '{"task":"x"}', 3)])

    # Then: it is refused, and nothing is left to claim
    assert written == 0
    assert broker.claim("default", count=10, lease_ms=60_000).jobs == []


def test_a_death_of_a_late_push_after_two_losses_of_redis_is_mirrored(
    rj_settings: Any, redis_client: redis.Redis
) -> None:
    # Given: a job reconcile rebuilt (generation 1) after Redis lost it, and
    # Redis then lost it again
    rj_settings()
    broker, result = rebuilt_after_a_loss(redis_client)
    redis_client.flushdb()
    # and the original push (generation 0) arrives late, so that incarnation
    # runs and fails for good: the mirror refuses its record (an older
    # generation than the row's), Redis buries it
    assert broker.enqueue("default", [NewJob(result.id, '{"task":"x"}', 3)]) == 1
    job = broker.claim("default", count=1, lease_ms=60_000).jobs[0]
    assert (job.gen, broker.start("default", [job.fence])) == (0, [True])
    now = timezone.now()
    mirror.record("default", [AttemptRecord(
        job_id=job.id, attempt=job.attempt, gen=job.gen, job_state=JobState.DEAD,
        worker_id="w", started_at=now, finished_at=now, outcome=AttemptOutcome.FAILED,
        error="builtins.ValueError: for good")])
    assert Job.objects.get(pk=result.id).state == JobState.QUEUED
    assert broker.nack("default", [(*job.fence, -1, "builtins.ValueError: for good")]) == [True]

    # When: reconcile looks at the row
    backdate(result.id)
    Sweep(task_backends["default"].parts).reconcile()  # type: ignore[attr-defined]

    # Then: the death Redis recorded is the job's outcome; the row is not left
    # unfinished for ever behind a hash that reconcile would never rebuild
    row = Job.objects.get(pk=result.id)
    assert (row.state, row.last_error) == (JobState.DEAD, "builtins.ValueError: for good")


# -- 3. the jobs in hand are keyed by token ------------------------------------


def test_a_job_claimed_again_by_the_same_worker_keeps_its_new_lease_renewed(
    rj_settings: Any, redis_client: redis.Redis
) -> None:
    # Given: this worker claimed a job (attempt 1), lost it to lease expiry
    # before starting it, and claimed it again (attempt 2)
    rj_settings()
    backend = task_backends["default"]
    broker: Broker = backend.broker
    demo.add.enqueue(1, 2)
    shared = Shared()
    in_hand = shared.in_hand
    first = broker.claim("default", count=1, lease_ms=50).jobs[0]
    in_hand.add([first])
    time.sleep(0.1)
    Sweep(backend.parts).redis_pass()
    second = broker.claim("default", count=1, lease_ms=1_000).jobs[0]
    in_hand.add([second])
    assert (first.id, first.attempt, second.attempt) == (second.id, 1, 2)

    # When: the stale attempt 1 is dropped (its outcome refused, or never run)
    in_hand.drop([first])
    keeper = LeaseKeeper(broker=broker, shared=shared, lease_ms=60_000,
                         renew_interval_ms=1_000, beat_info=dict)
    before = lease_of(redis_client, second.id)
    assert keeper.renew()

    # Then: attempt 2 is still in hand, and its lease was renewed
    assert [job.attempt for jobs in in_hand.renewable().values() for job in jobs] == [2]
    after = lease_of(redis_client, second.id)
    assert before is not None and after is not None and after > before + 30_000


def test_an_executor_never_runs_a_job_whose_lease_was_lost() -> None:
    # Given: a held job whose renewal Redis refused
    in_hand = InHand()
    job = ClaimedJob("default", "a", 1, 3, "{}", 0)
    in_hand.add([job])
    in_hand.lose([job])

    # Then: it cannot be started, and leaves the hand
    assert in_hand.begin(job) is None
    assert len(in_hand) == 0


def test_an_executor_lets_go_of_a_claim_whose_lease_expired_before_it_started(
    rj_settings: Any, redis_client: redis.Redis
) -> None:
    # Given: a worker holding a claim whose lease expired before its start
    # mark (the worker stalled; no sweep has run yet)
    rj_settings()
    backend = task_backends["default"]
    broker: Broker = backend.broker
    result = demo.add.enqueue(1, 2)
    worker = Worker(backend, queues=["default"])
    [job] = broker.claim("default", count=1, lease_ms=50).jobs
    worker.in_hand.add([job])
    wait_until(lambda: (lease_of(redis_client, job.id) or 0) < broker.server_time_ms(),
               message="the claim's lease to expire")

    # When: an executor thread marks it started
    started = worker.executor._mark_started([job])

    # Then: it is not run and leaves the hand (its lease is no longer
    # renewed), nothing is recorded, and the sweep requeues it as a claim
    # that never started
    assert started == []
    assert len(worker.in_hand) == 0
    assert not Attempt.objects.filter(job_id=result.id).exists()
    assert redis_client.hget(KEYS.job(job.id), "started") is None
    assert Sweep(backend.parts).redis_pass().requeued == 1
    [again] = broker.claim("default", count=1, lease_ms=60_000).jobs
    assert (again.id, again.attempt, again.max_attempts) == (job.id, 2, job.max_attempts + 1)


# -- 4 and 5. reconcile, cancel and late pushes cannot resurrect a job ---------


def test_a_cancel_racing_reconcile_never_runs_the_job(
    rj_settings: Any, redis_client: redis.Redis
) -> None:
    # Given: an old queued job (a reconcile candidate) that staff cancel: the
    # cancel has acted in Redis and its transaction has not committed yet
    rj_settings()
    backend = task_backends["default"]
    result = demo.add.enqueue(1, 2)
    backdate(result.id)
    cancelled_in_redis = threading.Event()
    release = threading.Event()

    def staff_cancel() -> None:
        with transaction.atomic():
            assert mirror.lock_job("default", result.id) is not None
            assert backend.broker.cancel("default", result.id)[0]
            cancelled_in_redis.set()
            release.wait(10)
            mirror.mark_cancelled("default", result.id)
        close_old_connections()

    staff = threading.Thread(target=staff_cancel)
    staff.start()
    try:
        assert cancelled_in_redis.wait(10)

        # When: reconcile runs meanwhile
        report = Sweep(backend.parts).reconcile()
    finally:
        release.set()
        staff.join(10)

    # Then: it pushed nothing, and no worker can ever claim the job
    assert report.pushed == 0
    assert backend.broker.claim("default", count=10, lease_ms=60_000).jobs == []
    assert Job.objects.get(pk=result.id).state == JobState.CANCELLED
    backdate(result.id)
    assert Sweep(backend.parts).reconcile().pushed == 0


def test_two_reconcilers_on_the_same_lost_rows_push_each_once(
    rj_settings: Any, redis_client: redis.Redis
) -> None:
    # Given: 50 jobs Redis lost, and two reconcilers walking the same rows;
    # the first has seen them missing from Redis and not pushed them yet
    rj_settings()
    backend = task_backends["default"]
    broker: Broker = backend.broker
    ids = [demo.add.enqueue(i, 0).id for i in range(50)]
    redis_client.flushdb()
    backdate(*ids)
    first_has_them = threading.Event()
    second_done = threading.Event()
    real_held_states = broker.held_states

    def held_states(queue: str, job_ids: Any) -> Any:
        found = real_held_states(queue, job_ids)
        if threading.current_thread().name == "first-reconciler":
            first_has_them.set()
            second_done.wait(10)
        return found

    broker.held_states = held_states  # type: ignore[method-assign]
    reports: dict[str, Any] = {}

    def first() -> None:
        reports["first"] = Sweep(backend.parts).reconcile()
        close_old_connections()

    thread = threading.Thread(target=first, name="first-reconciler")
    thread.start()
    try:
        assert first_has_them.wait(10)

        # When: the second reconciler runs while the first holds the rows
        reports["second"] = Sweep(backend.parts).reconcile()
    finally:
        second_done.set()
        thread.join(10)
        broker.held_states = real_held_states  # type: ignore[method-assign]

    # Then: each job was pushed exactly once, by one of them
    assert reports["first"].pushed + reports["second"].pushed == 50
    assert sorted(redis_client.lrange(KEYS.queued, 0, -1)) == sorted(ids)
    assert set(Job.objects.filter(pk__in=ids).values_list("generation", flat=True)) == {1}


# -- 6 and 11. no worker waits on another worker, nor its leases on the database


def process_state(pid: int) -> str:
    """The one-letter state of a process ('T' when stopped), '' once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return ""


def longest_idle_transaction_s() -> float:
    """How long the oldest session of this database has sat idle inside a transaction."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT COALESCE(EXTRACT(EPOCH FROM max(now() - state_change)), 0) "
                       "FROM pg_stat_activity WHERE state = 'idle in transaction' "
                       "AND datname = current_database()")
        return float(cursor.fetchone()[0])


def longest_pause(starts: list[float], since: float, until: float) -> float:
    """The longest time in [since, until] during which none of ``starts`` happened."""
    moments = [since, *sorted(t for t in starts if since < t < until), until]
    return max(b - a for a, b in itertools.pairwise(moments))


@pytest.mark.slow
@pytest.mark.skipif(connection.vendor != "postgresql", reason=(
    "SQLite has one writer for the whole database: a transaction frozen open holds "
    "every other worker's writes (PostgreSQL locks rows, which this test is about)"))
def test_a_worker_frozen_inside_its_mirror_transaction_never_stalls_the_others(
    rj_settings: Any, processes: Processes, redis_client: redis.Redis
) -> None:
    # Given: three workers draining a steady flow of short jobs; worker A will
    # freeze itself (SIGSTOP) inside its 4th mirror transaction, holding row
    # locks that the others need once A's leases expire and they recover its jobs
    env = rj_settings(LEASE_MS=1_000, RENEW_INTERVAL_MS=200, SWEEP_INTERVAL_MS=200)
    backend = task_backends["default"]
    results = backend.enqueue_many(demo.sleep_for, [((0.05,), {}) for _ in range(1200)])
    frozen = processes.worker(env, "--concurrency", "4", "--worker-id", "A", extra_env={
        "RJ_STOP_AT": "in_mirror_transaction", "RJ_STOP_AFTER": "3"})
    others = [processes.worker(env, "--concurrency", "4", "--worker-id", name)
              for name in ("B", "C")]

    # When: A freezes there for 5 leases, then resumes
    wait_until(lambda: process_state(frozen.pid) == "T", timeout=60,
               message="worker A to freeze inside its mirror transaction")
    stopped_at = timezone.now()
    time.sleep(3.0)
    # (meanwhile the server ended A's session: no transaction sits idle with
    # its locks for longer than about half a lease)
    assert longest_idle_transaction_s() < 2.0
    time.sleep(2.0)
    frozen.send_signal(signal.SIGCONT)
    resumed_at = timezone.now()
    wait_until(lambda: Job.objects.filter(pk__in=[r.id for r in results],
                                          state=JobState.SUCCEEDED).count() == len(results),
               timeout=120, message="every job to succeed")

    # Then: B and C kept starting jobs while A was frozen: no pause of theirs
    # was longer than about one lease (lease, the lock timeout, a retry)
    starts = [t.timestamp() for t in Attempt.objects.filter(
        job_id__in=[r.id for r in results], worker_id__in=["B", "C"]
    ).values_list("started_at", flat=True)]
    pause = longest_pause(starts, stopped_at.timestamp(), resumed_at.timestamp())
    assert pause < 2.5, f"the other workers started nothing for {pause:.1f} s"
    # and nothing was lost or left running
    assert not Job.objects.exclude(state=JobState.SUCCEEDED).exists()
    procs = (frozen, *others)
    for proc, code in zip(procs, processes.stop_many(*procs), strict=True):
        assert code == 0, processes.log(proc)


# -- 7. a hard stop never hands back a job whose outcome is on its way ----------


def test_a_hard_stop_never_hands_back_a_job_whose_success_is_being_committed(
    rj_settings: Any, redis_client: redis.Redis
) -> None:
    # Given: a worker whose finisher is committing one job's success (the real
    # finisher; its mirror write held open until the worker has stopped), a
    # second job's success waiting behind it
    rj_settings()
    results = [demo.add.enqueue(i, 0) for i in range(2)]
    worker = Worker(task_backends["default"], queues=["default"], scheduler=False)
    write_mirror, submit = worker.finisher._write_mirror, worker.finisher.submit
    committing, commit, second = threading.Event(), threading.Event(), threading.Event()
    outcomes: list[str] = []

    def slow_commit(batch: list[FinishedAttempt]) -> bool:
        if any(outcome.job is not None for outcome in batch):
            committing.set()
            commit.wait(timeout=20)
        return write_mirror(batch)

    def submit_in_turn(outcome: FinishedAttempt) -> None:
        submit(outcome)
        if outcome.job is not None:
            outcomes.append(outcome.job.id)
            if len(outcomes) == 1:  # the next job runs once this one is being committed
                committing.wait(timeout=20)
            else:
                second.set()

    worker.finisher._write_mirror = slow_commit  # type: ignore[method-assign]
    worker.finisher.submit = submit_in_turn  # type: ignore[method-assign]
    with worker_in_thread(worker) as thread:
        try:
            assert second.wait(timeout=20), "both successes to reach the finisher"

            # When: the worker is stopped hard (a second signal) mid-commit
            worker._on_signal(signal.SIGTERM, None)
            worker._on_signal(signal.SIGTERM, None)
            thread.join(timeout=20)
            assert not thread.is_alive()

            # Then: neither job was handed back while its success was on its way
            assert redis_client.lrange(KEYS.queued, 0, -1) == []
            assert [redis_client.hget(KEYS.job(r.id), "state") for r in results] == [
                "running", "running"]
        finally:
            commit.set()

    # And: the commits land; whatever happens to the acks, each job succeeded
    # once and never runs again (the sweep settles it from the mirror)
    wait_until(lambda: Job.objects.filter(state=JobState.SUCCEEDED).count() == 2,
               message="both successes to be committed")
    drain_here()
    for r in results:
        assert list(Attempt.objects.filter(job_id=r.id).values_list("outcome", flat=True)
                    ) == [AttemptOutcome.SUCCEEDED]
        assert Job.objects.get(pk=r.id).attempts == 1
    assert redis_client.lrange(KEYS.queued, 0, -1) == []


def test_a_hard_stop_never_hands_back_a_job_whose_commit_may_have_landed(
    rj_settings: Any, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given: a worker whose finisher committed a job's success but lost the
    # commit's reply (the connection dropped), and whose retries then fail
    rj_settings()
    result = demo.add.enqueue(1, 2)
    worker = Worker(task_backends["default"], queues=["default"], scheduler=False)
    record = mirror.record
    landed = threading.Event()

    def commit_then_lose_the_reply(database: str, records: list[AttemptRecord]) -> None:
        if any(r.job_id == result.id and r.outcome == AttemptOutcome.SUCCEEDED
               for r in records):
            if not landed.is_set():
                record(database, records)
                landed.set()
            raise OperationalError("server closed the connection unexpectedly")
        record(database, records)

    monkeypatch.setattr(mirror, "record", commit_then_lose_the_reply)
    with worker_in_thread(worker) as thread:
        assert landed.wait(timeout=20), "the success to be committed"

        # When: the worker is stopped hard while its finisher retries; the
        # finisher's thread ends
        worker._on_signal(signal.SIGTERM, None)
        worker._on_signal(signal.SIGTERM, None)
        thread.join(timeout=20)
        assert not thread.is_alive()

        # Then: the job was not handed back: its success may have landed (it did)
        assert redis_client.lrange(KEYS.queued, 0, -1) == []
    monkeypatch.undo()

    # And: the sweep settles it from the mirror; it never runs again
    drain_here()
    assert list(Attempt.objects.filter(job_id=result.id).values_list("outcome", flat=True)
                ) == [AttemptOutcome.SUCCEEDED]
    assert Job.objects.get(pk=result.id).attempts == 1
    assert redis_client.lrange(KEYS.queued, 0, -1) == []


# -- 12. the smaller ones -------------------------------------------------------


def test_a_retry_due_later_is_mirrored_and_survives_a_rebuild(
    rj_settings: Any, redis_client: redis.Redis
) -> None:
    # Given: a job whose attempt failed with a retry due in a minute
    rj_settings()
    backend = task_backends["default"]
    result = demo.add.enqueue(1, 2)
    job = backend.broker.claim("default", count=1, lease_ms=60_000).jobs[0]
    due = timezone.now() + timedelta(minutes=1)
    mirror.record("default", [AttemptRecord(
        job_id=job.id, attempt=1, gen=0, job_state=JobState.SCHEDULED, worker_id="w",
        started_at=timezone.now(), finished_at=timezone.now(), outcome=AttemptOutcome.FAILED,
        error="ValueError: flaky", retry_at=due)])
    assert backend.broker.nack("default", [(*job.fence, 60_000, "ValueError: flaky")]) == [True]

    # When: Redis loses it, and reconcile rebuilds it from the row
    redis_client.flushdb()
    backdate(result.id)
    assert Sweep(backend.parts).reconcile().pushed == 1

    # Then: it waits for its retry instead of running at once
    assert Job.objects.get(pk=result.id).run_after == due
    assert backend.broker.claim("default", count=1, lease_ms=60_000).jobs == []
    assert redis_client.zscore(KEYS.scheduled, result.id) == pytest.approx(
        due.timestamp() * 1000, abs=2)


def test_bury_is_fenced_by_generation_and_attempt(rj_settings: Any) -> None:
    # Given: a job rebuilt once (generation 1) now at attempt 3
    rj_settings()
    result = demo.add.enqueue(1, 2)
    Job.objects.filter(pk=result.id).update(generation=1, attempts=3, state=JobState.RUNNING)

    # When: a death Redis recorded for an older generation or attempt is mirrored
    mirror.bury("default", result.id, attempts=5, gen=0, error="old generation")
    mirror.bury("default", result.id, attempts=2, gen=1, error="older attempt")

    # Then: neither moves the row; the current one does
    assert Job.objects.get(pk=result.id).state == JobState.RUNNING
    mirror.bury("default", result.id, attempts=3, gen=1, error="current")
    assert Job.objects.get(pk=result.id).last_error == "current"


def test_prune_forgets_a_dead_redis_entry_of_a_row_that_succeeded(
    rj_settings: Any, redis_client: redis.Redis
) -> None:
    # Given: a row that succeeded long ago while Redis still buries the job
    rj_settings()
    backend = task_backends["default"]
    result = demo.add.enqueue(1, 2)
    Job.objects.filter(pk=result.id).update(state=JobState.SUCCEEDED,
                                            updated_at=timezone.now() - timedelta(days=60))
    redis_client.delete(KEYS.queued)
    redis_client.hset(KEYS.job(result.id), mapping={"state": "dead", "attempts": 1})
    redis_client.zadd(KEYS.dead, {result.id: 1})

    # When: finished jobs older than 30 days are pruned
    report = prune(backend, older_than=timedelta(days=30))

    # Then: the row is gone, and so is everything Redis kept of it
    assert report.jobs == 1 and not Job.objects.filter(pk=result.id).exists()
    assert not redis_client.exists(KEYS.job(result.id))
    assert redis_client.zcard(KEYS.dead) == 0


def test_an_id_read_from_redis_cannot_forge_a_log_line() -> None:
    # Given ids anyone who can write to Redis may choose
    forged = "x\n2026-12-01 00:00:00 INFO reliable_jobs.worker: all good"
    # Then a log line shows them on one line, and plain ids unchanged
    assert "\n" not in printable(forged)
    assert printable("0b6c3f8e-1a2b-4c5d-8e9f-0a1b2c3d4e5f") == (
        "0b6c3f8e-1a2b-4c5d-8e9f-0a1b2c3d4e5f")
    assert len(printable("y" * 10_000)) < 120


# -- 4. a stale holder's late record never closes the current attempt ----------


@pytest.fixture(params=["native", "orm"])
def mirror_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run the mirror's writes on the database's own path, then on the ORM path.

    "native" is the SQL path on PostgreSQL (the ORM path on SQLite, as
    ever); "orm" takes the portable path whatever the database, so both
    paths of every rule run in the suite's PostgreSQL run.
    """
    if request.param == "orm":
        monkeypatch.setattr(mirror, "_on_postgresql", lambda using: False)
    return str(request.param)


def test_a_stale_holders_late_record_does_not_close_the_current_attempt(
    mirror_path: str, rj_settings: Any, redis_client: redis.Redis
) -> None:
    # Given: worker A holds attempt 2 of a job (its first claim was handed
    # back unstarted), none of it mirrored; Redis loses the job, reconcile
    # rebuilds it (generation 1) and worker B claims and starts attempt 1
    rj_settings()
    backend = task_backends["default"]
    broker: Broker = backend.broker
    result = demo.add.enqueue(1, 2)
    first = broker.claim("default", count=1, lease_ms=60_000).jobs[0]
    assert broker.release("default", [(*first.fence, False)]) == [True]
    stale = broker.claim("default", count=1, lease_ms=60_000).jobs[0]
    assert (stale.attempt, stale.gen) == (2, 0)
    redis_client.flushdb()
    backdate(result.id)
    assert Sweep(backend.parts).reconcile().pushed == 1
    fresh = broker.claim("default", count=1, lease_ms=60_000).jobs[0]
    assert (fresh.attempt, fresh.gen) == (1, 1)
    assert broker.start("default", [fresh.fence]) == [True]
    mirror.record("default", [AttemptRecord(job_id=fresh.id, attempt=1, gen=1,
                                            job_state=JobState.RUNNING, worker_id="B",
                                            started_at=timezone.now())])

    # When: A's late success (generation 0, attempt 2) reaches the mirror,
    # then B's
    mirror.record("default", [success(stale, "A")])
    mirror.record("default", [success(fresh, "B")])

    # Then: B's attempt was never closed by A's record, and its success is the job's
    attempt = Attempt.objects.get(job_id=result.id, number=1)
    assert (attempt.outcome, attempt.worker_id) == (AttemptOutcome.SUCCEEDED, "B")
    row = Job.objects.get(pk=result.id)
    assert (row.state, row.attempts, row.generation) == (JobState.SUCCEEDED, 1, 1)


def test_a_key_of_another_type_under_a_jobs_name_is_rebuilt_by_reconcile(
    rj_settings: Any, redis_client: redis.Redis
) -> None:
    # Given: a queued job whose hash someone replaced by hand with a key of
    # another type, its id gone from the list
    rj_settings()
    backend = task_backends["default"]
    result = demo.add.enqueue(1, 2)
    redis_client.delete(KEYS.job(result.id), KEYS.queued)
    redis_client.set(KEYS.job(result.id), "not a hash")
    backdate(result.id)

    # When: the sweep reconciles
    pushed = Sweep(backend.parts).reconcile().pushed

    # Then: Redis holds no job there, so the job is pushed again over the key, and runs
    assert pushed == 1
    [job] = backend.broker.claim("default", count=1, lease_ms=60_000).jobs
    assert (job.id, job.gen) == (result.id, 1)
