"""Faults and real worker parts for the state machine of tests/model_helpers.py.

Why a module of its own: each helper here stands between the machine and
one real part of the package (a database commit, a Redis push, a worker's
shutdown, the finisher's Redis step) and says how a fault is put into it,
so the machine itself only picks when.

- :func:`failing_commit`: the next commit on the machine's connection fails
  and PostgreSQL rolls the transaction back, as when the server ends a
  session (idle_in_transaction_session_timeout, a failover) at COMMIT;
- :class:`SlowPush`: a rebuild's push (reconcile, a staff retry or requeue)
  is slow, and other Redis events land before it;
- :func:`stop_like_a_worker`: a real :class:`~reliable_jobs.worker.Worker`
  holding what a simulated one holds runs its own ``_shutdown``, so the
  machine follows whatever the worker's shutdown does;
- :func:`finisher`: a real :class:`~reliable_jobs.worker.finisher.Finisher`
  whose Redis step the machine calls, for the same reason.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from django.db import OperationalError, connections

from reliable_jobs.broker import Broker, ClaimedJob
from reliable_jobs.worker import Worker, core
from reliable_jobs.worker.backoff import Outage
from reliable_jobs.worker.finisher import Finisher, WorkerStats
from reliable_jobs.worker.registry import InHand

if TYPE_CHECKING:
    from reliable_jobs.backend import ReliableJobsBackend


class CommitFault:
    """Whether the armed commit was reached (a write with nothing to write commits nothing)."""

    fired = False


@contextmanager
def failing_commit(database: str) -> Iterator[CommitFault]:
    """Make the next COMMIT on ``database`` fail; PostgreSQL rolls the transaction back.

    Django's ``atomic`` calls ``connection.commit()`` for the outermost
    block and, when it raises, rolls back for real: every statement of the
    transaction is undone, whatever the caller did outside the database
    (in Redis) meanwhile. One commit only; nested blocks (savepoints) are
    not commits.
    """
    connection = connections[database]
    fault = CommitFault()

    def commit() -> None:
        del connection.commit  # type: ignore[method-assign]  # once: the next one is real
        fault.fired = True
        raise OperationalError("terminating connection due to idle-in-transaction timeout "
                               "(injected at COMMIT by the model test)")

    connection.commit = commit  # type: ignore[method-assign]
    try:
        yield fault
    finally:
        connection.__dict__.pop("commit", None)


#: The broker's push methods a rebuild may call (the newer one returns one
#: verdict per job, the older a count).
PUSH_METHODS = ("enqueue", "enqueue_each")


class SlowPush:
    """Make the next push through ``broker`` slow: ``before`` runs first, then the push.

    The call still returns what Redis answered to it, so the caller (the
    sweep or a staff action) decides on its real reply. Used as a context
    manager around one reconcile or staff action.
    """

    def __init__(self, broker: Broker, before: Callable[[list[Any]], None]) -> None:
        self.broker = broker
        self.before = before
        self.done = False

    def __enter__(self) -> SlowPush:
        for name in PUSH_METHODS:
            real = getattr(self.broker, name, None)
            if real is not None:
                setattr(self.broker, name, self._slow(real))
        return self

    def __exit__(self, *exc: object) -> None:
        for name in PUSH_METHODS:
            self.broker.__dict__.pop(name, None)

    def _slow(self, real: Callable[..., Any]) -> Callable[..., Any]:
        def push(queue: str, jobs: Any, **kwargs: Any) -> Any:
            jobs = list(jobs)
            if not self.done:
                self.done = True
                self.__exit__()  # what ``before`` pushes is not slowed down
                self.before(jobs)
            return real(queue, jobs, **kwargs)

        return push


def finisher(backend: ReliableJobsBackend) -> Finisher:
    """A finisher whose thread never runs: the machine calls its Redis step itself."""
    return Finisher(broker=backend.broker, database=backend.config.DATABASE, in_hand=InHand(),
                    stats=WorkerStats(), redis_outage=Outage("Redis"),
                    db_outage=Outage("The database"), hard_stop=threading.Event(),
                    slot_freed=threading.Event())


def stop_like_a_worker(backend: ReliableJobsBackend, name: str, queue: str, *, hard: bool,
                       unstarted: list[ClaimedJob], running: list[ClaimedJob],
                       unmirrored: list[ClaimedJob], mirrored: list[ClaimedJob]) -> None:
    """Run a real worker's shutdown over what a simulated worker holds.

    A :class:`Worker` is built (none of its threads started) and given the
    same jobs, at the same stages, in its registry and job buffer:
    ``unstarted`` claims waiting in the buffer, ``running`` tasks (begun, not
    ended: their threads are still running them), ``unmirrored`` outcomes
    (the task ended and the finisher is writing them: its COMMIT is on its
    way) and ``mirrored`` ones (committed, not acked). Then ``_shutdown``
    runs as after the first signal once the grace period is over (``hard``
    False: the executor threads did not end in time, nor the finisher within
    its own grace) or after a second signal (``hard``). The executor threads
    are given as ended (their tasks are the machine's); the finisher's
    thread is alive while it has outcomes in hand. Whatever the shutdown
    hands back or leaves is the real code's choice.
    """
    worker = Worker(backend, queues=[queue], worker_id=name, scheduler=False, grace_s=0)
    in_hand = worker.in_hand
    in_hand.add([*unstarted, *running, *unmirrored, *mirrored])
    for job in [*running, *unmirrored, *mirrored]:
        in_hand.begin(job)
    for job in [*unmirrored, *mirrored]:
        in_hand.done(job)
    # The finisher notes the outcomes it begins to write, where it does so.
    writing = getattr(in_hand, "writing", None)
    if writing is not None:
        writing(unmirrored)
    in_hand.mirrored(mirrored)
    worker._buffer.put(unstarted)
    if hard:
        worker._hard_stop.set()
    worker.stop()
    busy = threading.Event()
    finisher_thread = threading.Thread(target=busy.wait, name="model-finisher", daemon=True)
    if unmirrored or (hard and mirrored):
        finisher_thread.start()
    # Its grace after the executors' is over too (the shutdown would wait it out).
    finisher_grace_s = core.FINISHER_GRACE_S
    core.FINISHER_GRACE_S = 0.0
    try:
        worker._shutdown([], finisher_thread)
    finally:
        core.FINISHER_GRACE_S = finisher_grace_s
        busy.set()
        if finisher_thread.is_alive():
            finisher_thread.join(timeout=5)
