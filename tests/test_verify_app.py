"""The opt-in verify app's tasks find a reliable_jobs backend in whatever TASKS a project has.

``chaosjobs`` enqueues the app's own task, which workers register at
start-up, so the task must be bound to a backend the project really has:
the default one when it is reliable_jobs', else the first that is. The
end-to-end proof is tests/test_chaos_run.py (the run with its default task)
and tests/test_packaging.py (the installed wheel, in a project of its own).
"""

from __future__ import annotations

from typing import Any

import pytest
from django.core.exceptions import ImproperlyConfigured

from reliable_jobs.backend import ReliableJobsBackend
from reliable_jobs.compat import USING_BACKPORT
from reliable_jobs.contrib.verify.tasks import backend_alias

from .helpers import REDIS_URL

OURS = {"BACKEND": "reliable_jobs.backend.ReliableJobsBackend",
        "OPTIONS": {"REDIS_URL": REDIS_URL}}
OTHER = {"BACKEND": ("django_tasks" if USING_BACKPORT else "django.tasks")
         + ".backends.dummy.DummyBackend"}


class SubclassedBackend(ReliableJobsBackend):
    """A project's own subclass of the backend: still one the tasks can use."""


def test_the_default_backend_when_it_is_ours(settings: Any) -> None:
    # Given a project whose default backend is reliable_jobs', listed after another
    settings.TASKS = {"first": OURS, "default": OURS, "other": OTHER}
    # Then the tasks belong to the default one, as chaosjobs' --backend does
    assert backend_alias() == "default"


def test_the_first_backend_that_is_ours_when_the_default_is_not(settings: Any) -> None:
    # Given a project whose default backend is another library's
    settings.TASKS = {"default": OTHER,
                      "jobs": {**OURS, "BACKEND": f"{__name__}.SubclassedBackend"},
                      "more": OURS}
    # Then the tasks belong to the first reliable_jobs backend (a subclass counts)
    assert backend_alias() == "jobs"


def test_a_project_without_our_backend_is_told_what_to_fix(settings: Any) -> None:
    # Given a project with the app but no reliable_jobs backend
    settings.TASKS = {"default": OTHER, "broken": {"BACKEND": "no.such.Backend"}}
    # Then the error says what is missing, in a sentence
    with pytest.raises(ImproperlyConfigured, match="no TASKS backend is reliable_jobs"):
        backend_alias()
