"""Dramatiq's side of the comparison: a Redis broker and a no-op actor.

The worker is started as ``dramatiq dramatiq_noop``: importing this module
is what sets the broker, in the producer and in the worker alike.
"""

from __future__ import annotations

import os

import dramatiq
import redis
from dramatiq.brokers.redis import RedisBroker

#: Dramatiq's default queue name and Redis key namespace.
QUEUE = "default"
NAMESPACE = "dramatiq"

# Typed or not depending on whether Dramatiq is installed where mypy runs (it
# is only in bench/.venv), hence the second code on these two ignores.
broker = RedisBroker(  # type: ignore[no-untyped-call,unused-ignore]
    url=os.environ["BENCH_REDIS_URL"], namespace=NAMESPACE)
dramatiq.set_broker(broker)


@dramatiq.actor(queue_name=QUEUE)  # type: ignore[untyped-decorator,unused-ignore]
def noop() -> None:
    """Do nothing: what is left is the queue's own cost."""


def enqueue(count: int) -> None:
    """Send ``count`` messages one by one (Dramatiq has no bulk enqueue)."""
    for _ in range(count):
        noop.send()


def pending(client: redis.Redis) -> int:
    """Messages not yet acknowledged: the broker keeps each in ``<queue>.msgs`` until acked."""
    return int(client.hlen(f"{NAMESPACE}:{QUEUE}.msgs"))
