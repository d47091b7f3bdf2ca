"""Health: the heartbeat file of a real worker, checkworkers' exit codes, the readiness view."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import redis
from django.conf import settings
from django.test import Client

from reliable_jobs.health import TOUCH_EVERY_S, HeartbeatFile
from reliable_jobs.keys import QueueKeys
from testproject.demo import tasks as demo

from .faultinjection import free_port
from .helpers import Processes, wait_until

pytestmark = [pytest.mark.django_db(transaction=True)]
KEYS = QueueKeys("rj", "default")


def mtime(path: Path) -> float:
    return path.stat().st_mtime


def moves(path: Path, *, timeout: float = 20.0) -> bool:
    """Wait until ``path``'s modification time changes; True when it did."""
    before = mtime(path)
    wait_until(lambda: mtime(path) != before, timeout=timeout, message=f"{path} to be touched")
    return True


@pytest.mark.slow
def test_the_heartbeat_file_goes_stale_while_the_worker_is_stopped(
    rj_settings: Any, processes: Processes, tmp_path: Path
) -> None:
    # Given: a worker touching its heartbeat file
    env = rj_settings()
    beat = tmp_path / "alive"
    worker = processes.worker(env, "--heartbeat-file", str(beat))
    wait_until(beat.exists, timeout=30, message="the heartbeat file")
    assert moves(beat)

    # When: the process is stopped (SIGSTOP) for several touch intervals
    worker.send_signal(signal.SIGSTOP)
    try:
        frozen = mtime(beat)
        # 1.5 touch intervals (TOUCH_EVERY_S = 2 s): anything still touching it on
        # its interval would have, at least once
        time.sleep(1.5 * TOUCH_EVERY_S)

        # Then: the file's age grew, untouched
        assert mtime(beat) == frozen
    finally:
        worker.send_signal(signal.SIGCONT)

    # And: once resumed it is touched again, and the worker stops cleanly
    assert moves(beat)
    assert processes.stop(worker) == 0


@pytest.mark.slow
@pytest.mark.parametrize("processes_flag", ["1", "2"])
def test_an_unwritable_heartbeat_file_stops_the_worker_at_start(
    processes_flag: str, rj_settings: Any, processes: Processes, tmp_path: Path
) -> None:
    # Given: a heartbeat file in a directory that does not exist
    env = rj_settings()
    path = tmp_path / "missing" / "alive"

    # When: a worker (or a supervisor of two) is started with it
    worker = processes.worker(env, "--heartbeat-file", str(path), "--processes", processes_flag)

    # Then: it exits at once saying why, rather than running unwatched or restarting
    assert worker.wait(timeout=60) == 1
    assert f"Cannot write the heartbeat file '{path}' (No such file or directory)." in (
        processes.log(worker))


class Loop:
    """Stands for a worker: when its claim loop last went round."""

    def __init__(self) -> None:
        self.loop_tick = time.monotonic()


def test_the_heartbeat_stops_when_the_claim_loop_stalls(tmp_path: Path) -> None:
    # Given: a heartbeat on a loop that turns
    loop, path = Loop(), tmp_path / "alive"
    heartbeat = HeartbeatFile(path, loop, every_s=0.02, stall_s=0.5)
    heartbeat.start()
    try:
        os.utime(path, (0, 0))
        assert moves(path)

        # When: the loop stops turning, other threads alive
        loop.loop_tick = time.monotonic() - 60
        time.sleep(0.1)  # a touch already under way may land
        os.utime(path, (0, 0))
        time.sleep(0.3)  # 15 touch intervals

        # Then: the file is no longer touched
        assert mtime(path) == 0

        # And: when it turns again, the file is touched again
        loop.loop_tick = time.monotonic() + 60
        assert moves(path)
    finally:
        heartbeat.stop()


def checkworkers(processes: Processes, env: dict[str, str], *args: str) -> tuple[int, str]:
    proc = processes.manage("checkworkers", *args, env=env)
    code = proc.wait(timeout=60)
    return code, processes.log(proc).strip()


@pytest.mark.slow
def test_checkworkers_exit_codes(rj_settings: Any, processes: Processes,
                                 redis_client: redis.Redis) -> None:
    # Given: no worker at all
    env = rj_settings()

    # Then: the queue is not served (1), in one line
    code, out = checkworkers(processes, env)
    assert (code, out) == (1, "CommandError: Queue 'default' has 0 live worker(s), fewer "
                              "than 1.")

    # When: a worker serves it
    worker = processes.worker(env)
    wait_until(lambda: "serving default" in processes.log(worker), message="worker start")

    # Then: all is well (0)
    code, out = checkworkers(processes, env, "--max-latency", "60")
    assert code == 0, out
    assert out.startswith("OK: default (1 worker(s), oldest ")
    assert processes.stop(worker) == 0

    # When: a job has waited a minute on a queue nobody serves
    job = demo.add.enqueue(1, 1)
    redis_client.hset(KEYS.job(job.id), "enqueued_ms", int(time.time() * 1000) - 60_000)

    # Then: a latency limit below that fails (1); a higher one passes
    code, out = checkworkers(processes, env, "--max-latency", "30", "--min-workers", "0")
    assert code == 1, out
    assert "Queue 'default''s oldest job has waited 6" in out and "more than 30 s" in out
    code, out = checkworkers(processes, env, "--max-latency", "120", "--min-workers", "0")
    assert code == 0, out

    # And: Redis that does not answer is another status (3), naming no address
    closed = {**env, "REDIS_URL": f"redis://127.0.0.1:{free_port()}/0"}
    code, out = checkworkers(processes, closed)
    assert code == 3, out
    assert out == "CommandError: Redis does not answer (ConnectionError)."

    # And: so is a database that does not answer
    no_db = {**env, "DATABASE_URL": "postgres://postgres@127.0.0.1:1/nothing"}
    code, out = checkworkers(processes, no_db)
    assert code == 3, out
    assert out.startswith("CommandError: The database 'default' does not answer (")


def test_readiness_is_200_when_both_answer(rj_settings: Any) -> None:
    # Given
    rj_settings()

    # When
    response = Client().get("/jobs/ready")

    # Then
    assert response.status_code == 200
    assert response.json() == {"ready": True, "database": True, "redis": True,
                               "backends": {"default": {"database": True, "redis": True}}}


def test_readiness_is_503_when_redis_does_not_answer(rj_settings: Any) -> None:
    # Given: the backend's Redis is a closed port
    rj_settings()
    port = free_port()
    settings.TASKS["default"]["OPTIONS"]["REDIS_URL"] = f"redis://127.0.0.1:{port}/0"
    settings.TASKS = dict(settings.TASKS)  # a new value: the task backends are rebuilt

    # When
    response = Client().get("/jobs/ready")

    # Then: not ready, and the body says Redis is what is missing, naming no address
    assert response.status_code == 503
    assert response.json() == {"ready": False, "database": True, "redis": False,
                               "backends": {"default": {"database": True, "redis": False}}}
    assert str(port) not in response.content.decode()
    assert response["Cache-Control"].startswith("max-age=0")
