"""Periodic timetables and the downtime policies, as pure functions of the clock.

Slot times (DST nights pinned with fixed dates), intervals, refused
declarations, and what ``decide`` enqueues after an outage: no scheduler, no
database. How the scheduler turns these into exactly one job per slot is in
tests/test_periodic.py; the real-process races in tests/test_periodic_processes.py.
"""

from __future__ import annotations

from collections import Counter
from datetime import UTC, datetime, timedelta
from typing import Any
from zoneinfo import ZoneInfo

import pytest

from reliable_jobs.periodic import Cron, Every, TimetableError, periodic
from reliable_jobs.periodic.scheduler import decide
from testproject.demo import tasks as demo

from ..helpers import slots_between


def utc(*parts: int) -> datetime:
    return datetime(*parts, tzinfo=UTC)  # type: ignore[misc]


# -- slot times and DST -------------------------------------------------------


@pytest.mark.parametrize(("zone", "night"), [
    ("Europe/Berlin", utc(2027, 3, 28)),     # 02:00 -> 03:00 CET to CEST
    ("America/New_York", utc(2027, 3, 14)),  # 02:00 -> 03:00 EST to EDT
])
def test_a_daily_time_the_clocks_skip_runs_once_that_day(zone: str, night: datetime) -> None:
    # Given: a daily 02:30 job in a zone whose clocks jump over 02:30 that night
    timetable = Cron("30 2 * * *", zone)

    # When: its slots over the three days around the change are listed
    slots = slots_between(timetable, night - timedelta(days=1), night + timedelta(days=2))

    # Then: one slot per local day, the day of the change included (at 03:00,
    # the end of the gap, as Debian cron does)
    local_days = Counter(s.astimezone(ZoneInfo(zone)).date() for s in slots)
    assert sorted(local_days.values()) == [1, 1, 1]
    change_day = [s.astimezone(ZoneInfo(zone)) for s in slots
                  if s.astimezone(ZoneInfo(zone)).date() == night.date()]
    assert [(d.hour, d.minute) for d in change_day] == [(3, 0)]


@pytest.mark.parametrize(("zone", "expression", "night"), [
    ("Europe/London", "30 1 * * *", utc(2027, 10, 31)),     # 02:00 BST -> 01:00 GMT
    ("America/New_York", "30 1 * * *", utc(2027, 11, 7)),  # 02:00 EDT -> 01:00 EST
    ("Europe/Berlin", "30 2 * * *", utc(2027, 10, 31)),     # 03:00 CEST -> 02:00 CET
])
def test_a_daily_time_the_clocks_repeat_runs_once_that_day(zone: str, expression: str,
                                                           night: datetime) -> None:
    # Given: a daily job at a time that happens twice on the night clocks fall back
    timetable = Cron(expression, zone)

    # When: its slots over the three days around the change are listed
    slots = slots_between(timetable, night - timedelta(days=1), night + timedelta(days=2))

    # Then: one slot per local day: the first of the two occurrences only
    local = [s.astimezone(ZoneInfo(zone)) for s in slots]
    assert sorted(Counter(d.date() for d in local).values()) == [1, 1, 1]
    assert [d.fold for d in local] == [0, 0, 0]


def test_intervals_count_from_the_epoch_in_utc() -> None:
    # Given: every 5 minutes
    timetable = Every(300_000)

    # When: slots after 10:02:30 are listed
    slots = slots_between(timetable, utc(2027, 1, 1, 10, 2, 30), utc(2027, 1, 1, 10, 16))

    # Then: they fall on the five-minute marks, whatever the start
    assert slots == [utc(2027, 1, 1, 10, 5), utc(2027, 1, 1, 10, 10), utc(2027, 1, 1, 10, 15)]


@pytest.mark.parametrize(("kwargs", "says"), [
    ({"cron": "0 3 * *"}, "has 4 field(s)"),
    ({"cron": "0 0 3 * * *"}, "has 6 field(s)"),
    ({"cron": "61 3 * * *"}, "cannot be read"),
    ({"cron": "0 3 * * *", "tz": "Mars/Olympus"}, "unknown"),
    ({"every_ms": 10}, ">= 1000"),
    ({"cron": "0 3 * * *", "every_ms": 60_000}, "exactly one"),
    ({"cron": "0 3 * * *", "catch_up": "some"}, "catch_up"),
    ({"cron": "0 3 * * *", "args": [object()]}, "not JSON"),
])
def test_a_bad_declaration_is_refused_at_import_with_a_sentence(
        no_decorated: None, kwargs: dict[str, Any], says: str) -> None:
    # When: @periodic is given something unusable
    with pytest.raises(TimetableError) as refused:
        cron = kwargs.pop("cron", None)
        periodic(cron, **kwargs)(demo.add)

    # Then: it says what is wrong, before any worker starts
    assert says in str(refused.value)
    assert str(refused.value).endswith(".")


def test_periodic_goes_above_task(no_decorated: None) -> None:
    with pytest.raises(TypeError, match="above @task"):
        periodic("0 3 * * *")(lambda: None)


# -- the downtime policies ------------------------------------------------------


EVERY_MINUTE = Every(60_000)


@pytest.mark.parametrize(("catch_up", "enqueued", "skipped"), [
    ("all", 60, 0), ("last", 1, 59), ("none", 0, 60),
])
def test_after_an_hour_down_each_policy_enqueues_what_it_says(
        catch_up: str, enqueued: int, skipped: int) -> None:
    # Given: an every-minute schedule decided up to 10:00, and nothing since
    # When: a scheduler comes back at 11:00:30 (the 11:00 slot is 30 s late)
    plans = []
    cursor = utc(2027, 1, 1, 10)
    for _ in range(3):  # "all" may take several passes (100 slots each)
        plan = decide(EVERY_MINUTE, catch_up, cursor, utc(2027, 1, 1, 11, 0, 30))
        plans.append(plan)
        cursor = plan.cursor or cursor

    # Then: "all" enqueues the 60 missed slots in order, "last" only 11:00,
    # "none" none; the rest is counted as skipped
    slots = [s for p in plans for s in p.enqueue]
    assert len(slots) == enqueued
    assert sum(p.skipped for p in plans) == skipped
    if catch_up == "last":
        assert slots == [utc(2027, 1, 1, 11)]
    if catch_up == "all":
        assert slots == sorted(set(slots)) and slots[-1] == utc(2027, 1, 1, 11)
    assert cursor == utc(2027, 1, 1, 11)


@pytest.mark.parametrize("catch_up", ["last", "none"])
def test_slots_on_time_are_always_enqueued(catch_up: str) -> None:
    # Given: an every-second schedule whose passes are a few seconds apart
    every_second = Every(1000)

    # When: a pass comes 3 s after the last one
    plan = decide(every_second, catch_up, utc(2027, 1, 1, 10), utc(2027, 1, 1, 10, 0, 3))

    # Then: each of the three slots is enqueued, none skipped as "missed"
    assert plan.enqueue == [utc(2027, 1, 1, 10, 0, s) for s in (1, 2, 3)]
    assert plan.skipped == 0

