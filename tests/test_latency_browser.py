"""Queue latency and the per-task page in a real browser (Chromium via Playwright).

Same set-up as ``test_browser.py`` (its fixtures are used here): a live
server, real Redis, real PostgreSQL and a real ``runworker``. Screenshots
go to ``test-artifacts/`` (``dashboard-latency.png``, ``task-stats.png``).
"""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest
import redis
from playwright.sync_api import Page, expect

from reliable_jobs.keys import QueueKeys
from reliable_jobs.models import Job, JobState
from testproject.demo import tasks as demo

from . import test_browser
from .helpers import Processes, wait_until
from .test_latency import backdate

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

# The browser and the logged-in page of test_browser.py.
browser = test_browser.browser
site = test_browser.site
#: admin.css's warning colour (#b91c1c).
WARNING_RGB = "rgb(185, 28, 28)"


def test_staff_see_a_late_queue_and_each_tasks_figures(
    rj_settings: Callable[..., dict[str, str]], processes: Processes,
    site: Callable[..., Page], redis_client: redis.Redis,
) -> None:
    # Given: a 10 s latency warning; a worker serving "default" only, which ran
    # two additions, a job that failed once before succeeding and one that
    # failed all 3 attempts; on "emails", which no worker serves, a job ready
    # for two minutes
    env = rj_settings(queues=["default", "emails"], LATENCY_WARNING_MS=10_000)
    jobs = [demo.add.enqueue(1, 2), demo.add.enqueue(3, 4),
            demo.fail_times.enqueue("once", 1), demo.always_fail.enqueue("doomed")]
    late = demo.add.using(queue_name="emails").enqueue(5, 6)
    backdate(redis_client, late.id, "enqueued_ms", 120_000, keys=QueueKeys("rj", "emails"))
    processes.worker(env, "--queue", "default", "--worker-id", "latency-worker")
    wait_until(lambda: Job.objects.filter(pk__in=[j.id for j in jobs],
                                          state__in=[JobState.SUCCEEDED, JobState.DEAD]
                                          ).count() == len(jobs),
               timeout=60, message="the worker to finish its four jobs")

    # When staff open the dashboard from the job list
    page = site("latency-ops", superuser=True)
    page.goto(test_browser.CHANGELIST)
    page.click("a.rj-dashboard-link")

    # Then "emails" shows its two-minute wait in the warning colour, "default" does not
    late_cell = page.locator("tr[data-queue=emails] td.rj-oldest-ready")
    expect(late_cell).to_have_text(re.compile(r"^2 min \d+ s$"))
    expect(late_cell).to_have_class("num rj-oldest-ready rj-over")
    expect(late_cell).to_have_css("color", WARNING_RGB)
    expect(page.locator("tr[data-queue=default] td.rj-oldest-ready")).to_have_text("-")
    expect(page.locator("tr[data-queue=default] td.rj-oldest-ready.rj-over")).to_have_count(0)
    test_browser.shoot(page, "dashboard-latency.png")

    # When they follow the link to the per-task figures
    page.click("a.rj-taskstats-link")

    # Then each task of the last hour has its line, the busiest first
    rows = page.locator("#rj-taskstats tbody tr")
    expect(rows).to_have_count(3)
    doomed = page.locator("tr[data-task='testproject.demo.tasks.always_fail']")
    expect(doomed.locator("td.rj-failed")).to_have_text("3")
    expect(doomed.locator("td.rj-dead")).to_have_text("1")
    expect(doomed.locator("td.rj-retried")).to_have_text("2")
    expect(doomed.locator("td.rj-failed")).to_have_css("color", WARNING_RGB)
    once = page.locator("tr[data-task='testproject.demo.tasks.fail_times']")
    expect(once.locator("td.rj-started")).to_have_text("2")
    expect(once.locator("td.rj-failure_ratio")).to_have_text("50.0 %")
    expect(rows.first).to_have_attribute("data-task", "testproject.demo.tasks.always_fail")

    # When they sort by successes (a click: most first), then flip it
    page.locator("th[data-column=succeeded] a").click()
    expect(rows.first).to_have_attribute("data-task", "testproject.demo.tasks.add")
    expect(page.locator("th[data-column=succeeded]")).to_have_class(
        "num sorted descending")
    page.locator("th[data-column=succeeded] a").click()
    expect(rows.first).to_have_attribute("data-task", "testproject.demo.tasks.always_fail")
    # And by the name, and by the 99th percentile of run time
    page.locator("th[data-column=task] a").click()
    expect(rows.locator("th.rj-task")).to_have_text([
        "testproject.demo.tasks.add", "testproject.demo.tasks.always_fail",
        "testproject.demo.tasks.fail_times"])
    page.locator("th[data-column=run_p99_ms] a").click()
    expect(page.locator("th[data-column=run_p99_ms]")).to_have_class("num sorted descending")
    page.locator("#rj-windows a[data-window=day]").click()
    expect(rows).to_have_count(3)
    test_browser.shoot(page, "task-stats.png")

    # When they follow a task's dead count to the job list
    doomed.locator("td.rj-dead a").click()

    # Then the list shows that task's dead job only
    listed = page.locator("#result_list tbody tr")
    expect(listed).to_have_count(1)
    expect(listed.first.locator(".rj-id")).to_have_attribute("title", jobs[3].id)
