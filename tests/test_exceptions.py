"""Error class paths the app records resolve to real exception classes.

Django's ``TaskError.exception_class`` imports the path an attempt recorded;
a path naming a class that does not exist makes reading a result's errors
raise ImportError.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import pytest
from django.utils import timezone
from django.utils.module_loading import import_string

from reliable_jobs import exceptions, mirror
from reliable_jobs.compat import TaskResultStatus
from reliable_jobs.mirror import AttemptRecord
from reliable_jobs.models import JobState
from testproject.demo import tasks as demo

from .test_admin import configured_backend

PACKAGE = Path(exceptions.__file__).resolve().parent
#: A dotted path into reliable_jobs.exceptions, as error texts start with.
PATH_RE = re.compile(r"reliable_jobs\.exceptions\.([A-Za-z_][A-Za-z0-9_]*)")


def recorded_paths() -> dict[str, list[str]]:
    """Every ``reliable_jobs.exceptions.X`` in the package's Python and Lua, with its files."""
    found: dict[str, list[str]] = {}
    for source in sorted([*PACKAGE.rglob("*.py"), *PACKAGE.rglob("*.lua")]):
        for match in PATH_RE.finditer(source.read_text(encoding="utf-8")):
            found.setdefault(match.group(0), []).append(str(source.relative_to(PACKAGE)))
    return found


def test_every_recorded_error_path_names_an_exception_class() -> None:
    # Given: the paths written in the package's sources
    paths = recorded_paths()
    # (the scan would catch the paths the app writes, were one typed by hand)
    assert PATH_RE.fullmatch(exceptions.class_path(exceptions.AttemptsExhausted))

    # Then: each imports, as TaskError.exception_class will, to an exception class
    for path, files in paths.items():
        try:
            found = import_string(path)
        except ImportError:
            pytest.fail(f"{path} (written in {', '.join(sorted(set(files)))}) does not import.")
        assert isinstance(found, type) and issubclass(found, BaseException), path


def test_no_script_or_module_types_an_exception_path_by_hand() -> None:
    # Given every Lua script and Python module of the package, exceptions.py aside
    for source in sorted([*PACKAGE.rglob("*.py"), *PACKAGE.rglob("*.lua")]):
        if source.name == "exceptions.py":
            continue
        text = source.read_text(encoding="utf-8")
        for match in PATH_RE.finditer(text):
            # Then a path appears only as a docstring's class reference; the
            # paths written into errors come from class_path (scripts get them
            # as ARGV from the broker)
            assert text[max(0, match.start() - 1)] in "~`", (
                f"{source.relative_to(PACKAGE)} types {match.group(0)} by hand; "
                "build it with exceptions.class_path().")


def test_class_path_is_the_importable_dotted_path() -> None:
    assert exceptions.class_path(exceptions.AttemptsExhausted) == \
        "reliable_jobs.exceptions.AttemptsExhausted"
    assert exceptions.class_path(ValueError) == "builtins.ValueError"
    assert import_string(exceptions.class_path(exceptions.LeaseExpired)) is exceptions.LeaseExpired


@pytest.mark.django_db(transaction=True)
def test_a_job_dead_of_exhausted_attempts_reports_an_importable_error(
    rj_settings: Callable[..., dict[str, str]],
) -> None:
    # Given: a job whose only attempt started and was lost, then found with no
    # attempt left at the next claim: the record the worker mirrors for it
    backend = configured_backend()
    result = demo.add.enqueue(1, 2)
    started = timezone.now()
    error = ("reliable_jobs.exceptions.AttemptsExhausted: claimed 1 time(s) without "
             "finishing (worker lost or lease expired)")
    mirror.record(backend.database, [AttemptRecord(result.id, 1, JobState.RUNNING,
                                                   worker_id="lost-worker",
                                                   started_at=started)])
    mirror.record(backend.database, [mirror.expired_record(result.id, 1, dead=True,
                                                           error=error)])

    # When: its result is read
    fetched = backend.get_result(result.id)

    # Then: it failed, and its error's class imports
    assert fetched.status == TaskResultStatus.FAILED
    (task_error,) = fetched.errors
    assert task_error.exception_class_path == "reliable_jobs.exceptions.AttemptsExhausted"
    assert task_error.exception_class is exceptions.AttemptsExhausted
    assert "without finishing" in task_error.traceback
