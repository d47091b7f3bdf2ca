"""Read-only views of the queues and the workers: counts, latency, heartbeats.

Nothing here changes a job; the dashboard, the metrics and the sweep read
through these (the heartbeat is the one write, to a worker's own entry).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from ..keys import worker_key, workers_index
from .core import BrokerCore
from .records import Latency, LimitUse, Progress, QueueCounts, WorkerBeat

#: How long a worker that stopped beating stays in the workers index, in ms.
WORKER_INDEX_KEEP_MS = 3_600_000

#: Ids latency.lua reads at most from a queue's oldest end, past cancelled
#: tombstones and stray copies, to find the oldest job that will run.
LATENCY_LOOK = 20
#: Limits whose held lists counts() and the dashboard add up at most.
HELD_LOOK = 100


class Inspection(BrokerCore):
    """Counts, latency, held states and the workers index."""

    def held_states(self, queue: str, job_ids: Sequence[str]) -> dict[str, dict[str, str]]:
        """Return the state, attempts, gen and last_error of each job Redis holds.

        A key of another type under a job's name (written by hand) holds no
        job: its error reply is read as no hash, as the scripts read it
        (include/read_job.lua), so a rebuild pushes the job over it instead
        of every reconcile pass failing.
        """
        k = self.keys(queue)
        with self.client.pipeline(transaction=False) as pipe:
            for job_id in job_ids:
                pipe.hmget(k.job(job_id), "state", "attempts", "last_error", "gen")
            replies = pipe.execute(raise_on_error=False)
        held: dict[str, dict[str, str]] = {}
        for job_id, reply in zip(job_ids, replies, strict=True):
            if isinstance(reply, Exception) or reply[0] is None:
                continue
            state, attempts, error, gen = reply
            held[job_id] = {"state": state, "attempts": attempts or "0",
                            "last_error": error or "", "gen": gen or "0"}
        return held

    def progress(self, jobs: Sequence[tuple[str, str]]) -> dict[str, Progress]:
        """The progress of each job Redis holds, by id; ``jobs`` are (queue, id) pairs.

        One pipelined round trip whatever the queues. A job is started when
        its hash's ``started`` (the attempt start.lua last marked) is its
        current attempt: a claimed job whose task has not begun is not. A
        key of another type under a job's name holds no job, as in
        :meth:`held_states`.
        """
        with self.client.pipeline(transaction=False) as pipe:
            for queue, job_id in jobs:
                pipe.hmget(self.keys(queue).job(job_id), "state", "attempts", "started")
            answers = pipe.execute(raise_on_error=False)
        found: dict[str, Progress] = {}
        for (_, job_id), reply in zip(jobs, answers, strict=True):
            if isinstance(reply, Exception) or reply[0] is None:
                continue
            state, attempts, started = reply
            found[job_id] = Progress(state, started is not None and started == attempts)
        return found

    def dead_since(self, queue: str, *, before_ms: int, start: int, count: int
                   ) -> tuple[list[str], bool]:
        """Ids of the dead set by rank from ``start`` (``count`` at most) that died
        before ``before_ms``; and whether the set goes on past them."""
        found = self.client.zrange(self.keys(queue).dead, start, start + count - 1,
                                   withscores=True)
        return [job_id for job_id, died in found if died < before_ms], len(found) == count

    def counts(self, queue: str) -> QueueCounts:
        """Ids on each list; queued adds up every priority band (at most 201 lists)
        and every fair group's list (one LLEN per group waiting, pipelined).

        Running counts the leases set, the in-flight index (an orphan a
        sweep leased on landing included).
        """
        k = self.keys(queue)
        with self.client.pipeline(transaction=False) as pipe:
            pipe.llen(k.queued)
            pipe.zcard(k.leases)
            pipe.zcard(k.scheduled)
            pipe.zcard(k.dead)
            pipe.zrange(k.bands, 0, -1)
            pipe.zrange(k.fair_bands, 0, -1)
            queued, running, scheduled, dead, bands, fair_bands = pipe.execute()
        if bands:
            with self.client.pipeline(transaction=False) as pipe:
                for band in bands:
                    pipe.llen(f"{k.band_prefix}{band}")
                queued += sum(pipe.execute())
        if fair_bands:
            with self.client.pipeline(transaction=False) as pipe:
                for band in fair_bands:
                    pipe.zrange(f"{k.rota_prefix}{band}", 0, -1)
                rotations = pipe.execute()
            with self.client.pipeline(transaction=False) as pipe:
                for band, groups in zip(fair_bands, rotations, strict=True):
                    for group in groups:
                        if group:  # '' is the plain list, counted above
                            pipe.llen(k.group(int(band), group))
                queued += sum(pipe.execute())
        held = sum(self.held_back(queue).values())
        return QueueCounts(queued + held, running, scheduled, dead, held)

    def held_back(self, queue: str, *, look: int = HELD_LOOK) -> dict[str, int]:
        """Jobs each limit of ``queue`` holds back (its held list), by wire name.

        The ``look`` limits due soonest at most (a per-key limit has one per
        key): a look bounded whatever the number of keys.
        """
        k = self.keys(queue)
        wires = self.client.zrange(k.holds, 0, look - 1)
        if not wires:
            return {}
        with self.client.pipeline(transaction=False) as pipe:
            for wire in wires:
                pipe.llen(k.flow("held", wire))
            lengths = pipe.execute()
        return {wire: int(n) for wire, n in zip(wires, lengths, strict=True) if n}

    def limit_use(self, queue: str, limits: Sequence[tuple[str, int]]) -> list[LimitUse]:
        """The current use of each limit named (wire name, window in ms; 'q' the queue's own).

        A cap's running jobs are the members of its running set that still
        hold a lease (as the claim counts them); a rate's recent claims are
        those of its log in the last window, on the server's clock.
        """
        k = self.keys(queue)
        now_ms = self.server_time_ms()
        with self.client.pipeline(transaction=False) as pipe:
            for wire, window_ms in limits:
                if wire == "q":
                    pipe.zcard(k.leases)
                    pipe.zcount(k.flow("log", "q"), f"({now_ms - window_ms}", "+inf")
                    pipe.llen(k.queued)
                else:
                    pipe.zrange(k.flow("run", wire), 0, -1)
                    pipe.zcount(k.flow("log", wire), f"({now_ms - window_ms}", "+inf")
                    pipe.llen(k.flow("held", wire))
            replies = pipe.execute()
        uses = []
        for index, (wire, _) in enumerate(limits):
            running, recent, held = replies[3 * index:3 * index + 3]
            if wire != "q":
                with self.client.pipeline(transaction=False) as pipe:
                    for member in running:
                        pipe.zscore(k.leases, member)
                    running = sum(score is not None for score in pipe.execute())
            uses.append(LimitUse(wire, int(running), int(recent), int(held)))
        return uses

    def latency(self, queue: str, *, look: int = LATENCY_LOOK) -> Latency:
        """The age of ``queue``'s oldest ready job and oldest due scheduled job.

        One read-only script call: O(``look``) at the queued list's oldest
        end and O(log n) on the scheduled set, whatever their length (and
        O(``look``) more per priority other than 0 in use).
        """
        k = self.keys(queue)
        now_ms, queued, ready_id, ready_ms, due_id, due_ms = self._run(
            "latency", (k.queued, k.scheduled, k.job_prefix, k.bands, k.band_prefix), (look,))
        ready_ms, due_ms, now_ms = int(ready_ms), int(due_ms), int(now_ms)
        return Latency(
            queue, int(queued),
            oldest_ready_ms=max(0, now_ms - ready_ms) if ready_id and ready_ms else None,
            oldest_due_ms=max(0, now_ms - due_ms) if due_id else None,
            oldest_ready_id=ready_id, oldest_due_id=due_id,
        )

    def heartbeat(self, worker_id: str, info: dict[str, Any], *, ttl_ms: int) -> None:
        """Record that a worker is alive, with what it holds, for ``ttl_ms``.

        Workers killed outright never say goodbye: entries of the index older
        than an hour (far beyond any heartbeat TTL) are dropped here, so the
        index stays as small as the set of recent workers. Beats are scored
        on the Redis server's clock, so one worker's skewed clock can neither
        drop the others nor keep itself listed.
        """
        now_ms = self.server_time_ms()
        index = workers_index(self.prefix)
        with self.client.pipeline(transaction=False) as pipe:
            pipe.set(worker_key(self.prefix, worker_id), json.dumps(info), px=ttl_ms)
            pipe.zadd(index, {worker_id: now_ms})
            pipe.zremrangebyscore(index, "-inf", now_ms - WORKER_INDEX_KEEP_MS)
            pipe.execute()

    def forget_worker(self, worker_id: str) -> None:
        with self.client.pipeline(transaction=False) as pipe:
            pipe.delete(worker_key(self.prefix, worker_id))
            pipe.zrem(workers_index(self.prefix), worker_id)
            pipe.execute()

    def next_due_in_ms(self, queues: Sequence[str]) -> int | None:
        """How long until the earliest scheduled job of ``queues`` is due, in ms on Redis's
        clock (0: one is due now); None when none is scheduled.

        When the sweep should promote next, so a job runs at its due time
        rather than up to a sweep interval after it (a debounced job, a
        ``run_after``, a retry). A hint only: promote.lua decides what is due.
        """
        if not queues:
            return None
        with self.client.pipeline(transaction=False) as pipe:
            for queue in queues:
                pipe.zrange(self.keys(queue).scheduled, 0, 0, withscores=True)
            firsts = pipe.execute(raise_on_error=False)
        dues = [int(found[0][1]) for found in firsts
                if not isinstance(found, Exception) and found]
        if not dues:
            return None
        return max(0, min(dues) - self.server_time_ms())

    def server_time_ms(self) -> int:
        seconds, micros = self.client.time()
        return int(seconds) * 1000 + int(micros) // 1000

    def workers(self, *, limit: int = 500) -> list[WorkerBeat]:
        """Workers whose heartbeat has not expired, newest beat first (``limit`` at most).

        The index keeps a worker until it says goodbye; one killed with
        SIGKILL stays there, so only ids whose heartbeat key still exists
        (it has a TTL) are returned.
        """
        index = workers_index(self.prefix)
        beats = [(str(entry[0]), int(entry[1]))  # withscores: (member, score) pairs
                 for entry in self.client.zrevrange(index, 0, limit - 1, withscores=True)
                 if isinstance(entry, tuple)]
        if not beats:
            return []
        with self.client.pipeline(transaction=False) as pipe:
            for worker_id, _ in beats:
                pipe.get(worker_key(self.prefix, worker_id))
            infos = pipe.execute()
        return [
            WorkerBeat(worker_id, beat_ms, json.loads(raw))
            for (worker_id, beat_ms), raw in zip(beats, infos, strict=True)
            if raw
        ]
