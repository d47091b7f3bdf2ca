"""Django's task signals from the worker: sent whenever a send would be seen.

The Tasks framework connects log-only receivers of its own to
``task_started`` and ``task_finished``; ``runworker`` silences their logger
below ``-v 2``. The worker then skips the ``TaskResult`` and the sends for
started and successful attempts (signalwatch.py), and must still send
them to any other receiver, to the framework's receivers when their logger
would write, and ``task_finished`` of a failure whenever it has a listener.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest

from reliable_jobs.compat import TASKS_LOGGER, TaskResultStatus, task_finished, task_started
from reliable_jobs.signalwatch import SignalWatch, is_framework_log_receiver
from testproject.demo import tasks as demo

from .helpers import drain_here


class Received:
    """A receiver that keeps each task_result it is sent (connected strongly)."""

    def __init__(self) -> None:
        self.results: list[Any] = []

    def __call__(self, sender: Any, task_result: Any, **kwargs: Any) -> None:
        self.results.append(task_result)


@pytest.fixture
def tasks_logger_level() -> Iterator[logging.Logger]:
    """The Tasks framework's logger, its level restored after the test."""
    logger = logging.getLogger(TASKS_LOGGER)
    level = logger.level
    yield logger
    logger.setLevel(level)


def sender() -> type:
    from reliable_jobs.backend import ReliableJobsBackend

    return ReliableJobsBackend


def test_the_framework_receivers_are_recognised() -> None:
    # Given: the receivers the Tasks framework connected to its signals
    from reliable_jobs.compat import task_started as signal

    sync, _ = signal._live_receivers(sender())
    # Then: the watch knows them as the log-only ones (a renamed receiver would
    # silently make every job pay for a TaskResult again)
    assert [r.__name__ for r in sync if is_framework_log_receiver(r)] == ["log_task_started"]


def test_a_send_is_seen_only_by_a_receiver_or_a_logger_that_writes(
    tasks_logger_level: logging.Logger,
) -> None:
    watch = SignalWatch(task_started, sender())
    # Given: only the framework's receivers, their logger silenced (runworker -v 1)
    tasks_logger_level.setLevel(logging.CRITICAL + 1)
    # Then: nobody would see a send
    assert not watch.observed()

    # When: the logger writes debug lines (runworker -v 2), or info lines (Django's
    # default level, for a worker run inside another process)
    for level in (logging.DEBUG, logging.INFO):
        tasks_logger_level.setLevel(level)
        # Then: a send would be seen
        assert watch.observed()

    # When: the logger is silenced again but a receiver of the project's is connected
    tasks_logger_level.setLevel(logging.CRITICAL + 1)
    received = Received()
    task_started.connect(received, weak=False)
    try:
        # Then: that receiver would see it
        assert watch.observed()
    finally:
        task_started.disconnect(received)
    # And: once it is gone, nobody again
    assert not watch.observed()


@pytest.mark.django_db(transaction=True)
def test_a_projects_receivers_get_every_attempt_with_the_logger_silenced(
    rj_settings: Any, tasks_logger_level: logging.Logger,
) -> None:
    # Given: receivers of both signals, the framework's logger silenced
    rj_settings()
    tasks_logger_level.setLevel(logging.CRITICAL + 1)
    started, finished = Received(), Received()
    task_started.connect(started, weak=False)
    task_finished.connect(finished, weak=False)
    try:
        ok = demo.add.enqueue(2, 3)
        # When: a worker runs the job
        drain_here()
    finally:
        task_started.disconnect(started)
        task_finished.disconnect(finished)

    # Then: each receiver got the job's TaskResult once, as Django's contract says
    assert [r.id for r in started.results] == [ok.id]
    assert started.results[0].args == [2, 3]
    assert [(r.id, r.status, r.return_value) for r in finished.results] == [
        (ok.id, TaskResultStatus.SUCCESSFUL, 5)]


@pytest.mark.django_db(transaction=True)
def test_a_failure_is_still_logged_by_the_framework_when_its_logger_writes_errors(
    rj_settings: Any, tasks_logger_level: logging.Logger,
) -> None:
    # Given: a job failing once, the framework's logger at WARNING (benchjobs' quiet
    # logging): its receivers would drop a start or a success, not a failure
    rj_settings(MAX_ATTEMPTS=1)
    tasks_logger_level.setLevel(logging.WARNING)
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]  # keep, print nothing
    tasks_logger_level.addHandler(handler)
    try:
        failed = demo.always_fail.enqueue("late")
        ok = demo.add.enqueue(1, 1)
        # When: a worker runs both
        drain_here()
    finally:
        tasks_logger_level.removeHandler(handler)

    # Then: Django's ERROR line names the failed job (its TaskResult was built
    # for the failure), and nothing was logged for the success
    lines = [r.getMessage() for r in records]
    assert [line for line in lines if failed.id in line], lines
    assert not [line for line in lines if ok.id in line], lines
    assert all(r.levelno == logging.ERROR for r in records), lines


@pytest.mark.django_db(transaction=True)
def test_a_failed_attempts_result_carries_its_error_to_task_finished(
    rj_settings: Any, tasks_logger_level: logging.Logger,
) -> None:
    # Given: a receiver of task_finished, and a job whose every attempt raises
    rj_settings()
    finished = Received()
    task_finished.connect(finished, weak=False)
    try:
        failed = demo.always_fail.enqueue("no luck")
        # When: a worker runs it until it is dead
        drain_here()
    finally:
        task_finished.disconnect(finished)

    # Then: each attempt's TaskResult holds that attempt's error, as Django's
    # ImmediateBackend fills it in before it sends task_finished: the class
    # path of the exception and its traceback
    assert finished.results
    for result in finished.results:
        assert (result.id, result.status) == (failed.id, TaskResultStatus.FAILED)
        [error] = result.errors
        assert error.exception_class_path == "builtins.RuntimeError"
        assert error.traceback.startswith("Traceback (most recent call last):")
        assert error.traceback.rstrip().endswith("RuntimeError: no luck")
    # ... the error the backend's get_result later reads from the mirror
    stored = demo.always_fail.get_result(failed.id).errors
    assert [e.exception_class_path for e in stored] == ["builtins.RuntimeError"] * len(
        finished.results)
