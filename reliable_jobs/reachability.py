"""Will a worker ever run this task? Asked at enqueue, answered with the fix.

A worker runs only tasks it registered itself (see ``tasks.lookup``): those
of the modules its start-up imports. A task defined anywhere else passes
``check`` and ``enqueue`` and then fails in the worker as ``UnknownTask``,
far from the mistake. This module lets enqueue refuse it instead. It is off
the job path on purpose (it imports modules by the names of installed apps,
which the worker's modules never do; see tests/test_security.py).
"""

from __future__ import annotations

import sys
from importlib import import_module
from typing import Any

from django.apps import AppConfig, apps
from django.conf import settings
from django.core.signals import setting_changed
from django.dispatch import receiver

from .compat import InvalidTask, Task

#: Modules unreachable_reason() found workers import.
_reachable: set[str] = set()


def ensure_reachable(task: Task[..., Any]) -> None:
    """Raise InvalidTask, saying the fix, if no worker will ever run ``task``."""
    reason = unreachable_reason(task)
    if reason is not None:
        raise InvalidTask(reason)


def unreachable_reason(task: Task[..., Any]) -> str | None:
    """Why no worker will ever run ``task``, with the fix; None when one will.

    Called by enqueue (not by validate_task, which runs while the task's
    module is still being imported), so that a task defined where workers never look
    (``myapp/jobs.py``, or ``mysite/tasks.py`` next to the settings) fails
    in the caller's hands rather than later in a worker as UnknownTask. A
    worker knows the tasks of the modules Django imports at start-up (each
    app's package, AppConfig and models; admin modules when the admin is
    installed) and those ``tasks.discover`` imports (each app's ``tasks``
    module and whatever that imports). From here only the first link of an
    import chain is visible: a task reached through a longer one (tasks.py
    imports a helper that imports jobs.py) is refused, and the message says
    how to make the link direct.

    A function outside every installed app and outside the project's own
    package (a library's, a test module's) is let through: it may belong to
    code that enqueues without a worker (a test suite's fixtures), and the
    worker refuses it by ``tasks.lookup`` all the same.
    """
    module = getattr(task.func, "__module__", None)
    if not isinstance(module, str) or not apps.ready:
        return None
    if module in _reachable:
        return None
    app = apps.get_containing_app_config(module)
    if app is None:
        reachable = _top_package(module) != _top_package(
            getattr(settings, "SETTINGS_MODULE", None) or "")
    else:
        reachable = _imported_by_workers(module, app)
    if reachable:
        # Keyed by module: a module that holds one reachable task holds them all.
        _reachable.add(module)
        return None
    name = getattr(task.func, "__name__", "the task")
    if app is None:
        package = _top_package(module)
        return (
            f"Task {task.module_path!r} is in {package!r}, the project package, which is not "
            "an installed app, so workers never import it and would refuse its jobs. Move it "
            "to the tasks.py of an app in INSTALLED_APPS (python manage.py startapp <app>)."
        )
    tasks_path = app.name.replace(".", "/") + "/tasks.py"
    return (
        f"Task {task.module_path!r} is defined in {module!r}, a module workers do not import "
        f"(they import each installed app's tasks module), so its jobs would fail as an "
        f"unknown task. Move it to {tasks_path}, or import it from there "
        f"(from {module.removeprefix(app.name)} import {name})."
    )


def _imported_by_workers(module: str, app: AppConfig) -> bool:
    """Whether a worker's start-up imports ``module`` of ``app`` (see unreachable_reason)."""
    base = app.name
    if module in (base, type(app).__module__):
        return True
    packages = [f"{base}.models", f"{base}.tasks"]
    if apps.is_installed("django.contrib.admin"):
        packages.append(f"{base}.admin")  # admin.autodiscover()
    if any(module == name or module.startswith(f"{name}.") for name in packages):
        return True
    try:
        tasks_module = import_module(f"{base}.tasks")  # what discover() does in a worker
    except ModuleNotFoundError as exc:
        if exc.name != f"{base}.tasks":
            raise
        return False
    # tasks.py imports the task (from .jobs import send) or its module (from . import jobs).
    held = sys.modules.get(module)
    return any(
        value is held
        or (isinstance(value, Task) and getattr(value.func, "__module__", None) == module)
        for value in vars(tasks_module).values()
    )


def _top_package(module: str) -> str:
    return module.partition(".")[0]


@receiver(setting_changed)
def _forget(*, setting: str, **kwargs: Any) -> None:
    """Tests may change INSTALLED_APPS or the settings module: decide again."""
    if setting in ("INSTALLED_APPS", "SETTINGS_MODULE"):
        _reachable.clear()
