"""django-tasks-rq's side of the comparison: RQ's lists, django-rq's ``rqworker``."""

from __future__ import annotations

from typing import Any

import djtasks_noop
import rq_noop

KIND = "rq"


def enqueue(count: int) -> None:
    djtasks_noop.enqueue(KIND, count)


def pending(client: Any) -> int:
    """RQ's queue plus its intermediate queue (the same keys as plain RQ's)."""
    return rq_noop.pending(client)
