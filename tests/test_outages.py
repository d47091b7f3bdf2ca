"""Outages that hang instead of failing: the database black-holed for seconds.

A refused connection is easy: the worker sees an error at once. A database
that hangs (a black-holed network path, a server stuck on a lock) gives the
worker nothing to react to. Leases must not care: the lease keeper renews
from Redis alone, so a hung database delays the mirror and recovery, never a
renewal, and no job of the affected worker runs twice.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

import pytest
from django.utils import timezone

from reliable_jobs.compat import task_backends
from reliable_jobs.contrib.verify.netfaults import CuttableProxy
from reliable_jobs.models import Attempt, AttemptOutcome, Job, JobState
from testproject.demo import tasks as demo

from .helpers import Processes, wait_until

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow, pytest.mark.crash]

#: A queue only worker A serves: expired attempts planted there are found by
#: A's maintenance thread alone, whose database work then hangs for sure.
PLANTED = "planted"


def test_postgresql_that_hangs_for_three_leases_reruns_nothing(
    rj_settings: Any, processes: Processes
) -> None:
    # Given: worker A reaches PostgreSQL through a proxy that can black-hole
    # it, worker B directly; both hold 1.5 s jobs (leases of 1 s)
    proxy = CuttableProxy(5432)
    try:
        env = rj_settings(LEASE_MS=1_000, RENEW_INTERVAL_MS=200, SWEEP_INTERVAL_MS=200,
                          queues=["default", PLANTED])
        env_a = {**env, "DATABASE_URL": env["DATABASE_URL"].replace(":5432/",
                                                                   f":{proxy.port}/")}
        assert env_a["DATABASE_URL"] != env["DATABASE_URL"]
        ids = [demo.sleep_for.enqueue(1.5).id for _ in range(12)]
        worker_a = processes.worker(env_a, "--concurrency", "3", "--prefetch", "0",
                                    "--worker-id", "A")
        worker_b = processes.worker(env, "--concurrency", "3", "--prefetch", "0",
                                    "--worker-id", "B", "--queue", "default")
        wait_until(lambda: Attempt.objects.filter(job_id__in=ids, worker_id="A",
                                                  outcome="").exists()
                   and Attempt.objects.filter(job_id__in=ids, worker_id="B").exists(),
                   timeout=30, message="both workers to start jobs")

        # When: the database hangs for three leases; right as it starts, A's
        # maintenance thread is given expired started attempts to look up in
        # the mirror (claimed by hand with a short lease and abandoned)
        proxy.stall()
        stalled_at = time.monotonic()
        extra = [demo.sleep_for.using(queue_name=PLANTED).enqueue(0.01).id for _ in range(5)]
        broker = task_backends["default"].broker
        claimed = broker.claim(PLANTED, count=5, lease_ms=150).jobs
        assert claimed, "A claimed every planted job first"
        assert broker.start(PLANTED, [job.fence for job in claimed]) == [True] * len(claimed)
        planted = [job.id for job in claimed]
        time.sleep(max(0.0, 3.0 - (time.monotonic() - stalled_at)))
        proxy.resume()
        resumed_at = timezone.now()

        # Then: every job succeeds, and none but the planted ones ran twice
        everything = ids + extra
        wait_until(lambda: Job.objects.filter(pk__in=everything,
                                              state=JobState.SUCCEEDED).count() == len(everything),
                   timeout=60, message="every job to succeed after the stall")
        attempts = Counter(Attempt.objects.filter(job_id__in=ids).values_list("job_id",
                                                                                 flat=True))
        rerun = {str(job_id): n for job_id, n in attempts.items() if n > 1}
        assert not rerun, f"jobs ran more than once: {rerun}"
        expired = Attempt.objects.filter(job_id__in=ids, outcome=AttemptOutcome.LEASE_EXPIRED)
        assert not expired.exists(), list(expired.values_list("job_id", "worker_id", "error"))
        assert Attempt.objects.filter(job_id__in=ids, worker_id="A").exists()
        assert "Lost the lease" not in processes.log(worker_a), processes.log(worker_a)
        # A's maintenance thread found the planted attempts during the stall and
        # waited for the mirror's answer: it recovered them only once it resumed
        recovered = Attempt.objects.filter(job_id__in=planted,
                                           outcome=AttemptOutcome.LEASE_EXPIRED)
        assert recovered.count() == len(planted)
        assert all(at >= resumed_at for at in recovered.values_list("finished_at", flat=True))
        procs = (worker_a, worker_b)
        for proc, code in zip(procs, processes.stop_many(*procs), strict=True):
            assert code == 0, processes.log(proc)
    finally:
        proxy.close()
