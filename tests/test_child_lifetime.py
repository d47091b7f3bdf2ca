"""An isolated attempt's process dies with its worker, so a job never runs twice at once.

A task with ``timeout_ms`` runs in a child forked from the worker's
forkserver. If the worker is SIGKILLed, its lease expires and another worker
recovers the job: a child left running would run the same job alongside the
recovered attempt until its own SIGALRM, ``timeout_ms`` later.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from testproject.demo import tasks as demo

from .helpers import Processes, wait_until

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow, pytest.mark.crash]


def _stat(pid: int) -> tuple[str, int, int] | None:
    """``(state, parent pid, start time)`` of a process from /proc, or None once it is gone.

    The start time tells a process apart from a later one given the same pid.
    """
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = text[text.rindex(")") + 2:].split()  # the command name may hold spaces
    return fields[0], int(fields[1]), int(fields[19])


def _gone(pid: int, started: int) -> bool:
    """Whether that process has exited (a zombie not yet reaped counts as exited)."""
    stat = _stat(pid)
    return stat is None or stat[2] != started or stat[0] in ("Z", "X")


def _kill_if_still_running(pid: int, started: int) -> None:
    """Stop a leftover descendant of a worker this test started, never another process."""
    if not _gone(pid, started):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads /proc (Linux)")
def test_isolated_attempt_dies_within_a_second_of_its_worker_sigkill(
    rj_settings: Any, processes: Processes, tmp_path: Path
) -> None:
    # Given: a worker running an isolated attempt that would sleep for a minute
    env = rj_settings()
    pid_file = tmp_path / "child.pid"
    demo.report_pid_then_sleep.enqueue(str(pid_file), 60)
    worker = processes.worker(env)
    wait_until(lambda: pid_file.exists() or worker.poll() is not None, timeout=60,
               message="the isolated attempt to start")
    assert worker.poll() is None, processes.log(worker)
    child = int(pid_file.read_text())
    child_stat = _stat(child)
    assert child_stat is not None, "the child exited before the worker was killed"
    forkserver = child_stat[1]
    forkserver_stat = _stat(forkserver)
    assert forkserver_stat is not None and forkserver_stat[1] == worker.pid, (
        "the child's parent should be the forkserver the worker started")
    watched = {"isolated child": (child, child_stat[2]),
               "forkserver": (forkserver, forkserver_stat[2])}

    def survivors() -> list[str]:
        return [name for name, (pid, started) in watched.items() if not _gone(pid, started)]

    try:
        # When: the worker is SIGKILLed (no cleanup of its own runs)
        worker.send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        worker.wait(timeout=10)

        # Then: the child and the forkserver are gone within a second
        with contextlib.suppress(AssertionError):
            wait_until(lambda: not survivors(), interval=0.02,
                       timeout=max(0.0, killed_at + 1.0 - time.monotonic()))
        assert not survivors(), f"still running 1 s after the worker's SIGKILL: {survivors()}"
    finally:
        for pid, started in watched.values():
            _kill_if_still_running(pid, started)
