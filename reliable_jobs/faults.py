"""Test-only fault points: ``RJ_CRASH_AT=<point>`` makes a process die there.

The chaos tests start real workers with this variable set to prove that a
crash at each step loses nothing. Unset (production), :func:`crash_point` is
one comparison against None. ``RJ_CRASH_AFTER=N`` lets N passes survive
first, so a crash can hit the middle of a run. ``RJ_STOP_AT=<point>`` (with
``RJ_STOP_AFTER=N``) freezes the process there instead, with SIGSTOP, as a
paused VM or a long GC pause would: the test resumes it with SIGCONT.
"""

from __future__ import annotations

import os
import signal
import threading

#: The point at which to die, read once at import.
CRASH_AT: str | None = os.environ.get("RJ_CRASH_AT") or None
_survivors = int(os.environ.get("RJ_CRASH_AFTER", "0") or 0)
#: The point at which to freeze, read once at import.
STOP_AT: str | None = os.environ.get("RJ_STOP_AT") or None
_stop_survivors = int(os.environ.get("RJ_STOP_AFTER", "0") or 0)
_lock = threading.Lock()

#: Every point the code declares, for tests to iterate over.
POINTS = (
    "after_blmove",    # id moved onto landing, claim script not yet run
    "after_claim",     # claimed and stamped, task not started
    "in_task",         # inside the task, before it returns
    "before_ack",      # mirror written, Redis ack not yet sent
    "after_ack",       # acked in Redis
    "sweep_after_recover",  # the sweep recovered leases, mirror not yet written
    "sweep_after_promote",  # the sweep promoted, reconcile not yet run
    "finisher_bug",    # the finisher thread raises (a bug), see raise_point()
    "reconcile_before_push",  # reconcile committed the rows' new generations, pushed nothing
    "reconcile_after_push",  # reconcile committed, then pushed the rebuilt jobs
    "in_mirror_transaction",  # attempts written, jobs not yet, transaction open (stop_point)
    "scheduler_decided",  # a schedule's due slots decided under its row lock, none enqueued yet
    "released_before_push",  # a commit made waiting jobs runnable; they are not pushed yet
)


def crash_point(name: str) -> None:
    """Die at once, like SIGKILL (no cleanup, no flush), if ``name`` is armed."""
    global _survivors
    if name != CRASH_AT:
        return
    with _lock:
        if _survivors > 0:
            _survivors -= 1
            return
    os._exit(86)


def raise_point(name: str) -> None:
    """Raise an unexpected error, like a bug, if ``name`` is armed."""
    if name == CRASH_AT:
        raise RuntimeError(f"fault injected at {name}")


def stop_point(name: str) -> None:
    """Freeze this whole process (SIGSTOP) if ``name`` is armed, once."""
    global _stop_survivors, STOP_AT
    if name != STOP_AT:
        return
    with _lock:
        if _stop_survivors > 0:
            _stop_survivors -= 1
            return
        STOP_AT = None  # once: after SIGCONT the process runs on normally
    os.kill(os.getpid(), signal.SIGSTOP)
