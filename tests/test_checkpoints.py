"""Progress and checkpoints from inside a task: stored in its row, fenced, read back.

Real PostgreSQL and Redis, real ``runworker`` processes for the crash test.
A task's ``context.checkpoint(value)`` is committed before it returns, so
the next attempt (``context.checkpoint_value``) resumes from it after a
SIGKILL; a stale attempt's write never moves a newer attempt's progress
back; progress is readable from Python (``backend.get_progress()``) and in
the admin's job page.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest
from django.test import Client

from reliable_jobs import JobContext
from reliable_jobs.compat import TaskResultDoesNotExist, TaskResultStatus
from reliable_jobs.mirror import journal
from reliable_jobs.mirror.journal import JobProgress, Journal
from reliable_jobs.models import Job, JobState
from reliable_jobs.worker import Worker
from testproject.demo import tasks as demo

from .helpers import Processes, wait_until, worker_in_thread
from .test_admin import change_url, configured_backend

pytestmark = pytest.mark.django_db(transaction=True)


def a_job(**fields: Any) -> Job:
    result = demo.add.enqueue(1, 2)
    if fields:
        Job.objects.filter(pk=result.id).update(**fields)
    return Job.objects.get(pk=result.id)


# -- the journal ----------------------------------------------------------------


def test_a_checkpoint_is_stored_and_read_back_by_the_next_attempt(rj_settings: Any) -> None:
    # Given: attempt 1 of a running job stores a checkpoint with its progress
    row = a_job(state=JobState.RUNNING, attempts=1)
    first = Journal("default", str(row.pk), attempt=1, gen=0)
    assert first.last_checkpoint() is None
    assert first.checkpoint({"next": 1000}, done=1000, total=5000)

    # When attempt 2 starts
    second = JobContext(task_result=demo.add.get_result(str(row.pk)),
                        journal=Journal("default", str(row.pk), attempt=2, gen=0))

    # Then it reads the checkpoint, and Python reads the progress
    assert second.checkpoint_value == {"next": 1000}
    progress = configured_backend().get_progress(str(row.pk))
    assert progress == JobProgress(done=1000, total=5000, checkpoint={"next": 1000}, attempt=1)
    assert progress.fraction == 0.2


def test_a_stale_attempt_never_moves_a_newer_attempts_checkpoint_back(rj_settings: Any) -> None:
    # Given: attempt 2 stored its checkpoint (attempt 1 lost its lease and runs on)
    row = a_job(state=JobState.RUNNING, attempts=2)
    stale = Journal("default", str(row.pk), attempt=1, gen=0)
    current = Journal("default", str(row.pk), attempt=2, gen=0)
    assert stale.checkpoint({"next": 3000})
    assert current.checkpoint({"next": 2000})

    # When the stale attempt writes again, and a holder of an older generation too
    assert not stale.checkpoint({"next": 4000})
    stale.progress(4000, 5000)
    assert not stale.flush()
    Job.objects.filter(pk=row.pk).update(generation=1)
    assert not Journal("default", str(row.pk), attempt=3, gen=0).checkpoint({"next": 9})

    # Then the row keeps attempt 2's checkpoint
    row.refresh_from_db()
    assert (row.checkpoint, row.progress_attempt) == ({"next": 2000}, 2)


def test_a_finished_job_takes_no_more_progress(rj_settings: Any) -> None:
    row = a_job(state=JobState.SUCCEEDED, attempts=1)
    late = Journal("default", str(row.pk), attempt=1, gen=0)
    assert not late.checkpoint({"next": 1})
    assert Job.objects.get(pk=row.pk).checkpoint is None


def test_progress_is_written_at_most_every_half_second_and_at_the_end(rj_settings: Any) -> None:
    row = a_job(state=JobState.RUNNING, attempts=1)
    writer = Journal("default", str(row.pk), attempt=1, gen=0)

    for done in range(1, 101):
        writer.progress(done, 100)

    # the first report is written, the other 99 within half a second are not yet
    assert Job.objects.get(pk=row.pk).progress_done == 1
    assert writer.flush()
    assert Job.objects.get(pk=row.pk).progress_done == 100


def test_a_checkpoint_must_be_json(rj_settings: Any) -> None:
    row = a_job(state=JobState.RUNNING, attempts=1)
    writer = Journal("default", str(row.pk), attempt=1, gen=0)
    with pytest.raises(TypeError):
        writer.checkpoint({"at": object()})
    with pytest.raises(ValueError):
        writer.checkpoint(float("nan"))
    with pytest.raises(ValueError):
        writer.progress(-1)
    with pytest.raises(ValueError):
        writer.checkpoint("x" * (journal.MAX_CHECKPOINT_BYTES + 1))


def test_get_progress_of_an_unknown_job_says_so(rj_settings: Any) -> None:
    with pytest.raises(TaskResultDoesNotExist):
        configured_backend().get_progress("01a24636-177e-72f6-9370-238860877c5d")
    with pytest.raises(TaskResultDoesNotExist):
        configured_backend().get_progress("not a uuid")


# -- a worker, the admin ---------------------------------------------------------------


def test_a_tasks_progress_reaches_its_row_and_the_admin_page(
    rj_settings: Any, tmp_path: Path, admin_client: Client
) -> None:
    # Given: a task that counts 5,000 items, a checkpoint every 1,000
    result = demo.count_with_checkpoints.enqueue(5000, 1000, str(tmp_path / "ledger"))

    # When a worker runs it
    with worker_in_thread(Worker(configured_backend(), queues=["default"], concurrency=1)):
        wait_until(lambda: demo.count_with_checkpoints.get_result(result.id).is_finished,
                   timeout=60, message="the job to finish")

    # Then its last progress and checkpoint are in the row, in Python and in the admin
    assert demo.count_with_checkpoints.get_result(result.id).status == \
        TaskResultStatus.SUCCESSFUL
    progress = configured_backend().get_progress(result.id)
    assert (progress.done, progress.total, progress.checkpoint) == (5000, 5000, {"next": 5000})
    page = admin_client.get(change_url(result.id)).content.decode()
    assert '<progress class="rj-progress" max="5000" value="5000">' in page
    assert "5000 / 5000 (100.0%, attempt 1)" in page


# -- a real worker, SIGKILLed --------------------------------------------------------


@pytest.mark.slow
@pytest.mark.crash
def test_a_job_killed_mid_way_resumes_from_its_last_checkpoint(
    rj_settings: Any, processes: Processes, tmp_path: Path
) -> None:
    # Given: a job of 30,000 items with a checkpoint every 1,000, on a real worker
    env = rj_settings()
    ledger = tmp_path / "ledger"
    result = demo.count_with_checkpoints.enqueue(30_000, 1000, str(ledger), pause_s=0.005)
    worker = processes.worker(env)

    # When the worker is SIGKILLed twice mid-way, each time once a checkpoint passed
    # the point the previous attempt had reached, and a new worker started
    for reached in (3000, 12_000):
        wait_until(lambda r=reached: (Job.objects.get(pk=result.id).checkpoint or {})
                   .get("next", 0) >= r, timeout=90, message=f"a checkpoint past {reached}")
        os.kill(worker.pid, signal.SIGKILL)
        worker.wait(timeout=10)
        worker = processes.worker(env)

    # Then the job succeeds, each attempt resumed where its last checkpoint said,
    # and no restart did more than 1,000 items again
    wait_until(lambda: demo.count_with_checkpoints.get_result(result.id).is_finished,
               timeout=120, message="the job to finish")
    assert demo.count_with_checkpoints.get_result(result.id).status == \
        TaskResultStatus.SUCCESSFUL
    redone, lines, items = demo.redone_per_restart(str(ledger))
    assert len(redone) == 2
    assert all(0 <= n <= 1000 for n in redone), redone
    assert items == set(range(30_000))
    assert lines == 30_000 + sum(redone)
