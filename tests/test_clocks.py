"""G4 on the mirror's side: which clock stamps a row's ``updated_at``.

Reconcile takes as candidates the unfinished rows whose ``updated_at`` is
older than a grace period measured on the database's clock
(mirror.grace_cutoff). On PostgreSQL every mirror write that costs nothing
more for it stamps ``updated_at`` with the database's clock too, so a
producer, a worker or a staff process whose own clock is off cannot make a
row look old (a healthy job rebuilt) or young (a lost job left alone).
Each test runs the writing process with its clock an hour behind: the
clock read of one module (``timezone`` in the module that reads it) is
wrapped, nothing else. PostgreSQL only (the ORM path stamps inserts with
the producer's clock, see docs/design.md), so this file is not in
scripts/test's SQLite run.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from datetime import datetime, timedelta
from types import SimpleNamespace
from typing import Any

import pytest
from django.db import connection
from django.utils import timezone

from reliable_jobs import backend as backend_module
from reliable_jobs import mirror, staff
from reliable_jobs.compat import task_backends
from reliable_jobs.models import Job
from testproject.demo import tasks as demo

pytestmark = pytest.mark.django_db(transaction=True)

#: How far behind the writing process's clock runs.
SKEW = timedelta(hours=1)


def database_now() -> datetime:
    with connection.cursor() as cursor:
        cursor.execute("SELECT statement_timestamp()")
        now: datetime = cursor.fetchone()[0]
    return now


@pytest.fixture
def clock_behind(monkeypatch: pytest.MonkeyPatch) -> Callable[[Any], None]:
    """Make the given module read a clock an hour behind the database's."""
    def skew(module: Any) -> None:
        monkeypatch.setattr(module, "timezone", SimpleNamespace(
            now=lambda: timezone.now() - SKEW))
    return skew


@pytest.fixture
def backend(rj_settings: Any) -> Iterator[Any]:
    rj_settings()
    if connection.vendor != "postgresql":
        raise RuntimeError("tests/test_clocks.py checks the PostgreSQL path: run it there.")
    yield task_backends["default"]


def assert_stamped_by_the_database(job_id: Any, before: datetime, after: datetime) -> None:
    updated_at = Job.objects.get(pk=job_id).updated_at
    assert before <= updated_at <= after, (
        f"updated_at {updated_at} is not the database's clock ({before} .. {after})")


@pytest.mark.parametrize("enqueue", [
    lambda: demo.add.enqueue(1, 2),
    lambda: demo.unique_add.enqueue(1, 2),
], ids=["single", "unique"])
def test_a_producer_with_its_clock_behind_stamps_its_row_with_the_database_clock(
    backend: Any, clock_behind: Callable[[Any], None], enqueue: Callable[[], Any]
) -> None:
    # Given: a producer whose clock runs an hour behind the database's
    clock_behind(backend_module)

    # When: it enqueues a job
    before = database_now()
    result = enqueue()
    after = database_now()

    # Then: the row's updated_at is the database's clock, so the job is not a
    # reconcile candidate the moment it is written
    assert_stamped_by_the_database(result.id, before, after)
    cutoff = mirror.grace_cutoff(backend.database, 30_000)
    assert not mirror.reconcile_candidates(backend.database, backend=backend.alias,
                                           older_than=cutoff, after_id=None, limit=10)


def test_a_staff_action_with_its_clock_behind_stamps_the_row_with_the_database_clock(
    backend: Any, clock_behind: Callable[[Any], None]
) -> None:
    # Given: a queued job, and a staff process whose clock runs an hour behind
    result = demo.add.enqueue(1, 2)
    clock_behind(mirror)

    # When: staff cancel it
    before = database_now()
    assert staff.cancel(backend.parts, result.id).done
    after = database_now()

    # Then: the row's updated_at is the database's clock
    assert_stamped_by_the_database(result.id, before, after)
