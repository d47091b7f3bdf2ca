"""A job's life on Redis: the typed wrappers of the scripts workers and the sweep run.

Claim, start, ack, nack, snooze, extend, release (workers), and expired, recover,
promote (the sweep): each one fenced script call; see their Lua headers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import redis

from ..exceptions import AttemptsExhausted, LeaseExpired, class_path
from ..keys import wake_marker
from .core import BrokerCore
from .records import (
    Applied,
    ClaimedJob,
    ClaimResult,
    Fence,
    RecoveredJob,
    RecoverResult,
    Settlement,
    _applied,
)

#: Expired leases and due jobs handled per recover/promote call.
SWEEP_BATCH = 1_000
#: How long a finished rebuilt job (generation > 0) keeps a tombstone, in ms:
#: a push of it from before the rebuild that arrives meanwhile is refused.
TOMBSTONE_MS = 3_600_000
#: The class paths claim.lua and recover.lua write before the error of a job
#: they bury, built from the classes so they always import (TaskError reads them).
EXHAUSTED_CLASS = class_path(AttemptsExhausted)
EXPIRED_CLASS = class_path(LeaseExpired)


class Lifecycle(BrokerCore):
    """The scripts of a job's life: waiting, claiming, finishing, recovering."""

    # -- workers ---------------------------------------------------------

    def wait(self, queues: Sequence[str], timeout_s: float) -> tuple[str, str | None] | None:
        """Block until one of ``queues`` has work, for at most ``timeout_s``.

        One queue: ``BLMOVE queued landing`` returns the moved id, which
        the caller must stamp with :meth:`claim` (``moved_id``). Several
        queues, or one whose last claim found priority bands in use (a
        BLMOVE on priority 0's list would not see a push onto another
        band): one ``BLPOP`` over their wake markers (one connection for
        any number of queues); the caller then claims from the queue named.
        Returns ``(queue, moved id or None)``, or None on timeout.
        """
        client = self._blocking_client()
        if len(queues) == 1 and queues[0] not in self._banded:
            k = self.keys(queues[0])
            # Typing only: BLMOVE's timeout is float seconds, and the client
            # decodes replies (str, not bytes | str as redis-py's types say).
            moved = client.blmove(k.queued, k.landing, timeout_s,  # type: ignore[arg-type]
                                  "RIGHT", "LEFT")
            return (queues[0], moved) if moved is not None else None  # type: ignore[return-value]
        markers = {(wake_marker(self.prefix, q) if self.cluster else self.keys(q).wake): q
                   for q in queues}
        reply = client.blpop(list(markers), timeout=timeout_s)
        if reply is None:
            return None
        return markers[reply[0]], None  # type: ignore[index]  # decoded: str keys

    def woken(self, queues: Sequence[str]) -> list[str]:
        """Without blocking, take the wake markers of ``queues``; return the queues that had one.

        A worker busy on other queues never blocks on the markers, so it
        asks for them this way now and then (worker/skip.py). Taking a marker
        obliges the caller to claim from its queue, as after :meth:`wait`;
        a claim that leaves work behind pushes a marker again. One ``LMPOP``
        per marker found (Redis 7); on an older server one ``LPOP`` per queue
        in one pipeline.
        """
        markers = {(wake_marker(self.prefix, q) if self.cluster else self.keys(q).wake): q
                   for q in queues}
        found: list[str] = []
        if not self._no_lmpop:
            left = list(markers)
            try:
                while left:
                    reply = self.client.execute_command("LMPOP", len(left), *left, "LEFT")
                    if not reply:
                        return found
                    found.append(markers[reply[0]])
                    left.remove(reply[0])
                return found
            except redis.ResponseError:  # Redis < 7: no LMPOP
                self._no_lmpop = True
        with self.client.pipeline(transaction=False) as pipe:
            for marker in markers:
                pipe.lpop(marker)
            popped = pipe.execute()
        return found + [q for q, got in zip(markers.values(), popped, strict=True)
                        if got is not None and q not in found]

    def claim(
        self, queue: str, *, count: int, lease_ms: int, moved_id: str | None = None,
        limits: tuple[int, int, int] = (0, 0, 0),
    ) -> ClaimResult:
        """Claim up to ``count`` jobs (plus ``moved_id``) and stamp their leases.

        Higher priorities first, FIFO within one, with the broker's fair
        share for the job that waited longest (see claim.lua). ``limits`` are
        the queue's (``flow.Limits.claim_args``: rate count, window in ms,
        cap; 0 for none); a task's or a key's travel in the job's payload.
        """
        k = self.keys(queue)
        reply = self._run(
            "claim",
            (k.queued, k.leases, k.dead, k.wake, k.job_prefix, k.landing,
             k.bands, k.band_prefix, k.share, k.strays, k.paused, k.flow_prefix, k.holds,
             *k.fair, k.turn),
            (max(count, 1 if moved_id else 0), lease_ms, moved_id or "", self.fair_share,
             EXHAUSTED_CLASS, *limits, self.fair_weights),
        )
        jobs_flat, dead_flat, garbage, remaining, banded, hold_ms, hold_by_cap = reply
        if int(banded):
            self._banded.add(queue)
        jobs = [
            ClaimedJob(queue, jobs_flat[i], int(jobs_flat[i + 1]), int(jobs_flat[i + 2]),
                       jobs_flat[i + 3], int(jobs_flat[i + 4]), int(jobs_flat[i + 5]))
            for i in range(0, len(jobs_flat), 6)
        ]
        dead = [(dead_flat[i], int(dead_flat[i + 1]), int(dead_flat[i + 2]))
                for i in range(0, len(dead_flat), 3)]
        self._wake(queue, int(remaining))  # work left behind: wake the next idle worker
        return ClaimResult(jobs, dead, list(garbage), int(remaining), int(banded), int(hold_ms),
                           bool(int(hold_by_cap)))

    def start(self, queue: str, held: Sequence[Fence]) -> list[Applied]:
        """Mark held attempts as started: DONE (run it), CANCELLED (do not run it,
        ack it), EXPIRED (its lease ran out: do not run it, let go of it; the
        sweep requeues it) or REFUSED (no longer held)."""
        if not held:
            return []
        k = self.keys(queue)
        args = [x for fence in held for x in fence]
        return _applied(self._run("start", (k.leases, k.job_prefix), args))

    def ack(self, queue: str, held: Sequence[Fence]) -> list[Applied]:
        """Finish jobs: DONE, CANCELLED (marked while it ran, finished as cancelled)
        or REFUSED (the attempt is no longer held)."""
        if not held:
            return []
        k = self.keys(queue)
        args: list[Any] = [TOMBSTONE_MS]
        args += [x for fence in held for x in fence]
        return _applied(self._run("ack", (k.leases, k.job_prefix), args))

    def nack(self, queue: str, failed: Sequence[tuple[str, int, int, int, str]]
             ) -> list[Applied]:
        """Apply (id, attempt, gen, delay_ms or -1 for dead, error) decisions, fenced;
        a job marked for cancellation is finished as cancelled instead (CANCELLED)."""
        if not failed:
            return []
        k = self.keys(queue)
        args = [x for entry in failed for x in entry]
        keys = (k.queued, k.leases, k.scheduled, k.dead, k.wake, k.job_prefix,
                k.bands, k.band_prefix, *k.fair)
        applied = _applied(self._run("nack", keys, args))
        self._wake(queue, any(ok == Applied.DONE and entry[3] == 0
                              for ok, entry in zip(applied, failed, strict=True)))
        return applied

    def snooze(self, queue: str, snoozed: Sequence[tuple[str, int, int, int]]
               ) -> list[Applied]:
        """Put (id, attempt, gen, delay_ms) back to wait, each attempt given back, fenced.

        DONE (due ``delay_ms`` from now on Redis's clock, its max_attempts one
        more), CANCELLED (marked while it ran: finished as cancelled instead)
        or REFUSED (the attempt is no longer held: nothing changed).
        """
        if not snoozed:
            return []
        k = self.keys(queue)
        args = [x for entry in snoozed for x in entry]
        keys = (k.queued, k.leases, k.scheduled, k.wake, k.job_prefix, k.bands, k.band_prefix,
                *k.fair)
        applied = _applied(self._run("snooze", keys, args))
        self._wake(queue, any(ok == Applied.DONE and entry[3] == 0
                              for ok, entry in zip(applied, snoozed, strict=True)))
        return applied

    def extend(self, queue: str, held: Sequence[Fence], *, lease_ms: int) -> list[Applied]:
        """Renew leases of held attempts: DONE, CANCELLED (renewed, and the job is
        to be cancelled: stop its task) or REFUSED (the attempt was lost)."""
        if not held:
            return []
        k = self.keys(queue)
        args: list[Any] = [lease_ms]
        args += [x for fence in held for x in fence]
        return _applied(self._run("extend", (k.leases, k.job_prefix), args))

    def release(self, queue: str, held: Sequence[tuple[str, int, int, bool]]
                ) -> list[Applied]:
        """Put (id, attempt, gen, started) back on queued at once (graceful stop);
        a job marked for cancellation is finished as cancelled instead (CANCELLED)."""
        if not held:
            return []
        k = self.keys(queue)
        args = [x for job_id, attempt, gen, started in held
                for x in (job_id, attempt, gen, int(started))]
        keys = (k.queued, k.leases, k.wake, k.job_prefix, k.bands, k.band_prefix, *k.fair)
        released = _applied(self._run("release", keys, args))
        self._wake(queue, Applied.DONE in released)
        return released

    # -- the sweep -------------------------------------------------------

    def sweepable(self, queues: Sequence[str]) -> list[str]:
        """Those of ``queues`` the sweep has anything to look at in (one round trip).

        Recover works on leases, landing and the legacy processing list,
        promote on scheduled: a queue with all four empty is skipped, which keeps a
        pass over hundreds of idle queues from costing three script calls
        each. Work that arrives just after this look waits for the next pass,
        as it would after the pass itself.
        """
        with self.client.pipeline(transaction=False) as pipe:
            for queue in queues:
                k = self.keys(queue)
                pipe.exists(k.leases, k.processing, k.landing, k.scheduled)
            found = pipe.execute()
        return [queue for queue, n in zip(queues, found, strict=True) if n]

    def expired(self, queue: str, *, limit: int = SWEEP_BATCH) -> list[Fence]:
        """Started attempts whose lease expired (read-only; see expired.lua)."""
        k = self.keys(queue)
        flat = self._run("expired", (k.leases, k.job_prefix), (limit,))
        return [(flat[i], int(flat[i + 1]), int(flat[i + 2])) for i in range(0, len(flat), 3)]

    def recover(self, queue: str, *, lease_ms: int, limit: int = SWEEP_BATCH,
                settle: Sequence[Settlement] = (), allowed: Sequence[Fence] | None = None
                ) -> RecoverResult:
        """Settle mirrored outcomes, requeue (or bury) expired leases, lease new orphans.

        ``allowed`` lists the started attempts this call may requeue or bury
        (those the caller checked against the mirror); None allows every one.
        """
        k = self.keys(queue)
        args: list[Any] = [limit, lease_ms, TOMBSTONE_MS, len(settle),
                           "all" if allowed is None else "listed", EXPIRED_CLASS]
        for s in settle:
            args += (s.id, s.attempt, s.gen, s.final, s.error[:4000])
        for fence in allowed or ():
            args += fence
        outcomes_flat, stamped = self._run(
            "recover",
            (k.queued, k.processing, k.leases, k.dead, k.wake, k.job_prefix, k.landing,
             k.bands, k.band_prefix, k.strays, *k.fair),
            args,
        )
        outcomes = [
            RecoveredJob(outcomes_flat[i], int(outcomes_flat[i + 1]), outcomes_flat[i + 3],
                         max_attempts=int(outcomes_flat[i + 2]), gen=int(outcomes_flat[i + 4]))
            for i in range(0, len(outcomes_flat), 5)
        ]
        self._wake(queue, any(o.kind in ("expired", "unstarted", "orphan") for o in outcomes))
        return RecoverResult(outcomes, int(stamped))

    def promote(self, queue: str, *, limit: int = SWEEP_BATCH) -> int:
        """Move due scheduled jobs onto queued."""
        k = self.keys(queue)
        promoted = int(self._run("promote", (k.queued, k.scheduled, k.wake, k.job_prefix,
                                             k.bands, k.band_prefix, *k.fair), (limit,)))
        self._wake(queue, promoted)
        return promoted
