"""``manage.py pausequeue``: pause queues at runtime (``--drain``: and wait until nothing runs).

A thin wrapper over ``pausing.pause`` / ``pausing.drain``: every worker stops
claiming the queue at its next claim, without a restart or a signal. Undo
with ``manage.py resumequeue``. Exit status: 0 paused (and drained, with
``--drain``), 1 an unknown queue or, with ``--drain``, jobs still running
when ``--timeout`` ran out (the queues stay paused).
"""

from __future__ import annotations

import time
from typing import Any

from django.core.management.base import CommandError, CommandParser

from reliable_jobs import pausing
from reliable_jobs.backend import ReliableJobsBackend
from reliable_jobs.management.base import ReliableJobsCommand, number


def known_queues(backend: ReliableJobsBackend, queues: list[str]) -> list[str]:
    """``queues`` in the order given, or a CommandError naming the unknown ones."""
    unknown = [q for q in queues if q not in backend.queues]
    if unknown:
        raise CommandError(
            f"Unknown queue(s) {', '.join(map(repr, unknown))}: TASKS[{backend.alias!r}] "
            f"serves {', '.join(sorted(backend.queues))}.")
    return list(dict.fromkeys(queues))


class Command(ReliableJobsCommand):
    help = (
        "Pause queues: from the next claim of every worker, none of their jobs is claimed, "
        "and no job already claimed but not yet started starts (it is handed back). Jobs "
        "already running finish. The pause is kept in the database and outlives a Redis "
        "restart. With --drain, also wait until none of their jobs runs. Undo with "
        "resumequeue."
    )
    backend_help = "TASKS alias whose queues to pause (default: %(default)r)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("queues", nargs="+", metavar="QUEUE", help="Queue(s) to pause.")
        parser.add_argument("--drain", action="store_true",
                            help="After pausing, wait until none of the queues' jobs runs "
                                 "(exit 1 if some still run after --timeout).")
        parser.add_argument("--timeout", type=number(0, "--timeout must be at least 0 seconds."),
                            default=300.0, metavar="SECONDS",
                            help="How long --drain waits, at most (default: %(default)r).")

    def handle_backend(self, backend: ReliableJobsBackend, options: dict[str, Any]) -> None:
        queues = known_queues(backend, options["queues"])
        for queue in queues:
            was_running = pausing.pause(backend.parts, queue, by="manage.py pausequeue")
            self.stdout.write(f"Paused queue {queue!r}." if was_running
                              else f"Queue {queue!r} was already paused.")
        if not options["drain"]:
            return
        deadline = time.monotonic() + options["timeout"]
        still: list[str] = []
        for queue in queues:
            state = pausing.drain(backend.parts, queue, by="manage.py pausequeue",
                                  timeout_s=max(0.0, deadline - time.monotonic()))
            if state.drained:
                self.stdout.write(f"Queue {queue!r} is drained: none of its jobs runs.")
            else:
                still.append(f"{queue!r} ({state.running} running)")
        if still:
            raise CommandError(f"Timed out after {options['timeout']:g} s with jobs still "
                               f"running on {', '.join(still)}; the queues stay paused.")
