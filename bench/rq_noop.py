"""RQ's side of the comparison: a no-op job function and its bulk enqueue."""

from __future__ import annotations

import os

import redis
from rq import Queue

#: RQ's default queue name.
QUEUE = "default"
#: Jobs per ``enqueue_many`` call (one Redis pipeline each), as reliable_jobs chunks.
CHUNK = 1000


def noop() -> None:
    """Do nothing: what is left is the queue's own cost."""


def enqueue(count: int) -> None:
    """Enqueue ``count`` jobs with RQ's bulk API, ``Queue.enqueue_many``."""
    queue = Queue(QUEUE, connection=redis.Redis.from_url(os.environ["BENCH_REDIS_URL"]))
    for start in range(0, count, CHUNK):
        size = min(CHUNK, count - start)
        queue.enqueue_many([Queue.prepare_data(noop) for _ in range(size)])


def pending(client: redis.Redis) -> int:
    """Jobs queued plus those a worker has moved aside (RQ's intermediate queue)."""
    queue = Queue(QUEUE, connection=client)
    with client.pipeline(transaction=False) as pipe:
        pipe.llen(queue.key)
        pipe.llen(queue.intermediate_queue_key)
        queued, moved = pipe.execute()
    return int(queued) + int(moved)
