"""The state machine behind tests/test_model.py: simulated workers on the real queue.

Why a separate module: the machine is long, and a failure's shrunk program
(printed by Hypothesis as ``state.rule(...)`` calls) can be replayed from a
Django shell by building :class:`QueueMachine` and calling the same methods.

Every step is one thing a real process does, in the order the real code
does it (``reliable_jobs/worker``, ``sweep.py``, ``staff.py``), with nothing
running in between: the machine picks the interleaving, and the invariants
are checked after each step. Where a step is a real part's own decision (a
worker's shutdown, the finisher's Redis step) the machine runs that real
part (tests/model_faults.py), so it follows the code as it changes.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from django.db import DatabaseError, transaction
from django.utils import timezone
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from reliable_jobs import mirror, pausing, staff
from reliable_jobs.broker import Applied, Broker, ClaimedJob, Fence, NewJob
from reliable_jobs.compat import task_backends
from reliable_jobs.mirror import AttemptRecord
from reliable_jobs.mirror.records import FINISHED_STATES
from reliable_jobs.models import (
    UNFINISHED_STATES,
    Attempt,
    AttemptOutcome,
    Dependency,
    Job,
    JobState,
    QueuePause,
)
from reliable_jobs.sweep import Sweep
from reliable_jobs.worker.finisher import FinishedAttempt
from testproject.demo import tasks as demo

from .model_faults import SlowPush, failing_commit, finisher, stop_like_a_worker

#: Lease length of every claim. Long: a lease runs out only when a step
#: says time passes (:meth:`QueueMachine.jump`), never because the machine
#: was slow, so the same program does the same thing every run (Hypothesis
#: replays programs, and a lease that ran out in one run but not in its
#: replay made the test fail as "flaky" on a loaded machine).
LEASE_MS = 30_000
#: How far the clock jumps when a step lets time pass: past every lease.
JUMP_MS = LEASE_MS * 6 // 5
#: The one queue the machine uses.
QUEUE = "default"
#: Workers the machine simulates.
WORKERS = 3
#: The cap of demo.capped_add.
CAP = 2
#: How far in the future a deferred enqueue is due, and a retry delay: both
#: due after one jump.
DEFER_MS = LEASE_MS // 3
RETRY_DELAY_MS = LEASE_MS // 10
#: How far back ``backdate`` moves every row: past reconcile's grace
#: (RECONCILE_GRACE_MS = LEASE_MS), well within any window that looks for
#: recent rows (reconcile's look for recent cancels).
BACKDATE_MS = 10 * LEASE_MS


class ModelViolation(AssertionError):
    """An invariant of the queue failed (not a mistake of the test's plumbing)."""



class SweepDied(Exception):
    """The sweep's process died (raised inside the sweep's mirror transaction)."""

@dataclass
class Held:
    """A claim a simulated worker holds: its token, and whether its task started."""

    job: ClaimedJob
    started: bool = False


@dataclass
class SimWorker:
    """What one worker process has in memory; forgetting it all is a crash."""

    name: str
    held: dict[Fence, Held] = field(default_factory=dict)
    #: Ids this worker moved onto landing with BLMOVE and has not claimed.
    landed: list[str] = field(default_factory=list)
    #: Outcomes handed to the finisher whose batch is not committed yet.
    committing: list[FinishedAttempt] = field(default_factory=list)
    #: Outcomes already in the mirror, waiting for their ack or nack.
    pending: list[FinishedAttempt] = field(default_factory=list)

    def forget(self) -> None:
        self.held.clear()
        self.landed.clear()
        self.committing.clear()
        self.pending.clear()


def _now_record(job: ClaimedJob, **fields: Any) -> AttemptRecord:
    return AttemptRecord(job_id=job.id, attempt=job.attempt, gen=job.gen, **fields)


class QueueMachine(RuleBasedStateMachine):
    """Workers, a sweep, a reconciler, a Redis that may lose everything, and staff."""

    def __init__(self) -> None:
        super().__init__()
        self.backend = task_backends["default"]
        self.broker: Broker = self.backend.broker
        self.database = self.backend.config.DATABASE
        # Each example starts from an empty Redis database and empty tables.
        self.broker.client.flushdb()
        # The broker remembers which queues had priorities in use (its lone-queue
        # wait depends on it): forget it with the data, or examples interfere.
        self.broker._banded.clear()
        self.broker._paused.clear()
        QueuePause.objects.all().delete()
        #: Whether the queue is paused (the QueuePause row exists): while its
        #: flag is in Redis no claim hands out a job and no claimed job starts.
        self.paused = False
        Job.objects.all().delete()
        self.keys = self.broker.keys(QUEUE)
        self.workers = [SimWorker(f"w{i}") for i in range(WORKERS)]
        self.jobs: list[str] = []
        #: On-commit pushes that have not happened yet (a producer stalled
        #: or died between its commit and its push).
        self.late_pushes: list[NewJob] = []
        #: Mirror records of a sweep pass not written yet (the maintenance
        #: thread hands them to the finisher, which writes them later).
        #: Every token claim handed out: a token handed out twice means two
        #: workers may both hold a current one.
        self.issued: set[Fence] = set()
        #: Jobs a crashed sweep may have requeued without mirroring it.
        self.unrecorded: set[str] = set()
        #: The terminal state each row was last seen in (succeeded, dead or
        #: cancelled), until a staff action legitimately moves it.
        self.final: dict[str, str] = {}
        #: Jobs cancelled by staff and not requeued since: they never start.
        self.cancelled: set[str] = set()
        #: Jobs staff gave another priority (reprioritize.lua leaves a copy
        #: behind): no copy of theirs may ever come back from a claim as garbage.
        self.reprioritized: set[str] = set()
        self.ever_cancelled: set[str] = set()
        #: Jobs whose place in their group's list is not their enqueue order
        #: (deferred, pushed late, moved by staff): left out of the FIFO check.
        self.out_of_order: set[str] = set()
        #: Jobs whose stalled on-commit push arrived late: if Redis had lost
        #: the job meanwhile, it runs at the priority it was enqueued with
        #: even when staff changed the row's since (docs/design.md).
        self.pushed_late: set[str] = set()
        #: Late pushes that were still on their way when Redis lost everything:
        #: once one lands, Redis may run an older incarnation than the row's
        #: (at least once, after a loss of Redis data), so the generation check
        #: and the acked-success check excuse its job.
        self.outlived_a_flush: set[str] = set()
        self.stale_incarnation: set[str] = set()
        #: Jobs a staff action moved in Redis whose commit then failed (not a
        #: rebuild: the same generation): staff.py says the job still runs and
        #: its worker's records bring the row up to date, so the row may say
        #: dead, or keep its old priority, while Redis runs it.
        self.staff_unmirrored: set[str] = set()
        #: Cancels a failover lost in Redis (the row says cancelled): excused
        #: from "a cancelled job never starts" until a reconcile has run since.
        self.cancel_lost: set[str] = set()
        #: While a stopping worker's threads still run these tasks (job id ->
        #: token): no other attempt of them may start.
        self.still_running: dict[str, Fence] = {}
        #: The finisher's Redis step, as the worker runs it (real code).
        self.finisher = finisher(self.backend)
        #: Jobs of demo.capped_add: at most CAP of them hold a slot at once.
        self.capped: set[str] = set()
        #: Jobs enqueued with after=: their upstreams, and their on_failure policy.
        self.upstreams: dict[str, tuple[list[str], str]] = {}
        #: Jobs whose release push (after the commit that released them) is to be
        #: lost, as if the releasing process died between its commit and the push.
        self.lose_release: set[str] = set()
        #: Jobs a staff retry or requeue moved: staff may run a job whatever it waits for.
        self.staff_moved: set[str] = set()
        #: Jobs of the debounced task (demo.debounced_note).
        self.debounced: set[str] = set()
        self.failed = False
        # The push of released jobs goes through broker.enqueue (workflows.push_released):
        # drop the ones lose_release names, once each. Taken back at teardown.
        self.broker.__dict__.pop("enqueue", None)
        real_enqueue = self.broker.enqueue

        def enqueue(queue: str, jobs: Any, **kwargs: Any) -> int:
            jobs = list(jobs)
            kept = [job for job in jobs if job.id not in self.lose_release]
            self.lose_release -= {job.id for job in jobs}
            return real_enqueue(queue, kept, **kwargs) if kept else 0
        self.broker.enqueue = enqueue  # type: ignore[method-assign]

    # -- helpers ---------------------------------------------------------

    def fail(self, message: str) -> None:
        """Raise a violation (and remember it, so teardown does not mask it)."""
        self.failed = True
        raise ModelViolation(message)

    def rows(self) -> dict[str, Job]:
        return {str(job.pk): job for job in Job.objects.all()}

    def job_hashes(self, job_ids: list[str]) -> dict[str, dict[str, str | None]]:
        with self.broker.client.pipeline(transaction=False) as pipe:
            for job_id in job_ids:
                pipe.hmget(self.keys.job(job_id), "state", "attempts", "gen", "started")
            replies = pipe.execute()
        return {job_id: dict(zip(("state", "attempts", "gen", "started"), reply, strict=True))
                for job_id, reply in zip(job_ids, replies, strict=True)}

    def is_current(self, fence: Fence, found: dict[str, str | None]) -> bool:
        """Would Redis accept this token now (the check every fenced script makes)?"""
        _, attempt, gen = fence
        return (found["state"] == "running" and found["attempts"] == str(attempt)
                and (found["gen"] or "0") == str(gen))

    def all_fences(self) -> list[tuple[SimWorker, Fence, bool]]:
        """(worker, token, started) for every claim any worker still acts on."""
        out = [(w, fence, h.started) for w in self.workers for fence, h in w.held.items()]
        out += [(w, o.job.fence, True) for w in self.workers for o in [*w.committing, *w.pending]
                if o.job is not None]
        return out

    def take_claims(self, worker: SimWorker, jobs: list[ClaimedJob],
                    dead: list[Fence], garbage: Sequence[str] = ()) -> None:
        """What the worker does with a claim's reply (worker/core.py ``_claim``)."""
        # (A job cancelled while queued, then requeued, has a second copy of
        # its own on queued that comes back as garbage, priorities or not.)
        moved = self.reprioritized.intersection(garbage) - self.ever_cancelled
        if moved:
            self.fail(f"a copy that reprioritize left behind came back as garbage: {moved}")
        rows = self.rows()
        for job in jobs:
            if job.fence in self.issued:
                self.fail(f"token {job.fence} was handed out twice")
            self.issued.add(job.fence)
            row = rows.get(job.id)
            if row is not None and row.state == JobState.SUCCEEDED \
                    and job.id not in self.unrecorded:
                self.fail(f"job {job.id} is handed out again (attempt {job.attempt}, gen "
                          f"{job.gen}) although its row already says succeeded "
                          f"(attempt {row.attempts}, gen {row.generation})")
            if job.id in self.cancelled and job.id not in self.cancel_lost:
                self.fail(f"job {job.id} was cancelled by staff and is handed out again "
                          f"(attempt {job.attempt}, gen {job.gen})")
            worker.held[job.fence] = Held(job)
        records = [mirror.expired_record(
            job_id, attempts, dead=True, gen=gen,
            error=f"AttemptsExhausted: claimed {attempts} time(s) without finishing")
            for job_id, attempts, gen in dead]
        if records:
            mirror.record(self.database, records)

    def lease_left_ms(self, job_id: str) -> int | None:
        """How long the job's lease has left by the server's clock (None: no lease)."""
        with self.broker.client.pipeline(transaction=False) as pipe:
            pipe.zscore(self.keys.leases, job_id)
            pipe.time()
            deadline, (seconds, micros) = pipe.execute()
        return None if deadline is None else int(deadline) - (seconds * 1000 + micros // 1000)

    def started(self, worker: SimWorker, held: Held, *, record_start: bool) -> bool:
        """start.lua for one claim; then (maybe) the start record the executor writes."""
        job = held.job
        # Read before start.lua: a lease found run out here had run out for it too.
        left_ms = self.lease_left_ms(job.id)
        flagged = self.pause_flagged()
        [ok] = self.broker.start(QUEUE, [job.fence])
        if ok == Applied.PAUSED:
            # Claimed before the pause: the worker hands it back unstarted and
            # gives its attempt back (Worker._release), never runs it.
            del worker.held[job.fence]
            if self.broker.release(QUEUE, [(*job.fence, False)]) == [Applied.DONE]:
                mirror.raise_budgets(self.database, {job.id: job.max_attempts + 1})
            return False
        if ok == Applied.DONE and flagged:
            self.fail(f"job {job.id} attempt {job.attempt} started while its queue was paused")
        if ok == Applied.CANCELLED:
            # Cancelled before it started: the worker records it and acks it
            # (the executor's _mark_started), never runs it.
            del worker.held[job.fence]
            rec = mirror.cancelled_record(job.id, job.attempt, gen=job.gen,
                                          error="cancelled before it started")
            mirror.record(self.database, [rec])
            self.apply([FinishedAttempt(rec, job=job, delay_ms=None)])
            return False
        if ok != Applied.DONE:
            del worker.held[job.fence]  # the worker drops a claim it lost
            return False
        if left_ms is not None and left_ms < 0:
            self.fail(f"job {job.id} attempt {job.attempt} was marked started {-left_ms} ms "
                      "after its lease had expired: the sweep may requeue it while it runs")
        if job.id in self.cancelled and job.id not in self.cancel_lost:
            self.fail(f"job {job.id} was cancelled by staff and then started "
                      f"(attempt {job.attempt}, gen {job.gen})")
        row = Job.objects.filter(pk=job.id).first()
        if row is not None and row.state == JobState.SUCCEEDED and job.id not in self.unrecorded:
            self.fail(f"job {job.id} starts again (attempt {job.attempt}, gen {job.gen}) "
                      f"although its success is in the mirror (attempt {row.attempts}, gen "
                      f"{row.generation})")
        other = self.still_running.get(job.id)
        if other is not None and other != job.fence:
            self.fail(f"job {job.id} started as attempt {job.attempt} (gen {job.gen}) on "
                      f"{worker.name} while attempt {other[1]} (gen {other[2]}) still runs in "
                      "a thread of a stopping worker, which handed it back")
        self.dependencies_succeeded_before(job.id, job.attempt)
        held.started = True
        if record_start:
            mirror.record(self.database, [_now_record(
                job, job_state=JobState.RUNNING, worker_id=worker.name,
                started_at=timezone.now())])
        return True

    def dependencies_succeeded_before(self, job_id: str, attempt: int) -> None:
        """No dependent starts before every job it waits for succeeded (ended, under "run").

        Excused: a job staff retried or requeued (staff may run it whatever
        it waits for), and the dependents of an upstream staff moved.
        """
        if job_id not in self.upstreams or job_id in self.staff_moved:
            return
        upstreams, policy = self.upstreams[job_id]
        ok = (JobState.SUCCEEDED,) if policy == "cancel" else FINISHED_STATES
        states = dict(Job.objects.filter(pk__in=upstreams).values_list("pk", "state"))
        if policy == "only":  # a callback on death: once one of them failed (or staff moved it)
            if not any(states.get(uuid.UUID(u)) in (JobState.DEAD, JobState.CANCELLED)
                       or u in self.staff_moved for u in upstreams):
                self.fail(f"job {job_id} (on_failure=only) starts (attempt {attempt}) though "
                          "no job it waits for failed")
            return
        for upstream in upstreams:
            state = states.get(uuid.UUID(upstream))
            if state not in ok and upstream not in self.staff_moved:
                self.fail(f"job {job_id} starts (attempt {attempt}) while job {upstream}, "
                          f"which it waits for (on_failure={policy}), is {state}")

    def apply(self, outcomes: list[FinishedAttempt]) -> None:
        """The finisher's Redis step, after the mirror write (fenced; may be refused).

        Run by the real finisher, one outcome at a time, so the machine sees
        each success Redis took: a success Redis finished is one the mirror
        holds, or the job runs again though it succeeded (a record the
        mirror fenced out while Redis took the ack).
        """
        stats = self.finisher.stats
        for outcome in outcomes:
            taken = stats.succeeded
            self.finisher._apply_in_redis([outcome])
            job = outcome.job
            assert job is not None
            if outcome.record.outcome == AttemptOutcome.CANCELLED:
                found = self.job_hashes([job.id])[job.id]
                put_back = found["attempts"] == str(job.attempt) \
                    and (found["gen"] or "0") == str(job.gen)  # this attempt's nack took
                if put_back and found["state"] in ("queued", "scheduled"):
                    self.fail(f"job {job.id}: the mirror recorded attempt {job.attempt} as "
                              f"cancelled (its row was cancelled), and the finisher's Redis "
                              f"step left the job {found['state']} to run again")
            if stats.succeeded == taken or outcome.record.outcome != AttemptOutcome.SUCCEEDED \
                    or job.id in self.stale_incarnation:
                continue
            row = Job.objects.get(pk=job.id)
            if row.state != JobState.SUCCEEDED:
                self.fail(f"Redis finished job {job.id} as succeeded (attempt {job.attempt}, gen "
                          f"{job.gen}) but its row is {row.state} (attempt {row.attempts}, gen "
                          f"{row.generation}): the mirror refused the success, and reconcile "
                          "will run the job again")

    def commit(self, worker: SimWorker, batch: list[FinishedAttempt], *, ack_now: bool) -> None:
        """The finisher's mirror write of one batch, then (maybe) its Redis step."""
        mirror.record(self.database, [o.record for o in batch])
        if ack_now:
            self.apply(batch)
        else:
            worker.pending.extend(batch)

    def jump(self) -> None:
        """JUMP_MS pass on the server's clock, for every deadline Redis holds.

        Lease deadlines and due times live in two sorted sets (leases,
        scheduled), read against the server's TIME by every script: moving
        each score JUMP_MS back is, to the scripts, JUMP_MS passing. Only the
        machine writes to this Redis database, so nothing runs in between.
        """
        client = self.broker.client
        for key in (self.keys.leases, self.keys.scheduled, self.keys.holds):
            entries = client.zrange(key, 0, -1, withscores=True)
            if entries:
                client.zadd(key, {member: score - JUMP_MS for member, score in entries})

    def backdate(self) -> None:
        """Make every row older than reconcile's grace: as if that much time passed."""
        Job.objects.update(updated_at=timezone.now() - timedelta(milliseconds=BACKDATE_MS))

    # -- producers ---------------------------------------------------------

    @initialize(deferred=st.lists(st.booleans(), min_size=1, max_size=3))
    def first_jobs(self, deferred: list[bool]) -> None:
        """Start with a few jobs already pushed (most programs need some)."""
        for later in deferred:
            self.enqueue(deferred=later, late=False)

    @precondition(lambda self: len(self.jobs) < 6)
    @rule(deferred=st.booleans(), late=st.booleans(), priority=st.sampled_from([0, 0, 3, -3]),
          tenant=st.sampled_from([None, None, "t1", "t2"]))
    def enqueue(self, deferred: bool, late: bool, priority: int = 0,
                tenant: str | None = None) -> None:
        """backend.enqueue in a transaction; the push runs on commit, or is held back.

        With a ``tenant`` the job has that fair group (demo.tenant_add).
        """
        task = demo.add if tenant is None else demo.tenant_add
        args: tuple[Any, ...] = ((len(self.jobs), 1) if tenant is None
                                 else (tenant, len(self.jobs), 1))
        if priority:
            task = task.using(priority=priority)
        if deferred:
            task = task.using(run_after=timezone.now() + timedelta(milliseconds=DEFER_MS))
        if late:
            # The producer commits, then stalls (or dies) before its push.
            self.backend._push = lambda queue, jobs: self.late_pushes.extend(jobs)  # type: ignore[method-assign]
        try:
            with transaction.atomic():
                result = task.enqueue(*args)
        finally:
            self.backend.__dict__.pop("_push", None)
        self.jobs.append(result.id)
        if deferred or late:
            self.out_of_order.add(result.id)

    @precondition(lambda self: self.late_pushes)
    @rule(index=st.integers(0, 10))
    def late_push(self, index: int) -> None:
        """A stalled producer's on-commit push finally arrives."""
        self.deliver(self.late_pushes.pop(index % len(self.late_pushes)))

    def deliver(self, job: NewJob) -> None:
        """A push held back lands (backend._push, as the on-commit hook calls it)."""
        self.pushed_late.add(job.id)
        row = Job.objects.filter(pk=job.id).first()
        if job.id in self.outlived_a_flush and row is not None and row.generation > job.gen:
            self.stale_incarnation.add(job.id)
        self.backend._push(QUEUE, [job])

    @precondition(lambda self: self.jobs and len(self.jobs) < 6)
    @rule(picks=st.lists(st.integers(0, 10), min_size=1, max_size=3),
          policy=st.sampled_from(["cancel", "cancel", "run", "only"]), lose_release=st.booleans())
    def enqueue_after(self, picks: list[int], policy: str, lose_release: bool) -> None:
        """A job waiting for up to three jobs (``after=``), in a transaction.

        With ``lose_release`` the push that follows the commit releasing it
        is lost (its process died in between): reconcile must push it.
        """
        upstreams = list(dict.fromkeys(self.jobs[i % len(self.jobs)] for i in picks))
        with transaction.atomic():
            result = demo.add.using(after=upstreams, on_failure=policy).enqueue(len(self.jobs), 1)
        self.jobs.append(result.id)
        self.out_of_order.add(result.id)
        self.upstreams[result.id] = (upstreams, policy)
        if lose_release and Job.objects.get(pk=result.id).state == JobState.WAITING:
            self.lose_release.add(result.id)

    @precondition(lambda self: len(self.jobs) < 6)
    @rule()
    def enqueue_capped(self) -> None:
        """A job of a task capped at CAP running at once (flow control), in a transaction."""
        with transaction.atomic():
            result = demo.capped_add.enqueue(len(self.jobs), 1)
        self.jobs.append(result.id)
        self.capped.add(result.id)

    @precondition(lambda self: len(self.jobs) < 6)
    @rule()
    def enqueue_unique(self) -> None:
        """An equal call of a unique task (unique_while_running off), in a transaction.

        Its unfinished equal job is returned only while that job waits: a
        call merged into a job whose task already began (Redis marked it
        started) or ended is a call that never runs.
        """
        with transaction.atomic():
            result = demo.unique_add.enqueue(0, 0)
        if result.id not in self.jobs:
            self.jobs.append(result.id)
            return
        found = self.job_hashes([result.id])[result.id]
        began = found["state"] == "running" and found["started"] == found["attempts"]
        if began or found["state"] == "finished":
            self.fail(f"an equal call of a unique task was merged into job {result.id}, which "
                      f"Redis holds {found['state']} (attempt {found['attempts']}, started "
                      f"{found['started']}): the call never runs")

    @precondition(lambda self: len(self.jobs) < 6)
    @rule(n=st.integers(0, 3))
    def enqueue_debounced(self, n: int) -> None:
        """An equal call of a debounced task, in a transaction.

        It joins the job it returns only while that job is pending (never
        claimed, still scheduled in Redis), and then Redis and the row both
        hold this call's arguments; otherwise it is a new pending job. A
        call merged into a job that was promoted, claimed or ran never runs.
        """
        with transaction.atomic():
            result = demo.debounced_note.enqueue("model", n)
        fresh = result.id not in self.jobs
        if fresh:
            self.jobs.append(result.id)
            self.debounced.add(result.id)
        found = self.job_hashes([result.id])[result.id]
        if not fresh and (found["state"] != "scheduled" or found["attempts"] != "0"):
            self.fail(f"a debounced call was merged into job {result.id}, which Redis holds "
                      f"{found['state']} (attempt {found['attempts']}): the call never runs")
        text = self.broker.client.hget(self.keys.job(result.id), "payload")
        row = Job.objects.get(pk=result.id)
        if text is not None and (json.loads(text)["args"], row.args) != (["model", n],) * 2:
            self.fail(f"debounced job {result.id}: Redis runs {json.loads(text)['args']}, the "
                      f"row says {row.args}, the last call was {['model', n]}")

    # -- workers -----------------------------------------------------------

    @rule(k=st.integers(0, WORKERS - 1), count=st.integers(1, 3), start=st.booleans())
    def claim(self, k: int, count: int, start: bool) -> None:
        """Claim a batch; with ``start`` the executors start all of it at once."""
        worker = self.workers[k]
        flagged = self.pause_flagged()
        result = self.broker.claim(QUEUE, count=count, lease_ms=LEASE_MS)
        if flagged and (result.jobs or result.dead):
            self.fail(f"a claim on the paused queue handed out {[j.id for j in result.jobs]}")
        self.take_claims(worker, result.jobs, result.dead, result.garbage)
        if start:
            for job in result.jobs:
                self.started(worker, worker.held[job.fence], record_start=True)

    @rule(k=st.integers(0, WORKERS - 1))
    def land(self, k: int) -> None:
        """BLMOVE queued -> landing (a worker serving one queue waits this way)."""
        found = self.broker.wait([QUEUE], 0.01)
        if found is not None and found[1] is not None:
            self.workers[k].landed.append(found[1])

    @precondition(lambda self: any(w.landed for w in self.workers))
    @rule(k=st.integers(0, WORKERS - 1))
    def claim_landed(self, k: int) -> None:
        """Stamp the id this worker moved with BLMOVE (claim with moved_id)."""
        waiting = [w for w in self.workers if w.landed]
        worker = waiting[k % len(waiting)]
        moved = worker.landed.pop(0)
        flagged = self.pause_flagged()
        result = self.broker.claim(QUEUE, count=0, lease_ms=LEASE_MS, moved_id=moved)
        if flagged and result.jobs:
            self.fail(f"a claim on the paused queue stamped the moved id {moved}")
        self.take_claims(worker, result.jobs, result.dead, result.garbage)

    def claims(self, *, started: bool) -> list[tuple[SimWorker, Held]]:
        """Every claim in any worker's hand that has (not) started, in a stable order."""
        return [(w, h) for w in self.workers for h in w.held.values() if h.started == started]

    @precondition(lambda self: self.claims(started=False))
    @rule(index=st.integers(0, 20), record_start=st.booleans())
    def start(self, index: int, record_start: bool) -> None:
        """start.lua before the task runs; only a started attempt may run."""
        unstarted = self.claims(started=False)
        worker, held = unstarted[index % len(unstarted)]
        self.started(worker, held, record_start=record_start)

    @precondition(lambda self: self.claims(started=True))
    @rule(index=st.integers(0, 20),
          # Success twice as likely: most attempts succeed, and most bugs
          # worth finding are about a success recorded at the wrong time.
          outcome=st.sampled_from(["succeeded", "succeeded", "queued", "scheduled", "dead",
                                   "snoozed"]),
          ack_now=st.booleans(), commit_now=st.booleans())
    def finish(self, index: int, outcome: str, ack_now: bool, commit_now: bool = True) -> None:
        """The task ended: mirror the outcome (committed), then ack or nack it.

        With ``commit_now`` False the outcome waits with the finisher, not
        committed yet (``commit_outcomes`` writes it). With ``ack_now`` False
        the Redis step waits (the finisher is slow, or the worker dies before
        it). A failure on the last attempt is dead, as retry.next_delay_ms decides.
        """
        running = self.claims(started=True)
        worker, held = running[index % len(running)]
        job = held.job
        del worker.held[job.fence]
        finished = self.outcome(worker, job, outcome)
        if commit_now:
            self.commit(worker, [finished], ack_now=ack_now)
        else:
            worker.committing.append(finished)

    def outcome(self, worker: SimWorker, job: ClaimedJob, outcome: str) -> FinishedAttempt:
        """What the executor hands the finisher when a task ends (executor.py).

        A snooze (``Snooze(RETRY_DELAY_MS)``) never turns into a death: it
        gives its attempt back, whatever attempt it is.
        """
        now = timezone.now()
        if outcome == "snoozed":
            return FinishedAttempt(mirror.snoozed_record(
                job.id, job.attempt, gen=job.gen, delay_ms=RETRY_DELAY_MS,
                max_attempts=job.max_attempts, worker_id=worker.name, started_at=now),
                job=job, delay_ms=RETRY_DELAY_MS, snoozed=True)
        if outcome != "succeeded" and job.attempt >= job.max_attempts:
            outcome = "dead"
        if outcome == "succeeded":
            return FinishedAttempt(_now_record(
                job, job_state=JobState.SUCCEEDED, worker_id=worker.name, started_at=now,
                finished_at=now, outcome=AttemptOutcome.SUCCEEDED, return_value=job.attempt),
                job=job, delay_ms=None)
        return FinishedAttempt(_now_record(
            job, job_state=outcome, worker_id=worker.name, started_at=now,
            finished_at=now, outcome=AttemptOutcome.FAILED,
            error=f"builtins.ValueError: attempt {job.attempt} failed",
            retry_at=now + timedelta(milliseconds=RETRY_DELAY_MS)
            if outcome == "scheduled" else None),
            job=job, delay_ms={"queued": 0, "scheduled": RETRY_DELAY_MS, "dead": -1}[outcome])

    @precondition(lambda self: any(w.committing for w in self.workers))
    @rule(k=st.integers(0, WORKERS - 1), fails=st.booleans(), ack_now=st.booleans())
    def commit_outcomes(self, k: int, fails: bool, ack_now: bool) -> None:
        """The finisher commits the batch it holds, then (maybe) acks or nacks it.

        With ``fails`` the COMMIT fails (the server ended the session): the
        transaction rolls back, and the finisher keeps the batch to retry.
        """
        waiting = [w for w in self.workers if w.committing]
        worker = waiting[k % len(waiting)]
        batch = list(worker.committing)
        if fails:
            with failing_commit(self.database) as fault:
                try:
                    mirror.record(self.database, [o.record for o in batch])
                except DatabaseError:
                    if fault.fired:
                        return
                    raise
        worker.committing.clear()
        self.commit(worker, batch, ack_now=ack_now)

    @precondition(lambda self: any(w.pending for w in self.workers))
    @rule(k=st.integers(0, WORKERS - 1))
    def ack_pending(self, k: int) -> None:
        """The finisher's late Redis step for the oldest mirrored outcome."""
        waiting = [w for w in self.workers if w.pending]
        worker = waiting[k % len(waiting)]
        self.apply([worker.pending.pop(0)])

    @rule(k=st.integers(0, WORKERS - 1))
    def renew(self, k: int) -> None:
        """The lease keeper renews every claim in hand (refused ones are left stale)."""
        fences = [f for w, f, _ in self.all_fences() if w is self.workers[k]]
        if fences:
            self.broker.extend(QUEUE, fences, lease_ms=LEASE_MS)

    @rule()
    def pause(self) -> None:
        """Every process stalls longer than a lease (a GC pause, a paused VM, a slow
        network), and no sweep runs meanwhile: every lease not renewed runs out."""
        self.jump()

    @rule(k=st.integers(0, WORKERS - 1), commit_lands=st.booleans())
    def kill(self, k: int, commit_lands: bool) -> None:
        """SIGKILL: the worker forgets everything it held, landed or had not acked.

        With ``commit_lands`` the finisher's COMMIT was already on its way to
        the server: the batch it held commits, and nothing is acked.
        """
        worker = self.workers[k]
        if commit_lands and worker.committing:
            mirror.record(self.database, [o.record for o in worker.committing])
        worker.forget()

    @rule(k=st.integers(0, WORKERS - 1), hard=st.booleans(), grace_over=st.booleans(),
          commit=st.sampled_from(["in_time", "late", "never"]), rival=st.booleans())
    def stop(self, k: int, hard: bool, grace_over: bool, commit: str, rival: bool) -> None:
        """A worker stops, with jobs at every stage, and its process exits.

        The real worker's ``_shutdown`` decides (tests/model_faults.py): it is
        given what this worker holds: claims not started, tasks still running
        in its threads, outcomes the finisher has not committed, outcomes
        committed and not acked. First signal (``hard`` False): unless
        ``grace_over``, every running task ends (succeeds) within the grace
        period and the finisher writes and applies everything; past the grace
        period the tasks still run. A second signal (``hard``): nothing is
        waited for. ``commit`` says when the finisher's pending COMMIT lands:
        before the shutdown looks (``in_time``), after it (``late``: the
        server had it), or ``never``. With ``rival`` another worker claims and
        starts what it can before this process has exited, while its threads
        still run their tasks.
        """
        worker = self.workers[k]
        if not hard and not grace_over:
            for held in [h for h in worker.held.values() if h.started]:
                del worker.held[held.job.fence]
                worker.committing.append(self.outcome(worker, held.job, "succeeded"))
            commit = "in_time"
        if commit == "in_time" and worker.committing:
            self.commit(worker, list(worker.committing), ack_now=False)
            worker.committing.clear()
        if not hard:  # the finisher applies what it committed before the process exits
            self.apply(list(worker.pending))
            worker.pending.clear()
        running = [h.job for h in worker.held.values() if h.started]
        found = self.job_hashes([job.id for job in running])
        held_fences = {job.fence for job in running if self.is_current(job.fence, found[job.id])}
        stop_like_a_worker(
            self.backend, worker.name, QUEUE, hard=hard,
            unstarted=[h.job for h in worker.held.values() if not h.started], running=running,
            unmirrored=[o.job for o in worker.committing if o.job is not None],
            mirrored=[o.job for o in worker.pending if o.job is not None])
        if commit == "late" and worker.committing:
            mirror.record(self.database, [o.record for o in worker.committing])
        if rival:
            # Those whose lease this worker still held: one Redis had already
            # given away (its lease ran out in a stall) may run elsewhere.
            self.still_running = {job.id: job.fence for job in running
                                  if job.fence in held_fences}
            try:
                self.claim(k=(k + 1) % WORKERS, count=3, start=True)
            finally:
                self.still_running = {}
        worker.forget()  # the process has exited: its threads and their tasks are gone

    # -- the sweep -----------------------------------------------------------

    @rule(expire=st.booleans(), stall=st.booleans(), crash=st.booleans())
    def sweep(self, expire: bool, stall: bool, crash: bool) -> None:
        """Sweep.redis_pass, which mirrors what recover did before its row locks go.

        With ``expire`` every lease not renewed runs out first (the server's
        clock decides): that is how a stalled or dead holder loses its job.
        With ``stall`` the pass pauses (a GC pause, a slow network) between
        expired.lua and its mirror lookup, for as long as a lease. With
        ``crash`` the sweep dies after recover.lua, before its mirror
        transaction commits: Redis has acted, the mirror knows nothing.
        """
        if expire:
            self.jump()
        broker = self.broker
        real_expired = broker.expired

        def expired_seen(queue: str, **kwargs: Any) -> Any:
            found = real_expired(queue, **kwargs)
            if crash:
                # Whatever recover requeues now, the mirror never hears of: a
                # late outcome of those attempts may then finish their rows
                # while Redis runs them again, which at-least-once allows after
                # a crash. (Taken from the sweep's own call: a lease that runs
                # out between a look taken before it and this one counts too.)
                self.unrecorded |= {job_id for job_id, _, _ in found}
            if stall:
                self.jump()
            return found

        broker.expired = expired_seen  # type: ignore[method-assign]
        real_record = mirror.record
        if crash:
            def die(*args: Any, **kwargs: Any) -> None:
                raise SweepDied

            mirror.record = die  # type: ignore[assignment]
        try:
            Sweep(self.backend.parts).redis_pass()
        except SweepDied:
            pass
        finally:
            broker.__dict__.pop("expired", None)
            mirror.record = real_record  # type: ignore[assignment]
        self.pause_is_back("a sweep pass")

    @rule(commit_fails=st.booleans(),
          slow_push=st.sampled_from([None, None, "late_first", "flush_first"]))
    def reconcile(self, commit_fails: bool = False, slow_push: str | None = None) -> None:
        """Reconcile once every row is older than the grace period.

        With ``commit_fails`` its first transaction fails at COMMIT (and the
        pass stops there, as the error propagates); with ``slow_push`` its
        push of rebuilt jobs is slow (see :meth:`slowly`).
        """
        self.backdate()
        with self.slowly(slow_push), failing_commit(self.database) if commit_fails \
                else nullcontext() as fault:
            try:
                Sweep(self.backend.parts).reconcile()
            except DatabaseError:
                if fault is None or not fault.fired:
                    raise
                return
        self.cancel_lost.clear()
        if slow_push != "flush_first":
            # (Redis losing everything again during the pass, after reconcile put
            # the flag back, is a new loss: the next sweep pass puts it back.)
            self.pause_is_back("reconcile")

    def slowly(self, slow_push: str | None) -> AbstractContextManager[object]:
        """Make the next rebuild push slow: before it lands, the job's own on-commit
        push, stalled until now, lands (``late_first``), or Redis loses everything
        (``flush_first``)."""
        if slow_push is None:
            return nullcontext()

        def before(jobs: list[NewJob]) -> None:
            if slow_push == "flush_first":
                self.flush_redis()
                return
            ids = {job.id for job in jobs}
            for late in [job for job in self.late_pushes if job.id in ids]:
                self.late_pushes.remove(late)
                self.deliver(late)

        return SlowPush(self.broker, before)

    def pause_flagged(self) -> bool:
        """Whether the queue's pause flag is in Redis now (Redis may have lost it)."""
        return bool(self.broker.paused_since([QUEUE]))

    def pause_is_back(self, step: str) -> None:
        """A paused queue's flag, lost with Redis's data, is back after ``step``."""
        if self.paused and not self.pause_flagged():
            self.fail(f"the queue is paused (its row says so) but {step} did not put the lost "
                      "flag back")

    @rule()
    def pause_queue(self) -> None:
        """Staff pause the queue: from now on no claim takes a job, no claim starts."""
        pausing.pause(self.backend.parts, QUEUE, by="model")
        self.paused = True

    @precondition(lambda self: self.paused)
    @rule()
    def resume_queue(self) -> None:
        pausing.resume(self.backend.parts, QUEUE)
        self.paused = False

    @rule()
    def flush_redis(self) -> None:
        """Redis restarts empty (no persistence) or a failover drops everything."""
        self.outlived_a_flush |= {job.id for job in self.late_pushes}
        self.broker.client.flushdb()

    # -- staff -------------------------------------------------------------

    @precondition(lambda self: self.jobs)
    @rule(action=st.sampled_from(["cancel", "retry", "requeue"]), index=st.integers(0, 10),
          commit_fails=st.booleans(),
          slow_push=st.sampled_from([None, None, "late_first", "flush_first"]))
    def staff_action(self, action: str, index: int, commit_fails: bool = False,
                     slow_push: str | None = None) -> None:
        """An admin action on one job (staff.py), as the admin calls it.

        With ``commit_fails`` the action's transaction fails at COMMIT, after
        it acted in Redis; with ``slow_push`` a rebuild's push is slow.
        """
        job_id = self.jobs[index % len(self.jobs)]
        self.out_of_order.add(job_id)
        with self.slowly(slow_push):
            done = self.staff_commit(job_id, commit_fails,
                                     lambda: getattr(staff, action)(self.backend.parts,
                                                                    job_id).done)
        if not done:
            return
        if action == "cancel":
            self.cancelled.add(job_id)
            self.ever_cancelled.add(job_id)
            self.final[job_id] = JobState.CANCELLED
        else:
            # retry: dead -> queued; requeue: cancelled (or scheduled) -> queued.
            self.staff_moved.add(job_id)
            self.cancelled.discard(job_id)
            self.cancel_lost.discard(job_id)
            self.final.pop(job_id, None)

    def staff_commit(self, job_id: str, commit_fails: bool, act: Callable[[], bool]) -> bool:
        """Run a staff action; with ``commit_fails`` its COMMIT fails (False then).

        What it did in Redis stays. When that kept the job's generation (not
        a rebuild), staff.py's word is that the job runs on and its worker's
        records bring the row up to date: the row may lag meanwhile.
        """
        if not commit_fails:
            return act()
        with failing_commit(self.database) as fault:
            try:
                return act()
            except DatabaseError:
                if not fault.fired:
                    raise
        row = Job.objects.get(pk=job_id)
        found = self.job_hashes([job_id])[job_id]
        if found["state"] is not None and int(found["gen"] or 0) == row.generation:
            self.staff_unmirrored.add(job_id)
        return False

    @precondition(lambda self: self.jobs)
    @rule(index=st.integers(0, 10), priority=st.sampled_from([0, 5, -5]),
          commit_fails=st.booleans())
    def staff_reprioritize(self, index: int, priority: int, commit_fails: bool = False) -> None:
        """Staff give a job another priority (staff.reprioritize, reprioritize.lua)."""
        job_id = self.jobs[index % len(self.jobs)]
        self.out_of_order.add(job_id)
        if self.staff_commit(job_id, commit_fails, lambda: staff.reprioritize(
                self.backend.parts, job_id, priority).done):
            self.reprioritized.add(job_id)

    @precondition(lambda self: self.jobs)
    @rule(index=st.integers(0, 10), priority=st.sampled_from([5, -5]),
          cancel_first=st.booleans())
    def reprioritize_during_cancel(self, index: int, priority: int, cancel_first: bool) -> None:
        """Two admins act on one job at once: one cancels it, one changes its priority."""
        if cancel_first:
            self.staff_action("cancel", index)
            self.staff_reprioritize(index, priority)
        else:
            self.staff_reprioritize(index, priority)
            self.staff_action("cancel", index)

    @precondition(lambda self: self.jobs)
    @rule(index=st.integers(0, 10))
    def staff_cancel_lost(self, index: int) -> None:
        """Staff cancel a job, then Redis fails over to a replica that missed the
        cancel's writes: the row says cancelled, Redis holds the job as before."""
        job_id = self.jobs[index % len(self.jobs)]
        client, keys = self.broker.client, [self.keys.job(job_id), self.keys.scheduled]
        with client.pipeline(transaction=False) as pipe:
            for key in keys:
                pipe.dump(key)
                pipe.pttl(key)
            saved = pipe.execute()
        if not staff.cancel(self.backend.parts, job_id).done:
            return
        with client.pipeline(transaction=True) as pipe:
            for i, key in enumerate(keys):
                dumped, ttl_ms = saved[2 * i], saved[2 * i + 1]
                pipe.delete(key)
                if dumped is not None:
                    pipe.restore(key, max(ttl_ms, 0), dumped)
            pipe.execute()
        self.cancelled.add(job_id)
        self.ever_cancelled.add(job_id)
        self.cancel_lost.add(job_id)
        self.final[job_id] = JobState.CANCELLED

    # -- invariants ----------------------------------------------------------

    @invariant()
    def one_live_token_per_job(self) -> None:
        """At most one token per job is current, and no token is held twice."""
        fences = self.all_fences()
        if not fences:
            return
        found = self.job_hashes(sorted({f[0] for _, f, _ in fences}))
        current: dict[str, set[tuple[str, Fence]]] = {}
        for worker, fence, _ in fences:
            if self.is_current(fence, found[fence[0]]):
                current.setdefault(fence[0], set()).add((worker.name, fence))
        for job_id, holders in current.items():
            if len(holders) > 1:
                self.fail(f"job {job_id} has {len(holders)} current tokens: {sorted(holders)}")

    @invariant()
    def snoozes_never_bury_a_job(self) -> None:
        """A job whose every recorded attempt was a snooze is not dead: a snooze uses no attempt."""
        dead = list(Job.objects.filter(state=JobState.DEAD).values_list("pk", flat=True))
        if not dead:
            return
        outcomes: dict[str, set[str]] = {}
        for job_id, outcome in Attempt.objects.filter(job_id__in=dead).values_list(
                "job_id", "outcome"):
            outcomes.setdefault(str(job_id), set()).add(outcome)
        for job_id, seen in outcomes.items():
            if seen == {AttemptOutcome.SNOOZED}:
                self.fail(f"job {job_id} is dead though every attempt it recorded snoozed")

    @invariant()
    def finished_rows_stay_finished(self) -> None:
        """Succeeded stays succeeded; dead and cancelled move only by staff action.

        One exception, by design (the mirror package): a dead job that Redis ran again
        (its lease had expired first) and that then succeeded is succeeded.
        """
        for job_id, row in self.rows().items():
            was = self.final.get(job_id)
            later_success = was == JobState.DEAD and row.state == JobState.SUCCEEDED
            if was is not None and row.state != was and not later_success:
                self.fail(f"job {job_id}'s row went from {was} to {row.state} (attempts "
                          f"{row.attempts}, gen {row.generation}) without a staff action")
            if row.state in (JobState.SUCCEEDED, JobState.DEAD, JobState.CANCELLED):
                self.final[job_id] = row.state

    @invariant()
    def finished_rows_are_not_waiting_in_redis(self) -> None:
        """A job the mirror says ended is never queued or scheduled to run again.

        (Running is allowed: its ack may be on the way. A job a crashed sweep
        requeued without mirroring it is excused, as at-least-once allows.)
        """
        rows = self.rows()
        finished = [job_id for job_id, row in rows.items()
                    if row.state in (JobState.SUCCEEDED, JobState.DEAD)
                    and job_id not in self.unrecorded | self.staff_unmirrored]
        for job_id in finished:
            state = self.broker.client.hget(self.broker.keys(QUEUE).job(job_id), "state")
            if state in ("queued", "scheduled"):
                self.fail(f"job {job_id}'s row says {rows[job_id].state} while Redis holds it "
                          f"{state}, to run again")

    @invariant()
    def waiting_jobs_wait_for_something(self) -> None:
        """A waiting job waits for exactly its unsettled edges, each of an upstream not ended.

        So none is left waiting once all its dependencies succeeded (the
        write that ended the last one released it), none misses an end
        (an edge of an ended upstream is settled by that write), and none
        waits on after a dependency failed under "cancel" (it was cancelled).
        """
        rows = self.rows()
        edges = list(Dependency.objects.values_list("job_id", "upstream_id", "state",
                                                    "on_failure"))
        unsettled: dict[str, int] = {}
        for job_id, upstream_id, state, policy in edges:
            job, upstream = str(job_id), str(upstream_id)
            up = rows.get(upstream)
            if state == "" and up is not None and up.state in FINISHED_STATES \
                    and upstream not in self.staff_moved:
                self.fail(f"job {upstream} ended {up.state} but the edge of job {job} waiting "
                          "for it was never settled")
            if state == "":
                unsettled[job] = unsettled.get(job, 0) + 1
            elif (state != JobState.SUCCEEDED and policy in ("cancel", "only") and job in rows
                  and rows[job].state == JobState.WAITING):
                self.fail(f"job {job} still waits although job {upstream} ended {state} "
                          f"(on_failure={policy})")
        for job_id, row in rows.items():
            if row.state != JobState.WAITING:
                continue
            if unsettled.get(job_id, 0) == 0:
                self.fail(f"job {job_id} is left waiting: every job it waits for has ended")
            if row.waiting_for != unsettled[job_id]:
                self.fail(f"job {job_id} counts {row.waiting_for} dependencies to wait for, "
                          f"and has {unsettled[job_id]} unsettled edges")

    @invariant()
    def unfinished_rows_are_reachable(self) -> None:
        """Every unfinished row is where a script finds it, or reconcile rebuilds it."""
        unfinished = [job_id for job_id, row in self.rows().items()
                      if row.state in UNFINISHED_STATES]
        if not unfinished:
            return
        client, k = self.broker.client, self.keys
        queued = {job_id for ids in self.lists_claims_visit().values() for job_id in ids}
        queued |= self.held_ids()
        landing = set(client.lrange(k.landing, 0, -1))
        scheduled = set(client.zrange(k.scheduled, 0, -1))
        leases = set(client.zrange(k.leases, 0, -1))
        late = {job.id for job in self.late_pushes}
        for job_id, found in self.job_hashes(unfinished).items():
            state = found["state"]
            if state in (None, "finished", "cancelled", "dead"):
                continue  # reconcile rebuilds (or buries) it
            if state == "queued" and (job_id in queued or job_id in landing):
                continue
            if state == "running" and job_id in leases:  # leases: the in-flight index
                continue
            if state == "scheduled" and job_id in scheduled:
                continue
            if job_id in late:
                continue
            self.fail(f"job {job_id} is unfinished in the mirror but stranded in Redis: "
                      f"hash {found}, queued={job_id in queued}, "
                      f"landing={job_id in landing}, "
                      f"scheduled={job_id in scheduled}, lease={job_id in leases}")

    def lists_claims_visit(self) -> dict[tuple[int, str], list[str]]:
        """The ids on every list a claim looks at, by (priority, fair group or '').

        A claim visits priority 0's plain list, the plain list of every
        priority in bands, and the list of every group in the rotation of a
        priority listed in fair_bands; a non-zero priority's groups only
        while that priority is in bands too (claim.lua). A job anywhere else
        would never be claimed.
        """
        client, k = self.broker.client, self.keys
        bands = [0] + [int(b) for b in client.zrange(k.bands, 0, -1)]
        lists = {(band, ""): client.lrange(k.band(band), 0, -1) for band in bands}
        for band in map(int, client.zrange(k.fair_bands, 0, -1)):
            if band not in bands:
                continue
            for group in client.zrange(f"{k.rota_prefix}{band}", 0, -1):
                if group:
                    lists[(band, group)] = client.lrange(k.group(band, group), 0, -1)
        return lists

    @invariant()
    def waiting_jobs_take_their_turn_in_their_group(self) -> None:
        """A queued job of a fair group is on its group's list, which a claim visits.

        Its group in Redis is its row's (a rebuild puts it back there); a
        band with a rotation lists its plain list in it whenever that list
        holds jobs; and jobs only ever enqueued once wait in their enqueue
        order within their group (oldest on the right).
        """
        rows = self.rows()
        if not rows:
            return
        client, k = self.broker.client, self.keys
        visited = self.lists_claims_visit()
        # A job a limit holds back waits on that limit's held list instead.
        landing = set(client.lrange(k.landing, 0, -1)) | self.held_ids()
        with client.pipeline(transaction=False) as pipe:
            for job_id in rows:
                pipe.hmget(k.job(job_id), "state", "priority", "fair", "attempts", "gen")
            found = dict(zip(rows, pipe.execute(), strict=True))
        for job_id, (state, priority, group, _, _) in found.items():
            if state not in ("queued", "scheduled", "running", "dead"):
                continue  # no hash, or a tombstone (finished, cancelled): only state and gen
            if (group or "") != rows[job_id].fair_key:
                self.fail(f"job {job_id} has fair group {group!r} in Redis but "
                          f"{rows[job_id].fair_key!r} in its row")
            if state == "queued" and job_id not in landing and \
                    job_id not in visited.get((int(priority or 0), group or ""), []):
                self.fail(f"job {job_id} is queued at priority {priority or 0} in group "
                          f"{group!r}, but on no list a claim visits")
        fair_bands = {int(b) for b in client.zrange(k.fair_bands, 0, -1)}
        for band in fair_bands:
            if client.llen(k.band(band)) and client.zscore(f"{k.rota_prefix}{band}", "") is None:
                self.fail(f"priority {band} has groups and plain jobs, but the plain list has "
                          "no turn")
        order = {job_id: index for index, job_id in enumerate(self.jobs)}
        for (_, group), ids in visited.items():
            fresh = [order[i] for i in ids if i in order and i not in self.out_of_order
                     and found.get(i, (None,) * 5)[3] in ("0", None)
                     and found[i][4] in ("0", None) and group]
            if fresh != sorted(fresh, reverse=True):
                self.fail(f"group {group!r}'s list holds its jobs out of their enqueue order: "
                          f"{ids}")

    @invariant()
    def waiting_jobs_wait_at_their_priority(self) -> None:
        """A queued job is on its own priority's list (or landing); Redis and the row agree.

        Copies that reprioritize left on other lists are allowed (claim drops
        them); what must hold is that the copy that runs is on the right list.
        """
        rows = self.rows()
        if not rows:
            return
        client, k = self.broker.client, self.keys
        landing = set(client.lrange(k.landing, 0, -1)) | self.held_ids()
        with client.pipeline(transaction=False) as pipe:
            for job_id in rows:
                pipe.hmget(k.job(job_id), "state", "priority", "fair")
            found = dict(zip(rows, pipe.execute(), strict=True))
        for job_id, (state, priority, group) in found.items():
            if state not in ("queued", "scheduled"):
                continue
            band = int(priority or 0)
            row = rows[job_id]
            if row.state in (JobState.QUEUED, JobState.SCHEDULED) and row.priority != band \
                    and job_id not in self.pushed_late | self.staff_unmirrored:
                self.fail(f"job {job_id} has priority {band} in Redis but {row.priority} in "
                          "its row: a rebuild would change it")
            # (A job of a fair group waits on its group's list: the check above.)
            if state == "queued" and job_id not in landing and not group and \
                    client.lpos(k.band(band), job_id) is None:
                self.fail(f"job {job_id} is queued at priority {band} but not on that "
                          "priority's list")

    def held_ids(self) -> set[str]:
        """Ids a limit holds back: on the held list of a limit listed in holds."""
        client, k = self.broker.client, self.keys
        held: set[str] = set()
        for wire in client.zrange(k.holds, 0, -1):
            held |= set(client.lrange(k.flow("held", wire), 0, -1))
        return held

    def counted_slots(self) -> set[str]:
        """The ids the cap of demo.capped_add counts: its running set's members with a lease."""
        client, k = self.broker.client, self.keys
        members = client.zrange(k.flow("run", f"c:{demo.capped_add.module_path}"), 0, -1)
        return {m for m in members if client.zscore(k.leases, m) is not None}

    @invariant()
    def pending_debounced_jobs_run_their_rows_call(self) -> None:
        """A debounced job still pending in Redis runs the call its row holds.

        The row is what a rebuild pushes again (G5): a pending job whose
        payload and row disagreed would run one call now and another after
        a loss of Redis data.
        """
        if not self.debounced:
            return
        found = self.job_hashes(sorted(self.debounced))
        rows = Job.objects.in_bulk(sorted(self.debounced))
        for job_id, one in found.items():
            if one["state"] != "scheduled" or one["attempts"] != "0":
                continue
            text = self.broker.client.hget(self.keys.job(job_id), "payload")
            row = rows.get(uuid.UUID(job_id))
            if text is not None and row is not None and json.loads(text)["args"] != row.args:
                self.fail(f"pending debounced job {job_id} runs {json.loads(text)['args']} "
                          f"but its row says {row.args}")

    @invariant()
    def capped_jobs_stay_within_their_cap(self) -> None:
        """No slot is double-counted or granted twice: at most CAP capped jobs are held.

        Every capped job a worker holds with a current token counts a slot
        (else a claim could grant one more), and the slots counted never
        exceed the cap. (A slot leaked, counted for a job that ended, is
        caught at the end: see teardown.)
        """
        if not self.capped:
            return
        counted = self.counted_slots()
        if len(counted) > CAP:
            self.fail(f"the cap of {CAP} counts {len(counted)} slots: {sorted(counted)}")
        found = self.job_hashes(list(self.capped))
        held = {fence[0] for _, fence, _ in self.all_fences()
                if fence[0] in self.capped and self.is_current(fence, found[fence[0]])}
        if len(held) > CAP:
            self.fail(f"{len(held)} capped jobs are held at once (cap {CAP}): {sorted(held)}")
        if held - counted:
            self.fail(f"capped jobs {sorted(held - counted)} are held with a current token "
                      "but count no slot: a claim could start one more than the cap")

    @invariant()
    def redis_and_row_agree_on_the_generation(self) -> None:
        """A job Redis may run (queued, scheduled, running) has its row's generation.

        Every record a worker writes is fenced by the generation of its token:
        a Redis job of another generation than its row runs with every record
        refused, its success never reaching the mirror, and reconcile then
        runs it again. (Excused: a late push that outlived a loss of Redis
        data and landed under a newer rebuild: at least once, after a loss.)
        """
        rows = self.rows()
        if not rows:
            return
        for job_id, found in self.job_hashes(list(rows)).items():
            if found["state"] not in ("queued", "scheduled", "running") \
                    or job_id in self.stale_incarnation:
                continue
            row = rows[job_id]
            if int(found["gen"] or 0) != row.generation:
                self.fail(f"job {job_id} is {found['state']} in Redis at generation "
                          f"{found['gen'] or 0} but its row ({row.state}) is at generation "
                          f"{row.generation}: the mirror refuses every record of it")

    # -- the end of an example: everything recovers ------------------------------

    def teardown(self) -> None:
        """Stop every fault, let sweep, reconcile and a fresh worker finish every job."""
        if self.failed:
            return
        for worker in self.workers:
            worker.forget()
        # Lost pushes are the outbox's business: reconcile must find them.
        self.late_pushes = []
        survivor = SimWorker("survivor")
        if self.paused:
            self.resume_queue()
        for round_ in range(40):
            if round_:
                self.jump()  # leases of the dead workers run out
            Sweep(self.backend.parts).redis_pass()
            self.backdate()
            Sweep(self.backend.parts).reconcile()
            self.cancel_lost.clear()
            while True:
                result = self.broker.claim(QUEUE, count=50, lease_ms=60_000)
                self.take_claims(survivor, result.jobs, result.dead, result.garbage)
                if not result.jobs and not result.dead and not result.garbage:
                    break
            for held in list(survivor.held.values()):
                if self.started(survivor, held, record_start=True):
                    job = held.job
                    del survivor.held[job.fence]
                    now = timezone.now()
                    mirror.record(self.database, [_now_record(
                        job, job_state=JobState.SUCCEEDED, worker_id=survivor.name,
                        started_at=now, finished_at=now, outcome=AttemptOutcome.SUCCEEDED,
                        return_value=job.attempt)])
                    self.broker.ack(QUEUE, [job.fence])
            self.finished_rows_stay_finished()
            rows = self.rows()
            if all(row.state not in (*UNFINISHED_STATES, JobState.WAITING)
                   for row in rows.values()):
                break
        self.broker.__dict__.pop("enqueue", None)
        for job_id, row in self.rows().items():
            if row.state in (*UNFINISHED_STATES, JobState.WAITING):
                self.fail(f"job {job_id} is lost: still {row.state} after recovery "
                          f"(attempts {row.attempts}/{row.max_attempts}, gen {row.generation}, "
                          f"Redis {self.job_hashes([job_id])[job_id]})")
            if row.state == JobState.DEAD and not row.last_error:
                self.fail(f"job {job_id} is dead without an error")
        # Leases that outlived their job's end (a dead holder's) run out, and the sweep takes them.
        self.jump()
        Sweep(self.backend).redis_pass()
        if self.counted_slots():
            self.fail(f"slots leaked: the cap still counts {sorted(self.counted_slots())} "
                      "after every job ended")
