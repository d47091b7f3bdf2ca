"""The Tasks API on every supported Django: the one place that imports it.

Django 6.0 and later ship ``django.tasks``; on Django 5.2 LTS the
``django-tasks`` backport (``pip install 'reliable-jobs[django52]'``)
provides the same API as ``django_tasks``, with two exceptions renamed
(``InvalidTaskError``, ``InvalidTaskBackendError``) and
``normalize_json`` in ``django_tasks.utils`` instead of
``django.utils.json``. Django 6.0's ``task()`` takes no extra keyword
arguments, so here ``task`` is 6.1's there: use ``reliable_jobs.compat.task``
for ``@task(max_attempts=..., timeout_ms=...)`` on 6.0. Everything in
reliable_jobs (and its test project) imports these names from here, never
from either package.

With the backport, ``django_tasks`` need not be in ``INSTALLED_APPS``:
importing this module connects what its app would (the ``TASKS``
``setting_changed`` receiver, the backends' system checks).

mypy checks against ``django.tasks`` (the newest Django); the backport
mirrors its API.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Concatenate, Literal, Protocol, TypeVar, overload

import django

if TYPE_CHECKING:
    from django.utils.functional import _StrOrPromise as StrOrPromise

_Action = TypeVar("_Action", bound=Callable[..., Any])

#: What a task's ``unique_by`` may be: a function of the call's arguments, or argument names
#: (see ``unique.py``). Here, the bottom layer, so the ``task`` decorator's type can name it.
UniqueBy = Callable[..., Any] | Sequence[str]
#: What a task's ``fair_key`` may be: a function of the call's arguments, or one
#: argument's name (see ``fairness.py``). Here for the same reason.
FairKey = Callable[..., Any] | str

__all__ = [
    "DEFAULT_TASK_BACKEND_ALIAS",
    "DEFAULT_TASK_QUEUE_NAME",
    "TASKS_LOGGER",
    "USING_BACKPORT",
    "BaseTaskBackend",
    "FairKey",
    "InvalidTask",
    "InvalidTaskBackend",
    "Task",
    "TaskContext",
    "TaskError",
    "TaskResult",
    "TaskResultDoesNotExist",
    "TaskResultMismatch",
    "TaskResultStatus",
    "UniqueBy",
    "admin_action",
    "normalize_json",
    "task",
    "task_backends",
    "task_enqueued",
    "task_finished",
    "task_started",
]

if TYPE_CHECKING:
    from django.tasks import (
        DEFAULT_TASK_BACKEND_ALIAS,
        DEFAULT_TASK_QUEUE_NAME,
        Task,
        TaskContext,
        TaskResult,
        TaskResultStatus,
        task_backends,
    )
    from django.tasks.backends.base import BaseTaskBackend
    from django.tasks.base import TaskError
    from django.tasks.exceptions import (
        InvalidTask,
        InvalidTaskBackend,
        TaskResultDoesNotExist,
        TaskResultMismatch,
    )
    from django.tasks.signals import task_enqueued, task_finished, task_started
    from django.utils.json import normalize_json

    USING_BACKPORT: bool
    TASKS_LOGGER: str

    class _TaskDecorator(Protocol):
        """django.tasks.task as the stubs type it, plus ReliableTask's options
        (which task() passes on to the backend's task_class), unique, fair_key and
        debounce ones included."""

        @overload
        def __call__[**P, R](
            self, function: Callable[Concatenate[TaskContext[Any, Any], P], R], *,
            priority: int | None = None, queue_name: str | None = None,
            backend: str | None = None, takes_context: Literal[True],
            max_attempts: int | None = None, retry_base_ms: int | None = None,
            retry_max_ms: int | None = None, timeout_ms: int | None = None,
            unique_for_ms: int | None = None, unique_by: UniqueBy | None = None,
            unique_while_running: bool = False, rate_limit: str | None = None,
            concurrency: int | None = None, rate_key: Callable[..., Any] | None = None,
            concurrency_key: Callable[..., Any] | None = None, fair_key: FairKey | None = None,
            debounce_ms: int | None = None, max_wait_ms: int | None = None,
        ) -> Task[P, R]: ...
        @overload
        def __call__[**P, R](
            self, function: Callable[P, R], *,
            priority: int | None = None, queue_name: str | None = None,
            backend: str | None = None, takes_context: Literal[False] = False,
            max_attempts: int | None = None, retry_base_ms: int | None = None,
            retry_max_ms: int | None = None, timeout_ms: int | None = None,
            unique_for_ms: int | None = None, unique_by: UniqueBy | None = None,
            unique_while_running: bool = False, rate_limit: str | None = None,
            concurrency: int | None = None, rate_key: Callable[..., Any] | None = None,
            concurrency_key: Callable[..., Any] | None = None, fair_key: FairKey | None = None,
            debounce_ms: int | None = None, max_wait_ms: int | None = None,
        ) -> Task[P, R]: ...
        @overload
        def __call__[**P, R](
            self, *,
            priority: int | None = None, queue_name: str | None = None,
            backend: str | None = None, takes_context: Literal[True],
            max_attempts: int | None = None, retry_base_ms: int | None = None,
            retry_max_ms: int | None = None, timeout_ms: int | None = None,
            unique_for_ms: int | None = None, unique_by: UniqueBy | None = None,
            unique_while_running: bool = False, rate_limit: str | None = None,
            concurrency: int | None = None, rate_key: Callable[..., Any] | None = None,
            concurrency_key: Callable[..., Any] | None = None, fair_key: FairKey | None = None,
            debounce_ms: int | None = None, max_wait_ms: int | None = None,
        ) -> Callable[[Callable[Concatenate[TaskContext[Any, Any], P], R]], Task[P, R]]: ...
        @overload
        def __call__[**P, R](
            self, *,
            priority: int | None = None, queue_name: str | None = None,
            backend: str | None = None, takes_context: Literal[False] = False,
            max_attempts: int | None = None, retry_base_ms: int | None = None,
            retry_max_ms: int | None = None, timeout_ms: int | None = None,
            unique_for_ms: int | None = None, unique_by: UniqueBy | None = None,
            unique_while_running: bool = False, rate_limit: str | None = None,
            concurrency: int | None = None, rate_key: Callable[..., Any] | None = None,
            concurrency_key: Callable[..., Any] | None = None, fair_key: FairKey | None = None,
            debounce_ms: int | None = None, max_wait_ms: int | None = None,
        ) -> Callable[[Callable[P, R]], Task[P, R]]: ...

    task: _TaskDecorator
else:
    try:
        from django.tasks import (
            DEFAULT_TASK_BACKEND_ALIAS,
            DEFAULT_TASK_QUEUE_NAME,
            Task,
            TaskContext,
            TaskResult,
            TaskResultStatus,
            task,
            task_backends,
        )
    except ImportError:  # Django 5.2: the django-tasks backport.
        try:
            import django_tasks  # noqa: F401
        except ImportError as exc:
            from django.core.exceptions import ImproperlyConfigured

            raise ImproperlyConfigured(
                "reliable_jobs needs the Tasks framework: Django >= 6.0, or on Django 5.2 "
                "the django-tasks backport (pip install 'reliable-jobs[django52]')."
            ) from exc
        from django_tasks import (
            DEFAULT_TASK_BACKEND_ALIAS,
            DEFAULT_TASK_QUEUE_NAME,
            TaskContext,
            TaskResult,
            TaskResultStatus,
            task,
            task_backends,
        )
        from django_tasks import checks as _checks  # noqa: F401 - registers the backends' checks
        from django_tasks.backends.base import BaseTaskBackend
        from django_tasks.base import Task, TaskError
        from django_tasks.exceptions import InvalidTaskBackendError as InvalidTaskBackend
        from django_tasks.exceptions import InvalidTaskError as InvalidTask
        from django_tasks.exceptions import TaskResultDoesNotExist, TaskResultMismatch
        from django_tasks.signals import task_enqueued, task_finished, task_started
        from django_tasks.utils import normalize_json

        USING_BACKPORT = True
        #: The logger the Tasks framework logs each task's start and end to.
        TASKS_LOGGER = "django_tasks"
    else:
        from django.tasks.backends.base import BaseTaskBackend
        from django.tasks.base import TaskError
        from django.tasks.exceptions import (
            InvalidTask,
            InvalidTaskBackend,
            TaskResultDoesNotExist,
            TaskResultMismatch,
        )
        from django.tasks.signals import task_enqueued, task_finished, task_started
        from django.utils.json import normalize_json

        USING_BACKPORT = False
        TASKS_LOGGER = "django.tasks"

        if django.VERSION < (6, 1):
            # Django 6.0's task() takes no extra keyword arguments; 6.1's (and the
            # backport's) passes them to the backend's task_class, which is how
            # @task(max_attempts=..., timeout_ms=...) reaches ReliableTask.
            from django.tasks.base import DEFAULT_TASK_PRIORITY

            def task(function=None, *, priority=DEFAULT_TASK_PRIORITY,
                     queue_name=DEFAULT_TASK_QUEUE_NAME, backend=DEFAULT_TASK_BACKEND_ALIAS,
                     takes_context=False, **kwargs):
                """Django 6.1's ``task()`` on Django 6.0."""
                if "run_after" in kwargs:
                    raise TypeError(
                        "run_after cannot be defined statically with the @task decorator. "
                        "Use .using(run_after=...) to set it dynamically."
                    )

                def wrapper(f):
                    return task_backends[backend].task_class(
                        func=f, priority=priority, queue_name=queue_name, backend=backend,
                        takes_context=takes_context, run_after=None, **kwargs,
                    )

                return wrapper(function) if function else wrapper


def admin_action(
    *, description: StrOrPromise, description_plural: StrOrPromise, permissions: list[str],
) -> Callable[[_Action], _Action]:
    """``@admin.action`` offered on the changelist and, from Django 6.1, the change form.

    Django 6.1 added admin actions on an object's page (``location``) and
    ``description_plural``; earlier versions get the changelist action with
    its singular description.
    """
    from django.contrib import admin

    if django.VERSION < (6, 1):
        return admin.action(description=description, permissions=permissions)
    from django.contrib.admin import ActionLocation

    return admin.action(
        description=description, description_plural=description_plural,
        permissions=permissions, location=[ActionLocation.CHANGE_LIST, ActionLocation.CHANGE_FORM],
    )
