"""A newcomer's set-up mistakes are reported where they are made, with the fix.

Two mistakes used to surface late or as a traceback: a task defined where
workers never look (``myapp/jobs.py``) passed ``check`` and ``enqueue`` and
then died in the worker as ``UnknownTask``; and ``reliable_jobs`` missing
from INSTALLED_APPS was a ``RuntimeError`` from a model import instead of
E009. Apps and projects are real packages written to a temporary directory;
``manage.py`` runs as a real process.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from reliable_jobs import reachability
from reliable_jobs.models import Job

from .helpers import REDIS_URL, REPO

Configure = Callable[..., dict[str, str]]

#: Seconds a `manage.py check` or `shell` run may take on a loaded 2-core machine.
COMMAND_TIMEOUT_S = 60


@pytest.fixture
def on_path(tmp_path: Path) -> Iterator[Path]:
    """``tmp_path`` on sys.path, so packages written there import like a project's."""
    sys.path.insert(0, str(tmp_path))
    try:
        yield tmp_path
    finally:
        sys.path.remove(str(tmp_path))
        for name in [m for m in sys.modules if m.startswith("rj_mistake_")]:
            del sys.modules[name]
        reachability._reachable.clear()


def write_package(root: Path, name: str, files: dict[str, str]) -> None:
    package = root / name
    package.mkdir()
    (package / "__init__.py").write_text("")
    for filename, text in files.items():
        (package / filename).write_text(textwrap.dedent(text))


SEND_TASK = """
    from django.tasks import task


    @task
    def send(user_id: int) -> int:
        return user_id
"""


def import_task(module: str) -> Any:
    return __import__(module, fromlist=["send"]).send


# -- a task where workers never look -------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_a_task_in_jobs_py_is_refused_at_enqueue_with_the_fix(
    rj_settings: Configure, settings: Any, on_path: Path, redis_client: redis.Redis
) -> None:
    # Given an installed app whose task is in jobs.py, and no tasks.py imports it
    app = f"rj_mistake_{uuid.uuid4().hex[:8]}"
    write_package(on_path, app, {"jobs.py": SEND_TASK})
    settings.INSTALLED_APPS = [*settings.INSTALLED_APPS, app]
    send = import_task(f"{app}.jobs")

    # When it is enqueued
    # Then InvalidTask says why and how to fix it, naming the file to use
    with pytest.raises(reachability.InvalidTask) as refused:
        send.enqueue(1)
    message = str(refused.value)
    assert f"{app}.jobs" in message
    assert f"Move it to {app}/tasks.py, or import it from there (from .jobs import send)." in (
        message)

    # And nothing was written for a worker to fail on
    assert Job.objects.count() == 0
    assert redis_client.dbsize() == 0


@pytest.mark.django_db(transaction=True)
def test_a_task_in_jobs_py_imported_from_tasks_py_is_enqueued(
    rj_settings: Configure, settings: Any, on_path: Path
) -> None:
    # Given the same app with the fix applied: tasks.py imports the task from jobs.py
    app = f"rj_mistake_{uuid.uuid4().hex[:8]}"
    write_package(on_path, app, {"jobs.py": SEND_TASK, "tasks.py": "from .jobs import send\n"})
    settings.INSTALLED_APPS = [*settings.INSTALLED_APPS, app]
    send = import_task(f"{app}.jobs")

    # When it is enqueued, Then the job is queued
    result = send.enqueue(1)
    assert Job.objects.filter(pk=result.id).exists()


@pytest.mark.django_db(transaction=True)
def test_a_task_in_the_app_tasks_py_and_in_models_py_are_enqueued(
    rj_settings: Configure, settings: Any, on_path: Path
) -> None:
    # Given an app with one task in tasks.py and one in models.py (Django imports
    # models in every process, the worker's included)
    app = f"rj_mistake_{uuid.uuid4().hex[:8]}"
    write_package(on_path, app, {"tasks.py": SEND_TASK, "models.py": SEND_TASK})
    settings.INSTALLED_APPS = [*settings.INSTALLED_APPS, app]

    # When each is enqueued, Then both are queued
    for module in (f"{app}.tasks", f"{app}.models"):
        result = import_task(module).enqueue(1)
        assert Job.objects.filter(pk=result.id).exists()


@pytest.mark.django_db(transaction=True)
def test_a_task_in_the_project_package_is_refused_at_enqueue(
    rj_settings: Configure, settings: Any, on_path: Path
) -> None:
    # Given a project package (the one holding settings.py, not an installed app)
    # with a tasks.py beside the settings, as `startproject` invites
    project = f"rj_mistake_{uuid.uuid4().hex[:8]}"
    write_package(on_path, project, {"settings.py": "", "tasks.py": SEND_TASK})
    settings.SETTINGS_MODULE = f"{project}.settings"
    send = import_task(f"{project}.tasks")

    # When it is enqueued, Then InvalidTask says to move it into an installed app
    with pytest.raises(reachability.InvalidTask, match="the project package, which is not an "
                                                   "installed app") as refused:
        send.enqueue(1)
    assert "manage.py startapp" in str(refused.value)
    assert Job.objects.count() == 0


# -- reliable_jobs missing from INSTALLED_APPS ----------------------------------


def run_manage(settings_dir: Path, settings_module: str, *args: str
               ) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "REDIS_URL": REDIS_URL, "DJANGO_SETTINGS_MODULE": settings_module,
           "PYTHONPATH": os.pathsep.join([str(settings_dir), str(REPO)])}
    return subprocess.run([sys.executable, str(REPO / "manage.py"), *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)


def settings_without_the_app(root: Path, *, extra_app: str | None = None) -> str:
    """Write a settings module: the test project's, minus reliable_jobs."""
    name = f"rj_mistake_settings_{uuid.uuid4().hex[:8]}"
    (root / f"{name}.py").write_text(textwrap.dedent(f"""
        from testproject.settings import *  # noqa: F403

        INSTALLED_APPS = [a for a in INSTALLED_APPS if a != "reliable_jobs"]  # noqa: F405
        INSTALLED_APPS += {[extra_app] if extra_app else []!r}
    """))
    return name


def test_check_without_the_app_reports_e009_not_a_traceback(tmp_path: Path) -> None:
    # Given settings without reliable_jobs, and an app whose models import its tasks
    # (so Django loads the task backends before `check` runs their checks)
    app = f"rj_mistake_{uuid.uuid4().hex[:8]}"
    write_package(tmp_path, app, {"models.py": "from testproject.demo import tasks  # noqa\n"})
    settings_module = settings_without_the_app(tmp_path, extra_app=app)

    # When manage.py check runs
    done = run_manage(tmp_path, settings_module, "check")

    # Then it fails with E009 and its fix, and no traceback
    output = done.stdout + done.stderr
    assert done.returncode == 1, output
    assert "reliable_jobs.E009" in output
    assert "'reliable_jobs' is not in INSTALLED_APPS" in output
    assert "Traceback" not in output


def test_enqueue_without_the_app_says_e009_not_runtime_error(tmp_path: Path) -> None:
    # Given settings without reliable_jobs, where nothing loads the task backends
    # before `check` (Django then runs no task checks at all)
    settings_module = settings_without_the_app(tmp_path)

    # When a task is enqueued
    done = run_manage(tmp_path, settings_module, "shell", "-c",
                      "from testproject.demo.tasks import add; add.enqueue(1, 2)")

    # Then the error is ImproperlyConfigured with E009's fix, not the model import's
    assert done.returncode == 1, done.stdout + done.stderr
    last_line = done.stderr.strip().splitlines()[-1]
    assert last_line.startswith("django.core.exceptions.ImproperlyConfigured: TASKS['default']"
                                " is misconfigured: 'reliable_jobs' is not in INSTALLED_APPS")
    assert "RuntimeError" not in done.stderr
