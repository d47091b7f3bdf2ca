"""``manage.py jobstats``: the live dashboard's numbers in the terminal, or as JSON."""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import Any

from django.core.management.base import CommandError, CommandParser
from django.db import DatabaseError
from django.utils import timezone

from reliable_jobs import dashboard, taskstats
from reliable_jobs.backend import ReliableJobsBackend
from reliable_jobs.management.base import ReliableJobsCommand
from reliable_jobs.redaction import mask_password

#: Minutes listed one by one (newest last); the hour's totals cover the rest.
RECENT_MINUTES = 10


class Command(ReliableJobsCommand):
    help = (
        "Print, for one task backend, what the admin's live dashboard shows: per queue the "
        "jobs queued, running, scheduled and dead (live from Redis, every shard of a sharded "
        "queue summed), which queues are paused (and whether they are drained), the "
        "workers alive, "
        "attempts succeeded and failed per minute over the last hour, and how many jobs "
        "Redis and the database disagree on, and the periodic jobs' schedules. Each "
        "queue's latency (the age of its oldest ready job and of its oldest due scheduled "
        "job) is marked with '!' past OPTIONS['LATENCY_WARNING_MS']. Exits with status 1 "
        "when a server did not answer, so it can serve as a health check."
    )
    backend_help = "TASKS alias to report on (default: %(default)r)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--json", action="store_true",
                            help="Print one JSON object instead (for scripts): queues with "
                                 "their counts and latency per shard, workers, throughput, "
                                 "drift, and per-task figures over the last hour and day.")
        parser.add_argument("--tasks", choices=sorted(taskstats.WINDOWS), default=None,
                            help="Also print per-task figures over this window.")

    def handle_backend(self, backend: ReliableJobsBackend, options: dict[str, Any]) -> None:
        snap = dashboard.snapshot(backend)
        if options["json"]:
            self._json(backend, snap)
            return
        out = self.stdout.write
        out(f"Backend {backend.alias!r}: Redis {mask_password(backend.config.REDIS_URL)} "
            f"(prefix {backend.config.PREFIX!r}), database {backend.config.DATABASE!r}, "
            f"at {timezone.now():%Y-%m-%d %H:%M:%S} UTC.")
        self._queues(snap)
        self._pauses(snap)
        self._limits(snap)
        self._workers(snap)
        self._throughput(snap)
        self._drift(snap)
        schedules_problem = self._schedules(backend)
        if schedules_problem:
            snap.problems.append(schedules_problem)
        if options["tasks"]:
            self._tasks(backend, snap, options["tasks"])
        if snap.problems:
            for problem in snap.problems:
                self.stderr.write(problem)
            raise CommandError("Some numbers are missing: a server did not answer.",
                               returncode=1)

    def _pauses(self, snap: dashboard.Snapshot) -> None:
        """Each paused queue: since when, by whom, and whether it is drained."""
        paused = [q.pause for q in snap.queues if q.pause is not None]
        if not paused:
            return
        self.stdout.write("")
        self.stdout.write("Paused queues (no job of them starts; resume with resumequeue):")
        for state in paused:
            drain = ("drained, nothing runs" if state.drained
                     else f"draining, {state.running} running")
            lost = (f"; Redis lost the flag of {state.shards - state.flagged} of "
                    f"{state.shards} shard(s), the next sweep puts it back"
                    if state.flagged < state.shards else "")
            since = f"{state.since:%Y-%m-%d %H:%M:%S}" if state.since else "?"
            self.stdout.write(f"  {state.queue}  since {since} UTC by {state.by or '?'}  "
                              f"{drain}{lost}")

    def _limits(self, snap: dashboard.Snapshot) -> None:
        """Each limit: running / cap or claims in the last window / rate, and jobs held back."""
        if not snap.limits:
            return
        self.stdout.write("")
        self.stdout.write("Limits (enforced by the claim across every worker):")
        for line in snap.limits:
            use = (f"running {line.running}/{line.limit}" if line.running is not None
                   else f"last window {line.recent}/{line.limit}")
            self.stdout.write(f"  {line.queue}  {line.scope} {line.name}  {line.kind}  {use}  "
                              f"held back {line.held}")

    def _queues(self, snap: dashboard.Snapshot) -> None:
        if not snap.queues:
            return
        # A sharded queue's shards follow it, indented.
        lines = [(name, line) for q in snap.queues
                 for name, line in ((q.name, q), *((f"  shard {s.shard}", s) for s in q.shards))]
        lines += [("all", snap.totals)] if len(snap.queues) > 1 else []
        width = max(len("queue"), *(len(name) for name, _ in lines))
        self.stdout.write("")
        self.stdout.write(f"{'queue':<{width}}  {'queued':>9}  {'running':>9}  "
                          f"{'scheduled':>9}  {'dead':>9}  {'oldest ready':>14}  "
                          f"{'oldest due':>14}")
        for name, q in lines:
            ready = q.oldest_ready + (" !" if q.ready_late else "")
            due = q.oldest_due + (" !" if q.due_late else "")
            self.stdout.write(f"{name:<{width}}  {q.queued:>9}  {q.running:>9}  "
                              f"{q.scheduled:>9}  {q.dead:>9}  {ready:>14}  {due:>14}")
        for q in snap.late_queues:
            self.stdout.write(f"Latency warning: queue {q.name!r} has a job waiting for longer "
                              f"than OPTIONS['LATENCY_WARNING_MS'] ({snap.latency_warning_ms} "
                              f"ms): oldest ready {q.oldest_ready}, oldest due {q.oldest_due}.")

    def _workers(self, snap: dashboard.Snapshot) -> None:
        now = timezone.now()
        self.stdout.write("")
        self.stdout.write(f"Workers alive: {len(snap.workers)}")
        for w in snap.workers:
            since = f"since {w.since:%Y-%m-%d %H:%M:%S}" if w.since else "since ?"
            beat = (now - w.last_beat).total_seconds()
            self.stdout.write(f"  {w.id}  host {w.host}  pid {w.pid}  queues "
                              f"{','.join(w.queues)}  jobs in hand {w.jobs}  {since}  "
                              f"last heartbeat {max(beat, 0):.0f} s ago")

    def _throughput(self, snap: dashboard.Snapshot) -> None:
        if not snap.minutes:
            return
        self.stdout.write("")
        self.stdout.write(f"Last hour: {snap.succeeded_last_hour} attempts succeeded, "
                          f"{snap.failed_last_hour} failed. Per minute (UTC):")
        for m in snap.minutes[-RECENT_MINUTES:]:
            self.stdout.write(f"  {m.at:%H:%M}  {m.succeeded:>7} succeeded  {m.failed:>7} failed")

    def _schedules(self, backend: ReliableJobsBackend) -> str:
        """Periodic jobs: when, next slot, last slot and its job; a problem sentence or ""."""
        from reliable_jobs.models import Schedule
        from reliable_jobs.periodic.scheduler import next_slot, timetable_of

        try:
            rows = list(Schedule.objects.using(backend.config.DATABASE)
                        .filter(backend=backend.alias).order_by("name"))
        except DatabaseError as exc:
            return f"Schedules: the database did not answer ({exc})."
        if not rows:
            return ""
        now = timezone.now()
        self.stdout.write("")
        self.stdout.write(f"Schedules: {len(rows)}")
        for row in rows:
            status = ("enabled" if row.enabled else "paused") if row.in_code else "not in code"
            upcoming = next_slot(row, now) if row.enabled and row.in_code else None
            last = (f"{row.last_slot_at:%Y-%m-%d %H:%M:%S} job {row.last_job_id}"
                    if row.last_slot_at else "none yet")
            self.stdout.write(
                f"  {row.name}  {timetable_of(row) or row.expression}  {row.task_path}  "
                f"{status}  catch-up {row.catch_up}  next "
                f"{f'{upcoming:%Y-%m-%d %H:%M:%S}' if upcoming else '-'}  last {last}")
        return ""

    def _drift(self, snap: dashboard.Snapshot) -> None:
        if snap.drift is None:
            return
        d = snap.drift
        self.stdout.write("")
        scope = "" if d.complete else " (the oldest-unchanged only)"
        self.stdout.write(f"Drift: {d.count} of {d.checked} unfinished jobs checked{scope} "
                          f"disagree with Redis: {len(d.missing)} missing from Redis, "
                          f"{len(d.dead_in_redis)} dead in Redis only.")
        if d.count:
            self.stdout.write("  The recovery sweep (recoverjobs, and every worker) repairs "
                              "them; the admin lists them under the Redis drift filter.")

    def _tasks(self, backend: ReliableJobsBackend, snap: dashboard.Snapshot,
               window: str) -> None:
        try:
            lines = task_figures(backend, window)
        except DatabaseError as exc:
            snap.problems.append(f"The database did not answer ({exc}): per-task figures "
                                 "are unknown.")
            return
        self.stdout.write("")
        self.stdout.write(f"Per task over the last {window} (times in ms: run p50/p95/p99, "
                          "in queue p50/p99):")
        if not lines:
            self.stdout.write("  No attempt started or finished.")
        for t in lines:
            times = " ".join(_ms(v) for v in (t.run_p50_ms, t.run_p95_ms, t.run_p99_ms))
            waits = " ".join(_ms(v) for v in (t.queue_p50_ms, t.queue_p99_ms))
            self.stdout.write(f"  {t.task}  started {t.started}  succeeded {t.succeeded}  "
                              f"failed {t.failed}  dead {t.dead}  retried {t.retried}  "
                              f"run {times}  in queue {waits}")

    def _json(self, backend: ReliableJobsBackend, snap: dashboard.Snapshot) -> None:
        """One JSON object on stdout; problems inside it, and exit status 1 if any."""
        tasks: dict[str, Any] = {}
        for window in taskstats.WINDOWS:
            try:
                tasks[window] = [line.as_dict() for line in task_figures(backend, window)]
            except DatabaseError as exc:
                snap.problems.append(f"The database did not answer ({exc}): per-task "
                                     f"figures over the last {window} are unknown.")
                tasks[window] = None
        document = {
            "backend": backend.alias,
            "at": timezone.now().isoformat(),
            "latency_warning_ms": snap.latency_warning_ms,
            "queues": [_queue_json(q) for q in snap.queues],
            "workers": [{**asdict(w), "since": w.since.isoformat() if w.since else None,
                         "last_beat": w.last_beat.isoformat()} for w in snap.workers],
            "last_hour": {"succeeded": snap.succeeded_last_hour,
                          "failed": snap.failed_last_hour,
                          "per_minute": [{"at": m.at.isoformat(), "succeeded": m.succeeded,
                                          "failed": m.failed} for m in snap.minutes]},
            "drift": None if snap.drift is None else {
                "checked": snap.drift.checked, "missing": len(snap.drift.missing),
                "dead_in_redis": len(snap.drift.dead_in_redis),
                "complete": snap.drift.complete},
            "limits": [asdict(line) for line in snap.limits],
            "tasks": tasks,
            "problems": snap.problems,
        }
        self.stdout.write(json.dumps(document, indent=2))
        if snap.problems:
            raise CommandError("Some numbers are missing: a server did not answer.",
                               returncode=1)


def task_figures(backend: ReliableJobsBackend, window: str) -> list[taskstats.TaskLine]:
    return taskstats.task_stats(using=backend.config.DATABASE, backend=backend.alias,
                                window=taskstats.WINDOWS[window])


def _queue_json(q: dashboard.QueueLine) -> dict[str, Any]:
    """A queue's counts and latency; a sharded queue lists its shards the same way."""
    found: dict[str, Any] = {
        "name": q.name, "shard": q.shard, "queued": q.queued, "running": q.running,
        "scheduled": q.scheduled, "dead": q.dead, "oldest_ready_ms": q.oldest_ready_ms,
        "oldest_due_ms": q.oldest_due_ms, "late": q.late,
        "paused": None if q.pause is None else {
            "since": q.pause.since.isoformat() if q.pause.since else None, "by": q.pause.by,
            "running": q.pause.running, "drained": q.pause.drained,
            "shards_flagged": q.pause.flagged, "shards": q.pause.shards},
    }
    if q.shards:
        found["shards"] = [_queue_json(shard) for shard in q.shards]
    return found


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"
