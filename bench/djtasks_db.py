"""django-tasks-db's side of the comparison: rows in PostgreSQL, its ``db_worker``."""

from __future__ import annotations

import os
from typing import Any

import djtasks_noop

KIND = "db"
#: Rows the worker has still to run (or is running).
PENDING_SQL = ("SELECT count(*) FROM django_tasks_database_dbtaskresult "
               "WHERE status IN ('READY', 'RUNNING')")
_connection: Any = None


def reset() -> None:
    """Empty the task table, so every run starts from the same state."""
    djtasks_noop.setup(KIND)
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("TRUNCATE django_tasks_database_dbtaskresult")


def enqueue(count: int) -> None:
    djtasks_noop.enqueue(KIND, count)


def check(count: int) -> str | None:
    djtasks_noop.setup(KIND)
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM django_tasks_database_dbtaskresult "
                       "WHERE status = 'SUCCESSFUL'")
        done = cursor.fetchone()[0]
    return None if done == count else f"{done} of {count} tasks succeeded"


def pending(client: Any) -> int:
    """Tasks not finished, read from the table (``client``, Redis, is unused)."""
    global _connection
    import psycopg

    if _connection is None:
        _connection = psycopg.connect(os.environ["BENCH_DATABASE_URL"], autocommit=True)
    return int(_connection.execute(PENDING_SQL).fetchone()[0])
