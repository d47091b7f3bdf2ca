"""``manage.py recoverjobs``: the recovery sweep (see reliable_jobs.sweep)."""

from __future__ import annotations

import signal
import threading
import time
from typing import Any

from django.core.management.base import CommandError, CommandParser
from django.db import DatabaseError

from reliable_jobs.backend import ReliableJobsBackend
from reliable_jobs.broker import REDIS_ERRORS
from reliable_jobs.management.base import ReliableJobsCommand, number
from reliable_jobs.sweep import Sweep, SweepReport


class Command(ReliableJobsCommand):
    help = (
        "Recover jobs whose worker died (expired leases), promote due scheduled jobs, and "
        "push again every unfinished job Redis lost (reconcile with the database). Run one "
        "pass from cron every minute, or keep it running with --interval; workers also "
        "recover on their own, so this is the safety net, and the way to rebuild Redis. "
        "Each pass prints how many jobs it: requeued (lease expired with attempts left, an "
        "attempt that never started, or an orphan's first lease ran out); dead (lease "
        "expired with no attempt left); orphans (ids found claimed but never leased, given "
        "a first lease); garbage (ids with no or a damaged job hash, moved to dead); "
        "promoted (scheduled jobs now due); settled (expired attempts whose outcome the "
        "database already had, finished as it says and not run again); cancelled (expired "
        "attempts of jobs cancelled while they ran, finished as cancelled, not run again); "
        "checked (unfinished "
        "rows past RECONCILE_GRACE_MS that reconcile compared with Redis); pushed (of those, "
        "jobs Redis had lost, rebuilt and pushed again, counting only the pushes Redis took); "
        "buried (of those, deaths Redis recorded that the database lacked); recancelled "
        "(jobs cancelled in the last hour that Redis held waiting or running again, a cancel "
        "lost in a failover: cancelled again); purged (dead jobs in Redis whose row does not "
        "exist, forgotten once RECONCILE_GRACE_MS has passed); repaused (shards of paused "
        "queues whose pause flag Redis had lost, paused again from the database)."
    )
    backend_help = "TASKS alias to sweep (default: %(default)r)."
    logging_mode = "verbosity"

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--interval",
                            type=number(0, "--interval must be a positive number of seconds.",
                                        above=True),
                            default=None,
                            help="Seconds between passes; loop until interrupted "
                                 "(default: one pass).")

    def handle_backend(self, backend: ReliableJobsBackend, options: dict[str, Any]) -> None:
        interval = options["interval"]
        sweep = Sweep(backend.parts)

        def report_pass(report: SweepReport, took_ms: float) -> None:
            if options["verbosity"] >= 1:
                queues = ", ".join(sweep.queues)
                self.stdout.write(f"Sweep of {queues}: {report} ({took_ms:.0f} ms).")

        if interval is None:
            started = time.monotonic()
            try:
                report = sweep.run_once()
            except (*REDIS_ERRORS, DatabaseError) as exc:  # type: ignore[misc]  # mypy cannot unpack a tuple[type, ...]
                raise CommandError(f"The sweep could not finish its pass: {exc}") from exc
            report_pass(report, (time.monotonic() - started) * 1000)
            return
        stop = threading.Event()
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, lambda *_: stop.set())
        sweep.run_every(
            interval, stop, on_pass=report_pass,
            on_failure=lambda exc: self.stderr.write(
                f"Sweep pass failed ({exc}); retrying in {interval} s."),
        )
