"""Cancelling a running job, as the task sees it: a flag, hooks, and its context.

Staff or code cancel a running job by marking its Redis hash (cancel.lua);
the worker's lease keeper learns it from its next renewal (extend.lua
answers "cancel requested" in the reply it sends anyway) and calls
:meth:`Cancellation.request` on the attempt's object here. That kills a
task running in a child process (a hook registered by isolation.py) and
tells a task running in a thread through its context:

    @task(takes_context=True)
    def export(context, rows):
        for row in rows:
            context.raise_if_cancelled()  # raises JobCancelled once cancelled
            write(row)

A task that never looks runs to completion, but its outcome is recorded as
cancelled and it is never retried (mirror/, ack.lua).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from .compat import TaskContext
from .exceptions import JobCancelled

if TYPE_CHECKING:
    _ContextBase = TaskContext[Any, Any]
else:
    _ContextBase = TaskContext

#: One lock for every attempt's hooks: a request is rare, and an attempt
#: object must cost next to nothing on the hot path (one per claimed job).
_hooks_lock = threading.Lock()


class Cancellation:
    """Whether one attempt was asked to stop; thread-safe, set once, never cleared."""

    __slots__ = ("_hooks", "_requested")

    def __init__(self) -> None:
        self._requested = False
        self._hooks: list[Callable[[], object]] | None = None

    def requested(self) -> bool:
        """Whether a cancel was requested (a call, not a property: it changes under
        the caller's feet, and type checkers narrow properties)."""
        return self._requested

    def request(self) -> None:
        """Mark the attempt cancelled and run every hook once (the lease keeper calls this)."""
        with _hooks_lock:
            if self._requested:
                return
            self._requested = True
            hooks, self._hooks = self._hooks or [], None
        for hook in hooks:
            hook()

    def on_request(self, hook: Callable[[], object]) -> Callable[[], None]:
        """Run ``hook`` when a cancel is requested (now, if it already was).

        Returns a function that unregisters it. Hooks run on the lease
        keeper's thread: they must not block (killing a process is fine).
        """
        with _hooks_lock:
            if not self._requested:
                if self._hooks is None:
                    self._hooks = []
                self._hooks.append(hook)
                return lambda: self._remove(hook)
        hook()
        return lambda: None

    def _remove(self, hook: Callable[[], object]) -> None:
        with _hooks_lock:
            if self._hooks is not None and hook in self._hooks:
                self._hooks.remove(hook)

    def wait(self, timeout_s: float) -> bool:
        """Sleep up to ``timeout_s``, waking at once on a cancel; return whether it came."""
        event = threading.Event()
        remove = self.on_request(event.set)
        try:
            return event.wait(timeout_s)
        finally:
            remove()


class TaskJournal(Protocol):
    """Where an attempt's progress and checkpoint go (mirror/journal.py's ``Journal``).

    Named here so the context, in the bottom layer, needs nothing above it.
    """

    def progress(self, done: int, total: int | None = None) -> None: ...

    def checkpoint(self, value: Any, *, done: int | None = None,
                   total: int | None = None) -> bool: ...

    def last_checkpoint(self) -> Any: ...


@dataclass(frozen=True, slots=True, kw_only=True)
class JobContext(_ContextBase):  # type: ignore[misc]  # frozen at run time; the stubs say not
    """The ``TaskContext`` reliable_jobs passes to tasks that take one.

    Adds cancellation: ``cancelled`` to poll, ``raise_if_cancelled()`` as a
    checkpoint, ``sleep()`` that ends early on a cancel. In a child process
    (``timeout_ms``) a cancel kills the process instead, so there they
    always say "not cancelled" while the task is alive.

    Adds progress and checkpoints: ``progress(done, total)``,
    ``checkpoint(value)`` and ``checkpoint_value`` (the last checkpoint any
    attempt of the job stored, so a job killed mid-way resumes from it). A
    context made without a journal (outside a worker) keeps nothing.
    """

    cancellation: Cancellation = field(default_factory=Cancellation, repr=False, compare=False)
    journal: TaskJournal | None = field(default=None, repr=False, compare=False)

    @property
    def cancelled(self) -> bool:
        """True once staff or code cancelled this job while it ran."""
        return self.cancellation.requested()

    def raise_if_cancelled(self) -> None:
        """A checkpoint: raise :class:`~reliable_jobs.exceptions.JobCancelled` if cancelled."""
        if self.cancellation.requested():
            raise JobCancelled("the task stopped at a cancellation checkpoint")

    def sleep(self, seconds: float) -> bool:
        """Sleep up to ``seconds``, ending early when the job is cancelled; return
        whether it was."""
        return self.cancellation.wait(seconds)

    def progress(self, done: int, total: int | None = None) -> None:
        """Report ``done`` items of ``total`` (shown in the admin, read with get_progress()).

        Cheap to call per item: written at most twice a second, and once more
        when the attempt ends.
        """
        if self.journal is not None:
            self.journal.progress(done, total)

    def checkpoint(self, value: Any, *, done: int | None = None,
                   total: int | None = None) -> bool:
        """Store ``value`` (JSON) as where the next attempt resumes; True once committed.

        False when the job is no longer this attempt's (its lease was lost
        and another attempt holds it): the task should stop. ``done`` and
        ``total`` report progress in the same write.
        """
        if self.journal is None:
            return False
        return self.journal.checkpoint(value, done=done, total=total)

    @property
    def checkpoint_value(self) -> Any:
        """The job's last checkpoint (None if no attempt stored one), read once per attempt."""
        return None if self.journal is None else self.journal.last_checkpoint()


def raise_if_cancelled(context: TaskContext[Any, Any]) -> None:
    """``context.raise_if_cancelled()`` for code typed against Django's ``TaskContext``."""
    if isinstance(context, JobContext):
        context.raise_if_cancelled()
