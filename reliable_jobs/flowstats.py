"""The "Limits" table of the dashboard and ``jobstats``: each limit's use, live from Redis.

One line per limit: the queue's own (OPTIONS['QUEUE_LIMITS']), each task
this process knows with limits on the queue, and each per-key limit that
holds jobs back now (the 100 due soonest at most: a per-key limit has one
line per key, and keys no job waits on are not listed). Use is read the way
the claim script counts it (``Broker.limit_use``): a cap's running jobs are
those of its slots still holding a lease, a rate's recent claims those of
its log in the last window. Bounded: a few pipelined calls per limit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .flow import NO_LIMITS, LimitName, Limits
from .keys import logical_queue
from .tasks import registered

if TYPE_CHECKING:
    from .backend import ReliableJobsBackend


@dataclass(frozen=True, slots=True)
class LimitLine:
    """One limit and its use now."""

    #: The physical queue the limit lives on.
    queue: str
    #: 'queue', 'task' or 'key'.
    scope: str
    #: The queue's name, the task's path, or the path and the key's digest.
    name: str
    #: 'rate' or 'concurrency'.
    kind: str
    #: '100/1000ms' for a rate, the cap for a concurrency limit.
    limit: str
    #: Jobs holding a slot now (caps); None for a rate.
    running: int | None
    #: Claims admitted in the last window (rates); None for a cap.
    recent: int | None
    #: Jobs it holds back now (for the queue's own: the jobs queued while it is full).
    held: int

    @property
    def full(self) -> bool:
        return self.held > 0


def limit_lines(backend: ReliableJobsBackend, queues: list[str]) -> list[LimitLine]:
    """The limits of ``queues`` (physical queues) and their use, queue by queue."""
    lines: list[LimitLine] = []
    for queue in queues:
        own = backend.config.queue_limits(logical_queue(queue))
        tasks: dict[str, Limits] = {}
        for task in registered():
            if task.queue_name == logical_queue(queue):
                found = backend.task_flow(task, task.module_path)
                if found is not None:
                    tasks[task.module_path] = found.limits
        held = backend.broker.held_back(queue)
        wires: dict[str, tuple[str, Limits]] = {}
        for path, limits in tasks.items():
            if limits.rate is not None:
                wires[f"r:{path}"] = ("task", limits)
            if limits.concurrency is not None:
                wires[f"c:{path}"] = ("task", limits)
        for wire in held:
            name = LimitName.from_wire(wire)
            wires.setdefault(wire, ("key" if name.keyed else "task",
                                    tasks.get(name.task_path, NO_LIMITS)))
        asked: list[tuple[str, int]] = []
        if own:
            asked.append(("q", own.rate.window_ms if own.rate else 1_000))
        asked += [(wire, limits.rate.window_ms if limits.rate else 1_000)
                  for wire, (_, limits) in wires.items()]
        if not asked:
            continue
        for use in backend.broker.limit_use(queue, asked):
            if use.wire == "q":
                lines += _queue_lines(queue, own, use.running, use.recent, use.held)
                continue
            scope, limits = wires[use.wire]
            name = LimitName.from_wire(use.wire)
            rate = name.kind == "rate"
            shown = (str(limits.rate) if rate and limits.rate else
                     str(limits.concurrency) if not rate and limits.concurrency else "?")
            lines.append(LimitLine(queue, scope, name.name, name.kind, shown,
                                   None if rate else use.running, use.recent if rate else None,
                                   use.held))
    return lines


def _queue_lines(queue: str, own: Limits, running: int, recent: int, queued: int
                 ) -> list[LimitLine]:
    lines = []
    if own.rate is not None:
        full = recent >= own.rate.count
        lines.append(LimitLine(queue, "queue", logical_queue(queue), "rate", str(own.rate),
                               None, recent, queued if full else 0))
    if own.concurrency is not None:
        full = running >= own.concurrency
        lines.append(LimitLine(queue, "queue", logical_queue(queue), "concurrency",
                               str(own.concurrency), running, None, queued if full else 0))
    return lines
