"""reliable_jobs' side of the comparison: the testproject's registered no-op task.

Runs with the testproject settings (``REDIS_URL`` and ``DATABASE_URL`` set by
compare.py), so enqueue goes through the real backend with the mirror on:
one bulk insert into PostgreSQL, then one script call per 1,000 jobs.
"""

from __future__ import annotations

import os

import redis

from reliable_jobs.keys import QueueKeys

#: The testproject's queue and key prefix (its defaults).
QUEUE = "default"
PREFIX = os.environ.get("RJ_PREFIX", "rj")


def _setup() -> None:
    """Start Django late: ``pending`` runs in compare.py, which never sets Django up."""
    import django

    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "testproject.settings")
    django.setup()


def reset() -> None:
    """Empty our tables in the bench database, so every run mirrors into the same state."""
    _setup()
    from django.apps import apps
    from django.db import connection

    tables = [model._meta.db_table for model in apps.get_app_config("reliable_jobs").get_models()]
    with connection.cursor() as cursor:
        cursor.execute("TRUNCATE " + ", ".join(connection.ops.quote_name(t) for t in tables))


def enqueue(count: int) -> None:
    """Enqueue ``count`` no-op jobs with ``ReliableJobsBackend.enqueue_many`` (mirror on)."""
    _setup()
    from django.tasks import task_backends

    from reliable_jobs.backend import ReliableJobsBackend
    from testproject.demo.tasks import noop

    backend = task_backends[noop.backend]
    if not isinstance(backend, ReliableJobsBackend):
        raise SystemExit(f"TASKS[{noop.backend!r}] is not a ReliableJobsBackend.")
    backend.enqueue_many(noop, (((), {}) for _ in range(count)))


def check(count: int) -> str | None:
    """Say what is wrong if the mirror does not show ``count`` succeeded jobs."""
    _setup()
    from reliable_jobs.models import Job, JobState

    succeeded = Job.objects.filter(state=JobState.SUCCEEDED).count()
    return None if succeeded == count else f"{succeeded} of {count} jobs succeeded in the mirror"


def pending(client: redis.Redis) -> int:
    """Jobs queued plus those claimed and not yet acked."""
    keys = QueueKeys(PREFIX, QUEUE)
    with client.pipeline(transaction=False) as pipe:
        pipe.llen(keys.queued)
        pipe.llen(keys.processing)
        queued, claimed = pipe.execute()
    return int(queued) + int(claimed)
