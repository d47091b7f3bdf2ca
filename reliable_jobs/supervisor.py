"""``runworker --processes P``: keep P worker processes running, stop them together.

The children are fresh processes (``subprocess.Popen``, fork + exec of this
very command line), not ``os.fork()`` copies of the supervisor. By the time
``runworker`` knows it should supervise, Django is set up, the system checks
have talked to Redis and any library may have started a thread; a forked
copy would share every socket still open and inherit locks held by threads
that do not exist in it. Exec starts from nothing, costs one
Django start-up per child (under a second, and only at start and restart),
and runs exactly the code a single ``runworker`` runs, so every worker test
holds for each child. The supervisor itself opens no connection and starts no
thread: it only starts, signals and waits for processes.

A child is the same command line (``manage.py``, ``django-admin`` or
``python -m django``, with every flag) plus ``--processes 1 --worker-id
<base>-<n>``: argparse keeps the last value of a flag, so those win over
whatever came before, even an abbreviated ``--proc 4`` (a child can never
become a supervisor itself). ``n`` counts every child started, replacements
included, so each process has its own id and the attempt history says which
incarnation ran what: a killed ``w-2`` is replaced by ``w-3``, not by a
second ``w-2``. With ``--metrics-port N`` the child in place i (0 to P - 1)
also gets ``--metrics-port N+i``: each process serves its own counters, and
a replacement takes over its place's port, so scrape targets stay fixed.

Policy, and why:

- A child that exits non-zero or is killed is restarted after
  ``RESTART_DELAY_S``, doubling up to ``RESTART_DELAY_MAX_S`` while its
  replacements keep dying within ``STABLE_AFTER_S``, so a broken deployment
  does not spin. The jobs it held come back as for any crashed worker: by
  lease expiry, through the other workers' sweeps.
- A child that exits 0 has finished (``--burst`` drained the queues,
  ``--max-jobs`` was reached, or someone stopped it on purpose) and is not
  replaced, like systemd's ``Restart=on-failure``. The supervisor exits
  when no child is left.
- The first SIGTERM/SIGINT is forwarded to every child (each finishes its
  running jobs within ``--grace`` and hands the rest back) and ends all
  restarts; a second one is forwarded again, and the children hand
  everything back at once.
- Exit status: 0 when every child stopped cleanly. 1 when a child's last
  exit was a failure that was not followed by a restart, which can only
  happen once stopping (a worker thread crashed during the shutdown, or the
  child was SIGKILLed): its jobs are safe, but an operator should look.
  Restarts during the run were handled and do not count; a child killed
  by the forwarded signal itself (still starting, no handler yet, so it held
  no job) counts as clean.

Children run in their own session, so a Ctrl-C in a terminal reaches the
supervisor only and each child gets the signal exactly once (twice would
mean "stop at once"). For the same reason, under systemd use
``KillMode=mixed``. If the supervisor is killed outright, Linux sends each
child SIGTERM (``PR_SET_PDEATHSIG``), which stops it gracefully: no worker is
left running unsupervised.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from django.core.management.base import CommandError

from .lifetime import die_with_parent

logger = logging.getLogger("reliable_jobs.supervisor")

#: Seconds before restarting a child that died; doubles while it keeps dying.
RESTART_DELAY_S = 0.5
#: Longest wait before restarting a child in a crash loop, in seconds.
RESTART_DELAY_MAX_S = 30.0
#: Seconds a child must stay up for its next restart to wait only RESTART_DELAY_S.
STABLE_AFTER_S = 10.0
#: Signals that stop the supervisor, forwarded to every child.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def runworker_command_line() -> list[str]:
    """The command line this process was started with, runnable by a child.

    ``python -m django runworker ...`` gives ``python -m django``; a script
    (``manage.py``, ``django-admin``) gives ``python /abs/path/to/script``.
    """
    if len(sys.argv) < 2 or sys.argv[1] != "runworker":
        raise CommandError(
            "--processes above 1 starts each worker with this process's own command line, "
            "so it needs one: run `manage.py runworker` or `django-admin runworker`, "
            "not call_command()."
        )
    spec = getattr(sys.modules["__main__"], "__spec__", None)
    if spec is not None and spec.name not in ("__main__", ""):
        program = [sys.executable, "-m", spec.name.removesuffix(".__main__")]
    else:
        program = [sys.executable, os.path.abspath(sys.argv[0])]
    return [*program, *sys.argv[1:]]


def signal_when_parent_dies(parent_pid: int, signum: int) -> Callable[[], None] | None:
    """A ``preexec_fn`` asking Linux to send the child ``signum`` when its parent dies.

    A parent killed with SIGKILL (the OOM killer, a test's teardown) runs no
    cleanup; without this its children would run on unsupervised. The
    supervisor asks for SIGTERM (each worker finishes its running jobs),
    ``chaosjobs`` for SIGKILL. None off Linux.
    """
    if not sys.platform.startswith("linux"):
        return None

    def preexec() -> None:
        die_with_parent(parent_pid, signum)

    return preexec


def describe_exit(code: int) -> str:
    """Say how a child ended, from its ``Popen.returncode``."""
    if code >= 0:
        return f"exited with code {code}"
    try:
        return f"was killed by {signal.Signals(-code).name}"
    except ValueError:  # a real-time signal has no name
        return f"was killed by signal {-code}"


@dataclass(slots=True)
class Child:
    """One of the P places: the process serving it now, or when to start the next."""

    worker_id: str = ""
    #: Which of the P places (0 to P - 1): a replacement takes its place's metrics port.
    place: int = 0
    proc: subprocess.Popen[bytes] | None = None
    #: time.monotonic() when ``proc`` started.
    started: float = 0.0
    #: time.monotonic() at which to start a replacement; None when none is due.
    restart_at: float | None = None
    #: Wait before the next restart, in seconds (grows in a crash loop).
    delay_s: float = RESTART_DELAY_S


class Supervisor:
    """Start ``processes`` children running ``command``, keep them up, stop them together."""

    def __init__(self, command: Sequence[str], *, processes: int, base_id: str,
                 metrics_port: int | None = None) -> None:
        self.command = list(command)
        self.base_id = base_id
        #: With ``--metrics-port N``, place i's process listens on N + i.
        self.metrics_port = metrics_port
        self.children = [Child(place=i) for i in range(processes)]
        self.stopping = False
        #: Children whose last exit, after the stop, was a failure.
        self.failed: list[str] = []
        self._started_total = 0
        self._signals: list[int] = []
        self._wakeup_r = self._wakeup_w = -1

    def run(self) -> int:
        """Supervise until every child has exited; return the exit status (see module doc)."""
        previous = self._install_signal_handlers()
        try:
            logger.info("Supervisor (pid %d) starting %d worker processes.",
                        os.getpid(), len(self.children))
            for child in self.children:
                if not self._signals:  # a stop already asked for: start no more
                    self._start(child)
            while any(c.proc is not None or c.restart_at is not None for c in self.children):
                self._wait(self._next_timer())
                self._handle_signals()
                self._reap()
                self._start_due()
        finally:
            self._restore_signal_handlers(previous)
        if self.failed:
            logger.error("Supervisor stopped; %d worker(s) did not stop cleanly: %s.",
                         len(self.failed), ", ".join(self.failed))
            return 1
        logger.info("Supervisor stopped: every worker exited cleanly.")
        return 0

    # -- signals -----------------------------------------------------------

    def _install_signal_handlers(self) -> dict[int, Any]:
        """Record signals in the handler, act on them in the loop.

        The handler runs between two bytecodes of the loop, maybe in the
        middle of starting a child; acting there could miss that child. The
        wakeup pipe makes the loop's ``select`` return at once instead.
        SIGCHLD is caught only to wake the loop when a child dies.
        """
        self._wakeup_r, self._wakeup_w = os.pipe()  # not inheritable (PEP 446)
        os.set_blocking(self._wakeup_r, False)
        os.set_blocking(self._wakeup_w, False)
        signal.set_wakeup_fd(self._wakeup_w)
        previous: dict[int, Any] = {
            signum: signal.getsignal(signum) for signum in (*STOP_SIGNALS, signal.SIGCHLD)}
        for signum in STOP_SIGNALS:
            signal.signal(signum, self._on_signal)
        signal.signal(signal.SIGCHLD, lambda signum, frame: None)
        return previous

    def _restore_signal_handlers(self, previous: dict[int, Any]) -> None:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        signal.set_wakeup_fd(-1)
        os.close(self._wakeup_r)
        os.close(self._wakeup_w)

    def _on_signal(self, signum: int, frame: Any) -> None:
        self._signals.append(signum)

    def _handle_signals(self) -> None:
        pending, self._signals = self._signals, []
        for signum in pending:
            name = signal.Signals(signum).name
            live = [c for c in self.children if c.proc is not None]
            if not self.stopping:
                self.stopping = True
                for child in self.children:
                    child.restart_at = None
                logger.warning("Got %s: asking %d worker(s) to finish their running jobs "
                               "(a second signal makes them hand everything back at once).",
                               name, len(live))
            else:
                logger.warning("Got %s again: telling %d worker(s) to hand every job back now.",
                               name, len(live))
            for child in live:
                assert child.proc is not None
                with contextlib.suppress(ProcessLookupError):
                    child.proc.send_signal(signum)

    # -- children ----------------------------------------------------------

    def _start(self, child: Child) -> None:
        self._started_total += 1
        child.worker_id = f"{self.base_id}-{self._started_total}"
        child.restart_at = None
        child.started = time.monotonic()
        port = ([] if self.metrics_port is None
                else ["--metrics-port", str(self.metrics_port + child.place)])
        try:
            child.proc = subprocess.Popen(
                [*self.command, "--processes", "1", "--worker-id", child.worker_id, *port],
                stdin=subprocess.DEVNULL, start_new_session=True,
                preexec_fn=signal_when_parent_dies(os.getpid(), signal.SIGTERM),
            )
        except OSError as exc:  # out of processes or memory: try again later
            logger.error("Could not start worker %s (%s).", child.worker_id, exc)
            self._schedule_restart(child)
            return
        logger.info("Started worker %s (pid %d).", child.worker_id, child.proc.pid)

    def _reap(self) -> None:
        for child in self.children:
            if child.proc is None or (code := child.proc.poll()) is None:
                continue
            pid, child.proc = child.proc.pid, None
            what = f"Worker {child.worker_id} (pid {pid}) {describe_exit(code)}"
            if self.stopping:
                if code in (0, -signal.SIGTERM, -signal.SIGINT):
                    logger.info("%s.", what)
                else:
                    logger.error("%s while stopping.", what)
                    self.failed.append(f"{child.worker_id} {describe_exit(code)}")
            elif code == 0:
                logger.info("%s: it has finished, and is not replaced.", what)
            else:
                lived = time.monotonic() - child.started
                delay = self._schedule_restart(child)
                logger.warning("%s after %.1f s; its jobs come back when their leases expire. "
                               "Starting a replacement in %.1f s.", what, lived, delay)

    def _schedule_restart(self, child: Child) -> float:
        """Restart after ``delay_s`` (returned), doubled for next time unless it lived long."""
        now = time.monotonic()
        if now - child.started >= STABLE_AFTER_S:
            child.delay_s = RESTART_DELAY_S
        delay, child.delay_s = child.delay_s, min(child.delay_s * 2, RESTART_DELAY_MAX_S)
        child.restart_at = now + delay
        return delay

    def _start_due(self) -> None:
        now = time.monotonic()
        for child in self.children:
            if not self.stopping and child.restart_at is not None and child.restart_at <= now:
                self._start(child)

    # -- waiting -----------------------------------------------------------

    def _next_timer(self) -> float | None:
        due = [c.restart_at for c in self.children if c.restart_at is not None]
        return max(0.0, min(due) - time.monotonic()) if due else None

    def _wait(self, timeout: float | None) -> None:
        """Sleep until a signal (a stop, a child's death) or ``timeout`` seconds."""
        if self._signals:
            return
        readable, _, _ = select.select([self._wakeup_r], [], [], timeout)
        if readable:
            with contextlib.suppress(BlockingIOError):
                while os.read(self._wakeup_r, 512):
                    pass
