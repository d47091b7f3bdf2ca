"""Pause, resume and drain a queue at runtime; put lost pauses back.

A pause is two facts that must agree: a ``QueuePause`` row (durable) and a
flag on every shard of the queue in Redis (``QueueKeys.paused``), which the
claim script reads at every claim and the start script at every start. So a
pause takes effect at the next claim of every worker, with no message to
any of them, and a job claimed just before it (in flight when the pause
returned) is handed back unstarted instead of starting after it.

Ordering: pause and resume write Redis while they hold the row's lock,
inside the transaction that writes the row, and :func:`restore` (the sweep)
sets a missing flag only for a row it could lock. So the Redis writes
happen in the order of the rows' commits: a resume can never be undone by a
sweep that read the row just before it, and a pause never by a resume
before it. A pause whose commit fails after its flags were set leaves the
queue paused in Redis only: the caller got the error, and a resume clears
it (resume removes the flags whether or not a row exists).

The public functions (:func:`pause_queue`, :func:`resume_queue`,
:func:`drain_queue`, :func:`queue_pauses`) name a backend by its TASKS
alias; the rest take ``backend.parts`` (see parts.py), as the sweep does.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING

from django.db import transaction
from django.utils import timezone

from .compat import DEFAULT_TASK_BACKEND_ALIAS
from .models import QueuePause

if TYPE_CHECKING:
    from .parts import BackendParts

#: How often drain looks at the queue's running jobs, in seconds.
DRAIN_POLL_S = 0.1


class UnknownQueue(ValueError):
    """The backend does not serve a queue of that name; the message lists those it does."""


@dataclass(frozen=True, slots=True)
class PauseState:
    """Where one queue stands: paused or not, since when, and what still runs."""

    queue: str
    paused: bool
    #: When it was paused (the row's time), None when it runs.
    since: datetime | None
    by: str
    #: Jobs of the queue holding a lease now, every shard together: the
    #: ones a drain waits for.
    running: int
    #: Shards whose Redis flag is set, of ``shards``: fewer than all while
    #: paused means Redis lost some and the next sweep pass puts them back.
    flagged: int
    shards: int

    @property
    def drained(self) -> bool:
        """Paused with nothing running: safe to deploy, migrate or stop workers."""
        return self.paused and self.running == 0


def _check_queue(parts: BackendParts, queue: str) -> None:
    if queue not in parts.queues:
        served = ", ".join(sorted(parts.queues))
        raise UnknownQueue(f"Queue {queue!r} is not served by task backend {parts.alias!r}; "
                           f"its queues are: {served}.")


def _shards(parts: BackendParts, queue: str) -> list[str]:
    """Every shard of ``queue``: configured (SHARDS) and ever written to."""
    return parts.broker.physical_queues([queue], parts.config.SHARDS)


def _ms(moment: datetime) -> int:
    return int(moment.timestamp() * 1000)


def pause(parts: BackendParts, queue: str, *, by: str = "") -> bool:
    """Pause ``queue``: no claim takes its jobs and no claimed job starts after this returns.

    Jobs already running go on to their end. Returns True when the queue
    was running before (False: it was paused already, and stays so since
    its first pause). Raises :class:`UnknownQueue` for a queue the backend
    does not serve, and Redis or database errors as they come: then the
    pause may or may not hold, and calling again is safe.
    """
    _check_queue(parts, queue)
    database = parts.config.DATABASE
    with transaction.atomic(using=database):
        row, created = QueuePause.objects.using(database).select_for_update().get_or_create(
            backend=parts.alias, queue=queue,
            defaults={"paused_at": timezone.now(), "paused_by": by[:150]})
        since_ms = _ms(row.paused_at)
        changed = [parts.broker.set_paused(shard, True, since_ms=since_ms)
                   for shard in _shards(parts, queue)]
    return created or any(changed)


def resume(parts: BackendParts, queue: str) -> bool:
    """Resume ``queue``: workers claim its jobs again at once. True when it was paused."""
    _check_queue(parts, queue)
    database = parts.config.DATABASE
    with transaction.atomic(using=database):
        deleted, _ = QueuePause.objects.using(database).filter(
            backend=parts.alias, queue=queue).delete()
        changed = [parts.broker.set_paused(shard, False) for shard in _shards(parts, queue)]
    return bool(deleted) or any(changed)


def drain(parts: BackendParts, queue: str, *, timeout_s: float, by: str = "",
          poll_s: float = DRAIN_POLL_S) -> PauseState:
    """Pause ``queue``, then wait until none of its jobs runs, for at most ``timeout_s``.

    Returns the last state seen: ``drained`` says whether the wait ended
    with nothing running. The queue stays paused either way: resume it when
    the work that needed it quiet is done.
    """
    pause(parts, queue, by=by)
    deadline = time.monotonic() + timeout_s
    while True:
        state = status(parts, [queue])[0]
        if state.running == 0 or time.monotonic() >= deadline:
            return state
        time.sleep(min(poll_s, max(0.0, deadline - time.monotonic())))


def status(parts: BackendParts, queues: list[str] | None = None) -> list[PauseState]:
    """Each queue's pause state (every queue the backend serves when None)."""
    names = sorted(parts.queues) if queues is None else queues
    for queue in names:
        _check_queue(parts, queue)
    database = parts.config.DATABASE
    rows = {row.queue: row for row in QueuePause.objects.using(database).filter(
        backend=parts.alias, queue__in=names)}
    broker = parts.broker
    states = []
    for queue in names:
        shards = _shards(parts, queue)
        flagged = broker.paused_since(shards)
        running = sum(broker.counts(shard).running for shard in shards)
        row = rows.get(queue)
        states.append(PauseState(
            queue=queue, paused=row is not None, since=row.paused_at if row else None,
            by=row.paused_by if row else "", running=running, flagged=len(flagged),
            shards=len(shards)))
    return states


def restore(parts: BackendParts, queues: list[str]) -> int:
    """Set again the Redis flags of paused ``queues`` that Redis lost; return how many.

    Run by the sweep at every pass and before reconcile pushes lost jobs
    back, so a queue paused before Redis restarted or was flushed is paused
    again before any of its rebuilt jobs can be claimed. Rows a pause or
    resume holds are skipped (SKIP LOCKED): that call writes the flags
    itself, and setting one under a resume that has just removed it would
    pause the queue again.
    """
    database = parts.config.DATABASE
    paused = QueuePause.objects.using(database).filter(backend=parts.alias, queue__in=queues)
    if not paused.exists():  # the usual case: one cheap query, no transaction
        return 0
    restored = 0
    with transaction.atomic(using=database):
        rows = list(paused.select_for_update(skip_locked=True))
        for row in rows:
            shards = _shards(parts, row.queue)
            flagged = parts.broker.paused_since(shards)
            for shard in shards:
                if shard not in flagged and parts.broker.set_paused(
                        shard, True, since_ms=_ms(row.paused_at)):
                    restored += 1
    return restored



# -- the public functions -------------------------------------------------------------


def _parts(alias: str) -> BackendParts:
    from .backend import find_backend  # the backend imports the sweep, which imports this

    return find_backend(alias).parts


def pause_queue(queue: str, *, backend: str = DEFAULT_TASK_BACKEND_ALIAS, by: str = "") -> bool:
    """Pause ``queue`` of the backend ``TASKS[backend]`` on every shard; see :func:`pause`.

    Once it returns, no attempt of the queue starts: claims take nothing and
    jobs claimed but not started are handed back. Jobs already running
    finish. True when the queue was running before. Raises
    :class:`UnknownQueue` (a ValueError) for a queue the backend does not
    serve, ``backend.BackendNotFound`` for an alias that is no
    reliable_jobs backend.
    """
    return pause(_parts(backend), queue, by=by)


def resume_queue(queue: str, *, backend: str = DEFAULT_TASK_BACKEND_ALIAS) -> bool:
    """Resume a paused ``queue``: workers claim its jobs again at once. True when it was paused."""
    return resume(_parts(backend), queue)


def drain_queue(queue: str, *, timeout_s: float, backend: str = DEFAULT_TASK_BACKEND_ALIAS,
                by: str = "") -> PauseState:
    """Pause ``queue``, then wait (at most ``timeout_s``) until none of its jobs runs.

    The state returned says ``drained`` when nothing was left running; the
    queue stays paused either way.
    """
    return drain(_parts(backend), queue, timeout_s=timeout_s, by=by)


def queue_pauses(queues: list[str] | None = None, *,
                 backend: str = DEFAULT_TASK_BACKEND_ALIAS) -> list[PauseState]:
    """Each queue's state (every queue of the backend when None): paused, since, running."""
    return status(_parts(backend), queues)
