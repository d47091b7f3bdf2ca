"""The lease keeper: renews the leases of every job in hand, and beats.

It talks only to Redis. Nothing it does waits on the database, a task or
another thread's lock held across I/O, so a database that hangs, a finisher
stuck in a transaction or a busy executor never lets a lease expire while
this process is alive: leases then mean what they promise, that their
holder is alive.

The renewal's reply also says which jobs staff or code cancelled while they
ran (extend.lua): the keeper passes that on to the attempt's
:class:`~reliable_jobs.cancellation.Cancellation` (which kills a task's
child process, or lets a thread task see it), at no extra round trip.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from ..broker import REDIS_ERRORS, Applied, Broker
from ..logformat import printable
from .shared import Shared

logger = logging.getLogger("reliable_jobs.worker")

#: After a failed renewal, try again this soon, in seconds.
RETRY_RENEW_S = 0.2


class LeaseKeeper:
    """A thread that renews leases every ``renew_interval_ms`` and beats every few seconds."""

    def __init__(self, *, broker: Broker, shared: Shared, lease_ms: int, renew_interval_ms: int,
                 beat_info: Callable[[], dict[str, Any]]) -> None:
        self.broker = broker
        self.in_hand = shared.in_hand
        self.lease_ms = lease_ms
        self.renew_interval_s = renew_interval_ms / 1000
        self.beat_interval_s = min(5.0, lease_ms / 3000)
        self.worker_id = shared.worker_id
        self.beat_info = beat_info
        self.redis_outage = shared.redis_outage
        self._stop = threading.Event()

    def stop(self) -> None:
        self._stop.set()

    def run(self) -> None:
        next_renew = next_beat = 0.0
        while not self._stop.is_set():
            now = time.monotonic()
            if now >= next_renew:
                renewed = self.renew()
                next_renew = now + (self.renew_interval_s if renewed else RETRY_RENEW_S)
            if now >= next_beat:
                next_beat = now + self.beat_interval_s
                self.beat()
            self._stop.wait(max(0.01, min(next_renew, next_beat) - time.monotonic()))

    def renew(self) -> bool:
        """Extend every lease still ours; False if Redis could not be reached."""
        ok = True
        for queue, jobs in self.in_hand.renewable().items():
            try:
                kept = self.broker.extend(queue, [job.fence for job in jobs],
                                          lease_ms=self.lease_ms)
            except REDIS_ERRORS as exc:
                self.redis_outage.failed(exc, "renewing leases")
                ok = False
                continue
            refused = [job for job, renewed in zip(jobs, kept, strict=True)
                       if renewed == Applied.REFUSED]
            # Acked meanwhile (refused because no longer running) is not lost.
            lost = self.in_hand.lose(refused) if refused else []
            cancelled = [job for job, renewed in zip(jobs, kept, strict=True)
                         if renewed == Applied.CANCELLED]
            for job in self.in_hand.cancel(cancelled) if cancelled else ():
                logger.info("Job %s attempt %d was cancelled while it ran: stopping it.",
                            printable(job.id), job.attempt)
            for job in lost:
                logger.warning("Lost the lease of job %s attempt %d: another worker may run "
                               "it; this attempt's outcome will be refused.",
                               printable(job.id), job.attempt)
        return ok

    def beat(self) -> None:
        try:
            self.broker.heartbeat(self.worker_id, self.beat_info(),
                                  ttl_ms=max(15_000, self.lease_ms))
        except REDIS_ERRORS as exc:
            logger.debug("Heartbeat failed: %s", exc)

