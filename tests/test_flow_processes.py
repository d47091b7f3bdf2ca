"""Concurrency caps with real worker processes, SIGKILLs included, read from the execution ledger.

The ledger (contrib/verify/chaos_ledger.py) is written by the task itself
into plain files the queue never touches, so it witnesses what ran when,
whatever the queue's own records say. A run whose process was SIGKILLed
has no end line: it ran until the kill.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

import pytest

from reliable_jobs.compat import task_backends
from reliable_jobs.contrib.verify.chaos_ledger import LEDGER_ENV, Run, read_ledger
from reliable_jobs.contrib.verify.tasks import FLOW_CAP, chaos_job, flow_capped_job
from reliable_jobs.models import Job, JobState
from tests.conftest import FAST_OPTIONS

from .helpers import Processes, wait_until

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]


def most_at_once(runs: list[Run], deaths: dict[int, float]) -> int:
    """The most runs alive at one moment; a run without an end lived until its process died."""
    events: list[tuple[float, int]] = []
    for run in runs:
        end = run.end if run.end is not None else deaths[run.pid]
        events += [(run.start, 1), (end, -1)]
    alive = most = 0
    for _, step in sorted(events, key=lambda e: (e[0], e[1])):  # an end before a start at a tie
        alive += step
        most = max(most, alive)
    return most


def all_succeeded(count: int) -> bool:
    return Job.objects.filter(state=JobState.SUCCEEDED).count() == count


@pytest.mark.parametrize("scope", ["queue", "task"])
def test_a_cap_of_5_across_4_processes_never_runs_a_6th_even_under_sigkills(
        rj_settings: Any, processes: Processes, tmp_path: Path, scope: str) -> None:
    # Given a cap of 5 (the queue's own, or the task's), 40 short jobs, and
    # 4 worker processes with 8 threads each
    options = {"QUEUE_LIMITS": {"default": {"concurrency": FLOW_CAP}}} if scope == "queue" else {}
    env = rj_settings(**options)
    ledger = tmp_path / "ledger"
    ledger.mkdir()
    job = chaos_job if scope == "queue" else flow_capped_job
    task_backends["default"].enqueue_many(job, [((0.3,), {}) for _ in range(40)])
    workers = [processes.worker(env, "--concurrency", "8", extra_env={LEDGER_ENV: str(ledger)})
               for _ in range(4)]
    deaths: dict[int, float] = {}

    # When two of them are SIGKILLed while they run jobs, and replaced
    for victim in workers[:2]:
        wait_until(lambda: len(read_ledger(ledger).runs) >= 5 + 5 * len(deaths), timeout=60,
                   message="jobs to run")
        victim.send_signal(signal.SIGKILL)
        deaths[victim.pid] = time.time()
        victim.wait(timeout=10)
        workers.append(processes.worker(env, "--concurrency", "8",
                                        extra_env={LEDGER_ENV: str(ledger)}))
    wait_until(lambda: all_succeeded(40), timeout=120, message="every job to succeed")

    # Then the ledger never shows a 6th run at once, and the cap was used
    runs = read_ledger(ledger).runs
    assert most_at_once(runs, deaths) == FLOW_CAP
    processes.stop_many(*[w for w in workers if w.poll() is None])


def test_a_killed_workers_slots_are_free_within_lease_and_sweep_interval(
        rj_settings: Any, processes: Processes, tmp_path: Path) -> None:
    # Given one worker holding all 5 slots of a capped task, a sixth job
    # waiting, and a second worker up and idle (its claims held by the cap)
    env = rj_settings()
    ledger = tmp_path / "ledger"
    ledger.mkdir()
    task_backends["default"].enqueue_many(flow_capped_job, [((2.0,), {})] * (FLOW_CAP + 1))
    holder = processes.worker(env, "--concurrency", "8", extra_env={LEDGER_ENV: str(ledger)})
    wait_until(lambda: len(read_ledger(ledger).runs) == FLOW_CAP, timeout=60,
               message="the first worker to fill the cap")
    waiter = processes.worker(env, "--concurrency", "8", extra_env={LEDGER_ENV: str(ledger)})
    wait_until(lambda: " serving " in processes.log(waiter), timeout=60,
               message="the second worker to serve")

    # When the holder is SIGKILLed
    holder.send_signal(signal.SIGKILL)
    killed_at = time.time()
    holder.wait(timeout=10)

    # Then the waiter starts a job once the leases expired and a sweep ran:
    # within LEASE_MS + SWEEP_INTERVAL_MS (plus a claim and a thread start)
    first = wait_until(lambda: [r for r in read_ledger(ledger).runs if r.pid == waiter.pid],
                       timeout=30, message="the waiter to start a job")
    delay_ms = (min(r.start for r in first) - killed_at) * 1000
    bound_ms = FAST_OPTIONS["LEASE_MS"] + FAST_OPTIONS["SWEEP_INTERVAL_MS"]
    print(f"slots free {delay_ms:.0f} ms after the SIGKILL (bound {bound_ms} ms)")
    assert delay_ms <= bound_ms + 250
    wait_until(lambda: all_succeeded(FLOW_CAP + 1), timeout=60, message="every job to succeed")
    assert most_at_once(read_ledger(ledger).runs, {holder.pid: killed_at}) == FLOW_CAP
    processes.stop(waiter)
