"""The task class of this backend, and the allow-list of runnable tasks.

``@task(max_attempts=5, retry_base_ms=500, timeout_ms=60_000)`` works
because Django's ``task()`` passes extra keyword arguments to the backend's
``task_class``. Every such task registers itself by its import path when it
is created; a worker runs only paths found here, and never imports a path it
read from Redis (payloads are data, not code).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from django.tasks import Task
from django.tasks.exceptions import InvalidTask
from django.utils.module_loading import autodiscover_modules

_registry: dict[str, Task] = {}
_lock = threading.Lock()


@dataclass(frozen=True, slots=True, kw_only=True)
class ReliableTask(Task):
    """A ``django.tasks.Task`` with per-task retry and time limits.

    Each option left at None takes the backend's OPTIONS default.
    """

    #: Claims before the job is dead (OPTIONS['MAX_ATTEMPTS']).
    max_attempts: int | None = None
    #: First retry delay in ms, doubling per attempt (OPTIONS['RETRY_BASE_MS']).
    retry_base_ms: int | None = None
    #: Cap on the retry delay in ms (OPTIONS['RETRY_MAX_MS']).
    retry_max_ms: int | None = None
    #: Wall-clock limit per attempt in ms (OPTIONS['TIMEOUT_MS']).
    timeout_ms: int | None = None

    def __post_init__(self) -> None:
        # Zero-argument super() does not work in a slots dataclass.
        Task.__post_init__(self)
        for name, minimum in (("max_attempts", 1), ("retry_base_ms", 0),
                              ("retry_max_ms", 0), ("timeout_ms", 1)):
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or value < minimum
            ):
                raise InvalidTask(f"{name} must be a whole number >= {minimum}, not {value!r}.")
        register(self)


def register(task: Task) -> None:
    """Allow workers to run ``task`` (the first task seen for a path wins)."""
    with _lock:
        _registry.setdefault(task.module_path, task)


def lookup(task_path: str) -> Task | None:
    """Return the registered task for ``task_path``, importing nothing."""
    return _registry.get(task_path)


def discover() -> int:
    """Import every installed app's ``tasks`` module; return how many tasks are known."""
    autodiscover_modules("tasks")
    return len(_registry)
