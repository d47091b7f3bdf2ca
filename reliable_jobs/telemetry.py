"""The module-level hook through which the queue reports to Prometheus and OpenTelemetry.

The hot path calls ``telemetry.hook.<event>(...)`` once per event and never
asks whether anyone listens: by default :data:`hook` is a :class:`Hook`
whose methods do nothing (one method call, no import, no allocation), so a
deployment without ``prometheus_client`` or ``opentelemetry-api`` pays
nothing more. :func:`install` replaces it with a fan-out over the
listeners that were installed (``metrics.py``, ``tracing.py``); the app does
that at start-up when their libraries can be imported.

Call sites read the attribute each time (``telemetry.hook.x``, never a
``from telemetry import hook``), so an install after import is seen.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, ExitStack, nullcontext
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .broker import ClaimedJob

#: The context manager a hook returns when it has nothing to wrap (reusable).
NOTHING: nullcontext[None] = nullcontext()


class Hook:
    """Every event the queue reports; each method does nothing here.

    ``queue`` is the queue an enqueue names, and elsewhere the physical
    queue (a shard, see ``keys.logical_queue``) the worker or sweep holds;
    ``task`` is the task's dotted path (``"?"`` when a payload could not be
    decoded). Methods must not raise: they run on the worker's hot path.
    """

    def enqueue(self, queue: str, task: str, count: int) -> AbstractContextManager[str | None]:
        """Wrap an enqueue of ``count`` jobs; the context gives a traceparent for their payload."""
        return NOTHING

    def attempt(self, job: ClaimedJob, task: str,
                trace: str | None) -> AbstractContextManager[object]:
        """Wrap one attempt's task call (``trace``: the traceparent its payload carries)."""
        return NOTHING

    def finished(self, job: ClaimedJob, task: str, state: str,
                 seconds: float, error: BaseException | None = None) -> None:
        """An attempt ended: ``state`` is the job state it leaves (succeeded, queued,
        scheduled or dead), ``seconds`` its run time."""

    def snoozed(self, job: ClaimedJob, task: str, seconds: float) -> None:
        """An attempt's task raised Snooze (no failure: the job waits, attempt given
        back); ``seconds`` its run time."""

    def refused(self, queue: str, task: str) -> None:
        """Redis refused an attempt's outcome: the attempt no longer held its job."""

    def recovered(self, queue: str, kind: str) -> None:
        """The sweep recovered a job (``kind`` as in :class:`broker.RecoveredJob`)."""


class Fanout(Hook):
    """Reports each event to several hooks, in order."""

    def __init__(self, hooks: list[Hook]) -> None:
        self.hooks = hooks

    def enqueue(self, queue: str, task: str, count: int) -> AbstractContextManager[str | None]:
        return _stack([h.enqueue(queue, task, count) for h in self.hooks])

    def attempt(self, job: ClaimedJob, task: str,
                trace: str | None) -> AbstractContextManager[object]:
        # Once per job: in the common case (no hook wraps the call) no list is built.
        wrapping: list[AbstractContextManager[object]] | None = None
        for h in self.hooks:
            context = h.attempt(job, task, trace)
            if context is not NOTHING:
                wrapping = [context] if wrapping is None else [*wrapping, context]
        return NOTHING if wrapping is None else _stack(wrapping)

    def finished(self, job: ClaimedJob, task: str, state: str,
                 seconds: float, error: BaseException | None = None) -> None:
        for h in self.hooks:
            h.finished(job, task, state, seconds, error)

    def snoozed(self, job: ClaimedJob, task: str, seconds: float) -> None:
        for h in self.hooks:
            h.snoozed(job, task, seconds)

    def refused(self, queue: str, task: str) -> None:
        for h in self.hooks:
            h.refused(queue, task)

    def recovered(self, queue: str, kind: str) -> None:
        for h in self.hooks:
            h.recovered(queue, kind)


def _stack(contexts: list[AbstractContextManager[Any]]) -> AbstractContextManager[Any]:
    """One context entering ``contexts``; those with nothing to wrap are left out."""
    wrapping = [c for c in contexts if c is not NOTHING]
    if not wrapping:
        return NOTHING
    return wrapping[0] if len(wrapping) == 1 else _Stacked(wrapping)


class _Stacked(AbstractContextManager[Any]):
    """Enter several hooks' contexts in order; the value is the last one not None
    (for an enqueue: the traceparent for the payload)."""

    def __init__(self, contexts: list[AbstractContextManager[Any]]) -> None:
        self._contexts = contexts
        self._stack = ExitStack()

    def __enter__(self) -> Any:
        value = None
        for context in self._contexts:
            entered = self._stack.enter_context(context)
            value = entered if entered is not None else value
        return value

    def __exit__(self, *exc: object) -> bool | None:
        return self._stack.__exit__(*exc)  # type: ignore[arg-type]  # the same triple


#: The hook every call site uses; a no-op until :func:`install`.
hook: Hook = Hook()
_installed: list[Hook] = []


def install(listener: Hook) -> None:
    """Add ``listener`` to the hook (once per type: the app's ready() may run twice)."""
    global hook
    if any(type(h) is type(listener) for h in _installed):
        return
    _installed.append(listener)
    hook = _installed[0] if len(_installed) == 1 else Fanout(list(_installed))


def uninstall(kind: type[Hook]) -> None:
    """Remove the listener of type ``kind`` (tests)."""
    global hook
    _installed[:] = [h for h in _installed if type(h) is not kind]
    hook = (Hook() if not _installed else _installed[0] if len(_installed) == 1
            else Fanout(list(_installed)))


def installed(kind: type[Hook]) -> Hook | None:
    return next((h for h in _installed if type(h) is kind), None)
