"""How long a worker waits on a queue its limits hold (worker/holds.py), without a server."""

from __future__ import annotations

import pytest

from reliable_jobs.flow import NO_LIMITS, Limits, Rate
from reliable_jobs.worker.holds import BACKOFF_MAX_S, FlowHolds


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def holds(clock: Clock) -> FlowHolds:
    limits = {"emails": Limits(Rate(100, 1_000), 5)}
    return FlowHolds(lambda q: limits.get(q, NO_LIMITS), max_wait_s=1.0, clock=clock)


def test_a_queue_passes_its_own_limits_and_a_shard_its_queues() -> None:
    h = holds(Clock())
    assert h.claim_args("emails") == (100, 1_000, 5)
    assert h.claim_args("emails#3") == (100, 1_000, 5)
    assert h.claim_args("other") == (0, 0, 0)


def test_no_hold_no_wait_and_the_first_hold_waits_the_scripts_hint() -> None:
    clock = Clock()
    h = holds(clock)
    assert h.wait_s() is None
    h.record("emails", 10)
    assert h.wait_s() == pytest.approx(0.01)


def test_a_queue_held_again_and_again_backs_off_to_the_cap_then_resets() -> None:
    # Given a queue whose cap stays full: each claim is told 10 ms
    clock = Clock()
    h = holds(clock)
    waits = []
    for _ in range(5):
        h.record("emails", 10)
        waits.append(round(h.wait_s() or 0, 3))

    # Then the waits double up to BACKOFF_MAX_S
    assert waits == [0.01, 0.02, 0.04, BACKOFF_MAX_S, BACKOFF_MAX_S]

    # And a claim that did something starts again from the hint
    h.record("emails", -1)
    assert h.wait_s() is None
    h.record("emails", 10)
    assert h.wait_s() == pytest.approx(0.01)


def test_a_rates_hold_is_exact_and_never_backs_off() -> None:
    h = holds(Clock())
    for _ in range(4):
        h.record("emails", 10, by_cap=False)
    assert h.wait_s() == pytest.approx(0.01)


def test_a_rates_longer_hint_is_kept_and_capped_by_max_wait() -> None:
    clock = Clock()
    h = holds(clock)
    h.record("emails", 300)
    assert h.wait_s() == pytest.approx(0.3)
    h.record("emails", 5_000)
    assert h.wait_s() == pytest.approx(1.0)
    clock.now += 10
    assert h.wait_s() == 0.001  # past: try again at once
