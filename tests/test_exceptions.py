"""Error class paths the app records resolve to real exception classes.

Django's ``TaskError.exception_class`` imports the path an attempt recorded;
a path naming a class that does not exist makes reading a result's errors
raise ImportError. The paths the sources write are checked in
tests/fast/test_exception_paths.py; here, a dead job's result read back.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from django.utils import timezone

from reliable_jobs import exceptions, mirror
from reliable_jobs.compat import TaskResultStatus
from reliable_jobs.mirror import AttemptRecord
from reliable_jobs.models import JobState
from testproject.demo import tasks as demo

from .test_admin import configured_backend


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
