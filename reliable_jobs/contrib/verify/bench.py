"""The workload of ``manage.py benchjobs``: no-op jobs through the real path.

Enqueue goes through the backend (database row + Redis push), the drain
through a real :class:`~reliable_jobs.worker.Worker` in this process, with
the mirror on; what is measured is the queue's own cost per job.
"""

from __future__ import annotations

import statistics
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from django.db import connections, transaction
from django.utils import timezone

from reliable_jobs import mirror, payload, scripts
from reliable_jobs.backend import ReliableJobsBackend
from reliable_jobs.compat import Task
from reliable_jobs.models import Attempt, Job
from reliable_jobs.retention import prune, prune_floor
from reliable_jobs.worker import Worker

from . import tasks
from .tasks import first_line, noop


@dataclass(frozen=True)
class Figure:
    """A rate measured over several runs."""

    name: str
    rates: list[float]
    unit: str = "jobs/s"

    @property
    def median(self) -> float:
        return statistics.median(self.rates)

    def row(self) -> str:
        spread = f"{min(self.rates):,.0f} - {max(self.rates):,.0f}"
        return f"{self.name:<28} {self.median:>10,.0f} {self.unit:<6}   (runs: {spread})"


#: Job rows deleted per transaction when a measurement cleans up.
DELETE_BATCH = 1_000


def delete_rows(backend: ReliableJobsBackend, *, task_path: str | None = None,
                queue: str | None = None) -> None:
    """Delete the rows a measurement left (of ``task_path``, or on ``queue``) with their attempts.

    Through the mirror, which owns every write to jobs, a batch per
    transaction: one statement would bind more ids than PostgreSQL (65,535)
    or SQLite allow after a 100,000-job measurement.
    """
    rows = Job.objects.using(backend.database)
    if task_path is not None:
        rows = rows.filter(task_path=task_path)
    if queue is not None:
        rows = rows.filter(queue=queue)
    ids = list(rows.values_list("pk", flat=True))
    for start in range(0, len(ids), DELETE_BATCH):
        with transaction.atomic(using=backend.database):
            mirror.delete_jobs(backend.database, ids[start:start + DELETE_BATCH])
    vacuum(backend)


def vacuum(backend: ReliableJobsBackend) -> None:
    """VACUUM ANALYZE the job and attempt tables (PostgreSQL, outside a transaction only).

    So that a measurement does not pay for the rows the ones before it
    deleted: with autovacuum off or behind (this project's machine runs
    PostgreSQL with it off), every deleted row stays in the table and its
    indexes, and a COPY into the job table took 10 µs a row after some
    20,000-job runs instead of 6 µs after a VACUUM. ANALYZE too, as
    autovacuum would: with the statistics of an empty table the planner
    picks a bitmap scan and a sort of every prunable row for each of
    prune's 1,000-row batches (0.4 s a batch at four million rows) instead
    of reading the (state, updated_at) index in order.
    """
    connection = connections[backend.database]
    if connection.vendor != "postgresql" or connection.in_atomic_block:
        return
    with connection.cursor() as cursor:
        cursor.execute(f"VACUUM ANALYZE {Job._meta.db_table}, {Attempt._meta.db_table}")


def autovacuum_off(backend: ReliableJobsBackend) -> bool:
    """True when the mirror is PostgreSQL with autovacuum switched off."""
    connection = connections[backend.database]
    if connection.vendor != "postgresql":
        return False
    with connection.cursor() as cursor:
        cursor.execute("SHOW autovacuum")
        (setting,) = cursor.fetchone()
    return str(setting) == "off"


def bench_task(backend: ReliableJobsBackend, queue: str) -> Task[..., Any]:
    """The no-op task bound to ``backend`` and ``queue`` (registered for this process)."""
    return backend.task_class(func=noop, backend=backend.alias, queue_name=queue)


def timed(action: Callable[[], object]) -> float:
    started = time.perf_counter()
    action()
    return time.perf_counter() - started


def run_once(backend: ReliableJobsBackend, queue: str, *, jobs: int, singles: int,
             concurrency: int, prefetch: int | None = None) -> dict[str, float]:
    """Enqueue in bulk, enqueue one by one, measure the floor, drain.

    Returns each rate in jobs/s, the single enqueue's floor (see
    :func:`measure_floor`) and the drain's CPU in µs per job: this process's
    CPU time (every thread; the worker starts no child for a no-op) over the
    drain, divided by the jobs drained.
    """
    task = bench_task(backend, queue)
    bulk_s = timed(lambda: backend.enqueue_many(task, (((), {}) for _ in range(jobs))))
    single_s = timed(lambda: [task.enqueue() for _ in range(singles)])
    floor = measure_floor(backend, queue, samples=singles)
    worker = Worker(backend, queues=[queue], concurrency=concurrency, burst=True, grace_s=5,
                    prefetch=prefetch)
    cpu_before = time.process_time()
    drain_s = timed(worker.run)
    cpu_s = time.process_time() - cpu_before
    delete_rows(backend, task_path=task.module_path)
    return {
        "bulk enqueue": jobs / bulk_s,
        "single enqueue": singles / single_s if singles else 0.0,
        "single enqueue floor": floor,
        "drain (1 process)": (jobs + singles) / drain_s,
        "drain CPU µs/job": cpu_s * 1e6 / (jobs + singles),
    }


def measure_latency(backend: ReliableJobsBackend, queue: str, *, samples: int) -> list[float]:
    """Enqueue-to-start latencies in ms, one job at a time, with an idle worker.

    The worker runs in a thread of this process (the producer only waits
    meanwhile) and blocks in BLMOVE between jobs, as an idle worker does; the
    clock starts when ``enqueue()`` returns (row committed, push done) and
    stops at the task's first line.
    """
    task = backend.task_class(func=first_line, backend=backend.alias, queue_name=queue)
    worker = Worker(backend, queues=[queue], concurrency=1, prefetch=0, grace_s=5)
    thread = threading.Thread(target=worker.run, name="rj-bench-worker", daemon=True)
    thread.start()
    latencies: list[float] = []
    try:
        time.sleep(0.5)  # let it reach its blocking wait
        for sample in range(samples):
            token = f"probe-{sample}"
            tasks.arrived.clear()
            task.enqueue(token)
            returned = time.perf_counter()
            if not tasks.arrived.wait(timeout=10):
                raise RuntimeError("a latency probe did not run within 10 s")
            latencies.append((tasks.first_lines.pop(token) - returned) * 1000)
            time.sleep(0.002)  # the worker goes back to its blocking wait
    finally:
        worker.stop()
        thread.join(timeout=30)
        delete_rows(backend, task_path=task.module_path)
    return latencies


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def measure_at_length(backend: ReliableJobsBackend, queue: str, *, waiting: int, window: int,
                      prefetch: int | None) -> tuple[float, float]:
    """Drain rate of ``window`` jobs taken from a queue ``waiting`` long, and Redis
    bytes per waiting job; the rest is drained afterwards (not timed)."""
    task = bench_task(backend, queue)
    used_before = int(backend.broker.client.info("memory")["used_memory"])
    for start in range(0, waiting + window, 10_000):
        backend.enqueue_many(task, (((), {}) for _ in range(min(10_000, waiting + window
                                                                - start))))
    per_job = (int(backend.broker.client.info("memory")["used_memory"]) - used_before) / (
        waiting + window)
    timed_worker = Worker(backend, queues=[queue], burst=True, max_jobs=window,
                          prefetch=prefetch, grace_s=5)
    rate = window / timed(timed_worker.run)
    Worker(backend, queues=[queue], burst=True, prefetch=prefetch, grace_s=5).run()
    delete_rows(backend, task_path=task.module_path)
    return rate, per_job


# -- the floor under single enqueue --------------------------------------------

#: The scratch queue of the floor measurement (emptied afterwards).
FLOOR_QUEUE = "rj-bench-floor"


def measure_floor(backend: ReliableJobsBackend, queue: str, *, samples: int) -> float:
    """What a single enqueue cannot go below, in jobs/s: a raw INSERT that commits
    itself plus one EVALSHA of the enqueue script, from this process.

    The row is the one ``enqueue()`` writes (same columns, same table, built
    once; only the id changes), sent on the raw driver connection in
    autocommit (the INSERT is its own transaction, as an ``enqueue()`` outside
    ``atomic()`` is); the script call is the enqueue script by SHA on the
    scratch queue FLOOR_QUEUE (rows and keys). Rows and keys are removed afterwards. PostgreSQL only
    (0.0 elsewhere).
    """
    connection = connections[backend.database]
    if connection.vendor != "postgresql" or samples < 1:
        return 0.0
    task = bench_task(backend, queue)
    now = timezone.now()
    new = mirror.NewJobs.at(now, backend=backend.alias, queue=FLOOR_QUEUE,
                            task_path=task.module_path, priority=task.priority, max_attempts=1,
                            run_after=task.run_after, rows=())
    # The statement and values of a single enqueue's INSERT (mirror.insert_jobs
    # of one row), built once: what is left per job is the driver's round trip.
    sql = mirror.postgres.insert_sql(new.shared(), 1, keyed=False)
    rest = (0, "[]", "{}", "", now.isoformat())  # shard, args, kwargs, fair group, enqueued_at
    text = payload.encode(task.module_path, (), {}, max_bytes=backend.config.MAX_PAYLOAD_BYTES)
    client = backend.broker.client
    keys = backend.broker.keys(FLOOR_QUEUE)
    script = client.register_script(scripts.source("enqueue"))
    script_keys = (keys.queued, keys.scheduled, keys.wake, keys.job_prefix, keys.bands,
                   keys.band_prefix, *keys.fair)
    script(keys=script_keys, args=())  # loads it, so every timed call is one EVALSHA
    ids = [uuid.uuid4() for _ in range(samples)]
    connection.ensure_connection()
    raw = connection.connection
    try:
        with raw.cursor() as cursor:
            started = time.perf_counter()
            for job_id in ids:
                cursor.execute(sql, (job_id, *rest))
                client.evalsha(script.sha, len(script_keys), *script_keys,
                               str(job_id), text, 1, 0, 0, 0, 0, "")
            elapsed = time.perf_counter() - started
    finally:
        delete_rows(backend, queue=FLOOR_QUEUE)
        client.delete(keys.queued, keys.scheduled, keys.wake,
                      *(keys.job_prefix + str(job_id) for job_id in ids))
    return samples / elapsed


# -- ack cost by the number of jobs in flight ------------------------------------

#: Simulated workers that hold the jobs in flight, and jobs per claim call.
ACK_WORKERS = 4
ACK_CLAIM_BATCH = 500
#: Fences per ack call while timing (the finisher acks in batches too).
ACK_BATCH = 50


def measure_ack_cost(backend: ReliableJobsBackend, queue: str, *, in_flight: int,
                     sample: int = 1_000) -> float:
    """Microseconds of ack per job while ``in_flight`` jobs are claimed and unacked.

    ``ACK_WORKERS`` simulated workers claim every job (``ACK_CLAIM_BATCH`` per
    claim, as a worker with a large prefetch does), so the leases set holds
    them all; then ``sample`` of them, spread evenly over the workers and
    taken in each worker's claim order, are acked ``ACK_BATCH`` per call and
    timed. The rest are acked afterwards (not timed) and the rows deleted.
    """
    task = bench_task(backend, queue)
    broker = backend.broker
    for start in range(0, in_flight, 10_000):
        backend.enqueue_many(task, (((), {}) for _ in range(min(10_000, in_flight - start))))
    per_worker = -(-in_flight // ACK_WORKERS)
    held: list[list[tuple[str, int, int]]] = []
    for _ in range(ACK_WORKERS):
        fences: list[tuple[str, int, int]] = []
        while len(fences) < per_worker:
            claimed = broker.claim(queue, count=min(ACK_CLAIM_BATCH, per_worker - len(fences)),
                                   lease_ms=600_000)
            if not claimed.jobs:
                break
            fences += [job.fence for job in claimed.jobs]
        held.append(fences)
    share = max(1, sample // ACK_WORKERS)
    timed_fences = [fences[:share] for fences in held]
    acked = 0
    try:
        started = time.perf_counter()
        for fences in timed_fences:
            for i in range(0, len(fences), ACK_BATCH):
                acked += sum(broker.ack(queue, fences[i:i + ACK_BATCH]))
        elapsed = time.perf_counter() - started
    finally:
        for fences in held:
            rest = fences[share:]
            for i in range(0, len(rest), 1_000):
                broker.ack(queue, rest[i:i + 1_000])
        delete_rows(backend, task_path=task.module_path)
    if not acked:
        raise RuntimeError("No ack was accepted: the queue was not idle.")
    return elapsed * 1e6 / acked


# -- many queues configured ---------------------------------------------------------

def idle_queue_names(count: int) -> list[str]:
    """``count`` queue names nobody uses, for a worker configured with many queues."""
    return [f"rj-bench-idle-{i:03d}" for i in range(count)]


def measure_many_queues(backend: ReliableJobsBackend, queue: str, *, jobs: int, queues: int,
                        prefetch: int | None) -> tuple[float, float]:
    """Drain rate of ``jobs`` with one queue configured, then with ``queues`` (work on one).

    The other queues are empty; the worker still waits on, sweeps and
    reconciles all of them, which is what is measured.
    """
    task = bench_task(backend, queue)
    idle = idle_queue_names(queues - 1)
    rates = []
    try:
        for names in ([queue], [queue, *idle]):
            backend.enqueue_many(task, (((), {}) for _ in range(jobs)))
            worker = Worker(backend, queues=names, burst=True, prefetch=prefetch, grace_s=5)
            rates.append(jobs / timed(worker.run))
            delete_rows(backend, task_path=task.module_path)
    finally:
        # The worker may leave a wake marker per queue it served.
        broker = backend.broker
        for start in range(0, len(idle), 100):
            broker.client.delete(*(broker.keys(name).wake for name in idle[start:start + 100]))
    return rates[0], rates[1]


# -- sustained drain with retention ----------------------------------------------------

@dataclass(frozen=True)
class Round:
    """One round of a sustained run."""

    jobs_done: int
    rate: float
    prune_s: float
    pruned: int
    table_rows: int
    table_bytes: int
    rss_bytes: int


def rss_bytes() -> int:
    """This process's resident set size (Linux; 0 elsewhere)."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def job_table_size(backend: ReliableJobsBackend) -> tuple[int, int]:
    """Rows in the job table and its bytes on disk with indexes (PostgreSQL; else 0)."""
    rows = Job.objects.using(backend.database).count()
    connection = connections[backend.database]
    if connection.vendor != "postgresql":
        return rows, 0
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_total_relation_size(%s)", [Job._meta.db_table])
        return rows, int(cursor.fetchone()[0])


def sustained(backend: ReliableJobsBackend, queue: str, *, total: int, per_round: int,
              retention: timedelta, prefetch: int | None,
              report: Callable[[Round], None], round_timeout_s: float = 600.0) -> None:
    """Run ``total`` jobs through one long-lived worker, ``per_round`` at a time, pruning
    like ``prunejobs`` between rounds.

    One worker (in a thread of this process, not in burst mode) serves the
    whole run, as a deployed worker does, so the RSS reported is a worker's
    after N jobs. Each round bulk-enqueues its jobs while the worker drains
    them and is timed from its first enqueue until the queue is empty and the
    worker holds nothing, so its rate is enqueue and drain together; then
    what finished more than ``retention`` ago is pruned (not timed), so after
    the first ``retention`` the job table stops growing. Rows are left as a
    real deployment would leave them, with one exception: on a PostgreSQL
    whose autovacuum is off (this project's machine), each round is followed
    by a VACUUM ANALYZE (timed with the prune), standing in
    for the autovacuum every production server runs; without it every
    deleted row stays in the table and its indexes, and each prune's range
    scan walks the dead entries of all the earlier ones.
    """
    task = bench_task(backend, queue)
    stand_in_for_autovacuum = autovacuum_off(backend)
    worker = Worker(backend, queues=[queue], prefetch=prefetch, grace_s=5)
    thread = threading.Thread(target=worker.run, name="rj-bench-sustained", daemon=True)
    thread.start()
    done = 0
    try:
        while done < total:
            size = min(per_round, total - done)
            started = time.perf_counter()
            for start in range(0, size, 10_000):
                backend.enqueue_many(task, (((), {}) for _ in range(min(10_000, size - start))))
            deadline = started + round_timeout_s
            while True:
                counts = backend.broker.counts(queue)
                if not (counts.queued or counts.running or len(worker.in_hand)):
                    break
                if time.perf_counter() > deadline or not thread.is_alive():
                    raise RuntimeError(f"A round of {size:,} jobs did not drain within "
                                       f"{round_timeout_s:.0f} s ({counts}).")
                time.sleep(0.01)
            rate = size / (time.perf_counter() - started)
            done += size
            pruned_at = time.perf_counter()
            if stand_in_for_autovacuum:
                vacuum(backend)  # before the prune, as autovacuum keeps the statistics
            # Every job of the round is drained (acked, so mirrored) before its
            # prune, so none is unfinished in Redis: a retention shorter than
            # prune_floor (which protects a job Redis may not have finished)
            # is measured as asked. prunejobs never goes below the floor.
            below_floor = max(timedelta(0), prune_floor(backend) - retention)
            pruned = prune(backend, older_than=retention, now=timezone.now() + below_floor).jobs
            prune_s = time.perf_counter() - pruned_at
            rows, size_bytes = job_table_size(backend)
            report(Round(done, rate, prune_s, pruned, rows, size_bytes, rss_bytes()))
    finally:
        worker.stop()
        thread.join(timeout=30)
