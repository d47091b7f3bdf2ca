"""The scheduler: turns each due slot of each schedule into one job, exactly once.

Any number of workers run it (``runworker`` does unless ``--no-scheduler``).
Per schedule and pass, in one database transaction:

1. lock the schedule's row (``SKIP LOCKED``: a row another scheduler holds is
   its business this pass) and read its cursor, the newest slot decided;
2. decide which slots in (cursor, now] to enqueue, by the downtime policy;
3. for each, insert the job's row (``backend.enqueue``: the push to Redis
   waits for the commit) and the slot's ``ScheduleSlot`` row, whose unique key
   (schedule, slot time) refuses a second job for the same slot;
4. move the cursor, and commit.

Exactly once, because the slot row and the job row commit together or not
at all: a scheduler that dies before the commit leaves neither (the next
one enqueues the slot), one that dies after it leaves both (nobody enqueues
it again, and a push lost with it is redone by reconcile from the job row),
two schedulers never both commit a slot (the lock serialises them, and the
unique key would refuse the second even without it), and Redis losing its
data touches neither row. Clocks: "now", which slots are due, is the
database's (``SELECT now()`` on PostgreSQL), the clock of the rows that
prove what happened; the wait until a schedule's next slot is measured on
this process's monotonic clock, so a step of the worker's wall clock (NTP,
a resumed virtual machine) neither delays a slot nor makes it "missed".
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from django.db import DatabaseError, IntegrityError, InterfaceError, connections, transaction
from django.utils import timezone

from ..compat import InvalidTask
from ..faults import crash_point, stop_point
from ..mirror import grace_cutoff
from ..models import Schedule, ScheduleSlot
from ..tasks import discover, lookup
from .declared import Declaration, decorated, from_options
from .timetable import MAX_COUNT, Cron, Every, Timetable, between, count

if TYPE_CHECKING:
    from ..backend import ReliableJobsBackend
    from ..compat import Task
    from ..conf import BackendOptions

logger = logging.getLogger("reliable_jobs.scheduler")

#: A slot found less than this long after its time is on time and always
#: enqueued; an older one was missed (no scheduler ran), and the schedule's
#: downtime policy decides. In milliseconds.
ON_TIME_MS = 10_000
#: Slots one schedule enqueues per pass at most (catch_up="all" after a long
#: outage goes on at the next pass), so a transaction stays short.
MAX_SLOTS_PER_PASS = 100
#: Pause between two passes, in seconds.
PASS_INTERVAL_S = 0.25
#: Longest wait, in seconds, before a schedule is looked at again (its row
#: locked, the database's clock read), however far its next slot: a wait
#: measured on this machine's monotonic clock drifts little from the
#: database's clock in that time.
MAX_WAIT_S = 60.0


@dataclass
class PassReport:
    """What one pass did, summed over schedules."""

    enqueued: int = 0
    skipped: int = 0
    #: Schedules another scheduler held locked this pass.
    busy: int = 0
    #: Slots found already enqueued by another scheduler (the unique key).
    duplicates: int = 0
    job_ids: list[str] = field(default_factory=list)

    def add(self, other: PassReport) -> None:
        self.enqueued += other.enqueued
        self.skipped += other.skipped
        self.busy += other.busy
        self.duplicates += other.duplicates
        self.job_ids += other.job_ids


@dataclass(frozen=True, slots=True)
class Plan:
    """What to do with the slots due since the cursor."""

    enqueue: list[datetime]
    #: Missed slots the policy leaves out: how many, the first and the last.
    skipped: int = 0
    first_skipped: datetime | None = None
    last_skipped: datetime | None = None

    @property
    def cursor(self) -> datetime | None:
        """The newest slot this plan decides (enqueued or skipped)."""
        newest = [s for s in (*self.enqueue[-1:], self.last_skipped) if s is not None]
        return max(newest) if newest else None


def decide(timetable: Timetable, catch_up: str, start: datetime, now: datetime) -> Plan:
    """Which slots in (start, now] to enqueue: the on-time ones, and missed ones by policy.

    ``all`` enqueues every slot in order (MAX_SLOTS_PER_PASS per pass);
    ``last`` the on-time slots, or when none is on time the newest missed
    one; ``none`` only the on-time slots. A pure function of its arguments:
    the tests give it fixed dates.
    """
    if catch_up == "all":
        return Plan(between(timetable, start, now, MAX_SLOTS_PER_PASS))
    late_edge = now - timedelta(milliseconds=ON_TIME_MS)
    on_time = between(timetable, max(start, late_edge), now, MAX_SLOTS_PER_PASS)
    newest_missed = timetable.latest(late_edge) if late_edge > start else None
    if newest_missed is None or newest_missed <= start:
        return Plan(on_time)
    missed = count(timetable, start, late_edge)
    first_missed = next(iter(timetable.after(start)))
    if catch_up == "last" and not on_time:
        if missed == 1:
            return Plan([newest_missed])
        before_newest = timetable.latest(newest_missed - timedelta(microseconds=1))
        return Plan([newest_missed], skipped=missed - 1, first_skipped=first_missed,
                    last_skipped=before_newest)
    return Plan(on_time, skipped=missed, first_skipped=first_missed, last_skipped=newest_missed)


def declarations(config: BackendOptions, alias: str) -> list[Declaration]:
    """Backend ``alias``'s schedules: its OPTIONS['SCHEDULE'] first, then ``@periodic`` ones.

    It takes the settings, not the backend (docs/design.md, "Layers"):
    the scheduler and the backend's checks ask, each with what it holds.
    """
    from_settings, _ = from_options(config.SCHEDULE, alias)
    seen: dict[str, Declaration] = {}
    for declaration in from_settings + decorated(alias):
        seen.setdefault(declaration.name, declaration)  # a clash is reported by the checks
    return list(seen.values())


def timetable_of(row: Schedule) -> Timetable | None:
    """A schedule row's timetable (None if the row holds one no longer valid)."""
    try:
        return Cron(row.expression, row.tz) if row.expression else Every(int(row.every_ms or 0))
    except ValueError:
        return None


def next_slot(row: Schedule, now: datetime) -> datetime | None:
    """The first slot after ``now`` the row would fire (for the admin and jobstats)."""
    timetable = timetable_of(row)
    if timetable is None:
        return None
    start = max(now, row.fire_after, row.cursor_at or row.fire_after)
    return next(iter(timetable.after(start)), None)


def database_now(database: str) -> datetime:
    """Now on the database's clock (PostgreSQL's ``now()``; this process's elsewhere)."""
    return grace_cutoff(database, 0)


class Scheduler:
    """One backend's scheduler: syncs declarations to rows, then fires due slots."""

    def __init__(self, backend: ReliableJobsBackend) -> None:
        self.backend = backend
        self.database = backend.config.DATABASE
        self._declared: dict[str, Declaration] = {}
        self._tasks: dict[str, Task[..., Any]] = {}
        #: When each schedule's next slot falls (on the database's clock).
        self._next_due: dict[str, datetime] = {}
        #: The same moment on this process's ``time.monotonic()`` clock (at
        #: most MAX_WAIT_S ahead), so a pass locks only rows with something
        #: due, whatever this machine's wall clock does meanwhile.
        self._wake_at: dict[str, float] = {}
        #: Schedules whose last pass failed with an error already logged.
        self._failing: set[str] = set()

    # -- start-up --------------------------------------------------------------

    def sync(self) -> list[str]:
        """Write the declarations to their rows; mark rows no longer declared. Returns names.

        A row keeps what staff and past passes wrote (enabled, cursor, last
        slot); a new row fires only slots after its creation.
        """
        discover()
        now = database_now(self.database)
        declared: dict[str, Declaration] = {}
        for declaration in declarations(self.backend.config, self.backend.alias):
            task = lookup(declaration.task_path)
            if task is None:
                logger.error("Schedule %r names %r, which is not a registered task of an "
                             "installed app: it will not fire.", declaration.name,
                             declaration.task_path)
                continue
            try:
                self._tasks[declaration.name] = (task.using(queue_name=declaration.queue)
                                                 if declaration.queue else task)
            except InvalidTask as exc:
                logger.error("Schedule %r cannot be fired (%s): it will not fire.",
                             declaration.name, exc)
                continue
            declared[declaration.name] = declaration
        rows = Schedule.objects.using(self.database)
        for name in sorted(declared):
            d = declared[name]
            values = {"backend": d.backend, "task_path": d.task_path,
                      "expression": d.expression, "every_ms": d.every_ms, "tz": d.tz,
                      "args": list(d.args), "kwargs": dict(d.kwargs), "queue": d.queue or "",
                      "catch_up": d.catch_up, "in_code": True}
            row = rows.filter(name=name).first()
            if row is None:
                try:
                    with transaction.atomic(using=self.database):
                        rows.create(name=name, fire_after=now, **values)
                    continue
                except IntegrityError:  # another scheduler created it just now
                    row = rows.get(name=name)
            if any(getattr(row, key) != value for key, value in values.items()):
                rows.filter(name=name).update(**values, updated_at=timezone.now())
        gone = rows.filter(backend=self.backend.alias, in_code=True).exclude(
            name__in=list(declared))
        for name in gone.values_list("name", flat=True):
            logger.warning("Schedule %r is no longer declared in code: it stops firing (its "
                           "history stays).", name)
        gone.update(in_code=False, updated_at=timezone.now())
        self._declared = declared
        return sorted(declared)

    # -- passes ----------------------------------------------------------------

    def run_pass(self, now: datetime | None = None) -> PassReport:
        """Fire every declared schedule that has a slot due (``now``: for tests)."""
        report = PassReport()
        for name in sorted(self._declared):
            due = self._next_due.get(name)
            if now is not None and due is not None and now < due:
                continue
            if now is None and time.monotonic() < self._wake_at.get(name, 0.0):
                continue
            try:
                report.add(self.fire(name, now))
            except (DatabaseError, InterfaceError):
                raise
            except Exception:
                # One schedule's bad task or arguments (a queue since removed,
                # a payload too large) must not stop the others.
                if name not in self._failing:
                    self._failing.add(name)
                    logger.exception("Schedule %r could not be fired; retrying every pass.",
                                     name)
            else:
                self._failing.discard(name)
        return report

    def fire(self, name: str, now: datetime | None = None) -> PassReport:
        """Enqueue what is due of one schedule, in one transaction (see the module doc)."""
        declaration = self._declared[name]
        report = PassReport()
        with transaction.atomic(using=self.database):
            row = (Schedule.objects.using(self.database).select_for_update(skip_locked=True)
                   .filter(name=name).first())
            if row is None:
                report.busy = 1
                return report
            measured = time.monotonic()
            if now is None:
                now = database_now(self.database)
            start = max(row.fire_after, row.cursor_at or row.fire_after)
            if not row.enabled:
                self._next_due.pop(name, None)
                self._wake_at.pop(name, None)
                return report
            plan = decide(declaration.timetable, declaration.catch_up, start, now)
            # The next slot after those decided: still due when a capped pass
            # left some for the next one.
            due = self._next_due[name] = next(iter(declaration.timetable.after(
                plan.cursor or start)))
            self._wake_at[name] = measured + min((due - now).total_seconds(), MAX_WAIT_S)
            if plan.cursor is None:
                return report
            stop_point("scheduler_decided")
            crash_point("scheduler_decided")
            for slot in plan.enqueue:
                job_id = self._enqueue_slot(row, slot)
                if job_id is None:
                    report.duplicates += 1
                else:
                    report.enqueued += 1
                    report.job_ids.append(job_id)
                    row.last_slot_at, row.last_job_id = slot, job_id
            if plan.skipped:
                report.skipped += plan.skipped
                logger.warning(
                    "Schedule %r: skipped %s%d missed slot(s) from %s to %s (catch_up=%r).",
                    name, "at least " if plan.skipped >= MAX_COUNT - 1 else "", plan.skipped,
                    _utc(plan.first_skipped), _utc(plan.last_skipped), declaration.catch_up)
            row.cursor_at = plan.cursor
            row.save(using=self.database,
                     update_fields=["cursor_at", "last_slot_at", "last_job_id", "updated_at"])
            if report.enqueued:
                logger.info("Schedule %r: enqueued %d slot(s), the last for %s.", name,
                            report.enqueued, _utc(row.last_slot_at))
        return report

    def _enqueue_slot(self, row: Schedule, slot: datetime) -> str | None:
        """Insert the job and its slot row together; None if the slot already has a job."""
        declaration = self._declared[row.name]
        try:
            with transaction.atomic(using=self.database):  # a savepoint: both rows or neither
                result = self.backend.enqueue(self._tasks[row.name], list(declaration.args),
                                              dict(declaration.kwargs))
                ScheduleSlot.objects.using(self.database).create(
                    schedule=row, slot_at=slot, job_id=result.id)
        except IntegrityError:
            # Only reachable if the row lock was bypassed: the key still holds.
            return None
        return str(result.id)

    # -- the thread --------------------------------------------------------------

    def run(self, stopping: threading.Event) -> None:
        """Sync, then pass every PASS_INTERVAL_S until ``stopping``; wait out database outages."""
        try:
            self._loop(stopping)
        finally:
            connections[self.database].close()  # this thread's own connection

    def _loop(self, stopping: threading.Event) -> None:
        synced = False
        down_since: float | None = None
        delay = 0.1
        while not stopping.is_set():
            try:
                if not synced:
                    names = self.sync()
                    synced = True
                    if not names:
                        return  # nothing declared in this code: nothing to fire, ever
                    logger.info("Scheduler firing %d schedule(s): %s.", len(names),
                                ", ".join(names))
                self.run_pass()
            except (DatabaseError, InterfaceError) as exc:
                if down_since is None:
                    down_since = time.monotonic()
                    logger.error("The scheduler cannot reach the database (%s); retrying "
                                 "with backoff (slots are decided when it is back).", exc)
                connections[self.database].close()
                stopping.wait(delay)
                delay = min(delay * 2, 5.0)
                continue
            if down_since is not None:
                logger.warning("The scheduler reached the database again after %.1f s.",
                               time.monotonic() - down_since)
                down_since, delay = None, 0.1
            stopping.wait(PASS_INTERVAL_S)


# -- staff ---------------------------------------------------------------------


def set_enabled(database: str, names: list[str], enabled: bool) -> int:
    """Enable or pause schedules; returns how many changed.

    Enabling sets ``fire_after`` to now, so the slots that passed while the
    schedule was paused are not fired as "missed".
    """
    rows = Schedule.objects.using(database).filter(name__in=names).exclude(enabled=enabled)
    changes: dict[str, Any] = {"enabled": enabled, "updated_at": timezone.now()}
    if enabled:
        changes["fire_after"] = database_now(database)
    return rows.update(**changes)


def run_now(backend: ReliableJobsBackend, name: str) -> str | None:
    """Enqueue one job of schedule ``name`` now, outside its slots; its id, or None.

    None when the row names a task this process cannot find. Recorded as a
    manual ``ScheduleSlot`` (outside the unique key), in the job's transaction.
    """
    discover()
    database = backend.config.DATABASE
    with transaction.atomic(using=database):
        row = Schedule.objects.using(database).select_for_update().get(name=name)
        task = lookup(row.task_path)
        if task is None:
            return None
        if row.queue:
            task = task.using(queue_name=row.queue)
        result = backend.enqueue(task, list(row.args), dict(row.kwargs))
        ScheduleSlot.objects.using(database).create(
            schedule=row, slot_at=database_now(database), job_id=result.id, manual=True)
    return str(result.id)


def _utc(moment: datetime | None) -> str:
    return f"{moment:%Y-%m-%d %H:%M:%S} UTC" if moment else "?"
