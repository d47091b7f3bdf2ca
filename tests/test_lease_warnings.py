""""Lost the lease" is logged for real losses only, never for a job the finisher just acked.

The lease keeper renews a snapshot of the jobs in hand; the finisher may ack
some of them before the renewal reaches Redis, which then refuses it (the
job is no longer running). Those jobs are done, not lost.
"""

from __future__ import annotations

from typing import Any

import pytest
import redis

from reliable_jobs.broker import ClaimedJob
from reliable_jobs.compat import task_backends
from reliable_jobs.models import Job, JobState
from reliable_jobs.worker.leases import LeaseKeeper
from reliable_jobs.worker.registry import InHand
from reliable_jobs.worker.shared import Shared
from testproject.demo import tasks as demo

from .helpers import Processes

#: Enough for the drain to last many renewal intervals (RENEW_INTERVAL_MS=20): with the
#: keeper's acked-job filter removed, 4,000 jobs logged ~1,500 false losses, 2,000 still 250.
JOBS = 4_000


@pytest.mark.django_db(transaction=True)
@pytest.mark.slow
def test_a_long_drain_logs_no_lost_lease(rj_settings: Any, processes: Processes) -> None:
    # Given: many no-op jobs and leases renewed far more often than the drain lasts
    env = rj_settings(RENEW_INTERVAL_MS=20)
    backend = task_backends["default"]
    backend.enqueue_many(demo.noop, (((), {}) for _ in range(JOBS)))

    # When: a burst worker drains them
    worker = processes.worker(env, "--burst", "-v", "0")
    assert worker.wait(timeout=300) == 0, processes.log(worker)[-3000:]

    # Then: every job succeeded once, and no lease was reported lost
    assert Job.objects.filter(state=JobState.SUCCEEDED, attempts=1).count() == JOBS
    log = processes.log(worker)
    assert log.count("Lost the lease") == 0, log[-3000:]


def keeper_holding(job: ClaimedJob) -> tuple[InHand, LeaseKeeper]:
    """A lease keeper (on the default backend's Redis) for a worker holding ``job``."""
    shared = Shared()
    shared.in_hand.add([job])
    keeper = LeaseKeeper(broker=task_backends["default"].broker, shared=shared,
                         lease_ms=60_000, renew_interval_ms=1_000, beat_info=dict)
    return shared.in_hand, keeper


def test_a_refused_renewal_still_warns_and_loses_a_job_in_hand(
    rj_settings: Any, redis_client: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    # Given: a job in hand (not run, not mirrored) whose lease Redis no longer knows
    rj_settings()
    job = ClaimedJob("default", "not-in-redis", 1, 0, "{}", 0)
    in_hand, keeper = keeper_holding(job)

    # When: the keeper renews
    assert keeper.renew()

    # Then: it is lost, and said so
    assert in_hand.renewable() == {}
    assert "Lost the lease of job not-in-redis attempt 1" in caplog.text


def test_a_refused_renewal_of_a_mirrored_job_is_not_a_loss(
    rj_settings: Any, redis_client: redis.Redis, caplog: pytest.LogCaptureFixture
) -> None:
    # Given: a job whose outcome is in the mirror (its ack on its way) and
    # whose renewal Redis refuses, as after the ack landed
    rj_settings()
    job = ClaimedJob("default", "acked", 1, 0, "{}", 0)
    in_hand, keeper = keeper_holding(job)
    in_hand.done(job)
    in_hand.mirrored([job])

    # When: the keeper renews
    assert keeper.renew()

    # Then: no warning, and it is not marked lost
    assert "Lost the lease" not in caplog.text
    assert [j.id for jobs in in_hand.renewable().values() for j in jobs] == ["acked"]
