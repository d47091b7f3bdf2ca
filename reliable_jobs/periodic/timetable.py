"""When a schedule's slots fall: 5-field cron expressions in a time zone, and intervals.

A slot is an instant (an aware UTC datetime). Every scheduler computes the
same slots from the same declaration, whatever its clock or start time, so
a slot's time is a key two schedulers agree on: the unique key of
``ScheduleSlot`` is (schedule, slot time).

Cron expressions are evaluated by cronsim, which follows Debian cron at DST
changes for jobs at a fixed time: a time the clocks skip (02:30 on a
spring-forward night) fires once, at the end of the gap (03:00); a time the
clocks repeat (01:30 on a fall-back night) fires once, at its first
occurrence. Jobs every N minutes or hours keep to real time (an hourly job
runs every real hour, both 02:00s included). Intervals count from the Unix
epoch in UTC (``every_ms=300_000`` fires at :00, :05, ...), so time zones
and DST never touch them.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from cronsim import CronSim, CronSimError

#: Slots iterated at most when counting missed ones (the count says "at least").
MAX_COUNT = 10_000
#: Steps cronsim may take past a slot it yields twice or out of order (DST folds).
_MAX_STEPS = 8


class TimetableError(ValueError):
    """A schedule whose expression, interval or time zone cannot be used."""


@dataclass(frozen=True, slots=True)
class Cron:
    """A 5-field cron expression read in time zone ``tz`` (an IANA name)."""

    expression: str
    tz: str = "UTC"

    def __post_init__(self) -> None:
        fields = self.expression.split()
        if len(fields) != 5:
            raise TimetableError(
                f"Cron expression {self.expression!r} has {len(fields)} field(s); write 5: "
                "minute, hour, day of month, month, day of week (e.g. '0 3 * * *').")
        zone = zone_of(self.tz)
        try:
            CronSim(self.expression, datetime(2000, 1, 1, tzinfo=zone))
        except (CronSimError, ValueError) as exc:
            raise TimetableError(
                f"Cron expression {self.expression!r} cannot be read ({exc}).") from None

    def after(self, start: datetime) -> Iterator[datetime]:
        """Slots strictly after ``start``, ascending, as UTC instants."""
        zone = zone_of(self.tz)
        last = start
        for local in CronSim(self.expression, start.astimezone(zone)):
            slot = local.astimezone(UTC)
            if slot > last:  # cronsim works in wall time at DST changes: keep instants rising
                last = slot
                yield slot

    def latest(self, moment: datetime) -> datetime | None:
        """The newest slot at or before ``moment``."""
        zone = zone_of(self.tz)
        begin = (moment.replace(microsecond=0) + timedelta(seconds=1)).astimezone(zone)
        for steps, local in enumerate(CronSim(self.expression, begin, reverse=True)):
            slot = local.astimezone(UTC)
            if slot <= moment:
                return slot
            if steps >= _MAX_STEPS:
                break
        return None

    def __str__(self) -> str:
        return f"{self.expression} ({self.tz})"


@dataclass(frozen=True, slots=True)
class Every:
    """Every ``every_ms`` milliseconds, counted from the Unix epoch (UTC)."""

    every_ms: int

    def __post_init__(self) -> None:
        if isinstance(self.every_ms, bool) or not isinstance(self.every_ms, int) \
                or self.every_ms < 1000:
            raise TimetableError(
                f"An interval must be a whole number of milliseconds >= 1000, "
                f"not {self.every_ms!r}.")

    def after(self, start: datetime) -> Iterator[datetime]:
        index = _epoch_ms(start) // self.every_ms + 1
        while True:
            yield _from_epoch_ms(index * self.every_ms)
            index += 1

    def latest(self, moment: datetime) -> datetime | None:
        return _from_epoch_ms(_epoch_ms(moment) // self.every_ms * self.every_ms)

    def count_between(self, start: datetime, end: datetime) -> int:
        """Slots in (start, end], without iterating."""
        return max(0, _epoch_ms(end) // self.every_ms - _epoch_ms(start) // self.every_ms)

    def __str__(self) -> str:
        return f"every {_human_ms(self.every_ms)}"


Timetable = Cron | Every


def between(timetable: Timetable, start: datetime, end: datetime,
            limit: int) -> list[datetime]:
    """Up to ``limit`` slots in (start, end], ascending."""
    slots: list[datetime] = []
    if limit <= 0 or end <= start:
        return slots
    for slot in timetable.after(start):
        if slot > end or len(slots) >= limit:
            break
        slots.append(slot)
    return slots


def count(timetable: Timetable, start: datetime, end: datetime) -> int:
    """How many slots lie in (start, end] (at most MAX_COUNT for cron)."""
    if isinstance(timetable, Every):
        return timetable.count_between(start, end)
    return len(between(timetable, start, end, MAX_COUNT))


def zone_of(name: str) -> ZoneInfo:
    """The time zone ``name``, or a TimetableError that says what is wrong."""
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError, TypeError):
        raise TimetableError(
            f"Time zone {name!r} is unknown: use an IANA name such as 'Europe/Berlin' or "
            "'UTC'.") from None


def _epoch_ms(moment: datetime) -> int:
    delta = moment - datetime(1970, 1, 1, tzinfo=UTC)
    return (delta.days * 86_400 + delta.seconds) * 1000 + delta.microseconds // 1000


def _from_epoch_ms(ms: int) -> datetime:
    return datetime(1970, 1, 1, tzinfo=UTC) + timedelta(milliseconds=ms)


def _human_ms(ms: int) -> str:
    for unit, size in (("d", 86_400_000), ("h", 3_600_000), ("min", 60_000), ("s", 1000)):
        if ms % size == 0:
            return f"{ms // size} {unit}"
    return f"{ms} ms"
