"""django-tasks-redis' side of the comparison: Redis streams, its ``run_redis_tasks``."""

from __future__ import annotations

from typing import Any

import djtasks_noop

KIND = "redis"
#: The backend's status index for the default backend (django_tasks_redis.utils).
PREFIX = "django_tasks:default:status_index:"


def enqueue(count: int) -> None:
    djtasks_noop.enqueue(KIND, count)


def pending(client: Any) -> int:
    """Tasks ready or running, from the backend's own status index."""
    with client.pipeline(transaction=False) as pipe:
        pipe.zcard(PREFIX + "READY")
        pipe.zcard(PREFIX + "RUNNING")
        ready, running = pipe.execute()
    return int(ready) + int(running)
