"""Pruning finished jobs from the mirror (the prunejobs command, retention.py).

The one place rows are deleted: a finished job's history goes with it.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from datetime import datetime
from typing import Any

from django.db import connections

from ..keys import shard_queue
from ..models import Attempt, Job
from .records import FINISHED_STATES


def lock_prunable(using: str, *, backend: str, state: str, unchanged_since: datetime,
                  limit: int, keep: Collection[Any] = ()) -> list[tuple[Any, str]]:
    """Lock up to ``limit`` finished ``state`` jobs unchanged since the cutoff.

    Returns (id, physical queue) pairs, none of ``keep`` (rows an earlier
    batch left alone because Redis still holds their job unfinished).

    One state per query, oldest first, so the walk is a range scan of the
    (state, updated_at) index however many rows there are. A finished row's
    ``updated_at`` is its finish (or a later staff action), never earlier.
    Rows a staff action holds are skipped (SKIP LOCKED), not waited for: the
    action may make the job unfinished again, and the next run prunes the
    rest.
    """
    if state not in FINISHED_STATES:
        raise ValueError(f"Only finished jobs are pruned, not {state!r} ones.")
    rows = (Job.objects.using(using).select_for_update(skip_locked=True)
            .filter(backend=backend, state=state, updated_at__lt=unchanged_since)
            .exclude(pk__in=list(keep))
            .order_by("updated_at")
            .values_list("pk", "queue", "shard")[:limit])
    return [(pk, shard_queue(queue, shard)) for pk, queue, shard in rows]


def delete_jobs(using: str, job_ids: Sequence[Any]) -> tuple[int, int]:
    """Delete jobs and their attempts; returns (jobs, attempts) deleted.

    Two plain DELETEs: ``QuerySet.delete()`` on jobs would first load every
    row (JSON arguments included) to collect the cascade, which doubled the
    time of a million-row prune.
    """
    attempts, _ = Attempt.objects.using(using).filter(job_id__in=job_ids).delete()
    if not job_ids:
        return 0, attempts
    connection = connections[using]
    quote, pk = connection.ops.quote_name, Job._meta.pk
    placeholders = ", ".join(["%s"] * len(job_ids))
    with connection.cursor() as cursor:
        cursor.execute(f"DELETE FROM {quote(Job._meta.db_table)} WHERE {quote(str(pk.column))} "
                       f"IN ({placeholders})",
                       [pk.get_db_prep_value(job_id, connection) for job_id in job_ids])
        return cursor.rowcount, attempts
