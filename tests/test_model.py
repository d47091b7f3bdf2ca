"""A model-based test of the whole queue: real scripts, real mirror, simulated workers.

Why: the script tests check each Lua script alone and the process tests
check a few fault schedules end to end; neither explores the interleavings
of many small steps (claims, starts, stale finishes, sweeps, reconciles,
Redis flushes, staff actions) where a fencing or mirroring mistake hides.
A Hypothesis ``RuleBasedStateMachine`` drives exactly those steps against
the real Redis scripts (through the default backend's :class:`Broker`) and
the real PostgreSQL mirror (``mirror.record``, ``Sweep``, ``staff``), with
up to three simulated workers, and checks after every step the promises of
docs/explanation/guarantees.md and docs/design.md:

- one live token per job: a fencing token (id, attempt, gen) is never
  handed out twice, so two workers can never both hold a current token;
- terminal mirror states are final: a succeeded row stays succeeded, a dead
  row stays dead unless a staff retry moved it, a cancelled row stays
  cancelled unless a staff requeue moved it;
- a cancelled job never starts (and no finished job is handed out again);
- every unfinished row is reachable: Redis holds it where a script will
  find it, or reconcile would rebuild (or bury) it;
- a job whose success is in the mirror never starts again, and a success
  Redis took (its ack applied) is in the mirror;
- Redis and the row agree on the generation: a job Redis may run has its
  row's generation, or the mirror refuses every record of it;
- a job whose every attempt snoozed is never dead (a snooze uses no attempt);
- a claim whose lease ran out is not started; a job handed back by a
  stopping worker does not start elsewhere while that worker still runs
  it; an equal call of a unique task is not merged into a job that began;
- while the queue is paused and its flag is in Redis, no claim hands out a
  job and no claimed job starts (one claimed before the pause is handed back
  unstarted), and after Redis lost the flag a sweep pass or reconcile puts
  it back;
- a debounced call joins only a pending job, and a pending debounced job
  runs the call its row holds;

and, at the end of each example, that once every fault stops and the
sweep, reconcile and a fresh worker have run, every job is succeeded, dead
with its error, or cancelled: nothing is lost (G1).

The faults: workers stall, die (SIGKILL, with a COMMIT on its way or not)
or stop (first or second signal, past the grace period or not) with jobs
at every stage: claimed, running, finished with the outcome not committed,
committed and not acked; the sweep stalls or dies; Redis loses everything,
or fails over and loses one cancel; a COMMIT fails after its transaction
acted in Redis (a worker batch, reconcile, every staff action); a push is
late (a producer's on-commit push, held across steps) or slow (a rebuild's
push, overtaken by the job's late push or by a loss of Redis data); staff
cancel and reprioritize one job at once; unique calls arrive while their
job runs; staff pause and resume the queue; debounced calls arrive at every
stage of their job (pending, promoted, claimed, running, lost by Redis).
Time passes only when a step says so (the machine moves every deadline Redis holds), so a replayed
program does what it did.

The helpers a reader needs to replay a failure by hand live in
``tests/model_helpers.py``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import run_state_machine_as_test

from tests.model_helpers import LEASE_MS, QueueMachine

pytestmark = pytest.mark.django_db(transaction=True)

#: Small programs, many of them: a violation usually needs fewer than ten steps.
MODEL_SETTINGS = settings(
    # RJ_MODEL_EXAMPLES explores longer (a few hundred find rarer schedules).
    max_examples=int(os.environ.get("RJ_MODEL_EXAMPLES", "50")),
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    print_blob=True,
)


def test_the_queue_keeps_its_promises_under_any_schedule(rj_settings: Any) -> None:
    """Run the state machine against the real broker, mirror, sweep and staff actions."""
    # Leases of tens of ms so a step can let them expire; reconcile's grace
    # is as short as the contract allows (>= LEASE_MS) and the reconcile
    # rule backdates rows anyway, as a grace period that has passed.
    rj_settings(LEASE_MS=LEASE_MS, RENEW_INTERVAL_MS=LEASE_MS // 3,
                RECONCILE_GRACE_MS=LEASE_MS, MAX_ATTEMPTS=3)
    run_state_machine_as_test(QueueMachine, settings=MODEL_SETTINGS)




# -- the violations the machine found, as fixed programs --------------------------
#
# Each is the shrunk program (steps as QueueMachine calls), replayed without
# Hypothesis so it fails the same way every run until the bug is fixed.


def replay(*steps: Callable[[QueueMachine], object]) -> None:
    """Run ``steps`` on a fresh machine, checking every invariant after each one."""
    machine = QueueMachine()
    for step in steps:
        step(machine)
        machine.redis_and_row_agree_on_the_generation()
        machine.one_live_token_per_job()
        machine.finished_rows_stay_finished()
        machine.finished_rows_are_not_waiting_in_redis()
        machine.unfinished_rows_are_reachable()
        machine.waiting_jobs_wait_at_their_priority()
        machine.waiting_jobs_take_their_turn_in_their_group()
        machine.waiting_jobs_wait_for_something()
        machine.pending_debounced_jobs_run_their_rows_call()
        machine.snoozes_never_bury_a_job()
    machine.teardown()


@pytest.fixture
def model_settings(rj_settings: Any) -> None:
    rj_settings(LEASE_MS=LEASE_MS, RENEW_INTERVAL_MS=LEASE_MS // 3,
                RECONCILE_GRACE_MS=LEASE_MS, MAX_ATTEMPTS=3)


def test_a_stale_workers_success_does_not_finish_a_job_redis_gave_away(
    model_settings: None,
) -> None:
    """Found by the machine: worker 0 stalls past its lease, the sweep requeues the
    job (its record not yet written), then worker 0 wakes and mirrors success:
    the row says succeeded while Redis hands the job out again."""
    replay(
        lambda m: m.enqueue(deferred=False, late=False),
        lambda m: m.claim(k=0, count=1, start=True),
        lambda m: m.sweep(expire=True, stall=False, crash=False),
        lambda m: m.finish(index=0, outcome="succeeded", ack_now=True),  # ack refused
        lambda m: m.claim(k=1, count=1, start=True),
    )


def test_a_stale_workers_failure_does_not_bury_a_job_redis_gave_away(
    model_settings: None,
) -> None:
    """Same stall, with the sweep's lease_expired record written first: the stale
    failure still moves the row to dead (its Attempt row says lease_expired,
    "result discarded"), and the next attempt moves it out of dead again."""
    replay(
        lambda m: m.enqueue(deferred=False, late=False),
        lambda m: m.claim(k=0, count=1, start=True),
        lambda m: m.sweep(expire=True, stall=False, crash=False),
        lambda m: m.finish(index=0, outcome="dead", ack_now=True),  # nack refused
        lambda m: m.claim(k=1, count=1, start=True),
    )


def test_a_sweep_that_stalls_after_expired_does_not_rerun_a_mirrored_success(
    model_settings: None,
) -> None:
    """A success is in the mirror and its ack pending; the sweep reads expired.lua
    (the lease is still live: nothing to settle), stalls past the lease, and
    recover.lua requeues the attempt as 'expired': the succeeded job runs again."""
    replay(
        lambda m: m.enqueue(deferred=False, late=False),
        lambda m: m.claim(k=0, count=1, start=True),
        lambda m: m.finish(index=0, outcome="succeeded", ack_now=False),
        lambda m: m.sweep(expire=False, stall=True, crash=False),
        lambda m: m.claim(k=1, count=1, start=True),
    )


def test_a_late_push_does_not_bring_back_a_job_cancelled_while_scheduled(
    model_settings: None,
) -> None:
    """A producer stalls between its commit and its push (longer than the grace);
    reconcile rebuilds the job (gen 1, scheduled), staff cancel it (cancel.lua
    deletes a scheduled job's hash: no tombstone), then the stalled gen-0 push
    arrives: enqueue.lua finds no hash, writes the job again, and it runs."""
    replay(
        lambda m: m.enqueue(deferred=True, late=True),
        lambda m: m.reconcile(),
        lambda m: m.staff_action(action="cancel", index=0),
        lambda m: m.late_push(index=0),
        lambda m: m.sweep(expire=True, stall=False, crash=False),  # due: promoted
        lambda m: m.sweep(expire=True, stall=False, crash=False),
        lambda m: m.claim(k=0, count=1, start=True),
    )


# -- violations of the rules for shutdowns, failed commits, slow and stale pushes,
# -- lost cancels and unique enqueues (each fails until its fix lands) -------------


def test_a_reconcile_whose_commit_fails_leaves_redis_on_a_generation_the_row_never_got(
    model_settings: None,
) -> None:
    """Redis loses a queued job; reconcile raises its row to generation 1 and pushes
    generation 1 inside the same transaction, whose COMMIT then fails: the row rolls
    back to generation 0 while Redis runs generation 1, and the mirror refuses every
    record of that run (its success never lands; reconcile runs the job again).
    (Bug 1: the rebuild must commit before it pushes.)"""
    replay(
        lambda m: m.enqueue(deferred=False, late=False),
        lambda m: m.flush_redis(),
        lambda m: m.reconcile(commit_fails=True),
    )


def test_a_staff_retry_whose_commit_fails_leaves_redis_on_a_generation_the_row_never_got(
    model_settings: None,
) -> None:
    """A dead job Redis no longer holds is retried: the action raises the row to
    generation 1 and pushes generation 1 before its COMMIT, which fails. The row is
    dead at generation 0, Redis runs generation 1 whose records the mirror refuses.
    (Bug 1, staff retry.)"""
    replay(
        lambda m: m.enqueue(deferred=False, late=False),
        lambda m: m.claim(k=0, count=1, start=True),
        lambda m: m.finish(index=0, outcome="dead", ack_now=True),
        lambda m: m.flush_redis(),
        lambda m: m.staff_action(action="retry", index=0, commit_fails=True),
    )


def test_a_staff_requeue_whose_commit_fails_runs_a_job_the_row_says_is_cancelled(
    model_settings: None,
) -> None:
    """A cancelled job is requeued: the action pushes generation 1 (over the cancel
    tombstone) before its COMMIT, which fails. The row stays cancelled at generation
    0 and the admin saw an error, yet Redis runs the job at generation 1.
    (Bug 1, staff requeue.)"""
    replay(
        lambda m: m.enqueue(deferred=False, late=False),
        lambda m: m.staff_action(action="cancel", index=0),
        lambda m: m.staff_action(action="requeue", index=0, commit_fails=True),
    )


def test_a_rebuild_whose_push_a_late_push_beat_does_not_raise_the_rows_generation(
    model_settings: None,
) -> None:
    """A producer stalls between its commit and its push, past the grace; reconcile
    finds no job in Redis and raises the row to generation 1, but its push is slow
    and the stalled generation-0 push lands first: Redis refuses the rebuild (it
    holds the job), the row keeps generation 1, and every record of the run Redis
    holds is refused. (Bug 2.)"""
    replay(
        lambda m: m.enqueue(deferred=False, late=True),
        lambda m: m.reconcile(slow_push="late_first"),
    )


def test_a_hard_stop_does_not_hand_back_a_success_being_committed(
    model_settings: None,
) -> None:
    """A task succeeded and the finisher is committing its outcome when a second
    SIGTERM arrives: the shutdown hands the job back (it is not yet "mirrored"),
    then the COMMIT lands. The row says succeeded while Redis queues the job, and
    another worker runs it again. (Bug 3.)"""
    replay(
        lambda m: m.enqueue(deferred=False, late=False),
        lambda m: m.claim(k=0, count=1, start=True),
        lambda m: m.finish(index=0, outcome="succeeded", ack_now=False, commit_now=False),
        lambda m: m.stop(k=0, hard=True, grace_over=True, commit="late", rival=True),
    )


def test_a_task_still_running_after_the_grace_period_is_not_handed_back(
    model_settings: None,
) -> None:
    """SIGTERM; the grace period ends with a task still running in a thread (which
    cannot be stopped): the shutdown hands its job back, and another worker starts
    it while this process still runs it. (Bug 4.)"""
    replay(
        lambda m: m.enqueue(deferred=False, late=False),
        lambda m: m.claim(k=0, count=1, start=True),
        lambda m: m.stop(k=0, hard=False, grace_over=True, commit="never", rival=True),
    )


def test_a_stale_holders_late_record_does_not_close_the_current_attempt(
    model_settings: None,
) -> None:
    """Worker 0 holds attempt 2 of generation 0, which the mirror never heard of (a
    claim that never started was requeued, the next started without its record).
    Redis restarts empty; reconcile rebuilds generation 1 and worker 1 starts its
    attempt 1. Worker 0's late success is refused everywhere except by the rule that
    closes abandoned attempts, which has no generation check: it closes the current
    attempt 1 as lease_expired, so worker 1's success never reaches the row while
    Redis acks it (reconcile would run the job again). (Bug 5.)"""
    replay(
        lambda m: m.enqueue(deferred=False, late=False),
        lambda m: m.claim(k=0, count=1, start=False),
        lambda m: m.sweep(expire=True, stall=False, crash=False),  # never started: requeued
        lambda m: m.claim(k=0, count=1, start=False),
        lambda m: m.start(index=1, record_start=False),  # attempt 2, unrecorded
        lambda m: m.flush_redis(),
        lambda m: m.reconcile(),
        lambda m: m.claim(k=1, count=1, start=True),  # generation 1, attempt 1
        lambda m: m.finish(index=0, outcome="succeeded", ack_now=True),  # worker 0, stale
        lambda m: m.finish(index=0, outcome="succeeded", ack_now=True),  # worker 1
    )


def test_a_unique_call_is_not_merged_into_a_job_that_already_started(
    model_settings: None,
) -> None:
    """A unique task (unique_while_running off) starts; its start record is still on
    its way to the mirror (the finisher writes it with the outcome), so the row says
    queued, and an equal call gets the running job instead of a new one: the call
    never runs. (Bug 7.)"""
    replay(
        lambda m: m.enqueue_unique(),
        lambda m: m.claim(k=0, count=1, start=False),
        lambda m: m.start(index=0, record_start=False),
        lambda m: m.enqueue_unique(),
    )


def test_a_stale_push_does_not_bring_back_a_job_cancelled_while_queued(
    model_settings: None,
) -> None:
    """A producer stalls between its commit and its push; reconcile rebuilds the job
    (generation 1, queued); staff cancel it (a tombstone); a claim reaches its id and
    drops it with the tombstone; then the stalled generation-0 push arrives, finds
    nothing and writes the job again: the cancelled job runs. (Bug 9.)"""
    replay(
        lambda m: m.enqueue(deferred=False, late=True),
        lambda m: m.reconcile(),
        lambda m: m.staff_action(action="cancel", index=0),
        lambda m: m.claim(k=0, count=1, start=True),  # drops the cancelled id
        lambda m: m.late_push(index=0),
        lambda m: m.claim(k=0, count=1, start=True),
    )


def test_reconcile_redoes_a_cancel_redis_lost(model_settings: None) -> None:
    """Staff cancel a queued job; Redis fails over to a replica that missed the
    cancel: the row says cancelled, Redis queues the job. Reconcile never looks at a
    cancelled row, so a worker runs the cancelled job. (Bug 10, reconcile.)"""
    replay(
        lambda m: m.enqueue(deferred=False, late=False),
        lambda m: m.staff_cancel_lost(index=0),
        lambda m: m.reconcile(),
        lambda m: m.claim(k=0, count=1, start=True),
    )


def test_the_finisher_does_not_retry_an_attempt_the_mirror_recorded_as_cancelled(
    model_settings: None,
) -> None:
    """A running job is cancelled and Redis loses the cancel's mark in a failover.
    Its attempt fails; the mirror records it as cancelled (the row is), but the
    finisher nacks it for a retry as the task's failure said: Redis queues a job
    whose row is cancelled, to run again and again. (Bug 10, finisher.)"""
    replay(
        lambda m: m.enqueue(deferred=False, late=False),
        lambda m: m.claim(k=0, count=1, start=True),
        lambda m: m.staff_cancel_lost(index=0),
        lambda m: m.finish(index=0, outcome="queued", ack_now=True),
    )


def test_a_claim_whose_lease_expired_is_not_started(model_settings: None) -> None:
    """A worker claims a job and stalls past its lease before it marks it started:
    start.lua marks it anyway (it checks the token, not the lease's deadline), so
    the task runs while the sweep may requeue the job for another worker.
    (start.lua ignores the lease deadline.)"""
    replay(
        lambda m: m.enqueue(deferred=False, late=False),
        lambda m: m.claim(k=0, count=1, start=False),
        lambda m: m.pause(),
        lambda m: m.start(index=0, record_start=True),
    )


def test_a_claim_in_flight_when_the_pause_returned_does_not_start(model_settings: None) -> None:
    """A worker claims a job, the queue is paused, then the worker marks it started:
    the claim ran before the pause, so only the start can keep the promise that
    no attempt starts after a pause returned; the job is handed back unstarted,
    and after Redis loses everything the sweep pauses the queue again before
    reconcile pushes the job back. (start.lua did not read the pause flag.)"""
    replay(
        lambda m: m.enqueue(deferred=False, late=False),
        lambda m: m.claim(k=0, count=1, start=False),
        lambda m: m.pause_queue(),
        lambda m: m.start(index=0, record_start=True),
        lambda m: m.flush_redis(),
        lambda m: m.reconcile(),
        lambda m: m.claim(k=1, count=1, start=True),
        lambda m: m.resume_queue(),
        lambda m: m.claim(k=1, count=1, start=True),
    )


def test_a_flush_during_reconcile_leaves_the_pause_to_the_next_sweep_pass(
        model_settings: None) -> None:
    """Redis loses everything once the queue is paused, and again while reconcile
    pushes (after it put the flag back): the flag is lost a second time, and the
    next sweep pass puts it back before any claim may take a pushed job."""
    replay(
        lambda m: m.first_jobs(deferred=[False]),
        lambda m: m.pause_queue(),
        lambda m: m.flush_redis(),
        lambda m: m.reconcile(commit_fails=False, slow_push="flush_first"),
        lambda m: m.sweep(expire=False, stall=False, crash=False),
        lambda m: m.claim(k=0, count=1, start=True),
    )


def test_a_moved_id_put_back_by_a_paused_claim_gets_its_turn_among_fair_groups(
        model_settings: None) -> None:
    """A worker moves a plain job off queued (BLMOVE), a grouped job arrives, the
    queue is paused, and the worker's claim puts the plain job back: the plain
    list must rejoin priority 0's rotation, or it never gets a turn.
    (claim.lua's paused path pushed the id back without its turn.)"""
    replay(
        lambda m: m.first_jobs(deferred=[False]),
        lambda m: m.land(k=0),
        lambda m: m.enqueue(deferred=False, late=True, priority=0, tenant="t1"),
        lambda m: m.pause_queue(),
        lambda m: m.late_push(index=0),
        lambda m: m.claim_landed(k=0),
    )


def test_snoozes_never_use_up_a_jobs_attempts(model_settings: None) -> None:
    """A job of three attempts snoozes three times, then is claimed again: were a
    snooze to use an attempt, the claim would bury it with no attempt left though
    its task never failed. (snooze.lua gives the attempt back.)"""
    snooze_once = (
        lambda m: m.claim(k=0, count=1, start=True),
        lambda m: m.finish(index=0, outcome="snoozed", ack_now=True),
        lambda m: m.pause(),
        lambda m: m.sweep(expire=False, stall=False, crash=False),
    )
    replay(
        lambda m: m.enqueue(deferred=False, late=False),
        *snooze_once, *snooze_once, *snooze_once,
        lambda m: m.claim(k=0, count=1, start=True),
        lambda m: m.finish(index=0, outcome="succeeded", ack_now=True),
    )


def test_a_capped_job_cancelled_with_a_failing_commit_gives_its_slot_back(
        model_settings: None) -> None:
    """A capped job is moved off queued (BLMOVE), every lease runs out, a second
    capped job arrives and staff cancel it while the cancel's COMMIT fails: no
    concurrency slot may stay counted once every job ended. (The sweep leased
    the stale landing copy of the job, which reconcile had rebuilt and a claim
    had run: the lease made its old running-set entry count again.)"""
    replay(
        lambda m: m.first_jobs(deferred=[True]),
        lambda m: m.enqueue_capped(),
        lambda m: m.land(k=0),
        lambda m: m.pause(),
        lambda m: m.enqueue_capped(),
        lambda m: m.staff_action("cancel", commit_fails=True, index=1),
    )
