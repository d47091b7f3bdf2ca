"""Time limits on the worker's own database sessions.

A worker that freezes (SIGSTOP, a paused VM, a hung process) inside its
mirror transaction holds row locks. Without limits the other workers' writes
about those rows (the sweep's record, the re-run's outcome) wait for them,
and those workers stop finishing jobs until the frozen one resumes. Leases
exist so that one stuck worker cannot hold the others hostage; these limits
carry that promise into PostgreSQL:

- ``idle_in_transaction_session_timeout`` (half a lease): the server ends a
  session that sits inside a transaction, so a frozen worker's locks go.
- ``lock_timeout`` (a quarter of a lease): a write that would wait for a
  lock fails instead; the finisher retries it (its outcome is kept), and
  the sweep hands its records to the finisher.
- ``statement_timeout`` (a lease, at least 5 s): no statement runs forever.

They apply to the sessions of the worker's own threads only (finisher,
maintenance, main thread), never to the threads that run task code, whose
queries are the project's business. New connections also get a connect
timeout and TCP keepalives unless the settings already choose them.
"""

from __future__ import annotations

import threading
from typing import Any

from django.db import (
    DatabaseError,
    InterfaceError,
    OperationalError,
    close_old_connections,
    connections,
)
from django.db.backends.signals import connection_created

#: Executor threads (task code) are named with this prefix.
EXECUTOR_THREAD_PREFIX = "rj-exec"

#: libpq options for every new connection of the mirror's alias, unless set.
CONNECT_OPTIONS = {"connect_timeout": 5, "keepalives": 1, "keepalives_idle": 5,
                   "keepalives_interval": 2, "keepalives_count": 3}


def session_limits(lease_ms: int) -> dict[str, int]:
    """The limits, in milliseconds, for a worker whose leases last ``lease_ms``."""
    return {
        "idle_in_transaction_session_timeout": max(1_000, lease_ms // 2),
        "lock_timeout": max(200, lease_ms // 4),
        "statement_timeout": max(5_000, lease_ms),
    }


def guard_mirror_sessions(database: str, lease_ms: int) -> None:
    """Apply the limits above to the worker's sessions on ``database`` from now on."""
    if connections[database].vendor != "postgresql":
        return
    options = connections[database].settings_dict.setdefault("OPTIONS", {})
    for name, value in CONNECT_OPTIONS.items():
        options.setdefault(name, value)
    limits = session_limits(lease_ms)
    statements = [f"SET {name} = {int(value)}" for name, value in limits.items()]

    def limit_session(sender: Any, connection: Any, **kwargs: Any) -> None:
        if connection.alias != database:
            return
        if threading.current_thread().name.startswith(EXECUTOR_THREAD_PREFIX):
            return
        with connection.cursor() as cursor:
            for statement in statements:
                cursor.execute(statement)

    connection_created.connect(limit_session, weak=False,
                               dispatch_uid=f"reliable_jobs.worker.limits.{database}")


#: SQLSTATEs that say "this session or transaction was cut short, try again":
#: serialization failure, deadlock, lock not available, statement or lock
#: timeout, idle-in-transaction timeout, administrator or crash shutdown.
TRANSIENT_SQLSTATES = frozenset({"40001", "40P01", "55P03", "57014", "25P03",
                                 "57P01", "57P02", "57P03"})


def is_transient(exc: BaseException) -> bool:
    """Whether a database error is worth retrying (the connection or the moment, not the SQL).

    A lost or refused connection surfaces as OperationalError or
    InterfaceError; the server ending a session (the limits above, a
    restart) may surface as InternalError, so the SQLSTATE decides.
    """
    if isinstance(exc, OperationalError | InterfaceError):
        return True
    cause = exc.__cause__
    return isinstance(exc, DatabaseError) and getattr(cause, "sqlstate", None) in \
        TRANSIENT_SQLSTATES


#: Per thread: whether Django opened a database connection in it (any alias).
_opened = threading.local()


def _note_opened(sender: Any, connection: Any, **kwargs: Any) -> None:
    _opened.any = True


connection_created.connect(_note_opened, weak=False,
                           dispatch_uid="reliable_jobs.worker.database.opened")


def close_old_connections_if_opened() -> None:
    """``close_old_connections()``, in a thread where Django ever opened a connection.

    It only closes connections that are open (broken, or past
    ``CONN_MAX_AGE``), so a thread that never opened one has nothing to
    close; the look-up of every alias it makes per call (asgiref ``Local``
    reads) cost a no-op job about 4% of its worker CPU. Once a task opened a
    connection, every later job ends with the full check, as before.
    """
    if getattr(_opened, "any", False):
        close_old_connections()
