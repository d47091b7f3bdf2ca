"""Retrying a dependency that is down: one backoff rule, one outage log."""

from __future__ import annotations

import logging
import threading
import time

logger = logging.getLogger("reliable_jobs.worker")

#: First wait after a Redis or database error, in seconds; doubles to the cap.
BACKOFF_START_S = 0.1
#: Longest wait between two retries, in seconds.
BACKOFF_MAX_S = 5.0


class Backoff:
    """Exponential backoff: 0.1 s, 0.2 s, ... up to 5 s, reset by a success."""

    def __init__(self, start_s: float = BACKOFF_START_S, cap_s: float = BACKOFF_MAX_S) -> None:
        self.start_s = start_s
        self.cap_s = cap_s
        self.delay_s = start_s

    def wait(self, cancel: threading.Event) -> bool:
        """Sleep the current delay and double it; True if ``cancel`` was set meanwhile."""
        cancelled = cancel.wait(self.delay_s)
        self.delay_s = min(self.delay_s * 2, self.cap_s)
        return cancelled

    def reset(self) -> None:
        self.delay_s = self.start_s


class Outage:
    """Log a dependency's outage once: the first failure, then its return.

    Retries repeat every few seconds while Redis or the database is down;
    one ERROR line when it goes, one WARNING line when it is back, DEBUG between.
    Several threads report to one Outage, so it keeps its own lock.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self.down_since: float | None = None
        self._lock = threading.Lock()

    def failed(self, exc: BaseException, what: str) -> None:
        with self._lock:
            first = self.down_since is None
            if first:
                self.down_since = time.monotonic()
        if first:
            logger.error("%s is unavailable (%s) while %s; retrying with backoff, holding "
                         "every job (nothing is lost).", self.name, exc, what)
        else:
            logger.debug("%s still unavailable (%s) while %s.", self.name, exc, what)

    def ok(self) -> bool:
        """Note a success; return True if this ends an outage."""
        if self.down_since is None:  # the common case, without the lock
            return False
        with self._lock:
            since, self.down_since = self.down_since, None
        if since is None:
            return False  # type: ignore[unreachable]  # another thread cleared it first
        logger.warning("%s is back after %.1f s.", self.name, time.monotonic() - since)
        return True
