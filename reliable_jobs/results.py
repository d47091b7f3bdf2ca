"""The one place a ``TaskResult`` is built.

Django's ``TaskResult`` is a frozen dataclass with many fields, most of
them empty at the moment one is made (at enqueue, or when an attempt
starts); the backend, the worker's executor and a time-limited task's child
process build theirs here. The fields a caller does
not know default to empty, so every caller names only what it knows, and a
field Django adds is added once.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from .compat import Task, TaskError, TaskResult, TaskResultStatus


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
