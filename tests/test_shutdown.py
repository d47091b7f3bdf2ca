"""A deploy never runs a job twice: what SIGTERM, a second SIGTERM and ``--grace`` do.

While a worker stops, only two kinds of job may go back to the queue at
once: claims whose task never began, and attempts whose child process this
worker killed and reaped. A task still running in a thread, and a job whose
outcome is with the finisher (perhaps being committed), are left to their
leases: the sweep settles them from the mirror, or runs them again, once
the process is gone and the lease has expired. (The hard stop of a job
whose success is being committed is in test_guarantees.py, section 7.)
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import redis

from reliable_jobs.compat import task_backends
from reliable_jobs.isolation import FORKSERVER_PARENT_ENV
from reliable_jobs.keys import QueueKeys
from reliable_jobs.models import Attempt, AttemptOutcome, Job, JobState
from reliable_jobs.worker import Worker
from reliable_jobs.worker.database import EXECUTOR_THREAD_PREFIX
from testproject.demo import tasks as demo

from .helpers import Processes, wait_until, worker_in_thread

pytestmark = pytest.mark.django_db(transaction=True)
KEYS = QueueKeys("rj", "default")


def executors_alive() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith(EXECUTOR_THREAD_PREFIX)]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_past_its_grace_a_task_running_in_a_thread_is_left_to_its_lease(
    rj_settings: Any, redis_client: redis.Redis
) -> None:
    # Given: a worker with a 0.3 s grace period running a 2 s task in a thread
    rj_settings()
    result = demo.sleep_for.enqueue(2)
    worker = Worker(task_backends["default"], queues=["default"], grace_s=0.3,
                    scheduler=False)
    with worker_in_thread(worker) as thread:
        wait_until(lambda: Job.objects.filter(pk=result.id, state=JobState.RUNNING).exists(),
                   message="the task to start")

        # When: it is stopped and the grace period ends with the task running
        worker._on_signal(signal.SIGTERM, None)
        thread.join(timeout=20)
        assert not thread.is_alive()

        # Then: the task still runs in this process, and the job was not handed
        # back: no other worker can start it while it runs here
        assert executors_alive()
        assert redis_client.lrange(KEYS.queued, 0, -1) == []
        assert redis_client.zscore(KEYS.leases, result.id) is not None
        assert not Attempt.objects.filter(job_id=result.id, outcome=AttemptOutcome.RELEASED)
        wait_until(lambda: not executors_alive(), timeout=10, message="the task to end")


def test_past_its_grace_a_task_in_a_child_is_killed_then_handed_back(
    rj_settings: Any, redis_client: redis.Redis, tmp_path: Path
) -> None:
    # Given: a worker with a 0.3 s grace period running a 30 s task in a child
    # process (the task has a time limit)
    rj_settings()
    pid_file = tmp_path / "child.pid"
    result = demo.report_pid_then_sleep.enqueue(str(pid_file), 30)
    worker = Worker(task_backends["default"], queues=["default"], grace_s=0.3,
                    scheduler=False)
    child = 0
    try:
        with worker_in_thread(worker) as thread:
            wait_until(pid_file.exists, timeout=30, message="the child to start")
            child = int(pid_file.read_text())

            # When: it is stopped and the grace period ends with the child running
            worker._on_signal(signal.SIGTERM, None)
            thread.join(timeout=20)
            assert not thread.is_alive()

            # Then: the job is back on the queue only once its child is gone
            queued = redis_client.lrange(KEYS.queued, 0, -1)
            assert not (queued and alive(child)), "handed back while its child still ran"
            assert queued == [result.id]
            assert list(Attempt.objects.filter(job_id=result.id).values_list(
                "outcome", flat=True)) == [AttemptOutcome.RELEASED]
    finally:
        if child and alive(child):
            os.kill(child, signal.SIGKILL)
        # The worker told its forkserver its pid through the environment:
        # a later import of _child_boot in this process would read it and
        # take this process for a forkserver whose worker died.
        os.environ.pop(FORKSERVER_PARENT_ENV, None)


def test_a_worker_stopped_past_its_grace_exits_and_its_thread_task_runs_again_later(
    rj_settings: Any, processes: Processes, redis_client: redis.Redis
) -> None:
    # Given: a real worker (1 s grace, 5 s leases) running a 30 s task in a thread
    env = rj_settings(LEASE_MS=5_000, RENEW_INTERVAL_MS=500, RECONCILE_GRACE_MS=5_000)
    result = demo.sleep_for.enqueue(30)
    worker = processes.worker(env, "--grace", "1", "--no-scheduler")
    wait_until(lambda: Job.objects.filter(pk=result.id, state=JobState.RUNNING).exists(),
               timeout=30, message="the task to start")

    # When: a deploy SIGTERMs it
    stopped_at = time.monotonic()
    assert processes.stop(worker) == 0, processes.log(worker)

    # Then: it exited soon after its grace period, and the job was not handed
    # back (it is left to its lease, which outlives the process)
    assert time.monotonic() - stopped_at < 10
    assert redis_client.lrange(KEYS.queued, 0, -1) == []
    assert redis_client.zscore(KEYS.leases, result.id) is not None
    assert "left to their leases" in processes.log(worker)

    # And: once the lease expired, another worker runs it again, charged
    # an attempt (the first one was cut short with its process)
    processes.worker(env, "--no-scheduler")
    wait_until(lambda: Attempt.objects.filter(job_id=result.id, number=2).exists(),
               timeout=30, message="the job to run again")
    assert list(Attempt.objects.filter(job_id=result.id, number=1).values_list(
        "outcome", flat=True)) == [AttemptOutcome.LEASE_EXPIRED]


def test_a_burst_worker_exits_once_it_stopped_without_the_interpreter_teardown(
        rj_settings: Any, processes: Processes) -> None:
    # Given a job whose task leaves a non-daemon thread running for two minutes
    # (a library's background thread, say): an interpreter's normal exit
    # would wait for it, as it takes its time tearing down every module
    env = rj_settings()
    job = demo.leave_a_thread.enqueue(120.0)

    # When a burst worker runs it and finds the queue empty
    worker = processes.worker(env, "--burst")

    # Then the process ends as soon as the worker stopped, cleanly, its job done
    assert worker.wait(timeout=30) == 0, processes.log(worker)
    assert "stopped: 1 claimed, 1 succeeded" in processes.log(worker)
    assert Job.objects.get(pk=job.id).state == JobState.SUCCEEDED
