"""Periodic jobs in one process: a DST night and an outage through the scheduler,
the slot's unique key, enabling, removal, run now, checks.

The scheduler is driven with explicit ``now`` values, so a night or an outage
of an hour takes no time; the test of the worker's clock stepping back runs
passes in real time. The timetables and the downtime policies alone are in
tests/fast/test_timetables.py; the real-process races in
test_periodic_processes.py.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from io import StringIO
from typing import Any

import pytest
from django.core.checks import run_checks
from django.core.management import call_command
from django.utils import timezone

from reliable_jobs.compat import task_backends
from reliable_jobs.models import Job, Schedule, ScheduleSlot
from reliable_jobs.periodic import Every, periodic
from reliable_jobs.periodic.scheduler import (
    ON_TIME_MS,
    PASS_INTERVAL_S,
    Scheduler,
    database_now,
    run_now,
    set_enabled,
)
from testproject.demo import tasks as demo

from .helpers import slots_between

Configure = Callable[..., dict[str, str]]
ADD = "testproject.demo.tasks.add"


def utc(*parts: int) -> datetime:
    return datetime(*parts, tzinfo=UTC)  # type: ignore[misc]


NEW_YEAR = utc(2027, 1, 1)


@pytest.fixture
def scheduler_for(rj_settings: Configure) -> Callable[..., Scheduler]:
    """A synced Scheduler over the default backend with OPTIONS['SCHEDULE'] = ``entries``."""

    def make(since: datetime = NEW_YEAR, **entries: dict[str, Any]) -> Scheduler:
        rj_settings(SCHEDULE=entries)
        scheduler = Scheduler(task_backends["default"])
        assert scheduler.sync() == sorted(entries)
        # As if the rows had been created at ``since`` (they fire nothing before it).
        Schedule.objects.filter(name__in=entries).update(fire_after=since)
        return scheduler

    return make


def fire_through(scheduler: Scheduler, name: str, start: datetime, end: datetime,
                 step: timedelta) -> None:
    """Run the scheduler at every ``step`` from ``start`` to ``end``."""
    moment = start
    while moment <= end:
        scheduler.fire(name, now=moment)
        moment += step


def slot_times(name: str) -> list[datetime]:
    return list(ScheduleSlot.objects.filter(schedule__name=name, manual=False)
                .order_by("slot_at").values_list("slot_at", flat=True))


# -- slot times and DST -------------------------------------------------------


def test_the_scheduler_enqueues_a_dst_night_once_whatever_its_pass_rhythm(
        scheduler_for: Callable[..., Scheduler]) -> None:
    # Given: daily 02:30 Berlin (skipped in spring) and 01:30 London (repeated in autumn)
    scheduler = scheduler_for(
        since=utc(2027, 3, 27, 20),
        spring={"task": ADD, "cron": "30 2 * * *", "tz": "Europe/Berlin", "args": [1, 2]},
        autumn={"task": ADD, "cron": "30 1 * * *", "tz": "Europe/London", "args": [3, 4]})

    # When: the scheduler passes every 7 minutes through each night of change
    fire_through(scheduler, "spring", utc(2027, 3, 27, 20), utc(2027, 3, 28, 6),
                 timedelta(minutes=7))
    Schedule.objects.filter(name="autumn").update(fire_after=utc(2027, 10, 30, 20))
    fire_through(scheduler, "autumn", utc(2027, 10, 30, 20), utc(2027, 10, 31, 6),
                 timedelta(minutes=7))

    # Then: each night has exactly one slot, with one job, carrying the fixed arguments
    assert slot_times("spring") == [utc(2027, 3, 28, 1)]  # 03:00 CEST
    assert slot_times("autumn") == [utc(2027, 10, 31, 0, 30)]  # 01:30 BST, the first one
    jobs = Job.objects.filter(pk__in=ScheduleSlot.objects.values("job_id"))
    assert sorted((j.task_path, j.args) for j in jobs) == [(ADD, [1, 2]), (ADD, [3, 4])]


# -- the downtime policies ------------------------------------------------------


def test_skipped_slots_are_logged_and_the_last_one_enqueued(
        scheduler_for: Callable[..., Scheduler], app_log: list[logging.LogRecord]) -> None:
    # Given: an hourly schedule (default policy: only the last) that ran at 01:00
    scheduler = scheduler_for(hourly={"task": ADD, "cron": "0 * * * *", "args": [1, 1]})
    scheduler.fire("hourly", now=utc(2027, 1, 1, 1, 0, 5))

    # When: no scheduler runs until 06:20
    report = scheduler.fire("hourly", now=utc(2027, 1, 1, 6, 20))

    # Then: 06:00 is enqueued, 02:00 to 05:00 are skipped and said so
    assert slot_times("hourly") == [utc(2027, 1, 1, 1), utc(2027, 1, 1, 6)]
    assert (report.enqueued, report.skipped) == (1, 4)
    lines = [r.getMessage() for r in app_log if "skipped" in r.getMessage()]
    assert lines == ["Schedule 'hourly': skipped 4 missed slot(s) from 2027-01-01 02:00:00 UTC "
                     "to 2027-01-01 05:00:00 UTC (catch_up='last')."]
    row = Schedule.objects.get(name="hourly")
    assert (row.last_slot_at, row.cursor_at) == (utc(2027, 1, 1, 6), utc(2027, 1, 1, 6))
    assert str(row.last_job_id) == report.job_ids[0]


# -- exactly once -------------------------------------------------------------------


def test_a_slot_that_has_a_job_never_gets_a_second(
        scheduler_for: Callable[..., Scheduler]) -> None:
    # Given: a slot already enqueued (its slot row and job row committed together)
    scheduler = scheduler_for(tick={"task": ADD, "every_ms": 1000, "args": [1, 1]})
    row = Schedule.objects.get(name="tick")
    slot = utc(2027, 1, 1, 10)
    first = scheduler._enqueue_slot(row, slot)
    assert first is not None

    # When: a scheduler that missed the cursor (as if the row lock were
    # bypassed) enqueues the same slot again
    second = scheduler._enqueue_slot(row, slot)

    # Then: the unique key refuses it, and its job row is rolled back with it
    assert second is None
    assert slot_times("tick") == [slot]
    assert list(Job.objects.values_list("pk", flat=True)) == [
        ScheduleSlot.objects.get().job_id]


def test_passes_from_two_schedulers_enqueue_each_slot_once(
        scheduler_for: Callable[..., Scheduler]) -> None:
    # Given: two schedulers over one every-second schedule
    start = utc(2027, 1, 1, 10)
    one = scheduler_for(since=start, tick={"task": ADD, "every_ms": 1000, "args": [1, 1]})
    two = Scheduler(task_backends["default"])
    two.sync()

    # When: they pass alternately, at overlapping times, over 20 s
    for tenth in range(0, 200, 3):
        moment = start + timedelta(milliseconds=100 * tenth)
        (one if tenth % 2 else two).fire("tick", now=moment)
        (two if tenth % 2 else one).fire("tick", now=moment - timedelta(milliseconds=700))

    # Then: one job per second, no slot twice, none missing
    assert slot_times("tick") == [start + timedelta(seconds=s) for s in range(1, 20)]
    assert Job.objects.count() == 19


# -- the worker's clock ----------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)  # now() per pass, as in a worker
def test_a_backward_step_of_the_workers_clock_neither_delays_nor_drops_a_slot(
        scheduler_for: Callable[..., Scheduler], monkeypatch: pytest.MonkeyPatch) -> None:
    # Given: an every-second schedule that drops missed slots, fired in real time
    since = database_now("default")
    scheduler = scheduler_for(since=since, tick={"task": ADD, "every_ms": 1000, "args": [1, 1],
                                                 "catch_up": "none"})
    reports = [scheduler.run_pass()]

    # When: the worker's wall clock steps back an hour (NTP, a VM resumed) for
    # longer than a slot may be late, the scheduler passing as its thread does,
    # and is then set right
    wall_clock = timezone.now
    monkeypatch.setattr(timezone, "now", lambda: wall_clock() - timedelta(hours=1))
    stepped_until = time.monotonic() + ON_TIME_MS / 1000 + 2
    while time.monotonic() < stepped_until:
        reports.append(scheduler.run_pass())
        time.sleep(PASS_INTERVAL_S)
    monkeypatch.setattr(timezone, "now", wall_clock)
    reports.append(scheduler.run_pass())

    # Then: every slot since the start was enqueued on time: none dropped as
    # missed, none left for later
    assert sum(r.skipped for r in reports) == 0
    cursor = Schedule.objects.get(name="tick").cursor_at
    assert cursor is not None and cursor > database_now("default") - timedelta(seconds=2)
    assert slot_times("tick") == slots_between(Every(1000), since, cursor)


# -- staff and code changes -----------------------------------------------------------


def test_a_paused_schedule_does_not_fire_and_does_not_catch_up_when_enabled(
        scheduler_for: Callable[..., Scheduler]) -> None:
    # Given: a schedule with catch_up="all", paused by staff
    scheduler = scheduler_for(since=utc(2027, 1, 1, 9, 59),
                              tick={"task": ADD, "every_ms": 60_000, "catch_up": "all"})
    scheduler.fire("tick", now=utc(2027, 1, 1, 10, 0, 1))
    assert set_enabled("default", ["tick"], False) == 1

    # When: its passes go on for an hour, then staff enable it again
    fire_through(scheduler, "tick", utc(2027, 1, 1, 10, 1), utc(2027, 1, 1, 11),
                 timedelta(minutes=1))
    assert set_enabled("default", ["tick"], True) == 1
    Schedule.objects.filter(name="tick").update(fire_after=utc(2027, 1, 1, 11))
    scheduler.fire("tick", now=utc(2027, 1, 1, 11, 1, 1))

    # Then: nothing fired while paused, and enabling fires from then on only
    assert slot_times("tick") == [utc(2027, 1, 1, 10), utc(2027, 1, 1, 11, 1)]


def test_a_schedule_removed_from_code_stops_firing_and_keeps_its_history(
        scheduler_for: Callable[..., Scheduler]) -> None:
    # Given: a schedule that fired once
    old = scheduler_for(tick={"task": ADD, "every_ms": 60_000})
    old.fire("tick", now=utc(2027, 1, 1, 10, 0, 1))

    # When: a worker starts with code that no longer declares it
    new = scheduler_for(other={"task": ADD, "every_ms": 60_000})
    new.run_pass(now=utc(2027, 1, 1, 10, 5, 1))

    # Then: it is marked as gone from code, never fires again, and its slot stays
    row = Schedule.objects.get(name="tick")
    assert row.in_code is False
    assert slot_times("tick") == [utc(2027, 1, 1, 10)]
    assert Schedule.objects.get(name="other").in_code is True


def test_run_now_enqueues_one_job_outside_the_slots(
        scheduler_for: Callable[..., Scheduler]) -> None:
    # Given: a nightly schedule
    scheduler_for(nightly={"task": ADD, "cron": "0 3 * * *", "args": [2, 3]})

    # When: staff run it now
    job_id = run_now(task_backends["default"], "nightly")

    # Then: a job with its arguments, recorded as a manual run, not as a slot
    assert job_id is not None
    assert Job.objects.get(pk=job_id).args == [2, 3]
    assert ScheduleSlot.objects.get(job_id=job_id).manual is True
    assert slot_times("nightly") == []


def test_a_decorated_task_is_declared_for_its_backend(
        no_decorated: None, rj_settings: Configure) -> None:
    # Given: @periodic above a task
    periodic("15 4 * * 1", tz="Europe/Berlin", args=(5, 6), name="weekly-add",
             catch_up="none")(demo.add)

    # When: a scheduler syncs
    scheduler = Scheduler(task_backends["default"])
    names = scheduler.sync()

    # Then: its row holds the declaration
    assert "weekly-add" in names
    row = Schedule.objects.get(name="weekly-add")
    assert (row.expression, row.tz, row.args, row.catch_up, row.task_path) == (
        "15 4 * * 1", "Europe/Berlin", [5, 6], "none", ADD)


# -- checks ----------------------------------------------------------------------------


def schedule_messages() -> list[tuple[str, str]]:
    return [(m.id or "", m.msg) for m in run_checks()
            if m.id in ("reliable_jobs.E011", "reliable_jobs.E012", "reliable_jobs.E013")]


def test_checks_report_bad_schedules(rj_settings: Configure, no_decorated: None) -> None:
    # Given: a malformed entry, one naming no task, one on a queue not served, and a
    # name declared both in OPTIONS and by @periodic, differently
    rj_settings(SCHEDULE={
        "broken": {"task": ADD, "cron": "0 25 * * *"},
        "nowhere": {"task": "myapp.tasks.missing", "every_ms": 60_000},
        "elsewhere": {"task": ADD, "every_ms": 60_000, "queue": "emails"},
        "twice": {"task": ADD, "every_ms": 60_000},
        "fine": {"task": ADD, "cron": "*/5 * * * *", "tz": "Asia/Tokyo"},
    })
    periodic(every_ms=120_000, name="twice")(demo.add)

    # When: the checks run
    found = schedule_messages()

    # Then: each is reported once, with its id; the good one is not
    ids = sorted((check_id, next(n for n in ("broken", "nowhere", "elsewhere", "twice")
                                 if repr(n) in msg)) for check_id, msg in found)
    assert ids == [("reliable_jobs.E011", "broken"), ("reliable_jobs.E012", "elsewhere"),
                   ("reliable_jobs.E012", "nowhere"), ("reliable_jobs.E013", "twice")]
    assert all(msg.endswith(".") for _, msg in found)


def test_good_schedules_pass_the_checks(rj_settings: Configure) -> None:
    rj_settings(SCHEDULE={"fine": {"task": ADD, "cron": "0 3 * * *", "tz": "Europe/Berlin"}})
    assert schedule_messages() == []


pytestmark = pytest.mark.django_db


# -- jobstats and the admin ----------------------------------------------------------


def test_jobstats_lists_the_schedules(scheduler_for: Callable[..., Scheduler]) -> None:
    # Given: a schedule that enqueued one slot, and a paused one
    scheduler = scheduler_for(tick={"task": ADD, "every_ms": 60_000},
                              nightly={"task": ADD, "cron": "0 3 * * *", "tz": "Europe/Berlin"})
    report = scheduler.fire("tick", now=utc(2027, 1, 1, 10, 0, 1))
    set_enabled("default", ["nightly"], False)

    # When: jobstats runs
    out = StringIO()
    call_command("jobstats", stdout=out)

    # Then: both are listed with their timing, state, and the last slot's job
    text = out.getvalue()
    assert "Schedules: 2" in text
    tick = next(line for line in text.splitlines() if line.strip().startswith("tick"))
    assert "every 1 min" in tick and "enabled" in tick and report.job_ids[0] in tick
    nightly = next(line for line in text.splitlines() if line.strip().startswith("nightly"))
    assert "0 3 * * * (Europe/Berlin)" in nightly and "paused" in nightly


def test_the_admin_lists_schedules_and_pauses_one_with_its_permission_only(
        scheduler_for: Callable[..., Scheduler], client: Any) -> None:
    # Given: a schedule, and staff who may view schedules but not pause them
    from django.contrib.auth.models import Permission, User

    scheduler = scheduler_for(tick={"task": ADD, "every_ms": 60_000})
    report = scheduler.fire("tick", now=utc(2027, 1, 1, 10, 0, 1))
    user = User.objects.create_user("viewer", password="pw", is_staff=True)
    user.user_permissions.set(Permission.objects.filter(codename="view_schedule"))
    client.force_login(user)
    url = "/admin/reliable_jobs/schedule/"
    row = Schedule.objects.get(name="tick")

    # When: they open the list, then post the pause action anyway
    page = client.get(url).content.decode()
    refused = client.post(url, {"action": "disable_schedules", "_selected_action": [row.pk]})

    # Then: the list shows the schedule and its last job's link, the action is
    # neither offered nor honoured
    assert "every 1 min" in page and f"/admin/reliable_jobs/job/{report.job_ids[0]}/" in page
    assert "disable_schedules" not in page
    assert refused.status_code in (200, 302)
    assert Schedule.objects.get(name="tick").enabled is True

    # When: they are given toggle_schedule and post it again
    user.user_permissions.add(Permission.objects.get(codename="toggle_schedule"))
    client.post(url, {"action": "disable_schedules", "_selected_action": [row.pk]})

    # Then: the schedule is paused
    assert Schedule.objects.get(name="tick").enabled is False


def test_a_schedule_that_cannot_fire_is_left_out_and_the_others_fire(
        rj_settings: Configure, app_log: list[logging.LogRecord]) -> None:
    # Given: one schedule naming no task, one on a queue not served, and a good one
    rj_settings(SCHEDULE={
        "nowhere": {"task": "myapp.tasks.missing", "every_ms": 60_000},
        "elsewhere": {"task": ADD, "every_ms": 60_000, "queue": "emails"},
        "fine": {"task": ADD, "every_ms": 60_000, "args": [1, 1]},
    })
    scheduler = Scheduler(task_backends["default"])

    # When: a scheduler starts (E012 would stop runworker first; this is the fallback)
    names = scheduler.sync()

    # Then: it fires the good one only, and says why the others will not fire
    assert names == ["fine"]
    said = " ".join(r.getMessage() for r in app_log if r.levelno == logging.ERROR)
    assert "'nowhere'" in said and "'elsewhere'" in said
