"""The numbers of the live dashboard and ``jobstats``: one backend at a time.

Queue counts, latency (the age of each queue's oldest ready job and oldest
due scheduled job, see scripts/latency.lua) and workers come live from Redis
(list lengths, two bounded reads per shard, and heartbeats), and so does
each limit's use (flowstats.py), and which queues are paused (pausing.py);
throughput comes from the ``Attempt`` rows of the last hour; drift compares
the two sides the way reconcile does. A sharded queue is one line: the sum
of every shard a worker drains (see :func:`shards_of`), and each row is
checked on the shard it names. Every part is bounded, so the page
costs the same with a thousand jobs or a million: a few pipelined Redis
calls per shard, one grouped query on an index, and at most ``DRIFT_SCAN`` rows
checked.

A part whose server does not answer is reported as such, not raised: the
dashboard is where staff look when something is down.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

from django.db import DatabaseError
from django.db.models import Count
from django.db.models.functions import TruncMinute
from django.utils import timezone

from . import pausing
from .broker import REDIS_ERRORS
from .flowstats import LimitLine, limit_lines
from .keys import logical_queue, shard_index, shard_queue
from .models import FAILED_OUTCOMES, UNFINISHED_STATES, Attempt, AttemptOutcome, Job, JobState

if TYPE_CHECKING:
    from .backend import ReliableJobsBackend
    from .pausing import PauseState

#: Unfinished rows drift checks at most per call.
DRIFT_SCAN = 5_000
#: Job ids per pipelined Redis check.
DRIFT_BATCH = 500
#: Minutes of throughput shown.
WINDOW_MINUTES = 60


@dataclass(frozen=True, slots=True)
class QueueLine:
    name: str
    queued: int
    running: int
    scheduled: int
    dead: int
    #: Age of the oldest job ready to run, in ms (the largest over the
    #: shards); None when nothing is queued.
    oldest_ready_ms: int | None = field(default=None, compare=False)
    #: How long the oldest due scheduled job has waited for promotion, in ms.
    oldest_due_ms: int | None = field(default=None, compare=False)
    #: Each age is past OPTIONS['LATENCY_WARNING_MS'].
    ready_late: bool = field(default=False, compare=False)
    due_late: bool = field(default=False, compare=False)
    #: One line per shard of a sharded queue (empty for an unsharded one).
    shards: tuple[QueueLine, ...] = field(default=(), compare=False)
    #: The queue's pause, when it is paused (pausing.py); None when it runs.
    pause: PauseState | None = field(default=None, compare=False)

    @property
    def shard(self) -> int:
        """The shard number, when this line is one shard of a queue (0 otherwise)."""
        return shard_index(self.name)

    @property
    def late(self) -> bool:
        return self.ready_late or self.due_late

    @property
    def oldest_ready(self) -> str:
        return human_ms(self.oldest_ready_ms)

    @property
    def oldest_due(self) -> str:
        return human_ms(self.oldest_due_ms)


@dataclass(frozen=True, slots=True)
class WorkerLine:
    id: str
    host: str
    pid: int | None
    queues: list[str]
    #: Jobs it holds (claimed, running or waiting to be acked).
    jobs: int
    since: datetime | None
    last_beat: datetime


@dataclass(frozen=True, slots=True)
class Minute:
    at: datetime
    succeeded: int
    failed: int


@dataclass(frozen=True, slots=True)
class Drift:
    """Jobs the database and Redis disagree on, as reconcile would see them.

    Only rows unchanged for ``RECONCILE_GRACE_MS`` count: a fresher row may
    simply be a batch behind Redis, which is the hot path working, not drift.
    """

    checked: int
    #: Unfinished in the database, absent from Redis (reconcile pushes them again).
    missing: list[str]
    #: Unfinished in the database, dead in Redis (reconcile copies the death).
    dead_in_redis: list[str]
    #: False when more candidates than DRIFT_SCAN exist (the rest were not checked).
    complete: bool

    @property
    def ids(self) -> list[str]:
        return self.missing + self.dead_in_redis

    @property
    def count(self) -> int:
        return len(self.missing) + len(self.dead_in_redis)


@dataclass
class Snapshot:
    """Everything the dashboard shows for one backend."""

    backend: str
    #: OPTIONS['LATENCY_WARNING_MS'] of the backend (None: no warning).
    latency_warning_ms: int | None = None
    queues: list[QueueLine] = field(default_factory=list)
    workers: list[WorkerLine] = field(default_factory=list)
    minutes: list[Minute] = field(default_factory=list)
    drift: Drift | None = None
    #: Each rate limit's and concurrency cap's use (flowstats.py).
    limits: list[LimitLine] = field(default_factory=list)
    #: Why a part is missing: one whole sentence per server that failed.
    problems: list[str] = field(default_factory=list)

    @property
    def totals(self) -> QueueLine:
        return combined("all", self.queues)

    @property
    def late_queues(self) -> list[QueueLine]:
        return [q for q in self.queues if q.late]

    @property
    def succeeded_last_hour(self) -> int:
        return sum(m.succeeded for m in self.minutes)

    @property
    def failed_last_hour(self) -> int:
        return sum(m.failed for m in self.minutes)


def snapshot(backend: ReliableJobsBackend, *, now: datetime | None = None) -> Snapshot:
    """Collect every part, noting (not raising) a server that does not answer."""
    snap = Snapshot(backend.alias, latency_warning_ms=backend.config.LATENCY_WARNING_MS)
    try:
        snap.queues = queue_counts(backend)
        snap.workers = workers(backend)
        snap.limits = limit_lines(backend, [p for ps in shards_of(backend).values() for p in ps])
    except REDIS_ERRORS as exc:
        snap.problems.append(f"Redis did not answer ({exc}): queue counts, latency and "
                             "workers are unknown.")
    try:
        paused = {state.queue: state for state in pausing.status(backend.parts)
                  if state.paused}
        snap.queues = [replace(q, pause=paused.get(q.name)) for q in snap.queues]
    except (*REDIS_ERRORS, DatabaseError) as exc:  # type: ignore[misc]  # mypy cannot unpack a tuple[type, ...]
        snap.problems.append(f"Which queues are paused could not be read ({exc}).")
    try:
        snap.minutes = throughput(backend, now=now)
    except DatabaseError as exc:
        snap.problems.append(f"The database did not answer ({exc}): throughput is unknown.")
    try:
        snap.drift = drift(backend)
    except (*REDIS_ERRORS, DatabaseError) as exc:  # type: ignore[misc]  # mypy cannot unpack a tuple[type, ...]
        snap.problems.append(f"Drift could not be checked ({exc}).")
    return snap


def queues_of(backend: ReliableJobsBackend) -> list[str]:
    return sorted(backend.queues)


def shards_of(backend: ReliableJobsBackend) -> dict[str, list[str]]:
    """Each configured queue and its physical queues, as the workers drain them.

    The shards are the configured ones plus every shard ever written to
    (``Broker.physical_queues``, the same call the sweep makes): jobs left
    on a shard after SHARDS shrank are still there to count. An unsharded
    queue is its own single shard.
    """
    grouped: dict[str, list[str]] = {queue: [] for queue in queues_of(backend)}
    for physical in backend.broker.physical_queues(grouped, backend.config.SHARDS):
        grouped[logical_queue(physical)].append(physical)
    return grouped


def queue_counts(backend: ReliableJobsBackend) -> list[QueueLine]:
    """Live list and set sizes and latency of each configured queue, over its shards.

    Counts are summed over the shards and ages are the oldest of any shard;
    a sharded queue also gets a line per shard. Two bounded Redis calls per
    shard (see ``Broker.counts`` and ``Broker.latency``).
    """
    warn_ms = backend.config.LATENCY_WARNING_MS
    lines = []
    for queue, physical in shards_of(backend).items():
        shards = []
        for shard in physical:
            c = backend.broker.counts(shard)
            lat = backend.broker.latency(shard)
            shards.append(QueueLine(shard, c.queued, c.running, c.scheduled, c.dead,
                                    oldest_ready_ms=lat.oldest_ready_ms,
                                    oldest_due_ms=lat.oldest_due_ms,
                                    ready_late=is_late(warn_ms, lat.oldest_ready_ms),
                                    due_late=is_late(warn_ms, lat.oldest_due_ms)))
        lines.append(combined(queue, shards, keep_parts=len(shards) > 1))
    return lines


def combined(name: str, parts: Sequence[QueueLine], *, keep_parts: bool = False) -> QueueLine:
    """One line for several: counts summed, ages the oldest, late if any part is."""
    return QueueLine(
        name, queued=sum(p.queued for p in parts), running=sum(p.running for p in parts),
        scheduled=sum(p.scheduled for p in parts), dead=sum(p.dead for p in parts),
        oldest_ready_ms=_oldest(p.oldest_ready_ms for p in parts),
        oldest_due_ms=_oldest(p.oldest_due_ms for p in parts),
        ready_late=any(p.ready_late for p in parts), due_late=any(p.due_late for p in parts),
        shards=tuple(parts) if keep_parts else (),
    )


def is_late(warn_ms: int | None, age_ms: int | None) -> bool:
    """True when an age is past the warning threshold (never without one)."""
    return warn_ms is not None and age_ms is not None and age_ms > warn_ms


def human_ms(ms: int | None) -> str:
    """A short age: "-" for none, "850 ms", "12.3 s", "4 min 5 s", "2 h 3 min", "3 d 4 h"."""
    if ms is None:
        return "-"
    if ms < 1000:
        return f"{ms} ms"
    if ms < 60_000:
        return f"{ms / 1000:.1f} s"
    minutes, seconds = divmod(ms // 1000, 60)
    if minutes < 60:
        return f"{minutes} min {seconds} s"
    hours, minutes = divmod(minutes, 60)
    if hours < 48:
        return f"{hours} h {minutes} min"
    return f"{hours // 24} d {hours % 24} h"


def _oldest(ages: Iterable[int | None]) -> int | None:
    return max((age for age in ages if age is not None), default=None)


def workers(backend: ReliableJobsBackend) -> list[WorkerLine]:
    """Workers alive (heartbeat not expired) serving any of the backend's queues."""
    ours = set(backend.queues)
    lines = []
    for beat in backend.broker.workers():
        info = beat.info
        queues = [str(q) for q in info.get("queues") or []]
        if queues and not ours.intersection(queues):
            continue  # another backend sharing this prefix
        started = info.get("started")
        lines.append(WorkerLine(
            id=beat.id, host=str(info.get("host", "")),
            pid=info.get("pid") if isinstance(info.get("pid"), int) else None,
            queues=queues, jobs=int(info.get("in_hand", len(info.get("jobs") or []))),
            since=_from_epoch_s(started) if isinstance(started, int | float) else None,
            last_beat=_from_epoch_s(beat.beat_ms / 1000),
        ))
    return lines


def throughput(backend: ReliableJobsBackend, *, minutes: int = WINDOW_MINUTES,
               now: datetime | None = None) -> list[Minute]:
    """Attempts that succeeded and failed per minute, oldest first, one entry per minute.

    One grouped query on the attempts' ``finished_at`` index; a minute with
    nothing finished is a zero, so the chart's time axis is regular.
    """
    end = (now or timezone.now()).replace(second=0, microsecond=0) + timedelta(minutes=1)
    start = end - timedelta(minutes=minutes)
    rows = (Attempt.objects.using(backend.config.DATABASE)
            .filter(finished_at__gte=start, finished_at__lt=end, job__backend=backend.alias,
                    outcome__in=[AttemptOutcome.SUCCEEDED, *FAILED_OUTCOMES])
            .annotate(minute=TruncMinute("finished_at"))
            .values_list("minute", "outcome")
            .annotate(n=Count("id"))
            .order_by())
    succeeded: dict[datetime, int] = {}
    failed: dict[datetime, int] = {}
    for minute, outcome, n in rows:
        target = succeeded if outcome == AttemptOutcome.SUCCEEDED else failed
        target[minute] = target.get(minute, 0) + n
    slots = [start + timedelta(minutes=i) for i in range(minutes)]
    return [Minute(at, succeeded.get(at, 0), failed.get(at, 0)) for at in slots]


def drift(backend: ReliableJobsBackend, *, limit: int = DRIFT_SCAN) -> Drift:
    """Check the ``limit`` unfinished rows unchanged the longest against Redis.

    Those are where drift shows first (a healthy job's row changes as it
    moves). One range scan of the (state, updated_at) index per unfinished
    state, then one pipelined ``HMGET`` per shard and batch (a row is
    looked up on the shard it names, as reconcile does). Read-only:
    repairing drift is reconcile's job.
    """
    config = backend.config
    older_than = timezone.now() - timedelta(milliseconds=config.RECONCILE_GRACE_MS)
    rows: list[tuple[datetime, Any, str, int]] = []
    for state in UNFINISHED_STATES:
        rows += (Job.objects.using(config.DATABASE)
                 .filter(backend=backend.alias, state=state, updated_at__lt=older_than)
                 .order_by("updated_at")
                 .values_list("updated_at", "pk", "queue", "shard")[:limit + 1])
    rows.sort()
    complete = len(rows) <= limit
    by_queue: dict[str, list[str]] = {}
    for _, pk, queue, shard in rows[:limit]:
        by_queue.setdefault(shard_queue(queue, shard), []).append(str(pk))
    missing: list[str] = []
    dead: list[str] = []
    for queue, ids in by_queue.items():
        for start in range(0, len(ids), DRIFT_BATCH):
            batch = ids[start:start + DRIFT_BATCH]
            held = backend.broker.held_states(queue, batch)
            for job_id in batch:
                found = held.get(job_id)
                if found is None:
                    missing.append(job_id)
                elif found["state"] == JobState.DEAD:
                    dead.append(job_id)
    return Drift(min(len(rows), limit), missing, dead, complete)


# -- the chart --------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Bar:
    """One minute of the chart, in SVG user units (y grows downwards)."""

    x: float
    width: float
    ok_y: float
    ok_height: float
    failed_y: float
    failed_height: float
    title: str


def chart(minutes: Sequence[Minute], *, width: int = 600, height: int = 120
          ) -> tuple[list[Bar], int]:
    """Stacked bars (succeeded below, failed on top) and the scale's maximum.

    Drawn on the server as plain SVG: no script, no front-end build, and it
    prints and screenshots like the rest of the page.
    """
    peak = max((m.succeeded + m.failed for m in minutes), default=0)
    scale = height / peak if peak else 0.0
    step = width / max(len(minutes), 1)
    bars = []
    for i, m in enumerate(minutes):
        ok_h = m.succeeded * scale
        failed_h = m.failed * scale
        bars.append(Bar(
            x=round(i * step + 0.5, 2), width=round(max(step - 1.0, 1.0), 2),
            ok_y=round(height - ok_h, 2), ok_height=round(ok_h, 2),
            failed_y=round(height - ok_h - failed_h, 2), failed_height=round(failed_h, 2),
            title=f"{m.at:%H:%M} UTC: {m.succeeded} succeeded, {m.failed} failed",
        ))
    return bars, peak


def _from_epoch_s(seconds: float) -> datetime:
    return datetime.fromtimestamp(seconds, tz=UTC)
