"""The maintenance thread: the sweep's Redis pass and reconcile, on a timer.

Every worker recovers expired leases, promotes due jobs and reconciles, so a
deployment that runs no ``recoverjobs`` still recovers. This work reads and
writes the database (the sweep asks the mirror which expired attempts had
already finished, and mirrors what it did), so it runs on a thread of its
own: a slow or hung database delays recovery, never lease renewal.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from django.db import DatabaseError, InterfaceError, connections

from ..broker import REDIS_ERRORS
from ..sweep import Sweep
from .shared import Shared

logger = logging.getLogger("reliable_jobs.worker")

#: Reconcile at most this often from a worker, in seconds.
RECONCILE_EVERY_S = 30.0
#: Reconcile batches per pass from a worker (the cursor goes on next time).
RECONCILE_BATCHES = 10
#: The soonest a sweep follows the one before it when a scheduled job is due
#: (its promote is the sweep's), in seconds: due jobs in a stream (retries,
#: debounced runs) cost at most this many passes a second.
EARLIEST_SWEEP_S = 0.02


class Maintenance:
    """A thread that sweeps every ``sweep_interval_ms`` (sooner when a scheduled job is
    due before then, so it starts on time) and reconciles every 30 s."""

    def __init__(self, *, sweep: Sweep, database: str, sweep_interval_ms: int,
                 reconcile_grace_ms: int, shared: Shared,
                 on_pass: Callable[[], None] | None = None) -> None:
        self.sweep = sweep
        self.database = database
        self.sweep_interval_s = sweep_interval_ms / 1000
        self.reconcile_grace_s = reconcile_grace_ms / 1000
        self.redis_outage = shared.redis_outage
        self.db_outage = shared.db_outage
        self.stopping = shared.stopping
        self.shared = shared
        self.on_pass = on_pass
        #: Held while a pass may have requeued jobs whose records are not yet
        #: mirrored (see sweep_once).
        self.retry_gate = threading.Lock()
        self._next_reconcile = time.monotonic() + RECONCILE_EVERY_S

    def reconcile_soon(self) -> None:
        """Reconcile as soon as the grace period allows (Redis may have come back empty)."""
        self._next_reconcile = min(self._next_reconcile,
                                   time.monotonic() + self.reconcile_grace_s)

    def run(self) -> None:
        next_sweep = 0.0
        while not self.stopping.is_set():
            now = time.monotonic()
            if now >= next_sweep:
                next_sweep = now + self.sweep_interval_s
                due_in_s = self.sweep_once()
                if due_in_s is not None:  # sweep again when the next scheduled job is due
                    next_sweep = min(next_sweep, now + max(due_in_s, EARLIEST_SWEEP_S))
            if now >= self._next_reconcile:
                self._next_reconcile = now + RECONCILE_EVERY_S
                self.reconcile()
            self.stopping.wait(max(0.01, min(next_sweep, self._next_reconcile)
                                   - time.monotonic()))

    def sweep_once(self) -> float | None:
        """Recover and promote every shard (the sweep mirrors what recover did).

        Done under ``retry_gate``: an executor about to run a retried job
        (which this very pass may have requeued) waits for the gate, so a
        poison job cannot kill this process before the history of its
        previous attempt is written. Returns in how many seconds the next
        scheduled job is due (None: none is, or Redis did not say).
        """
        with self.retry_gate:
            try:
                physical = self.sweep.physical_queues()
                self.shared.physical = physical
                report = self.sweep.redis_pass(physical)
                due_in_ms = self.sweep.parts.broker.next_due_in_ms(physical)
            except REDIS_ERRORS as exc:
                self.redis_outage.failed(exc, "sweeping")
                return None
            except (DatabaseError, InterfaceError) as exc:
                self.db_outage.failed(exc, "sweeping")
                connections[self.database].close()
                return None
        if report.requeued or report.dead or report.garbage or report.settled:
            logger.info("Sweep: %s.", report)
        if self.on_pass is not None:
            self.on_pass()
        return None if due_in_ms is None else due_in_ms / 1000

    def reconcile(self) -> None:
        try:
            self.sweep.reconcile(max_batches=RECONCILE_BATCHES)
        except (DatabaseError, InterfaceError) as exc:
            logger.warning("Reconcile skipped: the database is unavailable (%s).", exc)
            connections[self.database].close()
        except REDIS_ERRORS as exc:
            logger.warning("Reconcile skipped: Redis is unavailable (%s).", exc)
