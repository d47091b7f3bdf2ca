"""``manage.py prunejobs``: delete the history of jobs that finished long ago."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.core.management.base import CommandError, CommandParser
from django.db import DatabaseError

from reliable_jobs import retention
from reliable_jobs.backend import ReliableJobsBackend
from reliable_jobs.broker import REDIS_ERRORS
from reliable_jobs.management.base import ReliableJobsCommand, number, whole_number

#: Said of a bad --older-than, and of a bad RELIABLE_JOBS_PRUNE_DAYS.
BAD_DAYS = ("--older-than (or RELIABLE_JOBS_PRUNE_DAYS) must be a number of days >= 0, "
            "not {value!r}.")


class Command(ReliableJobsCommand):
    help = (
        "Delete jobs that finished (succeeded, dead or cancelled) more than --older-than "
        "days ago, with their attempts, in batches; a dead job's Redis hash goes too. "
        "Unfinished jobs are never touched, nor a finished job Redis still holds waiting or "
        "running (a cancel its worker has not acted on yet), nor one that finished less than "
        "RECONCILE_GRACE_MS + LEASE_MS ago, whatever --older-than says. Run it daily from "
        "cron; safe to run while workers run."
    )
    backend_help = "TASKS alias whose jobs are pruned (default: %(default)r)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--older-than", type=number(0, BAD_DAYS), default=None, metavar="DAYS",
            help="Days since a job finished (and was last changed) before it is deleted "
                 "(default: settings.RELIABLE_JOBS_PRUNE_DAYS, or "
                 f"{retention.DEFAULT_PRUNE_DAYS}).")
        parser.add_argument("--batch-size",
                            type=whole_number(1, "--batch-size must be a whole number >= 1."),
                            default=retention.DEFAULT_BATCH,
                            help="Jobs deleted per transaction (default: %(default)r).")

    def handle(self, *args: Any, **options: Any) -> None:
        # The setting is checked before the backend, as --older-than is by its type.
        days = options["older_than"]
        if days is None:
            days = options["older_than"] = retention.prune_days()
        if isinstance(days, bool) or not isinstance(days, int | float) or days < 0:
            raise CommandError(BAD_DAYS.format(value=days))
        super().handle(*args, **options)

    def handle_backend(self, backend: ReliableJobsBackend, options: dict[str, Any]) -> None:
        days = options["older_than"]
        try:
            report = retention.prune(backend, older_than=timedelta(days=days),
                                     batch=options["batch_size"])
        except (*REDIS_ERRORS, DatabaseError) as exc:  # type: ignore[misc]  # mypy cannot unpack a tuple[type, ...]
            raise CommandError(f"Pruning stopped ({exc}); batches already committed stay "
                               "deleted, and running it again goes on.") from exc
        if options["verbosity"] >= 1:
            states = ", ".join(f"{n} {state}" for state, n in report.by_state.items() if n)
            self.stdout.write(
                f"Pruned {report.jobs} finished job{'s' if report.jobs != 1 else ''} older "
                f"than {days:g} days{f' ({states})' if states else ''} and {report.attempts} "
                f"attempt{'s' if report.attempts != 1 else ''}, in {report.batches} "
                f"batch{'es' if report.batches != 1 else ''}; {report.redis_hashes} dead "
                "job hashes freed in Redis. Unfinished jobs were not touched."
                + (f" {report.kept} finished job{'s' if report.kept != 1 else ''} kept: "
                   "Redis still holds them unfinished." if report.kept else "")
            )
