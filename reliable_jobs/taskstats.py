"""Per-task figures over a recent window, from the mirror: what each task did.

For each task path, over the last hour or day: attempts started, succeeded
and failed, jobs that died, retries, run time percentiles and time in queue
percentiles. The admin's per-task page and ``jobstats`` read them.

What each figure counts, exactly:

- **started**: attempts whose ``started_at`` is in the window (running ones too);
- **succeeded** / **failed**: attempts that finished in the window with that
  outcome (failed: failed, timed out, lease expired);
- **dead**: jobs that died in the window (their row's ``finished_at``);
- **retried**: failed attempts the job came back from, i.e. failed minus
  dead (an attempt that made its job dead was not retried);
- **run time** p50/p95/p99: ``finished_at - started_at`` of attempts that
  ran to an end of their own (succeeded, failed, timed out) in the window;
- **time in queue** p50/p99: for jobs whose first attempt started in the
  window, from when the job could run (``enqueued_at``, or ``run_after``
  when later) to that start. A job whose ``run_after`` moved past its first
  start (a retry rescheduled it) no longer says when it first became due,
  so it is left out of this sample.

Kept cheap on a million rows by reading only the window: attempts through
the ``finished_at`` index plus the small partial index of open attempts
(``rj_attempt_open``); the jobs they are joined to (for the task path)
through the (state, updated_at) index, every state at once: the mirror
rewrites a job's row in the transaction that records its attempt, so a job
whose attempt finished in the window was touched in it too (give or take
``TOUCHED_MARGIN``, for a worker's clock running ahead of the database's
and an expired attempt's late result); deaths through the same index (a
dead row's ``updated_at`` is its death or later). Without that second
range the join reads the whole job table. PostgreSQL computes the percentiles itself with
``percentile_cont`` (one statement); other databases (SQLite) fetch the
window's rows and interpolate the same way in Python, side by side below so
the two stay alike (tests run both on PostgreSQL).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import Any

from django.db import connections
from django.db.models import Count, Q
from django.utils import timezone

# RAN_OUTCOMES: attempts that ran to an end of their own. Their run time is
# the task's; a lease expiry or a release measures the worker's fate instead.
from .mirror import RAN_OUTCOMES
from .models import FAILED_OUTCOMES, Attempt, AttemptOutcome, Job, JobState

#: The windows offered, by name.
WINDOWS = {"hour": timedelta(hours=1), "day": timedelta(days=1)}
#: How much earlier than the window a job's row may have been touched and
#: still hold an attempt that finished in the window (see the docstring).
TOUCHED_MARGIN = timedelta(minutes=10)
#: Every state, so the (state, updated_at) index serves a range on updated_at.
_ALL_STATES = [state.value for state in JobState]
#: The percentiles of each sample, as fractions.
RUN_PERCENTILES = (0.5, 0.95, 0.99)
QUEUE_PERCENTILES = (0.5, 0.99)


@dataclass(frozen=True, slots=True)
class TaskLine:
    """One task's figures over a window; times in ms, None with no sample."""

    task: str
    started: int = 0
    succeeded: int = 0
    failed: int = 0
    dead: int = 0
    run_p50_ms: float | None = None
    run_p95_ms: float | None = None
    run_p99_ms: float | None = None
    queue_p50_ms: float | None = None
    queue_p99_ms: float | None = None

    @property
    def retried(self) -> int:
        return max(self.failed - self.dead, 0)

    @property
    def failure_ratio(self) -> float | None:
        """Failed attempts among those that finished, 0 to 1 (None when none finished)."""
        finished = self.succeeded + self.failed
        return self.failed / finished if finished else None

    def as_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in FIGURES}


#: Every figure of a line, in the page's column order (all sortable).
FIGURES = ("task", "started", "succeeded", "failed", "dead", "retried", "failure_ratio",
           "run_p50_ms", "run_p95_ms", "run_p99_ms", "queue_p50_ms", "queue_p99_ms")


def task_stats(*, using: str, backend: str, window: timedelta,
               now: datetime | None = None) -> list[TaskLine]:
    """Each task's figures over ``window`` up to ``now``, sorted by task path."""
    since = (now or timezone.now()) - window
    if connections[using].vendor == "postgresql":
        lines = _pg_attempt_figures(using, backend, since)
    else:
        lines = _portable_attempt_figures(using, backend, since)
    dead = dict(Job.objects.using(using)
                .filter(backend=backend, state=JobState.DEAD, updated_at__gte=since,
                        finished_at__gte=since)
                .values_list("task_path").annotate(n=Count("pk")).order_by())
    for task, n in dead.items():
        lines[task] = replace(lines.get(task) or TaskLine(task), dead=n)
    return [lines[task] for task in sorted(lines)]


# -- PostgreSQL: one statement ---------------------------------------------

def _in(values: Iterable[str]) -> str:
    return "(" + ", ".join(f"'{v}'" for v in values) + ")"


_ATTEMPT = Attempt._meta.db_table
_JOB = Job._meta.db_table
_WINDOW_ROWS = f"""
    SELECT j.task_path AS task, a.outcome, a.started_at, a.finished_at,
           j.enqueued_at, j.run_after, j.started_at AS first_start
    FROM {_ATTEMPT} a JOIN {_JOB} j ON j.id = a.job_id
    WHERE a.finished_at >= %(since)s AND j.backend = %(backend)s
      AND j.state = ANY(%(states)s) AND j.updated_at >= %(touched)s
    UNION ALL
    SELECT j.task_path, a.outcome, a.started_at, a.finished_at,
           j.enqueued_at, j.run_after, j.started_at
    FROM {_ATTEMPT} a JOIN {_JOB} j ON j.id = a.job_id
    WHERE a.outcome = '' AND a.started_at >= %(since)s AND j.backend = %(backend)s
"""
_PG_FIGURES = f"""
WITH w AS ({_WINDOW_ROWS})
SELECT task,
       count(*) FILTER (WHERE started_at >= %(since)s),
       count(*) FILTER (WHERE outcome = 'succeeded'),
       count(*) FILTER (WHERE outcome IN {_in(FAILED_OUTCOMES)}),
       percentile_cont(%(run_p)s::float8[]) WITHIN GROUP (
           ORDER BY extract(epoch FROM finished_at - started_at) * 1000)
           FILTER (WHERE outcome IN {_in(RAN_OUTCOMES)} AND started_at IS NOT NULL),
       percentile_cont(%(queue_p)s::float8[]) WITHIN GROUP (
           ORDER BY extract(epoch FROM first_start - GREATEST(enqueued_at, run_after)) * 1000)
           FILTER (WHERE started_at = first_start AND first_start >= %(since)s
                   AND (run_after IS NULL OR run_after <= first_start))
FROM w GROUP BY task
"""


def _pg_attempt_figures(using: str, backend: str, since: datetime) -> dict[str, TaskLine]:
    with connections[using].cursor() as cursor:
        cursor.execute(_PG_FIGURES, {"since": since, "backend": backend,
                                     "states": _ALL_STATES, "touched": since - TOUCHED_MARGIN,
                                     "run_p": list(RUN_PERCENTILES),
                                     "queue_p": list(QUEUE_PERCENTILES)})
        rows = cursor.fetchall()
    lines = {}
    for task, started, succeeded, failed, run, queue in rows:
        run = run or [None] * len(RUN_PERCENTILES)
        queue = queue or [None] * len(QUEUE_PERCENTILES)
        lines[task] = TaskLine(task, started, succeeded, failed, 0, *_ms(run), *_ms(queue))
    return lines


def _ms(values: Sequence[Any]) -> list[float | None]:
    return [None if v is None else round(float(v), 1) for v in values]


# -- elsewhere: the same rows, percentiles in Python -------------------------

def _portable_attempt_figures(using: str, backend: str, since: datetime
                              ) -> dict[str, TaskLine]:
    columns = ("job__task_path", "outcome", "started_at", "finished_at", "job__enqueued_at",
               "job__run_after", "job__started_at")
    rows = (Attempt.objects.using(using)
            .filter(Q(finished_at__gte=since, job__state__in=_ALL_STATES,
                      job__updated_at__gte=since - TOUCHED_MARGIN)
                    | Q(outcome="", started_at__gte=since),
                    job__backend=backend)
            .values_list(*columns).order_by())
    started: dict[str, int] = {}
    succeeded: dict[str, int] = {}
    failed: dict[str, int] = {}
    runs: dict[str, list[float]] = {}
    waits: dict[str, list[float]] = {}
    for task, outcome, start, finish, enqueued, run_after, first_start in rows:
        runs.setdefault(task, [])
        waits.setdefault(task, [])
        if start is not None and start >= since:
            started[task] = started.get(task, 0) + 1
        if outcome == AttemptOutcome.SUCCEEDED:
            succeeded[task] = succeeded.get(task, 0) + 1
        elif outcome in FAILED_OUTCOMES:
            failed[task] = failed.get(task, 0) + 1
        if outcome in RAN_OUTCOMES and start is not None and finish is not None:
            runs[task].append((finish - start).total_seconds() * 1000)
        if (start is not None and start == first_start and start >= since
                and (run_after is None or run_after <= start)):
            ready = max(enqueued, run_after) if run_after is not None else enqueued
            waits[task].append((start - ready).total_seconds() * 1000)
    return {
        task: TaskLine(task, started.get(task, 0), succeeded.get(task, 0), failed.get(task, 0),
                       0, *_ms(percentiles(runs[task], RUN_PERCENTILES)),
                       *_ms(percentiles(waits[task], QUEUE_PERCENTILES)))
        for task in runs
    }


def percentiles(sample: list[float], fractions: Sequence[float]) -> list[float | None]:
    """Continuous percentiles, interpolated as PostgreSQL's ``percentile_cont`` does."""
    if not sample:
        return [None] * len(fractions)
    ordered = sorted(sample)
    top = len(ordered) - 1
    found: list[float | None] = []
    for fraction in fractions:
        position = fraction * top
        low = math.floor(position)
        high = min(low + 1, top)
        found.append(ordered[low] + (ordered[high] - ordered[low]) * (position - low))
    return found
