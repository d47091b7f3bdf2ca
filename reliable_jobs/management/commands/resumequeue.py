"""``manage.py resumequeue``: resume queues paused by ``pausequeue`` or the admin.

A thin wrapper over ``pausing.resume``: workers claim the queues' jobs again
at once (the resume wakes the idle ones). Exit status 1 for an unknown queue.
"""

from __future__ import annotations

from typing import Any

from django.core.management.base import CommandParser

from reliable_jobs import pausing
from reliable_jobs.backend import ReliableJobsBackend
from reliable_jobs.management.base import ReliableJobsCommand
from reliable_jobs.management.commands.pausequeue import known_queues


class Command(ReliableJobsCommand):
    help = "Resume paused queues: workers claim their jobs again at once."
    backend_help = "TASKS alias whose queues to resume (default: %(default)r)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("queues", nargs="+", metavar="QUEUE", help="Queue(s) to resume.")

    def handle_backend(self, backend: ReliableJobsBackend, options: dict[str, Any]) -> None:
        for queue in known_queues(backend, options["queues"]):
            self.stdout.write(f"Resumed queue {queue!r}." if pausing.resume(backend.parts, queue)
                              else f"Queue {queue!r} was not paused.")
