"""The jobs a worker holds, from their claim to their ack, nack or release."""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field

from ..broker import ClaimedJob
from ..cancellation import Cancellation

#: A job in hand is known by its queue and its fencing token: the same job
#: claimed again by this worker (its stale attempt still buffered or
#: running) is another entry, renewed and finished on its own.
HeldKey = tuple[str, str, int, int]


def held_key(job: ClaimedJob) -> HeldKey:
    return (job.queue, job.id, job.attempt, job.gen)


@dataclass(slots=True)
class Held:
    """A job in hand: claimed, maybe running, not yet acked."""

    job: ClaimedJob
    started: bool = False
    #: Redis refused a renewal: another worker may hold the job now.
    lost: bool = False
    #: Its task ran; its outcome is with the finisher, on its way to the ack.
    done: bool = False
    #: The finisher began writing its outcome to the mirror: from then on the
    #: outcome may be committed, even if the write then failed (a commit
    #: whose reply was lost), so the job is never handed back.
    writing: bool = False
    #: Its outcome is in the mirror: a refused renewal no longer means lost.
    mirrored: bool = False
    #: Its task runs in a child process (a time limit), which a stop can kill.
    isolated: bool = False
    #: Set by the lease keeper when Redis says the job is to be cancelled.
    cancellation: Cancellation = field(default_factory=Cancellation)
    #: Set when the worker stops past its grace period: kills the attempt's
    #: child process, if it has one (a thread cannot be killed).
    interrupt: Cancellation = field(default_factory=Cancellation)


class InHand:
    """Every job this worker holds, keyed by token; thread-safe.

    The lease keeper renews what is here, the main thread claims into it,
    executors start and finish entries, the finisher drops them once Redis
    took the outcome.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: dict[HeldKey, Held] = {}
        #: How many entries are done (kept, so counts() is O(1)).
        self._done = 0

    def __len__(self) -> int:
        return len(self._held)

    def add(self, jobs: Iterable[ClaimedJob]) -> None:
        with self._lock:
            for job in jobs:
                self._held[held_key(job)] = Held(job)

    def drop(self, jobs: Iterable[ClaimedJob]) -> None:
        with self._lock:
            for job in jobs:
                held = self._held.pop(held_key(job), None)
                if held is not None and held.done:
                    self._done -= 1

    def begin(self, job: ClaimedJob) -> Held | None:
        """Mark ``job`` running and return its entry (its cancel and interrupt
        flags); None (and dropped) when its lease was lost or it was handed
        back meanwhile."""
        key = held_key(job)
        with self._lock:
            held = self._held.get(key)
            if held is None or held.lost:
                if held is not None:
                    self._held.pop(key, None)
                    self._done -= held.done
                return None
            held.started = True
            return held

    def done(self, job: ClaimedJob) -> int:
        """Mark ``job``'s task run; return how many jobs in hand are not (counts()[0])."""
        with self._lock:
            held = self._held.get(held_key(job))
            if held is not None and not held.done:
                held.done = True
                self._done += 1
            return len(self._held) - self._done

    def cancel(self, jobs: Iterable[ClaimedJob]) -> list[ClaimedJob]:
        """Request cancellation of ``jobs``; return those not requested before."""
        with self._lock:
            found = [(held.job, held.cancellation) for job in jobs
                     if (held := self._held.get(held_key(job))) is not None]
        fresh = [job for job, cancellation in found if not cancellation.requested()]
        for _, cancellation in found:
            cancellation.request()  # outside the lock: it runs hooks (kills a child)
        return fresh

    def counts(self) -> tuple[int, int]:
        """(jobs not run yet or running, jobs run and waiting for their ack)."""
        with self._lock:
            return len(self._held) - self._done, self._done

    def writing(self, jobs: Iterable[ClaimedJob]) -> None:
        """Note that the finisher begins writing the outcomes of ``jobs`` (see Held.writing)."""
        with self._lock:
            for job in jobs:
                held = self._held.get(held_key(job))
                if held is not None:
                    held.writing = True

    def mirrored(self, jobs: Iterable[ClaimedJob]) -> None:
        with self._lock:
            for job in jobs:
                held = self._held.get(held_key(job))
                if held is not None:
                    held.mirrored = True

    def lose(self, jobs: Iterable[ClaimedJob]) -> list[ClaimedJob]:
        """Mark ``jobs`` lost (Redis refused their renewal); return those really lost.

        The renewal works on a snapshot of the jobs in hand: the finisher
        may ack one before the renewal reaches Redis, which then refuses it.
        A job whose outcome is in the mirror (its ack on its way, or landed)
        or that left the hand meanwhile is done, not lost: it is neither
        marked nor returned.
        """
        lost: list[ClaimedJob] = []
        with self._lock:
            for job in jobs:
                held = self._held.get(held_key(job))
                if held is not None and not held.mirrored:
                    held.lost = True
                    lost.append(job)
        return lost

    def renewable(self) -> dict[str, list[ClaimedJob]]:
        """Jobs whose lease is still ours, by queue."""
        by_queue: dict[str, list[ClaimedJob]] = defaultdict(list)
        with self._lock:
            for held in self._held.values():
                if not held.lost:
                    by_queue[held.job.queue].append(held.job)
        return by_queue

    def take_releasable(self, *, finisher_ended: bool) -> list[tuple[ClaimedJob, bool]]:
        """(job, started) of every job nothing of which can run or land any more;
        no executor may begin one of them from now on.

        Those are the jobs whose task never began, and, once the finisher's
        thread has ended (``finisher_ended``), those whose task ran but
        whose outcome it never began to write: no commit of it can land any
        more. Any other job is unsafe to hand back while this process
        lives: its task may still run in a thread, or its outcome be inside
        (or have been in) a commit that lands, or landed, unknown to this
        worker, and the job would run again. Those are left to their
        leases (see Worker._shutdown): the sweep settles each from the
        mirror, or runs it again if its outcome is not there.
        """
        with self._lock:
            taken = [held for held in self._held.values() if not held.started
                     or (finisher_ended and held.done and not held.writing)]
            for held in taken:
                held.lost = True  # begin() refuses it now
            return [(held.job, held.started) for held in taken]

    def interrupt_running(self) -> int:
        """Ask every running attempt to stop (kills the children); return how many run."""
        with self._lock:
            running = [held for held in self._held.values() if held.started and not held.done]
        for held in running:
            held.interrupt.request()  # outside the lock: it runs hooks (kills a child)
        return len(running)

    def stopping_children(self) -> int:
        """How many interrupted attempts in a child process have not ended yet."""
        with self._lock:
            return sum(1 for held in self._held.values()
                       if held.isolated and held.started and not held.done
                       and held.interrupt.requested())

    def left_running(self) -> tuple[int, int]:
        """(attempts begun and not finished, finished attempts whose outcome is not applied)."""
        with self._lock:
            running = sum(1 for held in self._held.values() if held.started and not held.done)
            return running, self._done

    def sample(self, limit: int) -> list[str]:
        """Up to ``limit`` "queue:id" labels, for the heartbeat."""
        with self._lock:
            return [f"{key[0]}:{key[1]}" for key in list(self._held)[:limit]]
