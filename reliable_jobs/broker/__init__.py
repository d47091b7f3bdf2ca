"""The Redis side of the queue: one typed method per Lua script.

The broker is the only code that talks to Redis about jobs. It knows key
names only through :mod:`reliable_jobs.keys` and Lua only through
:mod:`reliable_jobs.scripts`; it holds no state beyond its connections.

:class:`Broker` is assembled from parts that each own one thing:
:mod:`.connection` (opening a client, ``REDIS_ERRORS``), :mod:`.records`
(the typed values), :mod:`.core` (clients, keys, scripts),
:mod:`.lifecycle` (the scripts of a job's life) and :mod:`.inspection`
(read-only views); producing and the staff actions live here.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from typing import Any

from ..keys import logical_queue, shard_index, shards_index
from .connection import (
    CLUSTER_RETRIES,
    CLUSTER_SCHEMES,
    REDIS_ERRORS,
    SCRIPT_ERRORS,
    SOCKET_TIMEOUT_S,
    connect,
    is_cluster_url,
)
from .inspection import LATENCY_LOOK, WORKER_INDEX_KEEP_MS, Inspection
from .lifecycle import EXHAUSTED_CLASS, EXPIRED_CLASS, SWEEP_BATCH, TOMBSTONE_MS, Lifecycle
from .records import (
    Applied,
    ClaimedJob,
    ClaimResult,
    Debounced,
    DebounceOutcome,
    Fence,
    Latency,
    NewJob,
    Progress,
    QueueCounts,
    RecoveredJob,
    RecoverResult,
    Settlement,
    WorkerBeat,
    epoch_ms,
)

__all__ = [
    "CLUSTER_RETRIES", "CLUSTER_SCHEMES", "EXHAUSTED_CLASS", "EXPIRED_CLASS", "LATENCY_LOOK",
    "REDIS_ERRORS", "REGISTER_EVERY_S", "SCRIPT_ERRORS", "SOCKET_TIMEOUT_S", "SWEEP_BATCH",
    "TOMBSTONE_MS",
    "WORKER_INDEX_KEEP_MS", "Applied", "Broker", "ClaimResult", "ClaimedJob", "DebounceOutcome",
    "Debounced", "Fence",
    "Latency", "NewJob", "Progress", "QueueCounts", "RecoverResult", "RecoveredJob", "Settlement",
    "WorkerBeat", "connect", "epoch_ms", "is_cluster_url",
]

#: How often a producer records again a shard it writes to, in seconds.
REGISTER_EVERY_S = 10.0


class Broker(Lifecycle, Inspection):
    """Typed access to one Redis server's queues under one key prefix."""

    # -- producers -------------------------------------------------------

    def enqueue(self, queue: str, jobs: Iterable[NewJob], *, register: bool = False) -> int:
        """Write jobs and make them runnable; return how many were written (see enqueue_each)."""
        return sum(self.enqueue_each(queue, jobs, register=register))

    def enqueue_each(self, queue: str, jobs: Iterable[NewJob], *,
                     register: bool = False) -> list[bool]:
        """Write jobs and make them runnable; say per job whether Redis now holds it.

        Existing job hashes are kept, and so are tombstones of the same or a
        newer generation; a push of a newer generation takes over an older
        incarnation still waiting (see enqueue.lua). A rebuild moves only the
        rows whose push was taken (sweep.push_rebuilt).

        ``queue`` is a physical queue (a shard). A shard other than 0 is
        recorded in its queue's shards index when this process writes to it,
        again at least every REGISTER_EVERY_S (Redis may have lost the index
        since) and every time when ``register``, so workers find and drain it
        even after SHARDS shrinks.
        """
        index = shard_index(queue)
        if index and (register or time.monotonic() - self._registered.get(queue, -1e9)
                      > REGISTER_EVERY_S):
            self.client.zadd(shards_index(self.prefix, logical_queue(queue)), {str(index): index})
            self._registered[queue] = time.monotonic()
        k = self.keys(queue)
        args: list[Any] = []
        for job in jobs:
            args += (job.id, job.payload, job.max_attempts, job.due_ms, job.attempts, job.gen,
                     job.priority, job.group)
        if not args:
            return []
        written = [bool(int(one)) for one in self._run(
            "enqueue", (k.queued, k.scheduled, k.wake, k.job_prefix, k.bands, k.band_prefix,
                        *k.fair),
            args)]
        self._wake(queue, any(written))
        return written

    def debounce(self, queue: str, job: NewJob, *, debounce_ms: int, max_wait_ms: int,
                 replace: bool) -> Debounced:
        """Make a debounced job, or (``replace``) give a pending one ``job``'s payload and
        push it back ``debounce_ms``; see debounce.lua.

        ``job`` is the call's job: its payload, and the row's values for a
        job Redis does not hold (made here, due ``debounce_ms`` from now on
        Redis's clock). Without ``replace`` (the on-commit push of a new
        row) a job Redis already holds is left alone. A debounced job is
        always scheduled when made or replaced, so no worker is woken.
        """
        k = self.keys(queue)
        reply = self._run("debounce", (k.scheduled, k.job_prefix), (
            job.id, job.payload, job.max_attempts, job.attempts, job.gen, job.priority,
            job.group, debounce_ms, max_wait_ms, "replace" if replace else "make"))
        state = reply[2] if len(reply) > 2 else ""
        return Debounced(DebounceOutcome(int(reply[0])), int(reply[1]), state or "")

    # -- staff actions ---------------------------------------------------

    def cancel(self, queue: str, job_id: str) -> tuple[bool, str]:
        """Cancel a job: a waiting one is taken off, a running one is marked for
        cancellation (its holder stops it); returns (done, state found)."""
        k = self.keys(queue)
        cancelled, state = self._run("cancel", (k.queued, k.scheduled, k.job_prefix),
                                     (job_id, TOMBSTONE_MS))
        return bool(cancelled), state

    def reprioritize(self, queue: str, job_id: str, priority: int) -> tuple[bool, str, int]:
        """Change a queued or scheduled job's priority; (changed, state found, old priority).

        Any other state is left alone (see reprioritize.lua); so is a job
        already at ``priority`` (changed False, its state found).
        """
        k = self.keys(queue)
        changed, state, old = self._run(
            "reprioritize", (k.queued, k.wake, k.job_prefix, k.bands, k.band_prefix, k.strays,
                             *k.fair),
            (job_id, priority))
        self._wake(queue, int(changed) and state == "queued")
        return bool(changed), state, int(old)

    def revive(self, queue: str, job_id: str, *, extra_attempts: int) -> bool:
        """Queue a dead job again with ``extra_attempts`` more attempts."""
        k = self.keys(queue)
        keys = (k.queued, k.dead, k.wake, k.job_prefix, k.bands, k.band_prefix, *k.fair)
        revived = bool(self._run("revive", keys, (job_id, extra_attempts)))
        self._wake(queue, revived)
        return revived

    def requeue(self, queue: str, job_id: str) -> tuple[bool, str]:
        """Run a scheduled job now; returns (moved, state found, '' when no hash)."""
        k = self.keys(queue)
        moved, state = self._run("requeue", (k.queued, k.scheduled, k.wake, k.job_prefix,
                                             k.bands, k.band_prefix, *k.fair), (job_id,))
        self._wake(queue, moved)
        return bool(moved), state

    def set_paused(self, queue: str, paused: bool, *, since_ms: int = 0) -> bool:
        """Pause or resume one shard (see pause.lua); True when its flag changed.

        ``since_ms``: when the pause began (the mirror's time, kept when a
        lost flag is put back), 0 for the server's clock now.
        """
        k = self.keys(queue)
        changed = bool(self._run("pause", (k.paused, k.wake, k.queued, k.bands, k.fair_bands,
                                           k.holds), (int(paused), since_ms)))
        if not paused:
            self._wake(queue, changed)
        return changed

    def paused_since(self, queues: Sequence[str]) -> dict[str, int]:
        """The shards of ``queues`` whose flag is set, and since when (ms); one round trip."""
        if not queues:
            return {}
        with self.client.pipeline(transaction=False) as pipe:
            for queue in queues:
                pipe.get(self.keys(queue).paused)
            found = pipe.execute()
        return {queue: int(value) for queue, value in zip(queues, found, strict=True)
                if value is not None and str(value).isdigit()}

    def purge(self, queue: str, job_ids: Sequence[str]) -> int:
        """Forget dead jobs whose rows are being pruned; returns hashes deleted."""
        if not job_ids:
            return 0
        k = self.keys(queue)
        purged = 0
        for start in range(0, len(job_ids), 1000):  # bounded script calls
            purged += int(self._run("purge", (k.dead, k.job_prefix), job_ids[start:start + 1000]))
        return purged
