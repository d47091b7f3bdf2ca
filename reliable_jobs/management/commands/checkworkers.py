"""``manage.py checkworkers``: exit non-zero when the queues are not being served.

For a cron alert, a systemd ``ExecCondition``/timer, or an orchestrator's
probe of the whole deployment (a worker's own liveness is its
``--heartbeat-file``). Exit status: 0 healthy, 1 a queue has too few live
workers or waited too long, 3 the database or Redis does not answer. The
reason is one line on stderr.
"""

from __future__ import annotations

from typing import Any

from django.core.management.base import CommandError, CommandParser

from reliable_jobs import health
from reliable_jobs.backend import ReliableJobsBackend
from reliable_jobs.management.base import ReliableJobsCommand, number, queue_list, whole_number

#: Exit status when a queue is not served well enough.
QUEUE_PROBLEM = 1
#: Exit status when the database or Redis does not answer.
UNREACHABLE = 3


class Command(ReliableJobsCommand):
    help = (
        "Check that every queue of a task backend is served: exit 1 when a queue has fewer "
        "live workers (heartbeats in Redis) than --min-workers or its oldest job waited "
        "longer than --max-latency, 3 when the database or Redis does not answer, else 0. "
        "The reason is printed on one line."
    )
    backend_help = "TASKS alias to check (default: %(default)r)."
    #: A probe asks about the servers, not the settings: no system checks (they
    #: would add their own lines, and a round trip to Redis, to every run).
    requires_system_checks: list[str] = []

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--queue", "-q", action="append", dest="queues", metavar="NAME",
                            help="Queue to check; repeat or separate with commas "
                                 "(default: every queue of the backend).")
        parser.add_argument("--max-latency",
                            type=number(0, "--max-latency must be at least 0 seconds."),
                            default=None, metavar="SECONDS",
                            help="Fail when a queue's oldest ready job (or oldest due "
                                 "scheduled job) waited longer (default: no limit).")
        parser.add_argument("--min-workers",
                            type=whole_number(0, "--min-workers must be at least 0."),
                            default=1, metavar="N",
                            help="Fail when a queue has fewer live workers "
                                 "(default: %(default)r).")

    def handle_backend(self, backend: ReliableJobsBackend, options: dict[str, Any]) -> None:
        queues = queue_list(options["queues"]) or sorted(backend.queues)
        unknown = sorted(set(queues) - backend.queues)
        if unknown:
            raise CommandError(f"Queue(s) {', '.join(unknown)} are not in "
                               f"TASKS[{backend.alias!r}]['QUEUES'].")
        report = health.check(backend, queues=queues, max_latency_s=options["max_latency"],
                              min_workers=options["min_workers"])
        if report.problems:
            raise CommandError(" ".join(report.problems),
                               returncode=UNREACHABLE if report.unreachable else QUEUE_PROBLEM)
        served = ", ".join(f"{q} ({len(report.workers[q])} worker(s), oldest "
                           f"{report.ages_s.get(q, 0.0):.1f} s)" for q in queues)
        self.stdout.write(f"OK: {served}.")
