"""The chaos run of ``manage.py chaosjobs``: SIGKILL real workers, count every job.

The crash-point tests kill one worker at one chosen instruction; this run
kills at random instants, many times, under load, with real
``manage.py runworker`` processes and a real ``recoverjobs`` sweep, and then
counts: every job enqueued must end succeeded or dead (G1), so ``lost`` must
be 0. It also measures what a user pays for a crash: how many jobs ran more
than once, and the worst time from a SIGKILL until a job the dead worker held
started again (about ``LEASE_MS`` + ``SWEEP_INTERVAL_MS``, plus the wait behind
the jobs its next worker had already prefetched).

Beyond the queue's own records, the run keeps an execution ledger
(:mod:`reliable_jobs.contrib.verify.chaos_ledger`): the chaos task
(:mod:`reliable_jobs.contrib.verify.tasks`) writes every run of its body
(job, attempt, pid, start, end, outcome) into files the queue never
touches, and the run checks it against the pids it killed and the mirror's
final states: no two runs of one job overlapping in time, no job re-run
unless a kill or a retryable failure explains it, no job ending in a state
its last run contradicts. Two server faults can join the kills: the
backend's Redis database emptied (FLUSHDB, as a restart without persistence
leaves it) and PostgreSQL cut off from every child through a TCP proxy the
run owns (:mod:`reliable_jobs.contrib.verify.netfaults`).

Which jobs a killed worker held comes from two places: its attempt rows
(jobs it started) and its last heartbeat, checked against Redis just before
the kill (jobs it had claimed, started or not). A heartbeat is up to a third
of a lease old, so a job claimed after it and never started is missed: the
crash-to-rerun figures are a sample of the interrupted jobs, each one exact.

Every process the run starts is stopped before it returns, whatever happens
(an exception, Ctrl-C, SIGTERM); on Linux the children are also told to die
with the run if it is itself SIGKILLed, so no worker is ever left behind.
"""

from __future__ import annotations

import contextlib
import os
import random
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import redis
from django.utils import timezone

from reliable_jobs.compat import Task
from reliable_jobs.models import Job, JobState
from reliable_jobs.tasks import discover, lookup

from . import chaos_ledger
from .broker_reads import lease_count, worker_info
from .chaos_count import CUT_FAULT, FLUSH_FAULT, ChaosCounting
from .chaos_fleet import Fleet, Slot, interruptible, manage_py, proxied_database_url
from .chaos_report import (
    DEFAULT_TASK,
    ChaosConfig,
    ChaosError,
    ChaosReport,
    Fault,
    Interrupted,
    Kill,
    Stop,
    rerun_delays,
)
from .netfaults import CuttableProxy

__all__ = ["DEFAULT_TASK", "ChaosConfig", "ChaosError", "ChaosReport", "ChaosRun", "Fault",
           "Interrupted", "Kill", "rerun_delays"]

if TYPE_CHECKING:
    from reliable_jobs.backend import ReliableJobsBackend

#: Seconds the sweep process waits between passes.
SWEEP_INTERVAL_S = 0.5
#: Seconds a rolling-deploy stop may take beyond the grace period (the
#: finisher's own grace, worker.core.FINISHER_GRACE_S, plus start-up slack)
#: before the run SIGKILLs the worker and counts the stop as unclean.
STOP_SLACK_S = 20.0
#: Seconds between the first and the second SIGTERM of a hard stop.
SECOND_SIGTERM_AFTER_S = 1.0
#: Seconds the first workers get to start (import Django, heartbeat).
START_TIMEOUT_S = 60.0
#: Seconds between two checks of the queue while waiting for it to drain.
POLL_S = 0.5


class ChaosRun(ChaosCounting):
    """One run: start the fleet, enqueue, kill workers, wait for the drain, count."""

    def __init__(self, backend: ReliableJobsBackend, config: ChaosConfig, *,
                 out: Callable[[str], None] = print, log_dir: Path | None = None) -> None:
        self.backend = backend
        self.config = config
        self.queue = config.queue or sorted(backend.queues)[0]
        self.seed = config.seed if config.seed is not None else random.randrange(1_000_000)
        self.rng = random.Random(self.seed)
        self.out = out
        self.log_dir = log_dir or Path(tempfile.mkdtemp(prefix="chaosjobs-"))
        # Unique per run, so attempts and heartbeats of an earlier run on the
        # same database never count as this one's.
        self.run_tag = f"chaos-{os.getpid()}"
        self._serial = 0
        self.slots: list[Slot] = []
        self.kills: list[Kill] = []
        self.unexpected_exits = 0
        self._sweep: subprocess.Popen[bytes] | None = None
        self.ledger_dir = self.log_dir / "ledger"
        #: Pid of every worker process that died during the run -> when it was
        #: known dead (``time.time()``): the ledger's end of its unfinished runs.
        self.deaths: dict[int, float] = {}
        self.faults: list[Fault] = []
        #: Rolling-deploy stops, in order (see _stop_one).
        self.stops: list[Stop] = []
        self._stopping: list[tuple[Stop, subprocess.Popen[bytes]]] = []
        self._proxy: CuttableProxy | None = None
        self._planned = (0, 0)

    # -- checks ------------------------------------------------------------

    def task(self) -> Task[..., Any]:
        """The registered task to enqueue, bound to the run's backend and queue."""
        discover()
        task = lookup(self.config.task_path)
        if task is None:
            raise ChaosError(
                f"{self.config.task_path!r} is not a registered task: workers only run tasks "
                "created with this backend's task class in an installed app's tasks module."
            )
        if task.backend != self.backend.alias:
            raise ChaosError(
                f"{self.config.task_path!r} belongs to backend {task.backend!r}, not "
                f"{self.backend.alias!r}: workers of {self.backend.alias!r} would refuse it."
            )
        return task.using(queue_name=self.queue)

    def check(self) -> None:
        """Refuse bad flags, an unknown queue and a queue with work in it.

        Counting is by job id, but jobs already on the queue would share the
        workers, and a kill would interrupt someone's real work.
        """
        problems = self.config.problems()
        if self.queue not in self.backend.queues:
            problems.append(f"Queue {self.queue!r} is not in TASKS[{self.backend.alias!r}]"
                            f"['QUEUES'] ({', '.join(sorted(self.backend.queues))}).")
        if self.config.flush_redis_at_s is not None and not isinstance(
                self.backend.broker.client, redis.Redis):
            problems.append("--flush-redis-at needs a single Redis server, not a cluster "
                            "(FLUSHDB would empty every master).")
        if self.config.cut_postgres_at_s is not None:
            try:
                proxied_database_url(self.backend.database, 0)
            except ChaosError as exc:
                problems.append(str(exc))
        if problems:
            raise ChaosError(" ".join(problems))
        broker = self.backend.broker
        counts = broker.counts(self.queue)
        leases = lease_count(broker, self.queue)
        unfinished = Job.objects.using(self.backend.database).unfinished().filter(
            backend=self.backend.alias, queue=self.queue).count()
        if counts.queued or counts.running or counts.scheduled or leases or unfinished:
            raise ChaosError(
                f"Queue {self.queue!r} is not empty ({counts.queued} queued, {counts.running} "
                f"running, {counts.scheduled} scheduled, {leases} leases in Redis; {unfinished} "
                "unfinished job(s) in the database). Run chaosjobs on an idle queue."
            )

    # -- the run -----------------------------------------------------------

    def run(self) -> ChaosReport:
        """Start, enqueue, kill for ``duration``, drain, stop everything, then count."""
        self.check()
        task = self.task()
        cfg = self.config
        options = self.backend.config
        self.out(f"chaosjobs: seed {self.seed}; LEASE_MS {options.LEASE_MS} (a killed worker's "
                 f"jobs come back after about that long); logs in {self.log_dir}")
        self.ledger_dir.mkdir(parents=True, exist_ok=True)
        env = {chaos_ledger.LEDGER_ENV: str(self.ledger_dir)}
        ids: list[str] = []
        chaos_s = 0.0
        drain_s: float | None = None
        with interruptible():
            try:
                if cfg.cut_postgres_at_s is not None:
                    _, host, port = proxied_database_url(self.backend.database, 0)
                    self._proxy = CuttableProxy(port, host)
                    env["DATABASE_URL"] = proxied_database_url(
                        self.backend.database, self._proxy.port)[0]
                    self.out(f"chaosjobs: workers and the sweep reach PostgreSQL through a "
                             f"proxy on port {self._proxy.port}")
                fleet = Fleet(manage_py(), self.log_dir, env)
                try:
                    self._start_sweep(fleet)
                    for _ in range(cfg.workers):
                        self.slots.append(self._start_worker(fleet))
                    self._wait_started(fleet)
                    results = self.backend.enqueue_many(task, self._calls())
                    ids = [result.id for result in results]
                    self.out(f"chaosjobs: enqueued {len(ids):,} jobs on queue {self.queue!r}; "
                             f"killing a worker every {cfg.kill_every_s:g} s for "
                             f"{cfg.duration_s:g} s")
                    chaos_s = self._chaos(fleet, ids)
                    drain_s = self._drain(fleet, ids)
                    self._reap_stopping(wait=True)
                finally:
                    if self._proxy is not None:
                        self._proxy.restore()  # let the workers finish cleanly
                    fleet.stop_all()
                    self._forget_killed()
            finally:
                if self._proxy is not None:
                    self._proxy.close()
        return self._report(ids, chaos_s, drain_s, ended_at=time.time())

    def _calls(self) -> list[tuple[tuple[float], dict[str, Any]]]:
        """Each job's arguments: the sleep, and for a seeded sample a planned failure."""
        cfg = self.config
        failing = round(cfg.jobs * cfg.fail_percent / 100)
        giving_up = round(cfg.jobs * cfg.give_up_percent / 100)
        long = round(cfg.jobs * cfg.long_percent / 100)
        planned = random.Random(f"{self.seed}-plan").sample(range(cfg.jobs),
                                                             failing + giving_up + long)
        kwargs: dict[int, dict[str, Any]] = {index: {"fail_attempts": 1}
                                             for index in planned[:failing]}
        kwargs.update({index: {"give_up": True}
                       for index in planned[failing:failing + giving_up]})
        longer = set(planned[failing + giving_up:])
        self._planned = (failing, giving_up)
        return [(((cfg.long_ms if index in longer else cfg.task_ms) / 1000,),
                 kwargs.get(index, {})) for index in range(cfg.jobs)]

    def _start_worker(self, fleet: Fleet) -> Slot:
        self._serial += 1
        worker_id = f"{self.run_tag}-{self._serial}"
        proc = fleet.start(
            worker_id, "runworker", "--queue", self.queue, "--backend", self.backend.alias,
            "--concurrency", str(self.config.concurrency), "--worker-id", worker_id,
            "--grace", str(self.config.grace_s), "-v", str(self.config.child_verbosity),
        )
        return Slot(worker_id, worker_id, proc)

    def _start_sweep(self, fleet: Fleet) -> None:
        self._sweep = fleet.start(
            f"{self.run_tag}-sweep", "recoverjobs", "--interval", str(SWEEP_INTERVAL_S),
            "--backend", self.backend.alias, "-v", str(self.config.child_verbosity),
        )

    def _wait_started(self, fleet: Fleet) -> None:
        """Wait until every first worker heartbeats, so the chaos clock measures work."""
        deadline = time.monotonic() + START_TIMEOUT_S
        waiting = {slot.worker_id: slot for slot in self.slots}
        while waiting:
            for worker_id, slot in list(waiting.items()):
                if slot.proc.poll() is not None:
                    raise ChaosError(f"Worker {worker_id} exited with {slot.proc.returncode} "
                                     f"while starting:\n{fleet.log_tail(slot.name)}")
                if worker_info(self.backend.broker, worker_id) is not None:
                    del waiting[worker_id]
            if waiting and time.monotonic() > deadline:
                raise ChaosError(f"Workers {', '.join(waiting)} did not start within "
                                 f"{START_TIMEOUT_S:g} s; see {self.log_dir}.")
            time.sleep(0.1)

    def _chaos(self, fleet: Fleet, ids: list[str]) -> float:
        """Kill a random worker every ``kill_every`` s; return how long the chaos lasted.

        It ends early once the queue has drained: a kill then interrupts
        nothing and proves nothing. It lasts at least until every server
        fault asked for has happened and ended.
        """
        started = time.monotonic()
        pending = self._fault_schedule(ids)
        end = started + max([self.config.duration_s, *(at for at, _ in pending)])
        next_kill = started + self.config.kill_every_s
        stop_every = self.config.sigterm_every_s
        next_stop = started + stop_every if stop_every is not None else float("inf")
        next_check = started + 1.0
        while (now := time.monotonic()) < end:
            self._restart_exited(fleet)
            self._reap_stopping()
            while pending and now >= started + pending[0][0]:
                pending.pop(0)[1](now - started)
            if now >= next_kill:
                self._kill_one(fleet)
                next_kill += self.config.kill_every_s
            if stop_every is not None and now >= next_stop:
                self._stop_one(fleet)
                next_stop += stop_every
            if now >= next_check and not pending:
                next_check = now + 1.0
                if self._drained(ids):
                    self.out(f"chaosjobs: the queue drained after {now - started:.1f} s; "
                             "no more kills (raise --jobs or --task-ms for a longer chaos)")
                    break
            time.sleep(max(0.0, min(0.05, next_kill - time.monotonic())))
        for _, action in pending:  # due at the very end (PostgreSQL back at --duration)
            action(time.monotonic() - started)
        return time.monotonic() - started

    def _fault_schedule(self, ids: list[str]) -> list[tuple[float, Callable[[float], None]]]:
        """The server faults asked for, as (seconds into the chaos, action), in time order."""
        cfg = self.config
        schedule: list[tuple[float, Callable[[float], None]]] = []
        if cfg.flush_redis_at_s is not None:
            schedule.append((cfg.flush_redis_at_s, lambda at: self._flush_redis(at, ids)))
        if cfg.cut_postgres_at_s is not None:
            schedule.append((cfg.cut_postgres_at_s, lambda at: self._cut_postgres(at, ids)))
            schedule.append((cfg.cut_postgres_at_s + cfg.cut_postgres_for_s,
                             self._restore_postgres))
        return sorted(schedule, key=lambda item: item[0])

    def _flush_redis(self, at_s: float, ids: list[str]) -> None:
        """Empty the backend's Redis database, as a restart without persistence leaves it.

        FLUSHDB on the backend's own connection empties exactly the database
        index of its REDIS_URL: queued, running, scheduled and dead lists,
        job hashes, leases and heartbeats of every queue there. Reconcile must
        rebuild the unfinished jobs from the mirror.
        """
        unfinished = self._unfinished(ids)
        client = self.backend.broker.client
        keys = int(client.dbsize())
        client.flushdb()
        detail = f"at {at_s:.1f} s: {keys:,} keys dropped, {unfinished:,} jobs unfinished"
        self.faults.append(Fault(FLUSH_FAULT, at_s, detail, time.time()))
        self.out(f"chaosjobs: FLUSHDB {detail} ({chaos_ledger.clock(time.time())} UTC)")

    def _cut_postgres(self, at_s: float, ids: list[str]) -> None:
        assert self._proxy is not None
        self._proxy.cut()
        unfinished = self._unfinished(ids)
        detail = (f"at {at_s:.1f} s for {self.config.cut_postgres_for_s:g} s, "
                  f"{unfinished:,} jobs unfinished")
        self.faults.append(Fault(CUT_FAULT, at_s, detail, time.time()))
        self.out(f"chaosjobs: PostgreSQL cut off {detail} ({chaos_ledger.clock(time.time())} UTC)")

    def _restore_postgres(self, at_s: float) -> None:
        assert self._proxy is not None
        self._proxy.restore()
        self.out(f"chaosjobs: PostgreSQL reachable again at {at_s:.1f} s "
                 f"({chaos_ledger.clock(time.time())} UTC)")

    def _kill_one(self, fleet: Fleet) -> None:
        alive = [slot for slot in self.slots if slot.proc.poll() is None]
        if not alive:
            return
        slot = self.rng.choice(alive)
        broker = self.backend.broker
        info = worker_info(broker, slot.worker_id) or {}
        prefix = f"{self.queue}:"
        listed = [entry[len(prefix):] for entry in info.get("jobs", [])
                  if entry.startswith(prefix)]
        # The heartbeat may be a beat old: keep only jobs Redis still shows
        # running (an acked job has no hash any more), with their attempt.
        held = {job_id: int(state["attempts"])
                for job_id, state in broker.held_states(self.queue, listed).items()
                if state["state"] == JobState.RUNNING}
        at = timezone.now()
        slot.proc.kill()
        slot.proc.wait()
        died_at = time.time()
        self.deaths[slot.proc.pid] = died_at
        self.kills.append(Kill(slot.worker_id, at, held, pid=slot.proc.pid, died_at=died_at))
        self.slots[self.slots.index(slot)] = self._start_worker(fleet)

    def _stop_one(self, fleet: Fleet) -> None:
        """A rolling deploy's step: SIGTERM a random worker and start its replacement now.

        Every ``second_sigterm_every``-th stop gets a second SIGTERM a second
        later (a hard stop). The worker drains by itself; _reap_stopping
        notes when it exited. Only a worker that beats is chosen: one still
        starting has no signal handler yet, and would die of the signal.
        """
        alive = [slot for slot in self.slots if slot.proc.poll() is None
                 and worker_info(self.backend.broker, slot.worker_id) is not None]
        if not alive:
            return
        slot = self.rng.choice(alive)
        slot.proc.terminate()
        now = time.time()
        every = self.config.second_sigterm_every
        hard = bool(every) and (len(self.stops) + 1) % every == 0
        stop = Stop(slot.worker_id, slot.proc.pid, signalled_at=now,
                    deadline=now + (SECOND_SIGTERM_AFTER_S if hard else self.config.grace_s),
                    second_at=now + SECOND_SIGTERM_AFTER_S if hard else None)
        self.stops.append(stop)
        self._stopping.append((stop, slot.proc))
        self.slots[self.slots.index(slot)] = self._start_worker(fleet)

    def _reap_stopping(self, *, wait: bool = False) -> None:
        """Send due second SIGTERMs, note exits, SIGKILL a stop that takes too long.

        ``wait``: until every stopping worker has exited (bounded by the same
        limit), so none is left for the final stop of the fleet.
        """
        while self._stopping:
            now = time.time()
            for stop, proc in list(self._stopping):
                if proc.poll() is not None:
                    stop.exited_at, stop.exit_code = time.time(), proc.returncode
                    self._stopping.remove((stop, proc))
                    if stop.second_at is not None or proc.returncode != 0:
                        # A hard stop is a crash for the jobs it cut short, and
                        # so is an exit that was not clean.
                        self.deaths[proc.pid] = stop.exited_at
                elif stop.second_at is not None and now >= stop.second_at \
                        and not stop.second_sent:
                    with contextlib.suppress(ProcessLookupError):
                        proc.terminate()
                    stop.second_sent, stop.deadline = True, time.time()
                elif now > stop.signalled_at + self.config.grace_s + STOP_SLACK_S:
                    proc.kill()
                    proc.wait()
                    stop.killed, stop.exited_at = True, time.time()
                    stop.exit_code = proc.returncode
                    self.deaths[proc.pid] = stop.exited_at
                    self._stopping.remove((stop, proc))
                    self.out(f"chaosjobs: worker {stop.worker_id} did not stop within "
                             f"{self.config.grace_s + STOP_SLACK_S:g} s of its SIGTERM; "
                             "SIGKILLed")
            if not wait:
                return
            time.sleep(0.05)

    def _restart_exited(self, fleet: Fleet) -> None:
        """Replace a worker or sweep that exited by itself (counted: it should not happen)."""
        for index, slot in enumerate(self.slots):
            if slot.proc.poll() is not None:
                self.unexpected_exits += 1
                # Dead some time before this poll: a late upper bound, which can
                # only make the ledger see an overlap that was not there.
                self.deaths[slot.proc.pid] = time.time()
                self.out(f"chaosjobs: worker {slot.worker_id} exited by itself with "
                         f"{slot.proc.returncode}:\n{fleet.log_tail(slot.name)}")
                self.slots[index] = self._start_worker(fleet)
        if self._sweep is not None and self._sweep.poll() is not None:
            self.unexpected_exits += 1
            self.out(f"chaosjobs: the sweep exited by itself with {self._sweep.returncode}")
            self._start_sweep(fleet)

    def _drain(self, fleet: Fleet, ids: list[str]) -> float | None:
        """Wait, bounded, until the queue has drained; return how long it took (None: timeout)."""
        started = time.monotonic()
        deadline = started + self.config.drain_timeout_s
        while time.monotonic() < deadline:
            self._restart_exited(fleet)
            self._reap_stopping()
            if self._drained(ids):
                return time.monotonic() - started
            time.sleep(POLL_S)
        return None

    def _forget_killed(self) -> None:
        """Drop the heartbeats of killed workers, so the admin does not list them as live."""
        with contextlib.suppress(Exception):
            for kill in self.kills:
                self.backend.broker.forget_worker(kill.worker_id)
