"""The fast layer: the pure logic, with no Redis, no PostgreSQL, no database at all.

``scripts/test --fast`` runs only this directory, in seconds, with no server
running; the full run runs it too, with everything else. What makes a test
belong here is that it cannot need a server, so each one is held to that: a
test here that asks for the database, or opens a network connection (a Redis
client, a psycopg connection through Django), fails with a sentence saying
where it belongs, even on a machine where the servers answer.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from typing import Any

import pytest

#: Fixtures that bring a server or the database with them.
SERVER_FIXTURES = frozenset({"db", "transactional_db", "django_db_setup", "live_server",
                             "redis_client", "rj_settings", "server_url", "valkey_url",
                             "processes"})

WHERE_IT_BELONGS = ("tests/fast/ holds only tests that need no server; "
                    "a test that needs Redis or the database belongs in tests/.")


@pytest.fixture(autouse=True)
def no_servers(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Refuse the database and any TCP connection for the length of the test."""
    needs = SERVER_FIXTURES.intersection(request.fixturenames)
    if request.node.get_closest_marker("django_db") or needs:
        pytest.fail(f"{request.node.nodeid} asks for {sorted(needs) or 'django_db'}: "
                    f"{WHERE_IT_BELONGS}", pytrace=False)
    plain_connect = socket.socket.connect

    def refuse(sock: socket.socket, address: Any) -> None:
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            raise AssertionError(f"connecting to {address}: {WHERE_IT_BELONGS}")
        plain_connect(sock, address)

    monkeypatch.setattr(socket.socket, "connect", refuse)
    yield
