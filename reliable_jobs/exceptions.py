"""Exceptions task code raises to steer retries, and the ones the app raises."""

from __future__ import annotations

from django.tasks.exceptions import InvalidTask


class RetryLater(Exception):
    """Raise from a task to fail this attempt and retry after ``delay_ms``.

    The attempt still counts against ``max_attempts``.
    """

    def __init__(self, delay_ms: int, reason: str = "") -> None:
        if not isinstance(delay_ms, int) or delay_ms < 0:
            raise ValueError("delay_ms must be a whole number of milliseconds >= 0.")
        super().__init__(reason or f"retry requested in {delay_ms} ms")
        self.delay_ms = delay_ms


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
