"""The processes a chaos run starts and stops: its workers and its sweep.

Each is a ``manage.py`` child in its own process group, stopped with
SIGTERM then SIGKILL; :func:`interruptible` turns SIGTERM and Ctrl-C into
:class:`~.chaos_report.Interrupted` while the run is in progress.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from django.conf import settings
from django.db import connections

from reliable_jobs.supervisor import signal_when_parent_dies

from .chaos_report import ChaosError, Interrupted

#: Seconds between SIGTERM and SIGKILL when the run stops its processes.
STOP_TIMEOUT_S = 15.0


def manage_py() -> list[str]:
    """The command line that starts ``manage.py`` in a child, as this process was started.

    ``python path/to/manage.py chaosjobs`` gives ``python path/to/manage.py``;
    anything else (``django-admin``, ``call_command``) gives ``python -m
    django``, which finds the project through ``DJANGO_SETTINGS_MODULE``.
    """
    script = Path(sys.argv[0])
    if script.name == "manage.py" and script.is_file():
        return [sys.executable, str(script.resolve())]
    return [sys.executable, "-m", "django"]


class Fleet:
    """Every process a run starts, each logging to its own file, all stopped at the end."""

    def __init__(self, argv: Sequence[str], log_dir: Path,
                 env: dict[str, str] | None = None) -> None:
        self.argv = list(argv)
        self.log_dir = log_dir
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.env.setdefault("DJANGO_SETTINGS_MODULE", settings.SETTINGS_MODULE)
        self.started: list[subprocess.Popen[bytes]] = []

    def start(self, name: str, *args: str) -> subprocess.Popen[bytes]:
        """Start ``manage.py <args>`` with this process's environment (same settings)."""
        with open(self.log_dir / f"{name}.log", "ab") as log:
            proc = subprocess.Popen(
                [*self.argv, *args], env=self.env, stdin=subprocess.DEVNULL, stdout=log,
                stderr=subprocess.STDOUT,
                # Its own session: Ctrl-C reaches the run only, which then stops
                # every child in order instead of racing their signal handlers.
                start_new_session=True,
                preexec_fn=signal_when_parent_dies(os.getpid(), signal.SIGKILL),
            )
        self.started.append(proc)
        return proc

    def log_tail(self, name: str, lines: int = 20) -> str:
        path = self.log_dir / f"{name}.log"
        text = path.read_text(errors="replace") if path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def stop_all(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """SIGTERM every live child, SIGKILL what is still alive after ``timeout_s``."""
        alive = [proc for proc in self.started if proc.poll() is None]
        for proc in alive:
            with contextlib.suppress(ProcessLookupError):
                proc.terminate()
        deadline = time.monotonic() + timeout_s
        for proc in alive:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@dataclass(slots=True)
class Slot:
    """One of the ``--workers`` places: the worker serving it now."""

    worker_id: str
    name: str
    proc: subprocess.Popen[bytes]


@contextlib.contextmanager
def interruptible() -> Iterator[None]:
    """Turn SIGTERM and Ctrl-C into :class:`Interrupted`, so the fleet is always stopped.

    Python's default SIGTERM ends the process without unwinding, which
    would leave every worker behind.
    """
    raised = False

    def interrupt(signum: int, frame: Any) -> None:
        nonlocal raised
        if raised:
            return  # already stopping: a second Ctrl-C must not cut the cleanup short
        raised = True
        raise Interrupted(signal.Signals(signum).name)

    previous = {signum: signal.signal(signum, interrupt)
                for signum in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def proxied_database_url(database: str, proxy_port: int) -> tuple[str, str, int]:
    """``DATABASE_URL`` pointed at a proxy on ``proxy_port``, with the real host and port.

    Children are configured from the environment like this process, so
    the one way to route them through the proxy without touching their
    settings is the URL they read. It must name the backend's database
    (alias ``database``), or cutting it would prove nothing.
    """
    url = os.environ.get("DATABASE_URL", "")
    parts = urlsplit(url)
    db = connections[database].settings_dict
    if (parts.scheme not in {"postgres", "postgresql", "pgsql"} or not parts.hostname
            or parts.path.lstrip("/") != db["NAME"]):
        raise ChaosError(
            "--cut-postgres-at needs DATABASE_URL in the environment, a postgres:// URL "
            f"with a TCP host naming the backend's database {db['NAME']!r}: the children "
            "reach PostgreSQL through a proxy by a rewritten DATABASE_URL."
        )
    userinfo = parts.netloc.rpartition("@")[0]
    netloc = (f"{userinfo}@" if userinfo else "") + f"127.0.0.1:{proxy_port}"
    return (urlunsplit(parts._replace(netloc=netloc)), parts.hostname,
            parts.port or 5432)
