"""What a running task says of itself: its progress and its checkpoint, in its job's row.

A task that takes its context calls ``context.progress(done, total)`` and
``context.checkpoint(value)``; the executor gives each attempt a
:class:`Journal` that writes them to the job's row (``progress_done``,
``progress_total``, ``checkpoint``), and the next attempt reads the
checkpoint back (``context.checkpoint_value``) to resume where the last one
stopped, a worker SIGKILLed mid-way included.

Why the database and not Redis: the row outlives Redis (a FLUSHDB, a
rebuild) and is what the admin and ``get_progress()`` read; a checkpoint is
written a few times a second at most, so one UPDATE each costs nothing
next to the work between two of them.

Fencing, as every mirror write: a write lands only on a row of the
attempt's generation that has not finished, and never over the progress of
a later attempt (``progress_attempt``), so a stale worker (its lease lost,
the job running elsewhere) cannot move the checkpoint back. A checkpoint
returns only once committed (its own autocommit UPDATE; inside the task's
own ``transaction.atomic()`` it commits with the task's writes, which is how
to make the two agree). Progress alone is written at most every
PROGRESS_EVERY_S, and what is left is written when the attempt ends.
``updated_at`` is left alone: it is reconcile's clock of state changes, and
a checkpoint changes no state.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

from django.db import DatabaseError
from django.db.models import Q

from ..compat import TaskResultDoesNotExist
from ..models import Job
from .records import FINISHED_STATES

logger = logging.getLogger("reliable_jobs.worker")

#: Least time between two progress-only writes of one attempt, in seconds.
PROGRESS_EVERY_S = 0.5
#: The largest checkpoint kept, in bytes of JSON: it is read back whole by
#: every attempt and shown in the admin; big state belongs in its own table.
MAX_CHECKPOINT_BYTES = 1_000_000

#: A value never written (checkpoint_value before the first read).
_UNREAD = object()


@dataclass(frozen=True, slots=True)
class JobProgress:
    """A job's progress as its task last reported it (``backend.get_progress()``).

    ``done`` and ``total`` are None until the task reports them; ``checkpoint``
    is the JSON value of its last checkpoint (None if none), ``attempt`` the
    attempt that wrote them.
    """

    done: int | None
    total: int | None
    checkpoint: Any
    attempt: int | None

    @property
    def fraction(self) -> float | None:
        """``done / total`` between 0 and 1, None when either is unknown or total is 0."""
        if self.done is None or not self.total:
            return None
        return max(0.0, min(1.0, self.done / self.total))


def progress_of(using: str, result_id: str, *, backend: str) -> JobProgress:
    """The progress a job's row holds (``backend.get_progress()``).

    Django's ``TaskResult`` has no place for it, so it is read beside
    ``get_result()``. Raises ``TaskResultDoesNotExist`` for an id that is no
    job of ``backend``.
    """
    try:
        job_id = uuid.UUID(str(result_id))
    except ValueError:
        raise TaskResultDoesNotExist(result_id) from None
    row = Job.objects.using(using).filter(pk=job_id, backend=backend).values_list(
        "progress_done", "progress_total", "checkpoint", "progress_attempt").first()
    if row is None:
        raise TaskResultDoesNotExist(result_id)
    return JobProgress(*row)


def _count(value: Any, name: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{name} must be a whole number >= 0, not {value!r}.")
    return value


class Journal:
    """One attempt's progress and checkpoint writer (used from its task's thread)."""

    def __init__(self, using: str, job_id: str, *, attempt: int, gen: int) -> None:
        self.using = using
        self.job_id = job_id
        self.attempt = attempt
        self.gen = gen
        self._lock = threading.Lock()
        #: Progress reported and not written yet: (done, total), or None.
        self._pending: tuple[int, int | None] | None = None
        self._written_at = 0.0
        self._checkpoint: Any = _UNREAD

    def progress(self, done: int, total: int | None = None) -> None:
        """Note ``done`` of ``total``; written now if the last write is PROGRESS_EVERY_S old."""
        done = _count(done, "done")
        total = None if total is None else _count(total, "total")
        with self._lock:
            self._pending = (done, total)
            if time.monotonic() - self._written_at < PROGRESS_EVERY_S:
                return
        self.flush()

    def checkpoint(self, value: Any, *, done: int | None = None,
                   total: int | None = None) -> bool:
        """Store ``value`` (JSON) as the job's checkpoint now; False if the write was refused.

        Refused: the job is no longer this attempt's (a later attempt wrote
        its own progress, Redis rebuilt it, or it finished).
        """
        text = json.dumps(value, allow_nan=False)  # TypeError / ValueError: not JSON
        if len(text.encode()) > MAX_CHECKPOINT_BYTES:
            raise ValueError(f"A checkpoint holds at most {MAX_CHECKPOINT_BYTES} bytes of JSON; "
                             f"this one has {len(text.encode())}.")
        changes: dict[str, Any] = {"checkpoint": json.loads(text)}
        with self._lock:
            if done is not None:
                self._pending = (_count(done, "done"),
                                 None if total is None else _count(total, "total"))
            if self._pending is not None:
                changes["progress_done"], changes["progress_total"] = self._pending
                self._pending = None
            self._written_at = time.monotonic()
        stored = self._write(changes)
        if stored:
            self._checkpoint = changes["checkpoint"]
        return stored

    def flush(self) -> bool:
        """Write the progress not written yet, if any; False if refused or not written.

        Progress is best effort: a database error is logged, never raised
        into the task (or over its outcome), and the next report tries again.
        """
        with self._lock:
            pending, self._pending = self._pending, None
            if pending is None:
                return True
            self._written_at = time.monotonic()
        try:
            return self._write({"progress_done": pending[0], "progress_total": pending[1]})
        except DatabaseError as exc:
            with self._lock:
                self._pending = self._pending or pending
            logger.warning("Progress of job %s attempt %d not written: %s",
                           self.job_id, self.attempt, exc)
            return False

    def last_checkpoint(self) -> Any:
        """The job's checkpoint as this attempt found it (or last stored it); read once."""
        if self._checkpoint is _UNREAD:
            self._checkpoint = Job.objects.using(self.using).filter(pk=self.job_id).values_list(
                "checkpoint", flat=True).first()
        return self._checkpoint

    def _write(self, changes: dict[str, Any]) -> bool:
        """One fenced UPDATE of the row: this generation, unfinished, no later attempt's."""
        return bool(Job.objects.using(self.using).filter(
            Q(progress_attempt__isnull=True) | Q(progress_attempt__lte=self.attempt),
            pk=self.job_id, generation=self.gen,
        ).exclude(state__in=FINISHED_STATES).update(progress_attempt=self.attempt, **changes))
