"""What happens after a failed attempt: retry when, or bury.

One function decides, in Python, from the attempt number, the budget and
the exception; the nack script only applies the decision (fenced).
"""

from __future__ import annotations

import random

from .exceptions import MalformedPayload, PermanentFailure, RetryLater, UnknownTask

#: Returned by :func:`next_delay_ms` when the job must go to dead.
DEAD = -1

#: Exceptions no retry can fix.
NOT_RETRYABLE = (PermanentFailure, UnknownTask, MalformedPayload)


def backoff_ms(attempt: int, *, base_ms: int, max_ms: int, rng: random.Random | None = None) -> int:
    """Exponential backoff with "equal jitter", capped at ``max_ms``.

    ``base_ms * 2 ** (attempt - 1)``, capped, then a random point in its
    upper half: retries of jobs that failed together spread out, and no
    retry comes sooner than half its nominal delay.
    """
    nominal: int = min(max_ms, base_ms * 2 ** min(max(attempt - 1, 0), 32))
    half = nominal // 2
    return half + (rng or random).randint(0, nominal - half)


def next_delay_ms(
    exc: BaseException, *, attempt: int, max_attempts: int, base_ms: int, max_ms: int
) -> int:
    """Return the retry delay for a failed attempt, or :data:`DEAD`."""
    if isinstance(exc, NOT_RETRYABLE) or attempt >= max_attempts:
        return DEAD
    if isinstance(exc, RetryLater):
        return exc.delay_ms
    return backoff_ms(attempt, base_ms=base_ms, max_ms=max_ms)
