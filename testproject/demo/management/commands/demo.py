"""``manage.py demo``: enqueue a mix of jobs and watch a running worker finish them.

It only enqueues and polls; start a worker first with ``manage.py runworker``.
"""

from __future__ import annotations

import argparse
import logging
import time
from collections.abc import Callable
from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from reliable_jobs.compat import TaskResult, TaskResultStatus
from testproject.demo.tasks import add, always_fail, fail_times, noop, sleep_for

#: Pause between polling rounds, in seconds.
POLL_INTERVAL_S = 0.2

#: One job per kind of outcome, chosen in turn: job ``i`` gets ``JOB_MIX[i % len]``.
JOB_MIX: list[Callable[[int], TaskResult[Any, Any]]] = [
    lambda i: add.enqueue(i, i),
    lambda i: noop.enqueue(),
    lambda i: sleep_for.enqueue(0.2),
    lambda i: fail_times.enqueue(f"demo-{i}", 2),  # fails twice, then succeeds
    lambda i: always_fail.enqueue(f"demo job {i} fails on purpose"),
]


def _positive_int(value: str) -> int:
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"{value!r} is not a positive whole number.")
    return number


def _positive_float(value: str) -> float:
    number = float(value)
    if not number > 0:
        raise argparse.ArgumentTypeError(f"{value!r} is not a positive number of seconds.")
    return number


class Command(BaseCommand):
    help = (
        "Enqueue a mix of demo jobs (add, noop, sleep_for, fail_times, always_fail) and wait "
        "until a worker has finished them all. Start one first: `manage.py runworker`."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument(
            "--jobs",
            type=_positive_int,
            default=20,
            help="How many jobs to enqueue (default: %(default)r).",
        )
        parser.add_argument(
            "--timeout",
            type=_positive_float,
            default=60.0,
            help="Seconds to wait for all of them to finish (default: %(default)r).",
        )

    def handle(self, *args: Any, jobs: int, timeout: float, **options: Any) -> None:
        if options["verbosity"] >= 2:
            logging.getLogger("reliable_jobs").setLevel(logging.DEBUG)
        results = [JOB_MIX[i % len(JOB_MIX)](i) for i in range(jobs)]
        self.stdout.write(f"Enqueued {jobs} jobs; waiting up to {timeout:g} s for a worker.")
        finished = self._wait(results, timeout)
        self._print_table(results)
        if finished < jobs:
            raise CommandError(
                f"{jobs - finished} of {jobs} jobs did not finish within {timeout:g} s. "
                "Is a worker running (`python manage.py runworker`)?"
            )

    def _wait(self, results: list[TaskResult[Any, Any]], timeout: float) -> int:
        """Poll until every result is finished or ``timeout`` passes; return how many finished."""
        deadline = time.monotonic() + timeout
        reported = -1
        while True:
            for job in results:
                if not job.is_finished:
                    job.refresh()
            finished = sum(job.is_finished for job in results)
            if finished != reported:
                self.stdout.write(f"{finished}/{len(results)} finished")
                reported = finished
            if finished == len(results) or time.monotonic() >= deadline:
                return finished
            time.sleep(POLL_INTERVAL_S)

    def _print_table(self, results: list[TaskResult[Any, Any]]) -> None:
        rows = [("id", "task", "status", "attempts", "outcome")]
        rows += [
            (job.id, job.task.name, str(job.status), str(job.attempts), _outcome(job))
            for job in results
        ]
        widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]) - 1)]
        self.stdout.write("")
        for row in rows:
            cells = [cell.ljust(width) for cell, width in zip(row, widths, strict=False)]
            self.stdout.write("  ".join([*cells, row[-1]]).rstrip())
        counts = {status: 0 for status in TaskResultStatus}
        for job in results:
            counts[job.status] += 1
        summary = [f"{n} {status.label.lower()}" for status, n in counts.items() if n]
        self.stdout.write(", ".join(summary))


def _outcome(job: TaskResult[Any, Any]) -> str:
    """Return the return value's repr when successful, else the last error's class name."""
    if job.status == TaskResultStatus.SUCCESSFUL:
        return repr(job.return_value)
    if job.errors:
        return job.errors[-1].exception_class_path.rpartition(".")[2]
    return ""
