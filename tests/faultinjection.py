"""Real faults for the tests: a private Redis server to restart.

A real process on loopback; nothing is simulated. The TCP proxy that cuts
PostgreSQL off lives in :mod:`reliable_jobs.contrib.verify.netfaults`, since
the chaos run uses it too.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

import redis


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_for_ping(port: int, timeout: float = 10.0) -> None:
    """Wait until a server just started on ``port`` answers PING."""
    client = redis.Redis(port=port, socket_connect_timeout=0.2)
    deadline = time.monotonic() + timeout
    try:
        while True:
            try:
                client.ping()
                return
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.02)
    finally:
        client.close()


class PrivateRedis:
    """A redis-server of our own that keeps nothing on disk, so a restart is empty."""

    def __init__(self, workdir: Path) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed (apt-get install redis-server).")
        self.binary = binary
        self.workdir = workdir
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.process = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self.workdir)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL,
        )
        wait_for_ping(self.port)

    def kill(self) -> None:
        """Die like a crash: every key is gone (nothing was saved)."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)

    def restart_empty(self, down_for: float = 0.5) -> None:
        self.kill()
        time.sleep(down_for)
        self.start()
