"""The worker: claim jobs from Redis, run them in threads, mirror, then ack.

One module per thread role: :mod:`.core` (the process, the claim loop,
shutdown), :mod:`.leases` (lease renewal and heartbeats, Redis only),
:mod:`.executor` (running tasks), :mod:`.finisher` (mirror then ack),
:mod:`.maintenance` (sweep and reconcile), with :mod:`.registry` (the jobs
in hand), :mod:`.backoff` and :mod:`.database` (limits on the worker's
database sessions).
"""

from __future__ import annotations

from .core import Worker, default_worker_id
from .shared import WorkerStats

__all__ = ["Worker", "WorkerStats", "default_worker_id"]
