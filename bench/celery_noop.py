"""Celery's side of the comparison: an app on the bench Redis and a no-op task.

Configured as a new user would leave it (defaults), except that results are
ignored: no result backend is set, and storing nothing is what the other
contenders are asked to do too.
"""

from __future__ import annotations

import os

import redis
from celery import Celery

#: Celery's default queue; kombu's Redis transport keeps it as a list of that name.
QUEUE = "celery"
#: kombu's hash of messages delivered to a worker and not yet acknowledged.
UNACKED = "unacked"

app = Celery("bench", broker=os.environ["BENCH_REDIS_URL"])
app.conf.update(
    task_ignore_result=True,
    # Only silences a deprecation warning; the broker is up before the worker starts.
    broker_connection_retry_on_startup=True,
)


# Celery's task decorator carries no type hints.
@app.task(name="bench.noop")  # type: ignore[untyped-decorator]
def noop() -> None:
    """Do nothing: what is left is the queue's own cost."""


def enqueue(count: int) -> None:
    """Send ``count`` messages through one producer (Celery has no bulk send)."""
    with app.producer_or_acquire() as producer:
        for _ in range(count):
            noop.apply_async(producer=producer)


def pending(client: redis.Redis) -> int:
    """Messages queued plus those a worker holds unacknowledged (prefetched)."""
    with client.pipeline(transaction=False) as pipe:
        pipe.llen(QUEUE)
        pipe.hlen(UNACKED)
        queued, unacked = pipe.execute()
    return int(queued) + int(unacked)
