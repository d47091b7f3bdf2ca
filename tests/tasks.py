"""Fixture tasks for the test suite, named after Django's own (``tests/tasks/tasks.py``).

Each is a module-level function, as ``django.tasks`` requires, so a worker in
another process can run it by its path (``tests.tasks.noop_task``). The module
is not named ``test_*.py``, so pytest never collects ``test_context`` as a test.
"""

from __future__ import annotations

import sys
import time
from typing import Any

from reliable_jobs.compat import TaskContext, task


@task()
def noop_task(*args: Any, **kwargs: Any) -> None:
    return None


@task
def noop_task_from_bare_decorator(*args: Any, **kwargs: Any) -> None:
    return None


@task()
async def noop_task_async(*args: Any, **kwargs: Any) -> None:
    return None


@task()
def calculate_meaning_of_life() -> int:
    return 42


@task()
def failing_task_value_error() -> None:
    raise ValueError("This Task failed due to ValueError")


@task()
def failing_task_system_exit() -> None:
    raise SystemExit("This Task failed due to SystemExit")


@task()
def failing_task_keyboard_interrupt() -> None:
    raise KeyboardInterrupt("This Task failed due to KeyboardInterrupt")


@task()
def complex_exception() -> None:
    raise ValueError(ValueError("This task failed"))


@task()
def complex_return_value() -> Any:
    # Return something which is neither JSON serializable nor picklable.
    return lambda: True


@task()
def exit_task() -> None:
    sys.exit(1)


@task()
def hang() -> None:
    """Do nothing for 5 minutes."""
    time.sleep(300)


@task()
def sleep_for(seconds: float) -> None:
    time.sleep(seconds)


@task(takes_context=True)
def get_task_id(context: TaskContext) -> str:
    return context.task_result.id


@task(takes_context=True)
def test_context(context: TaskContext, attempt: int) -> None:
    assert isinstance(context, TaskContext)
    assert context.attempt == attempt


# reliable_jobs' own per-task options (ReliableTask), not in Django's suite.


@task(max_attempts=5, retry_base_ms=10, retry_max_ms=100, timeout_ms=60_000)
def task_with_options(*args: Any, **kwargs: Any) -> None:
    return None


def plain_function() -> None:
    """Not a task: tests decorate it with bad options (it must be module-level)."""
