"""The worker's speed cuts against real servers: wake markers, per-job connection closing.

The pure rules (queue skipping, start-mark groups, payload decode) are in
tests/fast/test_worker_speed_rules.py.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import redis

from reliable_jobs.compat import task_backends
from reliable_jobs.keys import QueueKeys


@pytest.mark.parametrize("lmpop", [True, False])
def test_woken_takes_the_markers_of_the_queues_that_have_one(
    lmpop: bool, rj_settings: Any, redis_client: redis.Redis
) -> None:
    # Given: three queues, a marker waiting on two of them (as enqueue leaves it)
    rj_settings(queues=["default", "q1", "q2"])
    broker = task_backends["default"].broker
    broker._no_lmpop = not lmpop  # the pipeline of LPOPs Redis < 7 gets
    for queue in ("default", "q2"):
        redis_client.rpush(QueueKeys("rj", queue).wake, "1")

    # When: a busy worker asks without blocking, twice
    first = broker.woken(["default", "q1", "q2"])
    second = broker.woken(["default", "q1", "q2"])

    # Then: it names those two once, and took their markers
    assert sorted(first) == ["default", "q2"]
    assert second == []
    assert not redis_client.exists(*(QueueKeys("rj", q).wake for q in ("default", "q1", "q2")))


@pytest.mark.django_db(transaction=True)
def test_a_thread_that_opened_a_connection_still_has_it_closed_after_each_job() -> None:
    # Given: an executor-like thread whose task opened a database connection
    # (CONN_MAX_AGE 0: close it when the job ends, as Django's request cycle does)
    from django.db import connection

    from reliable_jobs.worker.database import close_old_connections_if_opened

    seen: dict[str, Any] = {}

    def job() -> None:
        max_age = connection.settings_dict["CONN_MAX_AGE"]
        connection.settings_dict["CONN_MAX_AGE"] = 0
        try:
            connection.ensure_connection()
            seen["open_during_job"] = connection.connection is not None
            # When: the job ends
            close_old_connections_if_opened()
            seen["open_after_job"] = connection.connection is not None
        finally:
            connection.settings_dict["CONN_MAX_AGE"] = max_age
            connection.close()

    thread = threading.Thread(target=job)
    thread.start()
    thread.join(timeout=30)

    # Then: the connection was open during the job and closed after it
    assert seen == {"open_during_job": True, "open_after_job": False}
