"""Run one attempt in a child process, so a time limit can really be enforced.

A thread cannot be killed, so a task with ``timeout_ms`` runs in a child
process forked from a ``forkserver`` that imported Django and every task
module once (the parent's threads and sockets are never forked). The
executor thread waits for the child; past the deadline it SIGKILLs it and the
attempt fails with :class:`JobTimeout`. A child that dies on its own (a task
that calls ``os._exit`` or crashes the interpreter) fails only its attempt.

A job cancelled while its child runs (see cancellation.py) is stopped the
same way: the lease keeper's cancel request SIGKILLs the child, and the
attempt ends with :class:`JobCancelled`. A worker stopping past its grace
period interrupts the attempt the same way too: the child is SIGKILLed and
reaped, and :class:`ChildStopped` tells the executor so, which then hands
the job back at once (nothing of the attempt runs any more).

Only JSON crosses the pipe: the payload text in, a JSON reply out.

Neither the forkserver nor a child may outlive the worker: a SIGKILLed
worker's jobs are recovered by another worker, and a child still running
would run the same job at the same time. So each asks Linux for SIGKILL when
its parent dies (:mod:`reliable_jobs.lifetime`): the forkserver when the
worker dies, each child when the forkserver dies. Linux ties that signal to
the parent *thread*, and the forkserver is started lazily by whichever
thread first needs it: were that an executor thread, its exit (a worker
shutting down thread by thread) would kill the forkserver and every attempt
still running in it. So one daemon thread, alive as long as the process,
starts the forkserver (:func:`_ensure_forkserver`). The child's ``SIGALRM``
stays as a last resort (off Linux, the only one).
"""

from __future__ import annotations

import json
import math
import multiprocessing
import multiprocessing.forkserver
import os
import queue
import signal
import sys
import threading
import traceback
from concurrent.futures import Future
from multiprocessing.connection import Connection
from typing import Any

from .cancellation import Cancellation
from .exceptions import JobCancelled, JobTimeout, PermanentFailure, RetryLater, Snooze
from .lifetime import die_with_parent

_context = multiprocessing.get_context("forkserver")
_context.set_forkserver_preload(["reliable_jobs._child_boot"])

#: Environment variable giving the forkserver the pid of the worker that
#: started it, so it can tell whether that worker died before prctl ran.
FORKSERVER_PARENT_ENV = "RELIABLE_JOBS_FORKSERVER_PARENT"
#: Seconds to wait for the forkserver to be started (it only spawns a process).
FORKSERVER_START_TIMEOUT_S = 30.0

_starter_lock = threading.Lock()
_starter: threading.Thread | None = None
_start_requests: queue.SimpleQueue[Future[None]] = queue.SimpleQueue()


def _start_forkservers() -> None:
    """The starter thread: start (or restart) the forkserver on each request.

    It never exits before its process does, so the forkserver's
    ``PR_SET_PDEATHSIG`` fires only when the worker itself dies.
    """
    while True:
        request = _start_requests.get()
        try:
            if os.environ.get(FORKSERVER_PARENT_ENV) != str(os.getpid()):
                os.environ[FORKSERVER_PARENT_ENV] = str(os.getpid())  # set once: putenv races
            multiprocessing.forkserver.ensure_running()
        except BaseException as exc:
            request.set_exception(exc)
        else:
            request.set_result(None)


def _ensure_forkserver() -> None:
    """Have the starter thread make sure the forkserver runs; start that thread if needed.

    ``Process.start()`` checks the forkserver again, from the calling thread:
    only a forkserver killed in between would be restarted by that thread.
    """
    global _starter
    with _starter_lock:
        if _starter is None or not _starter.is_alive():  # not alive in a forked copy
            _starter = threading.Thread(target=_start_forkservers,
                                        name="rj-forkserver-starter", daemon=True)
            _starter.start()
    request: Future[None] = Future()
    _start_requests.put(request)
    request.result(timeout=FORKSERVER_START_TIMEOUT_S)


class ChildFailed(Exception):
    """The task raised in the child; carries its class path and traceback."""

    def __init__(self, class_path: str, message: str, child_traceback: str) -> None:
        super().__init__(message)
        self.class_path = class_path
        self.child_traceback = child_traceback


class ChildDied(Exception):
    """The child process exited without answering (killed, crashed, os._exit)."""


class ChildStopped(Exception):
    """The worker stopped the attempt (its ``interrupt``) and killed its child.

    ``reaped``: the child's exit was seen, so nothing of the attempt runs
    any more and the job may be handed back at once. False only if the
    killed child could not be waited for: the job is then left to its lease.
    """

    def __init__(self, *, reaped: bool) -> None:
        super().__init__("the worker stopped past its grace period and killed the attempt's "
                         "process")
        self.reaped = reaped


def run_in_child(*, payload_text: str, job_id: str, attempt: int, worker_id: str,
                 backend: str, queue: str, timeout_s: float,
                 cancellation: Cancellation | None = None,
                 interrupt: Cancellation | None = None, gen: int = 0,
                 database: str = "default") -> Any:
    """Run the payload's task in a fresh child; return its JSON return value.

    A cancel requested through ``cancellation``, or a stop through
    ``interrupt``, kills the child at once. Raises ChildStopped (an
    interrupt, whatever else happened), JobTimeout, JobCancelled, ChildDied,
    RetryLater, Snooze, PermanentFailure or ChildFailed.
    """
    _ensure_forkserver()
    receiver, sender = _context.Pipe(duplex=False)
    child = _context.Process(
        target=_child_main,
        args=(sender, payload_text, job_id, attempt, worker_id, backend, queue, timeout_s, gen,
              database),
        name=f"rj-job-{job_id}", daemon=True,
    )
    child.start()
    sender.close()
    # SIGKILL, never waited for: the hooks run on the lease keeper's and the
    # stopping main thread.
    forget_hook = (cancellation or Cancellation()).on_request(child.kill)
    forget_interrupt = (interrupt or Cancellation()).on_request(child.kill)
    try:
        if not receiver.poll(timeout_s):
            raise JobTimeout(f"the attempt ran longer than its limit of {timeout_s * 1000:.0f} ms "
                             "and its process was killed")
        try:
            reply = json.loads(receiver.recv_bytes())
        except (EOFError, OSError):
            child.join(timeout=5)
            if interrupt is not None and interrupt.requested():
                raise ChildStopped(reaped=child.exitcode is not None) from None
            if cancellation is not None and cancellation.requested():
                raise JobCancelled("its process was killed") from None
            raise ChildDied(f"the task's process exited with code {child.exitcode} "
                            "before answering") from None
    finally:
        forget_hook()
        forget_interrupt()
        if child.is_alive():
            child.kill()
        child.join(timeout=5)
        receiver.close()
    if "value" in reply:
        return reply["value"]
    if reply["kind"] == "retry_later":
        raise RetryLater(reply["delay_ms"], reply["message"])
    if reply["kind"] == "snooze":
        raise Snooze(reply["delay_ms"])
    if reply["kind"] == "permanent":
        raise PermanentFailure(reply["message"])
    raise ChildFailed(reply["class_path"], reply["message"], reply["traceback"])


def _child_main(sender: Connection, payload_text: str, job_id: str, attempt: int,
                worker_id: str, backend: str, queue: str, timeout_s: float, gen: int = 0,
                database: str = "default") -> None:
    """The child: resolve the task from the allow-list, run it, answer in JSON."""
    # Die with the forkserver, which dies with the worker (see the module
    # docstring); the forkserver recorded its pid before forking this child.
    boot = sys.modules.get("reliable_jobs._child_boot")
    die_with_parent(getattr(boot, "FORKSERVER_PID", None), signal.SIGKILL)
    # Should that fail (not Linux), SIGALRM's default action still ends this
    # child a second after its limit.
    signal.alarm(math.ceil(timeout_s) + 1)
    from . import payload
    from .compat import TaskResultStatus, normalize_json
    from .results import task_result
    from .tasks import lookup

    try:
        decoded = payload.decode(payload_text)
        task = lookup(decoded.task_path)
        if task is None:
            raise PermanentFailure(f"{decoded.task_path!r} is not a registered task")
        if task.takes_context:
            from .cancellation import JobContext
            from .mirror.journal import Journal

            result = task_result(
                task.using(queue_name=queue), job_id=job_id, status=TaskResultStatus.RUNNING,
                args=decoded.args, kwargs=decoded.kwargs, backend=backend,
                worker_ids=[worker_id] * attempt,
            )
            # The same context class as in a thread; a cancel kills this process.
            journal = Journal(database, job_id, attempt=attempt, gen=gen)
            try:
                value = task.call(JobContext(task_result=result, journal=journal),
                                  *decoded.args, **decoded.kwargs)
            finally:
                journal.flush()
        else:
            value = task.call(*decoded.args, **decoded.kwargs)
        reply: dict[str, Any] = {"value": normalize_json(value)}
    except RetryLater as exc:
        reply = {"kind": "retry_later", "delay_ms": exc.delay_ms, "message": str(exc)}
    except Snooze as exc:
        reply = {"kind": "snooze", "delay_ms": exc.delay_ms}
    except PermanentFailure as exc:
        reply = {"kind": "permanent", "message": str(exc)}
    except Exception as exc:
        reply = {"kind": "error", "class_path": f"{type(exc).__module__}.{type(exc).__qualname__}",
                 "message": str(exc), "traceback": "".join(traceback.format_exception(exc))}
    sender.send_bytes(json.dumps(reply).encode())
    sender.close()
