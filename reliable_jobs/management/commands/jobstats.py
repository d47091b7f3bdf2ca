"""``manage.py jobstats``: the live dashboard's numbers in the terminal."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.utils import timezone

from reliable_jobs import dashboard
from reliable_jobs.compat import DEFAULT_TASK_BACKEND_ALIAS
from reliable_jobs.management.commands.runworker import get_backend
from reliable_jobs.redaction import mask_password

#: Minutes listed one by one (newest last); the hour's totals cover the rest.
RECENT_MINUTES = 10


class Command(BaseCommand):
    help = (
        "Print, for one task backend, what the admin's live dashboard shows: per queue the "
        "jobs queued, running, scheduled and dead (live from Redis, every shard of a sharded "
        "queue summed), the workers alive, "
        "attempts succeeded and failed per minute over the last hour, and how many jobs "
        "Redis and the database disagree on. Exits with status 1 when a server did not "
        "answer, so it can serve as a health check."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--backend", default=DEFAULT_TASK_BACKEND_ALIAS,
                            help="TASKS alias to report on (default: %(default)r).")

    def handle(self, *args: Any, **options: Any) -> None:
        backend = get_backend(options["backend"])
        if backend.config.problems:
            raise CommandError(" ".join(message for _, message in backend.config.problems))
        snap = dashboard.snapshot(backend)
        out = self.stdout.write
        out(f"Backend {backend.alias!r}: Redis {mask_password(backend.config.REDIS_URL)} "
            f"(prefix {backend.config.PREFIX!r}), database {backend.config.DATABASE!r}, "
            f"at {timezone.now():%Y-%m-%d %H:%M:%S} UTC.")
        self._queues(snap)
        self._workers(snap)
        self._throughput(snap)
        self._drift(snap)
        if snap.problems:
            for problem in snap.problems:
                self.stderr.write(problem)
            raise CommandError("Some numbers are missing: a server did not answer.",
                               returncode=1)

    def _queues(self, snap: dashboard.Snapshot) -> None:
        if not snap.queues:
            return
        width = max(len("queue"), *(len(q.name) for q in snap.queues))
        self.stdout.write("")
        self.stdout.write(f"{'queue':<{width}}  {'queued':>9}  {'running':>9}  "
                          f"{'scheduled':>9}  {'dead':>9}")
        lines = snap.queues + ([snap.totals] if len(snap.queues) > 1 else [])
        for q in lines:
            self.stdout.write(f"{q.name:<{width}}  {q.queued:>9}  {q.running:>9}  "
                              f"{q.scheduled:>9}  {q.dead:>9}")

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
