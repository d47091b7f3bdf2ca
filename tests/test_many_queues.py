"""A worker serving many queues: empty ones are skipped, yet none waits long (worker/skip.py).

Real ``manage.py runworker`` processes against Redis and PostgreSQL.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from reliable_jobs.compat import task_backends
from reliable_jobs.models import Job, JobState
from testproject.demo import tasks as demo

from .conftest import Processes, wait_until

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]
# The demo tasks live on "default", which must be among them.
QUEUES = ["default", *(f"q{i:03d}" for i in range(1, 100))]
FLOOD = 10_000


def succeeded(*job_ids: str) -> bool:
    return Job.objects.filter(pk__in=job_ids, state=JobState.SUCCEEDED).count() == len(job_ids)


def test_job_on_a_quiet_queue_starts_while_another_is_flooded(
    rj_settings: Any, processes: Processes
) -> None:
    # Given: a worker serving 100 queues, busy draining a flood on one of them
    env = rj_settings(queues=QUEUES)
    backend = task_backends["default"]
    flooded = demo.noop.using(queue_name="default")
    backend.enqueue_many(flooded, (((), {}) for _ in range(FLOOD)))
    worker = processes.worker(env)
    wait_until(lambda: Job.objects.filter(queue="default", state=JobState.SUCCEEDED).exists(),
               timeout=60, message="the flood to start draining")

    # When: one job arrives on each of three queues the worker has found empty
    probes = [demo.noop.using(queue_name=q).enqueue().id for q in ("q017", "q050", "q099")]
    drained = Job.objects.filter(queue="default", state=JobState.SUCCEEDED).count()
    assert drained < FLOOD, "the flood drained before the probes were enqueued"

    # Then: they run, and before the flood is over (no queue starves behind it)
    wait_until(lambda: succeeded(*probes), timeout=120, message="the probes to run")
    wait_until(lambda: Job.objects.filter(queue="default", state=JobState.SUCCEEDED).count()
               == FLOOD, timeout=180, message="the flood to drain")
    flood_end = max(Job.objects.filter(queue="default").values_list("finished_at", flat=True))
    for probe in Job.objects.filter(pk__in=probes):
        assert probe.finished_at is not None and probe.finished_at < flood_end, probe.queue
    assert processes.stop(worker) == 0, processes.log(worker)


def test_idle_worker_on_many_queues_starts_a_job_on_any_of_them(
    rj_settings: Any, processes: Processes
) -> None:
    # Given: an idle worker serving 100 empty queues, long enough to skip them all
    env = rj_settings(queues=QUEUES)
    worker = processes.worker(env)
    wait_until(lambda: "serving" in processes.log(worker), message="worker start")
    time.sleep(1.0)  # its first rounds find every queue empty

    for queue in ("q073", "q001", "q099"):
        # When: a job arrives on one of them
        job = demo.noop.using(queue_name=queue).enqueue()

        # Then: it runs promptly (bounded wait; speed is the bench's business)
        wait_until(lambda job_id=job.id: succeeded(job_id), timeout=20,
                   message=f"the job on {queue} to run")
    assert processes.stop(worker) == 0, processes.log(worker)
