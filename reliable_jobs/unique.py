"""Unique jobs: which calls of a task count as the same job.

A task with ``unique_for_ms`` gives each job a *unique key*: a digest of the
backend, the queue, the task and the call's arguments (all of them, bound to
the function's signature so ``f(1)`` and ``f(x=1)`` agree; or only the
arguments ``unique_by`` names; or whatever ``unique_by`` returns when it is
a function). The key only names the call: the database decides who holds
it (a partial unique index over the keys of unfinished jobs, see
``models.Job`` and ``mirror.insert_jobs``), Redis says whether the
holder's task started or ended (its rows learn it later), and Redis holds
nothing about the key itself.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from . import callargs
from .broker import REDIS_ERRORS, Broker
from .compat import InvalidTask, UniqueBy

if TYPE_CHECKING:
    from .models import Job

logger = logging.getLogger("reliable_jobs")

#: A job hash's state (see the scripts) as the mirror's JobState value; a
#: 'finished' tombstone is a rebuilt job that succeeded.
REDIS_TO_JOB_STATE = {"queued": "queued", "scheduled": "scheduled", "running": "running",
                      "dead": "dead", "finished": "succeeded", "cancelled": "cancelled"}


class UniqueTask(Protocol):
    """What this module reads of a task (a ``tasks.ReliableTask``, which it does not import)."""

    @property
    def func(self) -> Callable[..., Any]: ...
    @property
    def takes_context(self) -> bool: ...
    @property
    def module_path(self) -> str: ...
    @property
    def queue_name(self) -> str: ...
    @property
    def unique_for_ms(self) -> int | None: ...
    @property
    def unique_by(self) -> UniqueBy | None: ...
    @property
    def unique_while_running(self) -> bool: ...


def check_options(task: UniqueTask) -> None:
    """Raise InvalidTask, with the fix, for unique options that cannot work."""
    if task.unique_for_ms is None:
        for name, unset in (("unique_by", None), ("unique_while_running", False)):
            if getattr(task, name) != unset:
                raise InvalidTask(
                    f"{name} has no effect without unique_for_ms: set unique_for_ms to how "
                    "long (in ms) an equal call should return the existing job.")
        return
    if not isinstance(task.unique_while_running, bool):
        raise InvalidTask(
            f"unique_while_running must be True or False, not {task.unique_while_running!r}.")
    unique_by = task.unique_by
    if unique_by is None or callable(unique_by):
        return
    if isinstance(unique_by, (str, bytes)) or not isinstance(unique_by, Sequence):
        raise InvalidTask(
            f"unique_by must be a function or a list of argument names, not {unique_by!r}.")
    if not unique_by or not all(isinstance(name, str) for name in unique_by):
        raise InvalidTask(
            f"unique_by must name at least one argument, each as a string, not {unique_by!r}.")
    parameters = callargs.parameters(task)
    if not callargs.has_extra_keywords(task):
        unknown = [name for name in unique_by if name not in parameters]
        if unknown:
            raise InvalidTask(
                f"unique_by names {', '.join(map(repr, unknown))}, which "
                f"{'is not an argument' if len(unknown) == 1 else 'are not arguments'} of "
                f"{task.func.__qualname__}() (it takes {', '.join(parameters) or 'none'}).")


def database_problem(database: str) -> str | None:
    """Why unique jobs cannot work on ``database`` (an alias), or None.

    Without partial indexes (MySQL, MariaDB, Oracle) Django skips the
    conditional unique constraint with only a model warning, and equal
    calls would all be enqueued: refuse rather than pretend.
    """
    from django.db import connections

    connection = connections[database]
    if connection.features.supports_partial_indexes:
        return None
    return (f"Database {database!r} ({connection.vendor}) has no partial unique indexes, "
            "which unique jobs (unique_for_ms) rely on: use PostgreSQL or SQLite for the "
            "job mirror, or drop unique_for_ms.")


def states_in_redis(broker: Broker, rows: Sequence[Job]) -> dict[str, str]:
    """Each key holder's state as Redis has it (a JobState value), by id: ahead of its row.

    A claimed job whose task has not begun is still queued: it runs after
    the call that asks. Jobs Redis does not hold are left out, and so is
    every job when Redis cannot answer: the rows decide then.
    """
    try:
        progress = broker.progress([(row.physical_queue, str(row.pk)) for row in rows])
    except REDIS_ERRORS as exc:
        logger.warning("Redis did not say whether %d unique job(s) started (%s); their "
                       "database rows decide.", len(rows), exc)
        return {}
    states = {}
    for job_id, held in progress.items():
        state = REDIS_TO_JOB_STATE.get(held.state)
        if state == "running" and not held.started:
            state = "queued"
        if state is not None:
            states[job_id] = state
    return states


def key_for(task: UniqueTask, alias: str, args: Sequence[Any], kwargs: dict[str, Any]) -> str:
    """The unique key of one call of ``task`` (a unique task) on backend ``alias``.

    Equal calls on the same backend, queue and task get the same key; the
    queue is part of it, so ``task.using(queue_name=...)`` is another job.
    """
    unique_by = task.unique_by
    if unique_by is not None and callable(unique_by):
        material: Any = unique_by(*args, **kwargs)
    else:
        bound = callargs.bind(task, args, kwargs, purpose="unique key")
        if unique_by is None:
            material = bound
        else:
            extra: dict[str, Any] = next((bound.get(p.name, {}) for p in
                          callargs.parameters(task).values()
                          if p.kind is inspect.Parameter.VAR_KEYWORD), {})
            material = {name: bound[name] if name in bound else extra.get(name)
                        for name in unique_by}
    try:
        text = json.dumps([alias, task.queue_name, task.module_path, material],
                          sort_keys=True, separators=(",", ":"), allow_nan=False)
        return hashlib.sha256(text.encode()).hexdigest()
    except (TypeError, ValueError) as exc:
        raise InvalidTask(
            f"The unique key of {task.module_path} is not JSON ({exc}): unique_by must "
            "return numbers, strings, lists, dicts, booleans or None.") from None
