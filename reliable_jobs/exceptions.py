"""Exceptions task code raises to steer retries, and the ones the app raises.

The app's own classes are also recorded by path (``module.Class: message``)
in errors it writes for attempts no task code ended; Django's
``TaskError.exception_class`` imports that path, so it must name a class
here. :func:`class_path` builds the path from the class, never by hand.
"""

from __future__ import annotations

from .compat import InvalidTask


class RetryLater(Exception):
    """Raise from a task to fail this attempt and retry after ``delay_ms``.

    The attempt still counts against ``max_attempts``.
    """

    def __init__(self, delay_ms: int, reason: str = "") -> None:
        if not isinstance(delay_ms, int) or delay_ms < 0:
            raise ValueError("delay_ms must be a whole number of milliseconds >= 0.")
        super().__init__(reason or f"retry requested in {delay_ms} ms")
        self.delay_ms = delay_ms


class Snooze(Exception):
    """Raise from a task to run it again later without using an attempt.

    ``Snooze(500)`` or ``Snooze(seconds=0.5)``: the job goes back to
    ``scheduled``, due that long from now on Redis's clock (0: queued at
    once). The attempt is recorded as ``snoozed`` and given back (the job's
    ``max_attempts`` grows by one, as a claim that never started is given
    back: the attempt number itself only grows, it is the fencing token),
    so a job may snooze any number of times and never dies of it. Its
    checkpoint (``context.checkpoint()``) is kept for the next attempt.
    """

    def __init__(self, delay_ms: int | None = None, *, seconds: float | None = None) -> None:
        if (delay_ms is None) == (seconds is None):
            raise ValueError("Snooze takes a delay in milliseconds or seconds=..., not both.")
        if seconds is not None:
            if not isinstance(seconds, int | float) or not seconds >= 0:
                raise ValueError("seconds must be a number >= 0.")
            delay_ms = round(seconds * 1000)
        if not isinstance(delay_ms, int) or isinstance(delay_ms, bool) or delay_ms < 0:
            raise ValueError("delay_ms must be a whole number of milliseconds >= 0.")
        super().__init__(f"snoozed for {delay_ms} ms")
        self.delay_ms: int = delay_ms


class PermanentFailure(Exception):
    """Raise from a task to send the job straight to ``dead``: no retry helps."""


class InvalidJobArguments(InvalidTask, TypeError):
    """The arguments of an enqueue cannot be stored as JSON (nothing was written)."""


class PayloadTooLarge(InvalidTask, ValueError):
    """The encoded arguments exceed ``MAX_PAYLOAD_BYTES`` (nothing was written)."""


class MalformedPayload(Exception):
    """A payload read from Redis is not one this app wrote; the job is buried."""


class UnknownTask(Exception):
    """A payload names a function that is not a registered task; never imported."""


class LeaseExpired(Exception):
    """Recorded for an attempt whose worker stopped renewing its lease."""


class JobTimeout(Exception):
    """Recorded for an attempt that ran past its task's ``timeout_ms``."""


class JobCancelled(Exception):
    """The job was cancelled (by staff or ``backend.cancel()``) while it ran.

    ``context.raise_if_cancelled()`` raises it in a task that takes its
    context, at the checkpoint the task chooses; it is also the class
    recorded for every cancelled attempt. Whatever a cancelled attempt does
    afterwards (raise this, raise anything else, or return), the job ends
    ``cancelled`` and is never retried.
    """


class UpstreamFailed(Exception):
    """A job this one waited for ended dead or cancelled, so it was cancelled."""


class CallbackNotNeeded(Exception):
    """A callback on failure (``if_failed("only")``) whose jobs all succeeded: never run.

    Recorded on the callback, cancelled, so its workflow ends; counted apart
    from the failures (``workflows.progress()``'s ``skipped``), and never
    run again by ``workflows.retry_failed()``.
    """


class AttemptsExhausted(Exception):
    """Recorded for a job claimed ``max_attempts`` times without ever finishing.

    Each of those attempts was lost (its worker died or its lease expired
    before a result came back), so the next claim found no attempt left and
    buried the job instead of running it again.
    """


def class_path(exc_type: type[BaseException]) -> str:
    """The dotted path ``TaskError.exception_class`` imports ``exc_type`` back from.

    Built from the class so a rename cannot leave recorded errors pointing
    at a name that no longer exists.
    """
    return f"{exc_type.__module__}.{exc_type.__qualname__}"
