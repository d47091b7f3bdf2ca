"""The schedules' admin in a real browser (Debian's Chromium, Playwright), against a
live server and a real ``runworker`` whose scheduler fires an every-second schedule.

Fixtures come from test_browser.py; screenshots go to ``test-artifacts/``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
import redis
from playwright.sync_api import Page, expect

from reliable_jobs.models import Schedule, ScheduleSlot

from .helpers import Processes, wait_until
from .test_browser import browser, shoot, site  # noqa: F401  # fixtures used by name

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

SCHEDULES = "/admin/reliable_jobs/schedule/"


def slot_count() -> int:
    return ScheduleSlot.objects.filter(schedule__name="tick", manual=False).count()


def test_staff_pause_and_enable_a_schedule_without_a_restart(
    rj_settings: Callable[..., dict[str, str]], processes: Processes,
    site: Callable[..., Page], redis_client: redis.Redis,  # noqa: F811
) -> None:
    # Given: a worker whose scheduler fires "tick" every second, and staff who may
    # view and pause schedules, but not run them now
    env = rj_settings(SCHEDULE={"tick": {"task": "testproject.demo.tasks.add",
                                         "every_ms": 1000, "args": [1, 1]}})
    worker = processes.worker(env, "--worker-id", "scheduler-worker")
    wait_until(lambda: slot_count() >= 2, timeout=60, message="the first slots")
    page = site("planner", "view_schedule", "toggle_schedule", "view_job")

    # When: they open the schedules
    page.goto(SCHEDULES)

    # Then: the schedule is listed, enabled, with its timing and its last job's link;
    # "run now" is not offered to them
    row = page.locator("#result_list tbody tr", has_text="tick")
    expect(row.locator(".field-when")).to_have_text("every 1 s")
    expect(row.locator(".field-state .rj-badge")).to_have_text("enabled")
    expect(row.locator(".field-last_job a.rj-job-link")).to_have_count(1)
    expect(page.locator("select[name=action] option[value=run_schedules_now]")).to_have_count(0)
    shoot(page, "schedules.png")

    # When: they pause it with the action
    pk = Schedule.objects.get(name="tick").pk
    page.check(f"input[name=_selected_action][value='{pk}']")
    page.select_option("select[name=action]", "disable_schedules")
    page.click("button[name=index]")

    # Then: the admin says so, the row shows it, and the running scheduler stops
    # firing at its next pass: no restart
    expect(page.locator("ul.messagelist")).to_contain_text("1 schedule(s) paused")
    expect(row.locator(".field-state .rj-badge")).to_have_text("paused")
    time.sleep(1.5)  # a pass under way when the pause committed may finish its slot
    paused_count = slot_count()
    time.sleep(3.0)
    assert slot_count() == paused_count

    # When: they enable it again
    page.check(f"input[name=_selected_action][value='{pk}']")
    page.select_option("select[name=action]", "enable_schedules")
    page.click("button[name=index]")

    # Then: it fires again, from the next slot on (the paused ones are not caught up)
    expect(page.locator("ul.messagelist")).to_contain_text("1 schedule(s) enabled")
    wait_until(lambda: slot_count() > paused_count, timeout=30,
               message="the schedule to fire again")
    row_db = Schedule.objects.get(name="tick")
    assert row_db.last_slot_at is not None and row_db.last_slot_at > row_db.fire_after

    # When: they follow the last job's link
    page.reload()
    row.locator(".field-last_job a.rj-job-link").click()

    # Then: the job's page opens
    expect(page.locator(".field-task_path .readonly")).to_have_text(
        "testproject.demo.tasks.add")
    assert processes.stop(worker) == 0


def test_run_now_needs_its_own_permission_and_enqueues_one_job(
    rj_settings: Callable[..., dict[str, str]], site: Callable[..., Page],  # noqa: F811
    redis_client: redis.Redis, settings: Any,
) -> None:
    # Given: a nightly schedule declared (its row written by a scheduler's start-up)
    # and staff holding run_schedule
    from reliable_jobs.compat import task_backends
    from reliable_jobs.periodic.scheduler import Scheduler

    rj_settings(SCHEDULE={"nightly": {"task": "testproject.demo.tasks.add",
                                      "cron": "0 3 * * *", "tz": "Europe/Berlin",
                                      "args": [20, 22]}})
    Scheduler(task_backends["default"]).sync()
    page = site("operator", "view_schedule", "run_schedule", "view_job")

    # When: they run it now from the list
    page.goto(SCHEDULES)
    row = page.locator("#result_list tbody tr", has_text="nightly")
    expect(row.locator(".field-when")).to_have_text("0 3 * * * (Europe/Berlin)")
    pk = Schedule.objects.get(name="nightly").pk
    page.check(f"input[name=_selected_action][value='{pk}']")
    page.select_option("select[name=action]", "run_schedules_now")
    page.click("button[name=index]")

    # Then: one job is enqueued with the schedule's arguments, recorded as a manual run,
    # and they cannot pause it (no toggle permission)
    expect(page.locator("ul.messagelist")).to_contain_text("Schedule nightly enqueued job")
    manual = ScheduleSlot.objects.get(schedule__name="nightly")
    assert manual.manual is True
    expect(page.locator("select[name=action] option[value=disable_schedules]")).to_have_count(0)
