"""``runworker --processes P``: a real supervisor process and its real children.

Each test starts ``manage.py runworker --processes 2 --worker-id sup``, so
the children are ``sup-1`` and ``sup-2`` and every replacement gets the next
number. Child pids come from the supervisor's log ("Started worker sup-n (pid
p)") and are checked with ``os.kill(pid, 0)``; the supervisor reaps its
children, so a pid that still answers after it exited is a process left
behind.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from reliable_jobs.backend import ReliableJobsBackend
from reliable_jobs.compat import TaskResultStatus, task_backends
from reliable_jobs.keys import QueueKeys
from reliable_jobs.models import Attempt, AttemptOutcome, Job, JobState
from testproject.demo import tasks as demo

from .helpers import Processes, wait_until

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]
KEYS = QueueKeys("rj", "default")
STARTED = re.compile(r"Started worker (sup-\d+) \(pid (\d+)\)")
REPLACING = re.compile(r"Starting a replacement in ([\d.]+) s")
Start = Callable[..., subprocess.Popen[bytes]]


def children(processes: Processes, supervisor: subprocess.Popen[bytes]) -> dict[str, int]:
    """Worker id -> pid of every child the supervisor has started so far."""
    return {wid: int(pid) for wid, pid in STARTED.findall(processes.log(supervisor))}


def alive(pid: int) -> bool:
    """True while ``pid`` runs. A zombie does not count: an orphan that exited waits
    there until whoever adopted it reaps it, which is not the supervisor's doing."""
    try:
        os.kill(pid, 0)
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (ProcessLookupError, FileNotFoundError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def live_workers() -> dict[str, int]:
    """Worker id -> pid of every worker whose heartbeat has not expired."""
    backend = task_backends["default"]
    assert isinstance(backend, ReliableJobsBackend)
    return {beat.id: beat.info["pid"] for beat in backend.broker.workers()}


def finished(*job_ids: str) -> bool:
    return Job.objects.filter(pk__in=job_ids, state__in=[JobState.SUCCEEDED, JobState.DEAD]
                              ).count() == len(job_ids)


def running_on(worker_id: str) -> bool:
    """True once ``worker_id`` has an attempt started and not finished (in the mirror)."""
    return Attempt.objects.filter(worker_id=worker_id, started_at__isnull=False,
                                  finished_at__isnull=True).exists()


@pytest.fixture
def start_supervisor(processes: Processes) -> Iterator[Start]:
    """Start ``runworker --processes 2 --worker-id sup <args>``; kill any child left at the end.

    The ``processes`` fixture SIGKILLs the supervisor only; its children
    would then stop by themselves (parent-death signal), but a failed test
    must not leave them claiming the next test's jobs meanwhile.
    """
    started: list[subprocess.Popen[bytes]] = []

    def start(env: dict[str, str], *args: str, extra_env: dict[str, str] | None = None
              ) -> subprocess.Popen[bytes]:
        proc = processes.worker(env, "--processes", "2", "--worker-id", "sup", "--grace", "10",
                                *args, extra_env=extra_env)
        started.append(proc)
        return proc

    yield start
    for proc in started:
        for pid in children(processes, proc).values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_processes_must_be_at_least_one(rj_settings: Any, processes: Processes) -> None:
    # Given / When: a worker asked for no process at all
    worker = processes.worker(rj_settings(), "--processes", "0")

    # Then: it refuses, saying why, and starts nothing
    assert worker.wait(timeout=60) == 1
    assert "--processes must be at least 1." in processes.log(worker)
    assert "Started worker" not in processes.log(worker)


def test_two_children_share_the_work(
    rj_settings: Any, processes: Processes, start_supervisor: Start
) -> None:
    # Given: two single-threaded children that claim one job at a time, both serving
    env = rj_settings()
    supervisor = start_supervisor(env, "--prefetch", "0")
    wait_until(lambda: {"sup-1", "sup-2"} <= live_workers().keys(), timeout=30,
               message="both children to heartbeat")
    assert live_workers()["sup-1"] == children(processes, supervisor)["sup-1"]

    # When: twenty short jobs arrive
    results = [demo.sleep_for.enqueue(0.1) for _ in range(20)]
    wait_until(lambda: finished(*[r.id for r in results]), timeout=60,
               message="every job to finish")

    # Then: each succeeded on its first attempt, and both children ran some
    for r in results:
        final = demo.sleep_for.get_result(r.id)
        assert (final.status, final.attempts) == (TaskResultStatus.SUCCESSFUL, 1)
    assert set(Attempt.objects.values_list("worker_id", flat=True)) == {"sup-1", "sup-2"}
    assert processes.stop(supervisor) == 0, processes.log(supervisor)


@pytest.mark.crash
def test_sigkilled_child_is_replaced_and_its_jobs_come_back(
    rj_settings: Any, processes: Processes, start_supervisor: Start, redis_client: redis.Redis
) -> None:
    # Given: two children busy with 1.5 s jobs
    env = rj_settings()
    results = [demo.sleep_for.enqueue(1.5) for _ in range(6)]
    supervisor = start_supervisor(env, "--prefetch", "0")
    wait_until(lambda: running_on("sup-1"), timeout=30, message="sup-1 to start a job")
    victim = children(processes, supervisor)["sup-1"]

    # When: one child is SIGKILLed mid-job
    os.kill(victim, signal.SIGKILL)

    # Then: the supervisor says so, starts a replacement with a new id, and it serves
    wait_until(lambda: "sup-3" in live_workers(), timeout=30, message="a replacement to serve")
    log = processes.log(supervisor)
    assert f"Worker sup-1 (pid {victim}) was killed by SIGKILL" in log
    assert REPLACING.findall(log) == ["0.5"]
    assert not alive(victim)
    # And: every job succeeds; the interrupted one ran again after its lease expired
    wait_until(lambda: finished(*[r.id for r in results]), timeout=60,
               message="every job to finish")
    for r in results:
        final = demo.sleep_for.get_result(r.id)
        assert final.status == TaskResultStatus.SUCCESSFUL
        assert 1 <= final.attempts <= 2
    assert Attempt.objects.filter(worker_id="sup-1", outcome=AttemptOutcome.LEASE_EXPIRED
                                  ).exists()
    assert redis_client.zcard(KEYS.leases) == 0
    assert processes.stop(supervisor) == 0, processes.log(supervisor)


def test_sigterm_lets_every_child_finish_its_job_and_leaves_nothing_behind(
    rj_settings: Any, processes: Processes, start_supervisor: Start, redis_client: redis.Redis
) -> None:
    # Given: each child running one 1.5 s job
    env = rj_settings()
    supervisor = start_supervisor(env, "--prefetch", "0")
    wait_until(lambda: {"sup-1", "sup-2"} <= live_workers().keys(), timeout=30,
               message="both children to heartbeat")
    slow = [demo.sleep_for.enqueue(1.5) for _ in range(2)]
    wait_until(lambda: Job.objects.filter(state=JobState.RUNNING).count() == 2,
               message="both jobs to start")

    # When: SIGTERM reaches the supervisor
    assert processes.stop(supervisor) == 0, processes.log(supervisor)

    # Then: both jobs finished where they ran, once each
    for r in slow:
        final = demo.sleep_for.get_result(r.id)
        assert (final.status, final.attempts) == (TaskResultStatus.SUCCESSFUL, 1)
    assert sorted(Attempt.objects.values_list("worker_id", flat=True)) == ["sup-1", "sup-2"]
    # And: no child is left, none was restarted, and no worker still claims to be alive
    pids = children(processes, supervisor)
    assert pids.keys() == {"sup-1", "sup-2"}
    assert not [pid for pid in pids.values() if alive(pid)]
    assert not live_workers()
    assert redis_client.zcard(KEYS.leases) == 0


def test_second_sigterm_kills_and_hands_back_child_tasks_and_leaves_thread_tasks_to_leases(
    rj_settings: Any, processes: Processes, start_supervisor: Start, redis_client: redis.Redis,
    tmp_path: Path
) -> None:
    # Given: one child running a 30 s task in a child process (a time limit),
    # the other a 30 s task in a thread; both children told once to stop
    env = rj_settings(LEASE_MS=10_000, RENEW_INTERVAL_MS=500, RECONCILE_GRACE_MS=10_000)
    pid_file = tmp_path / "task.pid"
    isolated = demo.report_pid_then_sleep.enqueue(str(pid_file), 30)
    threaded = demo.sleep_for.enqueue(30)
    supervisor = start_supervisor(env, "--prefetch", "0")
    wait_until(lambda: Job.objects.filter(state=JobState.RUNNING).count() == 2
               and pid_file.exists(), timeout=30, message="both jobs to start")
    wait_until(lambda: processes.log(supervisor).count(" serving ") == 2, message="both children")
    supervisor.send_signal(signal.SIGTERM)
    wait_until(lambda: processes.log(supervisor).count("Got SIGTERM: finishing") == 2,
               message="both children to receive the first SIGTERM")

    # When: a second SIGTERM arrives
    supervisor.send_signal(signal.SIGTERM)

    # Then: everything exits at once, cleanly
    assert supervisor.wait(timeout=15) == 0, processes.log(supervisor)
    assert "Got SIGTERM again: telling 2 worker(s)" in processes.log(supervisor)
    assert not [pid for pid in children(processes, supervisor).values() if alive(pid)]
    # And: the task in a child was killed, then its job handed back at once
    assert not alive(int(pid_file.read_text()))
    assert redis_client.lrange(KEYS.queued, 0, -1) == [isolated.id]
    assert list(Attempt.objects.filter(job_id=isolated.id).values_list("outcome", flat=True)
                ) == [AttemptOutcome.RELEASED]
    # And: the task in a thread died with its process; its job is left to its
    # lease (the sweep runs it again once the lease expires), never handed
    # back while its process could still run it
    assert redis_client.zscore(KEYS.leases, threaded.id) is not None
    assert not Attempt.objects.filter(job_id=threaded.id, outcome=AttemptOutcome.RELEASED)


def test_burst_children_exit_when_drained_and_the_supervisor_follows(
    rj_settings: Any, processes: Processes, start_supervisor: Start
) -> None:
    # Given: thirty queued jobs
    env = rj_settings()
    results = [demo.add.enqueue(i, i) for i in range(30)]

    # When: two burst children drain them
    supervisor = start_supervisor(env, "--burst")

    # Then: the supervisor exits 0 once both children have, none replaced
    assert supervisor.wait(timeout=60) == 0, processes.log(supervisor)
    for i, r in enumerate(results):
        assert demo.add.get_result(r.id).return_value == 2 * i
    log = processes.log(supervisor)
    assert children(processes, supervisor).keys() == {"sup-1", "sup-2"}
    assert log.count("exited with code 0: it has finished, and is not replaced.") == 2
    assert "replacement" not in log


@pytest.mark.crash
def test_crash_loop_backs_off_and_a_stop_ends_it(
    rj_settings: Any, processes: Processes, start_supervisor: Start
) -> None:
    # Given: children that die at their first claim, every time (crash point, exit 86)
    env = rj_settings()
    supervisor = start_supervisor(env, extra_env={"RJ_CRASH_AT": "after_claim"})

    # When: both slots have died four times
    wait_until(lambda: len(REPLACING.findall(processes.log(supervisor))) >= 8, timeout=60,
               message="four restarts of each child")

    # Then: each restart waited twice as long as the one before, one log line each
    log = processes.log(supervisor)
    assert sorted(float(d) for d in REPLACING.findall(log)[:8]) == [0.5, 0.5, 1, 1, 2, 2, 4, 4]
    assert log.count("exited with code 86 after") >= 8
    # And: every incarnation had its own worker id
    assert len(children(processes, supervisor)) >= 8
    # And: a stop during the backoff ends the loop at once, cleanly
    supervisor.send_signal(signal.SIGTERM)
    assert supervisor.wait(timeout=10) == 0, processes.log(supervisor)
    assert not [pid for pid in children(processes, supervisor).values() if alive(pid)]


def test_children_stop_when_the_supervisor_is_killed(
    rj_settings: Any, processes: Processes, start_supervisor: Start
) -> None:
    # Given: a supervisor with both children serving
    env = rj_settings()
    supervisor = start_supervisor(env)
    wait_until(lambda: {"sup-1", "sup-2"} <= live_workers().keys(), timeout=30,
               message="both children to heartbeat")
    pids = children(processes, supervisor)

    # When: the supervisor is SIGKILLed (no cleanup runs)
    supervisor.send_signal(signal.SIGKILL)
    supervisor.wait(timeout=10)

    # Then: each child is told to stop (parent-death SIGTERM), stops, and says goodbye
    wait_until(lambda: not [pid for pid in pids.values() if alive(pid)], timeout=30,
               message="the orphaned children to stop")
    assert not live_workers()
