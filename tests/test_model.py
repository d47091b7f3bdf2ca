"""A model-based test of the whole queue: real scripts, real mirror, simulated workers.

Why: the script tests check each Lua script alone and the process tests
check a few fault schedules end to end; neither explores the interleavings
of many small steps (claims, starts, stale finishes, sweeps, reconciles,
Redis flushes, staff actions) where a fencing or mirroring mistake hides.
A Hypothesis ``RuleBasedStateMachine`` drives exactly those steps against
the real Redis scripts (through the default backend's :class:`Broker`) and
the real PostgreSQL mirror (``mirror.record``, ``Sweep``, ``staff``), with
up to three simulated workers, and checks after every step the promises of
README "Guarantees" and docs/design.md:

- one live token per job: a fencing token (id, attempt, gen) is never
  handed out twice, so two workers can never both hold a current token;
- terminal mirror states are final: a succeeded row stays succeeded, a dead
  row stays dead unless a staff retry moved it, a cancelled row stays
  cancelled unless a staff requeue moved it;
- a cancelled job never starts (and no finished job is handed out again);
- every unfinished row is reachable: Redis holds it where a script will
  find it, or reconcile would rebuild (or bury) it;

and, at the end of each example, that once every fault stops and the
sweep, reconcile and a fresh worker have run, every job is succeeded, dead
with its error, or cancelled: nothing is lost (G1).

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
