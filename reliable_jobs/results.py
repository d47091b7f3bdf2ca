"""The one place a ``TaskResult`` is built, and an attempt's finished.

Django's ``TaskResult`` is a frozen dataclass with many fields, most of
them empty at the moment one is made (at enqueue, or when an attempt
starts); the backend, the worker's executor and a time-limited task's child
process build theirs here. The fields a caller does
not know default to empty, so every caller names only what it knows, and a
field Django adds is added once. A worker finishes an attempt's result
with one function per outcome (succeeded, failed, cancelled) before it
sends ``task_finished``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import fields
from datetime import datetime
from typing import TYPE_CHECKING, Any

from .compat import Task, TaskError, TaskResult, TaskResultStatus, normalize_json
from .exceptions import JobCancelled, class_path

JOB_CANCELLED = class_path(JobCancelled)

if TYPE_CHECKING:
    from .models import Attempt, Job


def task_result(task: Task[..., Any], *, job_id: str, status: TaskResultStatus,
                args: list[Any], kwargs: dict[str, Any], backend: str,
                enqueued_at: datetime | None = None, started_at: datetime | None = None,
                finished_at: datetime | None = None,
                last_attempted_at: datetime | None = None,
                errors: Sequence[TaskError] = (),
                worker_ids: Sequence[str] = ()) -> TaskResult[..., Any]:
    """A ``TaskResult`` of ``task`` for the job ``job_id``: the given fields, the rest empty."""
    return TaskResult(
        task=task, id=job_id, status=status, enqueued_at=enqueued_at, started_at=started_at,
        finished_at=finished_at, last_attempted_at=last_attempted_at, args=args,
        kwargs=kwargs, backend=backend, errors=list(errors), worker_ids=list(worker_ids),
    )


def attempt_result(task: Task[..., Any], *, job_id: str, queue: str, args: list[Any],
                   kwargs: dict[str, Any], backend: str, started_at: datetime,
                   worker_id: str, attempt: int) -> TaskResult[..., Any]:
    """The running ``TaskResult`` of an attempt that starts now.

    Its task is on ``queue`` (the logical queue it was enqueued to, which a
    task of another default queue may not name), and every attempt so far
    is counted as this worker's (the worker ids of earlier attempts are the
    mirror's, not read for a start).
    """
    if task.queue_name != queue:
        task = task.using(queue_name=queue)
    return task_result(
        task, job_id=job_id, status=TaskResultStatus.RUNNING, started_at=started_at,
        last_attempted_at=started_at, args=args, kwargs=kwargs, backend=backend,
        worker_ids=[worker_id] * attempt,
    )


def job_result(job: Job, task: Task[..., Any], *, backend: str,
               attempts: Sequence[Attempt] = ()) -> TaskResult[..., Any]:
    """The ``TaskResult`` of a mirror row: its state, times and arguments, its attempts' errors.

    ``task`` is the task as it is now; the result carries the queue and
    run_after the job was enqueued with.
    """
    from .models import FAILED_OUTCOMES  # not at module level: see backend's docstring

    if job.queue != task.queue_name or job.run_after != task.run_after:
        task = _as_enqueued(task, queue_name=job.queue, run_after=job.run_after)
    result = task_result(
        task, job_id=str(job.pk), status=job.task_status, enqueued_at=job.enqueued_at,
        started_at=job.started_at, finished_at=job.finished_at,
        last_attempted_at=max((a.started_at for a in attempts if a.started_at), default=None),
        args=list(job.args), kwargs=dict(job.kwargs), backend=backend,
        errors=[TaskError(exception_class_path=a.exception_class_path or "builtins.Exception",
                          traceback=a.traceback or a.error)
                for a in attempts if a.outcome in FAILED_OUTCOMES],
        worker_ids=[a.worker_id for a in attempts],
    )
    if result.status == TaskResultStatus.SUCCESSFUL:
        object.__setattr__(result, "_return_value", job.return_value)
    return result


def _as_enqueued(task: Task[..., Any], *, queue_name: str,
                 run_after: datetime | None) -> Task[..., Any]:
    """Return ``task`` with the queue and run_after a job was enqueued with.

    Not ``task.using()``: that validates against today's settings, so the
    result of a job on a queue since removed from QUEUES could not be read,
    and it cannot set run_after back to None. A stored job is history, not a
    new request, so the copy is made without validating or registering it.
    """
    copy = object.__new__(type(task))
    for f in fields(task):
        object.__setattr__(copy, f.name, getattr(task, f.name))
    object.__setattr__(copy, "queue_name", queue_name)
    object.__setattr__(copy, "run_after", run_after)
    return copy


# An attempt's result is finished by one of the four functions below, one
# per outcome, before the worker sends ``task_finished`` with it.


def finish_succeeded(result: TaskResult[..., Any], *, value: Any,
                     finished_at: datetime | None) -> None:
    """Finish an attempt's ``result`` as successful, ``value`` (normalized) its return value."""
    object.__setattr__(result, "status", TaskResultStatus.SUCCESSFUL)
    object.__setattr__(result, "finished_at", finished_at)
    object.__setattr__(result, "_return_value", value)


def finish_failed(result: TaskResult[..., Any], *, exception_class_path: str, traceback: str,
                  finished_at: datetime | None) -> None:
    """Finish an attempt's ``result`` as failed, its error included, before ``task_finished``.

    As Django's ImmediateBackend does: the attempt's ``TaskError`` is added
    first, so a receiver never sees a failed result with no error. The
    class path and traceback are those the mirror stores for the attempt
    (an empty traceback is given as the attempt's error text by the caller).
    """
    result.errors.append(TaskError(exception_class_path=exception_class_path,
                                   traceback=traceback))
    object.__setattr__(result, "status", TaskResultStatus.FAILED)
    object.__setattr__(result, "finished_at", finished_at)


def finish_snoozed(result: TaskResult[..., Any]) -> None:
    """Finish the ``result`` of an attempt whose task raised Snooze.

    The job is not finished: it waits to run again, which Django's
    statuses call READY (as ``get_result()`` reads a scheduled job); no
    error is added and ``finished_at`` stays empty.
    """
    object.__setattr__(result, "status", TaskResultStatus.READY)


def finish_cancelled(result: TaskResult[..., Any], *, traceback: str,
                     finished_at: datetime | None) -> None:
    """Finish the ``result`` of an attempt cancelled while it ran.

    Django's results know no cancelled status: it is a failure whose error
    is :class:`~reliable_jobs.exceptions.JobCancelled`, whatever the task
    raised or returned (``traceback``: the attempt's, or its error text).
    """
    finish_failed(result, exception_class_path=JOB_CANCELLED, traceback=traceback,
                  finished_at=finished_at)


#: The fields :class:`ResultStamp` gives each result its own value of.
_PER_JOB = frozenset({"id", "args", "kwargs", "errors", "worker_ids"})
_new = object.__new__
_set = object.__setattr__


class ResultStamp:
    """The ``TaskResult`` of each job of one bulk enqueue: equal to :func:`task_result`'s.

    The results of one call differ only in id and arguments, and building
    each through ``TaskResult()`` (its ``__post_init__`` runs
    ``normalize_json`` over both argument containers even when they are
    empty) was one of a bulk enqueue's largest costs. One result is built
    the ordinary way as a template; each job's copies the template's fields
    (so a field Django adds is copied, not forgotten) and gets its own id,
    arguments and empty lists. Arguments are normalized as ``TaskResult``
    does, skipped only when empty (where it would return an equal empty copy).
    """

    def __init__(self, template: TaskResult[..., Any]) -> None:
        self._shared = [(f.name, getattr(template, f.name)) for f in fields(template)
                        if f.name not in _PER_JOB]

    def __call__(self, job_id: str, args: list[Any],
                 kwargs: dict[str, Any]) -> TaskResult[..., Any]:
        """A result for ``job_id``; ``args`` and ``kwargs`` must be new containers."""
        result = _new(TaskResult)
        for name, value in self._shared:
            _set(result, name, value)
        _set(result, "id", job_id)
        _set(result, "args", normalize_json(args) if args else args)
        _set(result, "kwargs", normalize_json(kwargs) if kwargs else kwargs)
        _set(result, "errors", [])
        _set(result, "worker_ids", [])
        return result
