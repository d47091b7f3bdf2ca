"""Per-task figures from the mirror: the numbers, both query paths, the admin page, jobstats.

Rows are written through the mirror with chosen times (no worker needed: the
figures read only the database), on the suite's PostgreSQL; the portable
path (SQLite's) runs on the same rows and must agree.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from datetime import datetime, timedelta
from io import StringIO
from typing import Any

import pytest
from django.core.management import call_command
from django.test import Client
from django.utils import timezone

from reliable_jobs import mirror, taskstats
from reliable_jobs.mirror import AttemptRecord
from reliable_jobs.models import AttemptOutcome, Job, JobState

from .helpers import insert_row
from .test_admin import staff_client

pytestmark = pytest.mark.django_db(transaction=True)
TASKS_PAGE = "/admin/reliable_jobs/job/tasks/"
CHANGELIST = "/admin/reliable_jobs/job/"
FAST = "demo.tasks.fast"
FLAKY = "demo.tasks.flaky"
MS = timedelta(milliseconds=1)


def new_job(task: str, enqueued: datetime, *, run_after: datetime | None = None,
            backend: str = "default") -> str:
    return insert_row(task_path=task, backend=backend, enqueued_at=enqueued,
                      run_after=run_after, state=JobState.QUEUED)


def attempt(job_id: str, number: int, started: datetime, *, ran_ms: int | None,
            outcome: str = AttemptOutcome.SUCCEEDED, job_state: str = JobState.SUCCEEDED
            ) -> None:
    """Mirror attempt ``number``: started at ``started``, ended ``ran_ms`` later (None: open)."""
    finished = None if ran_ms is None else started + ran_ms * MS
    mirror.record("default", [AttemptRecord(
        job_id, number, JobState.RUNNING if ran_ms is None else job_state, worker_id="w",
        started_at=started, finished_at=finished, outcome="" if ran_ms is None else outcome,
        error="" if outcome == AttemptOutcome.SUCCEEDED else "builtins.RuntimeError: no")])


def history(now: datetime) -> None:
    """The rows every test below reads.

    fast: three jobs in the last hour that waited 10/20/30 ms and ran
    100/200/300 ms; one scheduled job (run_after) that waited 40 ms after its
    due time, not after its enqueue an hour earlier; one job that ran two
    hours ago (the day's figures only); one running now.
    flaky: one job failing twice then succeeding; one failing three times,
    dead; each attempt 50 ms, the first two minutes after the enqueue.
    """
    base = now - timedelta(minutes=30)
    for i, (wait, ran) in enumerate([(10, 100), (20, 200), (30, 300)]):
        job = new_job(FAST, base + i * timedelta(minutes=1))
        attempt(job, 1, base + i * timedelta(minutes=1) + wait * MS, ran_ms=ran)
    due = base + timedelta(minutes=5)
    scheduled = new_job(FAST, due - timedelta(hours=1), run_after=due)
    attempt(scheduled, 1, due + 40 * MS, ran_ms=400)
    old = new_job(FAST, now - timedelta(hours=2))
    attempt(old, 1, now - timedelta(hours=2) + 5 * MS, ran_ms=1000)
    running = new_job(FAST, now - timedelta(minutes=1))
    attempt(running, 1, now - timedelta(minutes=1) + 50 * MS, ran_ms=None)

    comeback = new_job(FLAKY, base)
    dead = new_job(FLAKY, base)
    for n in (1, 2, 3):
        start = base + n * timedelta(minutes=2)
        attempt(comeback, n, start, ran_ms=50,
                outcome=AttemptOutcome.SUCCEEDED if n == 3 else AttemptOutcome.FAILED,
                job_state=JobState.SUCCEEDED if n == 3 else JobState.QUEUED)
        attempt(dead, n, start, ran_ms=50, outcome=AttemptOutcome.FAILED,
                job_state=JobState.DEAD if n == 3 else JobState.QUEUED)


def by_task(lines: list[taskstats.TaskLine]) -> dict[str, taskstats.TaskLine]:
    return {line.task: line for line in lines}


# -- the figures -----------------------------------------------------------------


def test_the_hours_figures_per_task(rj_settings: Callable[..., dict[str, str]]) -> None:
    # Given the history above
    rj_settings()
    now = timezone.now()
    history(now)

    # When the last hour's figures are read
    lines = by_task(taskstats.task_stats(using="default", backend="default",
                                         window=timedelta(hours=1), now=now))

    # Then fast counts its 5 starts (the running one too) and 4 successes, and
    # not the job of two hours ago; percentiles interpolate as percentile_cont
    fast = lines[FAST]
    assert (fast.started, fast.succeeded, fast.failed, fast.dead, fast.retried) == (5, 4, 0, 0, 0)
    assert (fast.run_p50_ms, fast.run_p95_ms, fast.run_p99_ms) == (250.0, 385.0, 397.0)
    # The waits: 10, 20, 30, 40 (from run_after) and 50 (the running job)
    assert (fast.queue_p50_ms, fast.queue_p99_ms) == (30.0, 49.6)
    # And flaky: 6 attempts, 5 failed, 1 job dead, so 4 retries
    flaky = lines[FLAKY]
    assert (flaky.started, flaky.succeeded, flaky.failed, flaky.dead, flaky.retried) == (
        6, 1, 5, 1, 4)
    assert flaky.failure_ratio == pytest.approx(5 / 6)
    # Both waited two minutes for their first start
    assert (flaky.queue_p50_ms, flaky.queue_p99_ms) == (120_000.0, 120_000.0)
    assert (flaky.run_p50_ms, flaky.run_p99_ms) == (50.0, 50.0)


def test_the_day_includes_older_attempts_and_other_backends_are_apart(
    rj_settings: Callable[..., dict[str, str]]
) -> None:
    # Given the history, and a job of another backend that shares the table
    rj_settings()
    now = timezone.now()
    history(now)
    other = new_job(FAST, now - timedelta(minutes=5), backend="other")
    attempt(other, 1, now - timedelta(minutes=5), ran_ms=10)

    # When the day's figures are read
    lines = by_task(taskstats.task_stats(using="default", backend="default",
                                         window=timedelta(days=1), now=now))

    # Then fast has the job of two hours ago as well, and nothing of "other"
    assert (lines[FAST].started, lines[FAST].succeeded) == (6, 5)
    assert lines[FAST].run_p99_ms == pytest.approx(976.0)


def test_a_row_touched_a_little_before_its_attempt_finished_still_counts(
    rj_settings: Callable[..., dict[str, str]]
) -> None:
    # Given a job whose attempt finished 58 min ago, by a worker whose clock ran
    # 5 min ahead of the database's (the row says it was written 63 min ago,
    # before the hour began), and one whose row was last written 3 hours ago,
    # long before its attempt "finished" (no mirror write does that)
    rj_settings()
    now = timezone.now()
    skewed = new_job(FAST, now - timedelta(minutes=59))
    attempt(skewed, 1, now - timedelta(minutes=58) - 100 * MS, ran_ms=100)
    stale = new_job(FLAKY, now - timedelta(minutes=59))
    attempt(stale, 1, now - timedelta(minutes=58) - 100 * MS, ran_ms=100)
    # (test set-up, not a mirror write: the rows' times as those clocks left them)
    Job.objects.filter(pk=skewed).update(updated_at=now - timedelta(minutes=63))
    Job.objects.filter(pk=stale).update(updated_at=now - timedelta(hours=3))

    # When the hour is read, on both paths
    since = now - timedelta(hours=1)
    found = [taskstats._pg_attempt_figures("default", "default", since),
             taskstats._portable_attempt_figures("default", "default", since)]

    # Then the skewed job counts (within TOUCHED_MARGIN), the stale row is not read
    assert [set(lines) for lines in found] == [{FAST}, {FAST}]
    assert found[0][FAST].succeeded == found[1][FAST].succeeded == 1


def test_postgresql_and_the_portable_path_agree(
    rj_settings: Callable[..., dict[str, str]]
) -> None:
    # Given the history (on PostgreSQL, where both paths can run)
    rj_settings()
    now = timezone.now()
    history(now)
    since = now - timedelta(days=1)

    # When both paths read it
    pg = taskstats._pg_attempt_figures("default", "default", since)
    portable = taskstats._portable_attempt_figures("default", "default", since)

    # Then every figure is the same
    assert pg == portable
    assert set(pg) == {FAST, FLAKY}


def test_percentiles_interpolate_like_percentile_cont() -> None:
    # Given samples of one, two and ten values
    # Then the portable percentiles match PostgreSQL's continuous ones
    assert taskstats.percentiles([], [0.5]) == [None]
    assert taskstats.percentiles([7.0], [0.5, 0.99]) == [7.0, 7.0]
    assert taskstats.percentiles([10.0, 20.0], [0.5, 0.95]) == [15.0, pytest.approx(19.5)]
    assert taskstats.percentiles([float(i) for i in range(10, 0, -1)], [0.5, 0.99]) == [
        5.5, pytest.approx(9.91)]


# -- the admin page ------------------------------------------------------------


def rows_of(text: str) -> list[str]:
    """Task paths in the order the page lists them."""
    return re.findall(r'<tr data-task="([^"]+)">', text)


def test_the_page_sorts_by_any_column_and_links_to_the_jobs(
    rj_settings: Callable[..., dict[str, str]], admin_client: Client
) -> None:
    # Given the history
    rj_settings()
    history(timezone.now())

    # When staff open the page, sorted by default (most started first), then by failures
    default = admin_client.get(TASKS_PAGE).content.decode()
    by_failed = admin_client.get(f"{TASKS_PAGE}?o=-failed").content.decode()
    by_name = admin_client.get(f"{TASKS_PAGE}?o=task").content.decode()
    by_p99 = admin_client.get(f"{TASKS_PAGE}?o=-run_p99_ms").content.decode()

    # Then each order is the one asked for
    assert rows_of(default) == [FLAKY, FAST]  # 6 starts against 5
    assert rows_of(by_failed) == [FLAKY, FAST]
    assert rows_of(by_name) == [FAST, FLAKY]
    assert rows_of(by_p99) == [FAST, FLAKY]
    # And the heading of the sort column flips it; another column starts high
    assert 'href="?window=hour&amp;o=failed"' in by_failed
    assert 'href="?window=hour&amp;o=-succeeded"' in by_failed
    # And each task links to the job list filtered on it (and on dead for its deaths)
    assert f'href="{CHANGELIST}?task=demo.tasks.flaky"' in default
    assert f'href="{CHANGELIST}?task=demo.tasks.flaky&amp;state__exact=dead"' in default
    assert "83.3 %" in default  # flaky's failed share
    assert "250 ms" in default  # fast's run p50


def test_the_window_and_an_unknown_order_or_backend(
    rj_settings: Callable[..., dict[str, str]], admin_client: Client
) -> None:
    # Given the history
    rj_settings()
    history(timezone.now())

    # When the day is asked for, with an order that is no column
    page = admin_client.get(f"{TASKS_PAGE}?window=day&o=-password").content.decode()

    # Then the day is shown in the default order, and an unknown backend is a 404
    assert '<td class="num rj-started">6</td>' in page  # fast, with the older job
    assert rows_of(page) == [FAST, FLAKY]  # a tie on started: by name
    assert admin_client.get(f"{TASKS_PAGE}nope/").status_code == 404


def test_the_page_needs_the_view_permission(
    rj_settings: Callable[..., dict[str, str]], django_user_model: Any
) -> None:
    # Given staff without, and with, the job view permission
    rj_settings()
    without = staff_client(django_user_model, username="nobody")
    viewer = staff_client(django_user_model, "view_job", username="viewer")

    # Then only the second sees the page
    assert without.get(TASKS_PAGE).status_code == 403
    assert viewer.get(TASKS_PAGE).status_code == 200


def test_the_job_list_and_dashboard_link_to_the_page(
    rj_settings: Callable[..., dict[str, str]], admin_client: Client
) -> None:
    # Given a configured backend
    rj_settings()

    # Then the job list and the dashboard both offer the per-task page
    link = f'href="{TASKS_PAGE}default/"'
    assert link in admin_client.get(CHANGELIST).content.decode()
    assert link in admin_client.get("/admin/reliable_jobs/job/dashboard/").content.decode()


# -- jobstats -----------------------------------------------------------------------


def test_jobstats_prints_the_figures_and_json(
    rj_settings: Callable[..., dict[str, str]]
) -> None:
    # Given the history
    rj_settings()
    history(timezone.now())

    # When jobstats prints the hour's figures, and then JSON
    text, document = StringIO(), StringIO()
    call_command("jobstats", "--tasks", "hour", stdout=text, stderr=StringIO())
    call_command("jobstats", "--json", stdout=document, stderr=StringIO())

    # Then the text has a line per task, and the JSON the same figures for both windows
    assert ("demo.tasks.flaky  started 6  succeeded 1  failed 5  dead 1  retried 4  "
            "run 50 50 50  in queue 120000 120000") in text.getvalue()
    found = json.loads(document.getvalue())
    hour = {line["task"]: line for line in found["tasks"]["hour"]}
    assert hour[FAST] == {
        "task": FAST, "started": 5, "succeeded": 4, "failed": 0, "dead": 0, "retried": 0,
        "failure_ratio": 0.0, "run_p50_ms": 250.0, "run_p95_ms": 385.0, "run_p99_ms": 397.0,
        "queue_p50_ms": 30.0, "queue_p99_ms": 49.6}
    assert {line["task"]: line["started"] for line in found["tasks"]["day"]} == {
        FAST: 6, FLAKY: 6}
    assert found["problems"] == []
    assert [q["name"] for q in found["queues"]] == ["default"]
