"""Reads of the broker's Redis that only the chaos run needs.

The core never asks these questions (a worker knows what it holds; the
sweep walks leases by expiry), so they live beside their one user, over the
broker's client and with key names from :mod:`reliable_jobs.keys` only.
"""

from __future__ import annotations

import json
from typing import Any

from reliable_jobs.broker import Broker
from reliable_jobs.keys import worker_key


def lease_count(broker: Broker, queue: str) -> int:
    """Leases ``queue`` holds: 0 only once every claimed job was acked or recovered."""
    return int(broker.client.zcard(broker.keys(queue).leases))


def worker_info(broker: Broker, worker_id: str) -> dict[str, Any] | None:
    """A worker's last heartbeat (queues, jobs in hand), or None once it expired."""
    raw = broker.client.get(worker_key(broker.prefix, worker_id))
    return json.loads(raw) if raw else None
