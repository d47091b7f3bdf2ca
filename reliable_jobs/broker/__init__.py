"""The Redis side of the queue: one typed method per Lua script.

The broker is the only code that talks to Redis about jobs. It knows key
names only through :mod:`reliable_jobs.keys` and Lua only through
:mod:`reliable_jobs.scripts`; it holds no state beyond its connections.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from enum import IntEnum
from typing import Any

import redis
from redis.backoff import ExponentialBackoff
from redis.cluster import RedisCluster
from redis.commands.core import Script
from redis.exceptions import RedisClusterException
from redis.retry import Retry

from .. import scripts
from ..exceptions import AttemptsExhausted, LeaseExpired, class_path
from ..keys import (
    QueueKeys,
    logical_queue,
    shard_index,
    shard_queue,
    shards_index,
    wake_marker,
    worker_key,
    workers_index,
)

#: Seconds a client waits for a reply before giving up on a dead connection.
#: Blocking waits use their own client whose timeout exceeds the block time.
SOCKET_TIMEOUT_S = 10.0
#: Expired leases and due jobs handled per recover/promote call.
SWEEP_BATCH = 1_000
#: How long a worker that stopped beating stays in the workers index, in ms.
WORKER_INDEX_KEEP_MS = 3_600_000
#: Every error a Redis call can raise when the server or the network fails:
#: the cluster client's own errors are not RedisErrors.
REDIS_ERRORS: tuple[type[Exception], ...] = (redis.RedisError, RedisClusterException)

#: Ids latency.lua reads at most from a queue's oldest end, past cancelled
#: tombstones and stray copies, to find the oldest job that will run.
LATENCY_LOOK = 20

#: Retries of a call on a Redis Cluster after a connection error or timeout.
CLUSTER_RETRIES = 1

#: How often a producer records again a shard it writes to, in seconds.
REGISTER_EVERY_S = 10.0

#: How long a finished rebuilt job (generation > 0) keeps a tombstone, in ms:
#: a push of it from before the rebuild that arrives meanwhile is refused.
TOMBSTONE_MS = 3_600_000
#: The class paths claim.lua and recover.lua write before the error of a job
#: they bury, built from the classes so they always import (TaskError reads them).
EXHAUSTED_CLASS = class_path(AttemptsExhausted)
EXPIRED_CLASS = class_path(LeaseExpired)

#: A fencing token with the id it guards: (id, attempt, gen). The attempt
#: counts claims; the generation counts rebuilds from the mirror, so a token
#: handed out before Redis lost a job never matches one handed out after.
Fence = tuple[str, int, int]


class Applied(IntEnum):
    """What a fenced script did with one token: its per-group reply.

    An int, so code that only asks "was it held?" can treat it as a bool.
    """

    #: The token is no longer current: nothing was done.
    REFUSED = 0
    #: Done as asked (started, renewed, acked, nacked, released).
    DONE = 1
    #: The job is marked for cancellation (cancel.lua): extend renewed it
    #: and says so; start did not mark it; ack, nack and release finished
    #: it as cancelled instead.
    CANCELLED = 2


def _applied(replies: Sequence[Any]) -> list[Applied]:
    return [Applied(int(r)) for r in replies]


def epoch_ms(moment: datetime | None) -> int:
    """A moment as ``NewJob.due_ms`` wants it: ms since the epoch, 0 for "now" (None)."""
    return 0 if moment is None else int(moment.timestamp() * 1000)


@dataclass(frozen=True, slots=True)
class NewJob:
    """A job to write into Redis (fresh, or rebuilt from the mirror)."""

    id: str
    payload: str
    max_attempts: int
    due_ms: int = 0
    attempts: int = 0
    #: 0 when first enqueued; the mirror's generation when rebuilt.
    gen: int = 0
    #: -100 to 100, higher runs first (Django's range); 0 keeps the plain list.
    priority: int = 0


@dataclass(frozen=True, slots=True)
class ClaimedJob:
    """A job this worker now holds: ``attempt`` and ``gen`` are its fencing token."""

    queue: str
    id: str
    attempt: int
    max_attempts: int
    payload: str
    gen: int = 0
    #: How long the job was ready before this claim (ms, server clock), -1 unknown.
    waited_ms: int = field(default=-1, compare=False)

    @property
    def fence(self) -> Fence:
        return (self.id, self.attempt, self.gen)


@dataclass(frozen=True, slots=True)
class ClaimResult:
    jobs: list[ClaimedJob]
    #: (id, attempts, gen) of jobs found with no attempt left, now dead.
    dead: list[Fence]
    #: Ids found on the list with no job hash, moved aside to dead.
    garbage: list[str]
    remaining: int
    #: Non-zero priority bands the queue had in use (0: only priority 0).
    banded: int = 0


@dataclass(frozen=True, slots=True)
class RecoveredJob:
    id: str
    attempts: int
    #: 'settled', 'cancelled', 'expired', 'unstarted', 'dead', 'orphan',
    #: 'garbage' or 'dropped'; see recover.lua.
    kind: str
    #: The job's budget after recovery (an unstarted claim is refunded).
    max_attempts: int = field(default=0, compare=False)
    gen: int = field(default=0, compare=False)


@dataclass(frozen=True, slots=True)
class Settlement:
    """An expired attempt whose outcome the mirror holds: finish it as that."""

    id: str
    attempt: int
    gen: int
    #: 'succeeded', 'dead' or 'cancelled'.
    final: str
    error: str = ""


@dataclass(frozen=True, slots=True)
class RecoverResult:
    outcomes: list[RecoveredJob]
    stamped: int


@dataclass(frozen=True, slots=True)
class Latency:
    """How long one physical queue's oldest jobs have waited (see latency.lua).

    Ages are in ms on the Redis server's clock, None when there is no such
    job: an empty queue, or nothing scheduled that is due.
    """

    queue: str
    queued: int
    #: Age of the oldest job ready to run (queued), from when it became ready.
    oldest_ready_ms: int | None
    #: How long the oldest scheduled job that is due has waited for promotion.
    oldest_due_ms: int | None
    oldest_ready_id: str = ""
    oldest_due_id: str = ""


@dataclass(frozen=True, slots=True)
class QueueCounts:
    queued: int
    running: int
    scheduled: int
    dead: int


#: URL schemes that mean Redis Cluster (or a Valkey cluster): any one node's
#: address; the client discovers the others.
CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}


def is_cluster_url(url: str) -> bool:
    return url.split("://", 1)[0] in CLUSTER_SCHEMES


def connect(url: str, *, socket_timeout: float | None = SOCKET_TIMEOUT_S) -> Any:
    """Open a client for ``url`` that decodes replies to ``str``.

    ``redis+cluster://host:port`` (or ``rediss+cluster://``) opens a
    ``RedisCluster`` client instead. Connections are named
    ``reliable_jobs:<pid>`` so ``CLIENT LIST`` shows which process holds which.

    Bytes that are not UTF-8 (anyone who can write to Redis can put them in
    an id or a payload) decode to lone surrogates instead of raising
    UnicodeDecodeError in the middle of a claim; ``Broker._run`` sends such
    ids back as the same bytes, and the payload codec refuses the surrogates.
    """
    options: dict[str, Any] = {
        "decode_responses": True,
        "encoding_errors": "surrogateescape",
        "socket_timeout": socket_timeout,
        "socket_connect_timeout": 5.0,
        "client_name": f"reliable_jobs:{os.getpid()}",
    }
    scheme, rest = url.split("://", 1)
    if scheme in CLUSTER_SCHEMES:
        # redis-py's cluster client retries a call 10 times by default, each
        # waiting the full socket timeout on a hung node: about 110 s for one
        # call, longer than a lease, while one thread renews every queue's
        # leases. One retry (with a fresh slot map) rides out a failover.
        return RedisCluster.from_url(f"{CLUSTER_SCHEMES[scheme]}://{rest}",
                                     retry=Retry(ExponentialBackoff(cap=1.0, base=0.1),
                                                 CLUSTER_RETRIES), **options)
    return redis.Redis.from_url(url, health_check_interval=30, **options)


class Broker:
    """Typed access to one Redis server's queues under one key prefix."""

    def __init__(self, url: str, prefix: str, *, fair_share: int = 0) -> None:
        self.url = url
        self.prefix = prefix
        #: One claim in ``fair_share`` (while several priorities wait) takes
        #: the job that waited longest; 0: strict priority. See claim.lua.
        self.fair_share = fair_share
        #: Queues this process saw with priority bands in use: a worker
        #: waiting on one of them alone waits on its wake marker, which
        #: every band's push signals, instead of BLMOVE on priority 0's list.
        self._banded: set[str] = set()
        self.client = connect(url)
        #: On a cluster, multi-queue waits use markers in one shared slot.
        self.cluster = is_cluster_url(url)
        self._keys: dict[str, QueueKeys] = {}
        self._scripts: dict[str, Script] = {
            name: self.client.register_script(scripts.source(name))
            for name in scripts.SCRIPT_NAMES
        }
        self._blocking: redis.Redis | None = None
        #: Shards this process recorded in their shards index, and when (monotonic s).
        self._registered: dict[str, float] = {}

    def keys(self, queue: str) -> QueueKeys:
        keys = self._keys.get(queue)
        if keys is None:
            keys = self._keys[queue] = QueueKeys(self.prefix, queue)
        return keys

    def _run(self, name: str, keys: Sequence[str], args: Sequence[Any]) -> Any:
        # An id read back from Redis may hold bytes that are not UTF-8 (lone
        # surrogates, see connect()): send it back as those same bytes.
        # redis-py's hiredis packer ignores encoding_errors, hence by hand.
        wire = [a.encode(errors="surrogateescape") if isinstance(a, str) else a for a in args]
        return self._scripts[name](keys=keys, args=wire)

    def physical_queues(self, queues: Iterable[str], shards: dict[str, int]) -> list[str]:
        """Every physical queue (shard) of ``queues``: configured, or ever written to."""
        queues = sorted(queues)
        with self.client.pipeline(transaction=False) as pipe:
            for queue in queues:
                pipe.zrange(shards_index(self.prefix, queue), 0, -1)
            used = pipe.execute()
        physical = {shard_queue(q, i) for q in queues for i in range(shards.get(q, 1))}
        physical |= {shard_queue(q, int(i)) for q, indexes in zip(queues, used, strict=True)
                     for i in indexes}
        return sorted(physical)

    def _wake(self, queue: str, ready: object) -> None:
        """On a cluster, signal waiting workers that ``queue`` may have work.

        Off a cluster the scripts push their in-slot marker themselves; on one
        the marker must live in the shared wake slot, which a script running
        in the queue's slot cannot touch. A lost signal (the process dies
        in between) only delays an idle worker until its next timed wait.
        """
        if self.cluster and ready:
            self._run("wake", (wake_marker(self.prefix, queue),), ())

    def close(self) -> None:
        self.client.close()
        if self._blocking is not None:
            self._blocking.close()

    # -- producers -------------------------------------------------------

    def enqueue(self, queue: str, jobs: Iterable[NewJob], *, register: bool = False) -> int:
        """Write jobs and make them runnable; return how many were written.

        Existing job hashes are kept, and so are tombstones of the same or a
        newer generation (see enqueue.lua).

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
                     job.priority)
        if not args:
            return 0
        written = sum(map(int, self._run(
            "enqueue", (k.queued, k.scheduled, k.wake, k.job_prefix, k.bands, k.band_prefix),
            args)))
        self._wake(queue, written)
        return written

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

    def _blocking_client(self) -> redis.Redis:
        if self._blocking is None:
            # Longer than any block we ask for, so the client never times out
            # a healthy wait (docs/machine.md: it would retry for many seconds).
            self._blocking = connect(self.url, socket_timeout=SOCKET_TIMEOUT_S + 5.0)
        return self._blocking

    def claim(
        self, queue: str, *, count: int, lease_ms: int, moved_id: str | None = None
    ) -> ClaimResult:
        """Claim up to ``count`` jobs (plus ``moved_id``) and stamp their leases.

        Higher priorities first, FIFO within one, with the broker's fair
        share for the job that waited longest (see claim.lua).
        """
        k = self.keys(queue)
        jobs_flat, dead_flat, garbage, remaining, banded = self._run(
            "claim",
            (k.queued, k.processing, k.leases, k.dead, k.wake, k.job_prefix, k.landing,
             k.bands, k.band_prefix, k.share, k.strays),
            (max(count, 1 if moved_id else 0), lease_ms, moved_id or "", self.fair_share,
             EXHAUSTED_CLASS),
        )
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
        return ClaimResult(jobs, dead, list(garbage), int(remaining), int(banded))

    def start(self, queue: str, held: Sequence[Fence]) -> list[Applied]:
        """Mark held attempts as started: DONE (run it), CANCELLED (do not run it,
        ack it) or REFUSED (no longer held)."""
        if not held:
            return []
        k = self.keys(queue)
        args = [x for fence in held for x in fence]
        return _applied(self._run("start", (k.job_prefix,), args))

    def ack(self, queue: str, held: Sequence[Fence]) -> list[Applied]:
        """Finish jobs: DONE, CANCELLED (marked while it ran, finished as cancelled)
        or REFUSED (the attempt is no longer held)."""
        if not held:
            return []
        k = self.keys(queue)
        args: list[Any] = [TOMBSTONE_MS]
        args += [x for fence in held for x in fence]
        return _applied(self._run("ack", (k.processing, k.leases, k.job_prefix), args))

    def nack(self, queue: str, failed: Sequence[tuple[str, int, int, int, str]]
             ) -> list[Applied]:
        """Apply (id, attempt, gen, delay_ms or -1 for dead, error) decisions, fenced;
        a job marked for cancellation is finished as cancelled instead (CANCELLED)."""
        if not failed:
            return []
        k = self.keys(queue)
        args = [x for entry in failed for x in entry]
        keys = (k.queued, k.processing, k.leases, k.scheduled, k.dead, k.wake, k.job_prefix,
                k.bands, k.band_prefix)
        applied = _applied(self._run("nack", keys, args))
        self._wake(queue, any(ok == Applied.DONE and entry[3] == 0
                              for ok, entry in zip(applied, failed, strict=True)))
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
        keys = (k.queued, k.processing, k.leases, k.wake, k.job_prefix, k.bands, k.band_prefix)
        released = _applied(self._run("release", keys, args))
        self._wake(queue, Applied.DONE in released)
        return released

    # -- the sweep -------------------------------------------------------

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
            (k.queued, k.processing, k.leases, k.dead, k.wake, k.job_prefix, k.landing, k.scan,
             k.bands, k.band_prefix, k.strays),
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
                                             k.bands, k.band_prefix), (limit,)))
        self._wake(queue, promoted)
        return promoted

    def held_states(self, queue: str, job_ids: Sequence[str]) -> dict[str, dict[str, str]]:
        """Return the state, attempts, gen and last_error of each job Redis holds."""
        k = self.keys(queue)
        with self.client.pipeline(transaction=False) as pipe:
            for job_id in job_ids:
                pipe.hmget(k.job(job_id), "state", "attempts", "last_error", "gen")
            replies = pipe.execute()
        return {
            job_id: {"state": state, "attempts": attempts or "0", "last_error": error or "",
                     "gen": gen or "0"}
            for job_id, (state, attempts, error, gen) in zip(job_ids, replies, strict=True)
            if state is not None
        }

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
            "reprioritize", (k.queued, k.wake, k.job_prefix, k.bands, k.band_prefix, k.strays),
            (job_id, priority))
        self._wake(queue, int(changed) and state == "queued")
        return bool(changed), state, int(old)

    def revive(self, queue: str, job_id: str, *, extra_attempts: int) -> bool:
        """Queue a dead job again with ``extra_attempts`` more attempts."""
        k = self.keys(queue)
        keys = (k.queued, k.dead, k.wake, k.job_prefix, k.bands, k.band_prefix)
        revived = bool(self._run("revive", keys, (job_id, extra_attempts)))
        self._wake(queue, revived)
        return revived

    # -- observability ---------------------------------------------------

    def counts(self, queue: str) -> QueueCounts:
        """Ids on each list; queued adds up every priority band (at most 201 lists)."""
        k = self.keys(queue)
        with self.client.pipeline(transaction=False) as pipe:
            pipe.llen(k.queued)
            pipe.llen(k.processing)
            pipe.zcard(k.scheduled)
            pipe.zcard(k.dead)
            pipe.zrange(k.bands, 0, -1)
            queued, running, scheduled, dead, bands = pipe.execute()
        if bands:
            with self.client.pipeline(transaction=False) as pipe:
                for band in bands:
                    pipe.llen(f"{k.band_prefix}{band}")
                queued += sum(pipe.execute())
        return QueueCounts(queued, running, scheduled, dead)

    def queued_by_priority(self, queue: str) -> dict[int, int]:
        """Ids waiting on each priority's list (copies a reprioritize left included)."""
        k = self.keys(queue)
        bands = [int(b) for b in self.client.zrange(k.bands, 0, -1)]
        with self.client.pipeline(transaction=False) as pipe:
            for band in [0, *bands]:
                pipe.llen(k.band(band))
            lengths = pipe.execute()
        return {band: n for band, n in zip([0, *bands], lengths, strict=True) if n}

    def latency(self, queue: str, *, look: int = LATENCY_LOOK) -> Latency:
        """The age of ``queue``'s oldest ready job and oldest due scheduled job.

        One read-only script call: O(``look``) at the queued list's oldest
        end and O(log n) on the scheduled set, whatever their length (and
        O(``look``) more per priority other than 0 in use).
        """
        k = self.keys(queue)
        now_ms, queued, ready_id, ready_ms, due_id, due_ms = self._run(
            "latency", (k.queued, k.scheduled, k.job_prefix, k.bands, k.band_prefix), (look,))
        ready_ms, due_ms, now_ms = int(ready_ms), int(due_ms), int(now_ms)
        return Latency(
            queue, int(queued),
            oldest_ready_ms=max(0, now_ms - ready_ms) if ready_id and ready_ms else None,
            oldest_due_ms=max(0, now_ms - due_ms) if due_id else None,
            oldest_ready_id=ready_id, oldest_due_id=due_id,
        )

    def heartbeat(self, worker_id: str, info: dict[str, Any], *, ttl_ms: int) -> None:
        """Record that a worker is alive, with what it holds, for ``ttl_ms``.

        Workers killed outright never say goodbye: entries of the index older
        than an hour (far beyond any heartbeat TTL) are dropped here, so the
        index stays as small as the set of recent workers. Beats are scored
        on the Redis server's clock, so one worker's skewed clock can neither
        drop the others nor keep itself listed.
        """
        now_ms = self.server_time_ms()
        index = workers_index(self.prefix)
        with self.client.pipeline(transaction=False) as pipe:
            pipe.set(worker_key(self.prefix, worker_id), json.dumps(info), px=ttl_ms)
            pipe.zadd(index, {worker_id: now_ms})
            pipe.zremrangebyscore(index, "-inf", now_ms - WORKER_INDEX_KEEP_MS)
            pipe.execute()

    def forget_worker(self, worker_id: str) -> None:
        with self.client.pipeline(transaction=False) as pipe:
            pipe.delete(worker_key(self.prefix, worker_id))
            pipe.zrem(workers_index(self.prefix), worker_id)
            pipe.execute()

    def server_time_ms(self) -> int:
        seconds, micros = self.client.time()
        return int(seconds) * 1000 + int(micros) // 1000

    # -- the admin: staff actions, retention and the dashboard ----------
    # (added for the admin issue; the methods above are unchanged)

    def requeue(self, queue: str, job_id: str) -> tuple[bool, str]:
        """Run a scheduled job now; returns (moved, state found, '' when no hash)."""
        k = self.keys(queue)
        moved, state = self._run("requeue", (k.queued, k.scheduled, k.wake, k.job_prefix,
                                             k.bands, k.band_prefix), (job_id,))
        self._wake(queue, moved)
        return bool(moved), state

    def purge(self, queue: str, job_ids: Sequence[str]) -> int:
        """Forget dead jobs whose rows are being pruned; returns hashes deleted."""
        if not job_ids:
            return 0
        k = self.keys(queue)
        purged = 0
        for start in range(0, len(job_ids), 1000):  # bounded script calls
            purged += int(self._run("purge", (k.dead, k.job_prefix), job_ids[start:start + 1000]))
        return purged

    def workers(self, *, limit: int = 500) -> list[WorkerBeat]:
        """Workers whose heartbeat has not expired, newest beat first (``limit`` at most).

        The index keeps a worker until it says goodbye; one killed with
        SIGKILL stays there, so only ids whose heartbeat key still exists
        (it has a TTL) are returned.
        """
        index = workers_index(self.prefix)
        beats = [(str(entry[0]), int(entry[1]))  # withscores: (member, score) pairs
                 for entry in self.client.zrevrange(index, 0, limit - 1, withscores=True)
                 if isinstance(entry, tuple)]
        if not beats:
            return []
        with self.client.pipeline(transaction=False) as pipe:
            for worker_id, _ in beats:
                pipe.get(worker_key(self.prefix, worker_id))
            infos = pipe.execute()
        return [
            WorkerBeat(worker_id, beat_ms, json.loads(raw))
            for (worker_id, beat_ms), raw in zip(beats, infos, strict=True)
            if raw
        ]


@dataclass(frozen=True, slots=True)
class WorkerBeat:
    """A live worker's last heartbeat: what ``Worker._heartbeat`` wrote."""

    id: str
    #: When it last beat, in ms since the epoch (the Redis server's clock).
    beat_ms: int
    #: id, host, pid, queues, concurrency, jobs ("queue:id", at most 50),
    #: started (epoch s), claimed, finished.
    info: dict[str, Any]
