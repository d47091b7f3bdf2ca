"""The typed values the broker's methods take and return.

Plain frozen dataclasses (and the fencing token tuple), so callers never
see a raw script reply.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from enum import IntEnum
from typing import Any

#: A fencing token with the id it guards: (id, attempt, gen). The attempt
#: counts claims; the generation counts rebuilds from the mirror, so a token
#: handed out before Redis lost a job never matches one handed out after.
Fence = tuple[str, int, int]


class Applied(IntEnum):
    """What a fenced script did with one token: its per-group reply.

    An int, so code that only asks "may I go on with it?" can treat it as a
    bool: REFUSED and EXPIRED are false.
    """

    #: The token is no longer current: nothing was done.
    REFUSED = 0
    #: Done as asked (started, renewed, acked, nacked, released).
    DONE = 1
    #: The job is marked for cancellation (cancel.lua): extend renewed it
    #: and says so; start did not mark it; ack, nack and release finished
    #: it as cancelled instead.
    CANCELLED = 2
    #: start only: the token is current but the claim's lease has expired, so
    #: the sweep may be giving the job to another worker right now. Not
    #: marked started and not to be run: its holder lets go of it, and the
    #: sweep requeues it as a claim that never started (its attempt given back).
    EXPIRED = 3
    #: start only: the token is current but the queue was paused since the
    #: claim (pause.lua). Not marked started and not to be run: its holder
    #: hands it back unstarted (release.lua gives the attempt back).
    PAUSED = 4

    def __bool__(self) -> bool:
        return self in (Applied.DONE, Applied.CANCELLED)


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
    #: The job's fair group ('' for none): groups of a queue take turns (claim.lua).
    group: str = ""


class DebounceOutcome(IntEnum):
    """What debounce.lua did with a call (its first reply)."""

    #: The job was pending (never claimed, still scheduled): it has the call's payload now.
    REPLACED = 2
    #: Redis did not hold the job: it was made, with the call's payload.
    MADE = 1
    #: The job is queued, running or ended (or another incarnation of it): untouched.
    REFUSED = 0


@dataclass(frozen=True, slots=True)
class Debounced:
    """debounce.lua's answer: what it did, and the due time (ms, Redis's clock; 0 if refused)."""

    outcome: DebounceOutcome
    due_ms: int
    #: The state the script found when it refused ('' when no hash).
    state: str = ""


@dataclass(frozen=True, slots=True)
class Progress:
    """Where a job hash says its job is: the hash's state ('queued',
    'scheduled', 'running', 'dead', 'finished', 'cancelled'), and whether the
    task of its current attempt has begun (start.lua marked it)."""

    state: str
    started: bool


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
    #: -1, or, when limits held back every job this claim could reach, how
    #: long (ms) until one of them may let a job go (see flow.py).
    hold_ms: int = -1
    #: Whether hold_ms is a concurrency cap's guess (a slot may free sooner:
    #: an ack elsewhere does not say so) rather than a rate's exact time.
    hold_by_cap: bool = False
    #: The queue (this shard) is paused: nothing was claimed.
    paused: bool = False


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
    #: 'succeeded', 'dead', 'cancelled' or 'snoozed' (queued again, attempt given back).
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
    #: Ready to run, the jobs limits hold back included.
    queued: int
    running: int
    scheduled: int
    dead: int
    #: Of queued, those a rate limit or concurrency cap holds back (flow.py).
    held: int = 0


@dataclass(frozen=True, slots=True)
class LimitUse:
    """One limit's current use (``Broker.limit_use``)."""

    #: 'q' (the queue's own limits) or a limit's wire name (flow.LimitName).
    wire: str
    #: Jobs holding one of its slots (caps; for 'q' the queue's leases).
    running: int
    #: Claims it admitted in the last window (rates).
    recent: int
    #: Jobs waiting on its held list (for 'q': on the queue's priority-0 list).
    held: int


@dataclass(frozen=True, slots=True)
class WorkerBeat:
    """A live worker's last heartbeat: what ``LeaseKeeper.beat`` wrote."""

    id: str
    #: When it last beat, in ms since the epoch (the Redis server's clock).
    beat_ms: int
    #: id, host, pid, queues, concurrency, jobs ("queue:id", at most 50),
    #: started (epoch s), claimed, finished.
    info: dict[str, Any]
