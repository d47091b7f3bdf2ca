"""What a chaos run is told and what it tells: its config, its kills and faults, its report.

Plain data and the arithmetic over it (the rerun delays after each kill),
apart from the processes and servers :mod:`.chaos` drives.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from datetime import datetime

from reliable_jobs.models import Attempt, AttemptOutcome

from . import chaos_ledger

#: The task a chaos run enqueues unless told otherwise (this app's): it
#: sleeps, so jobs are running (not just queued) when their worker is killed.
DEFAULT_TASK = "reliable_jobs.contrib.verify.tasks.chaos_job"
#: Outcomes of an attempt that the task itself caused: not a crash.
TASK_FAILURES = (AttemptOutcome.FAILED, AttemptOutcome.TIMED_OUT)


class ChaosError(Exception):
    """The run cannot start or cannot go on (bad flags, a busy queue, workers that never start)."""


class Interrupted(Exception):
    """SIGTERM or Ctrl-C arrived during the run."""


@dataclass(frozen=True, kw_only=True)
class ChaosConfig:
    """What ``chaosjobs`` was asked to do; durations in seconds, as the flags give them."""

    jobs: int = 5_000
    workers: int = 3
    concurrency: int = 2
    kill_every_s: float = 2.0
    duration_s: float = 20.0
    drain_timeout_s: float = 120.0
    task_ms: int = 5
    seed: int | None = None
    queue: str | None = None
    task_path: str = DEFAULT_TASK
    #: ``-v`` given to the child processes (per-job log lines from 1).
    child_verbosity: int = 0
    #: Percent of jobs planned to fail their first attempt (then retried), and
    #: to give up (``PermanentFailure``: dead); the task must accept the
    #: keyword arguments ``fail_attempts`` and ``give_up``.
    fail_percent: float = 0.0
    give_up_percent: float = 0.0
    #: Seconds into the chaos to FLUSHDB the backend's Redis database (None: never).
    flush_redis_at_s: float | None = None
    #: Seconds into the chaos to cut PostgreSQL off, and for how long (None: never).
    cut_postgres_at_s: float | None = None
    cut_postgres_for_s: float = 3.0
    #: Seconds between two rolling-deploy stops: SIGTERM a random worker and
    #: start its replacement at once (None: never).
    sigterm_every_s: float | None = None
    #: Every n-th of those stops gets a second SIGTERM (a hard stop) a second
    #: after the first (0: never).
    second_sigterm_every: int = 3
    #: ``--grace`` of every worker, in seconds.
    grace_s: float = 2.0
    #: Percent of jobs that sleep ``long_ms`` instead of ``task_ms``: longer
    #: than the grace period, so a deploy finds them running when it ends.
    long_percent: float = 0.0
    long_ms: int = 5_000

    def problems(self) -> list[str]:
        """Each flag that is out of range, as a whole sentence."""
        found = []
        for name, value, minimum in (("--jobs", self.jobs, 1), ("--workers", self.workers, 1),
                                     ("--concurrency", self.concurrency, 1),
                                     ("--task-ms", self.task_ms, 0),
                                     ("--duration", self.duration_s, 0),
                                     ("--fail-percent", self.fail_percent, 0),
                                     ("--give-up-percent", self.give_up_percent, 0),
                                     ("--flush-redis-at", self.flush_redis_at_s or 0, 0),
                                     ("--cut-postgres-at", self.cut_postgres_at_s or 0, 0),
                                     ("--second-sigterm-every", self.second_sigterm_every, 0),
                                     ("--grace", self.grace_s, 0),
                                     ("--long-percent", self.long_percent, 0),
                                     ("--long-ms", self.long_ms, 0)):
            if value < minimum:
                found.append(f"{name} must be at least {minimum}, not {value}.")
        if self.sigterm_every_s is not None and self.sigterm_every_s <= 0:
            found.append("--sigterm-every must be a positive number of seconds, not "
                         f"{self.sigterm_every_s}.")
        for name, value in (("--kill-every", self.kill_every_s),
                            ("--drain-timeout", self.drain_timeout_s),
                            ("--cut-postgres-for", self.cut_postgres_for_s)):
            if value <= 0:
                found.append(f"{name} must be a positive number of seconds, not {value}.")
        if self.fail_percent + self.give_up_percent + self.long_percent > 100:
            found.append("--fail-percent, --give-up-percent and --long-percent add up to more "
                         "than 100.")
        return found


@dataclass(frozen=True, slots=True)
class Kill:
    """One SIGKILL: whom, when (wall clock, as attempts record it), what it held."""

    worker_id: str
    at: datetime
    #: Job id -> attempt number, for the jobs of the worker's last heartbeat
    #: that Redis still showed running just before the kill: this covers the
    #: jobs it had claimed but not started, which leave no attempt row.
    held: dict[str, int]
    pid: int = 0
    #: ``time.time()`` once the process was reaped: the end of its unfinished runs.
    died_at: float = 0.0


@dataclass(slots=True)
class Stop:
    """One rolling-deploy stop: a SIGTERM (maybe two) to a worker, and how it ended."""

    worker_id: str
    pid: int
    #: ``time.time()`` of the first SIGTERM.
    signalled_at: float
    #: ``time.time()`` when its running jobs may be cut short: the end of the
    #: grace period, or the second SIGTERM (a hard stop) if that came first.
    deadline: float
    #: When to send the second SIGTERM (None: never), and whether it was sent.
    second_at: float | None = None
    second_sent: bool = False
    #: ``time.time()`` once the process was reaped (0: still stopping).
    exited_at: float = 0.0
    exit_code: int | None = None
    #: It did not exit in time and was SIGKILLed (then it counts as a crash).
    killed: bool = False


@dataclass(frozen=True, slots=True)
class Fault:
    """A server fault the run caused: what, when (seconds into the chaos), what it hit."""

    name: str
    at_s: float
    detail: str
    #: ``time.time()`` when it happened, to line it up with the ledger and the logs.
    wall: float = 0.0


@dataclass
class ChaosReport:
    """The counts a run ends with; :meth:`table` is what ``chaosjobs`` prints."""

    config: ChaosConfig
    lease_ms: int
    sweep_interval_ms: int
    max_attempts_allowed: int
    seed: int
    enqueued: int = 0
    succeeded: int = 0
    dead: int = 0
    #: Jobs claimed more than once (``attempts`` > 1), started or not.
    claimed_again: int = 0
    #: Jobs with more than one started attempt: the task body really ran twice.
    ran_again: int = 0
    #: Most claims of one job (``attempts``, the fencing token).
    max_attempts_seen: int = 0
    #: Most started attempts of one job: what ``max_attempts`` bounds for a
    #: job whose claims were cut short before it started.
    max_runs_seen: int = 0
    kills: int = 0
    #: Rolling-deploy stops: workers SIGTERMed, those given a second SIGTERM,
    #: and those that exited non-zero or had to be SIGKILLed.
    stops: int = 0
    hard_stops: int = 0
    unclean_stops: int = 0
    #: Runs still going when their worker's grace period ended (or its second
    #: SIGTERM came): each may run again once its lease expires (a hard stop
    #: is a crash for them).
    cut_by_stop: int = 0
    #: Workers and sweeps that exited without being killed (restarted).
    unexpected_exits: int = 0
    #: Jobs that were in a killed worker's hands and then ran again.
    interrupted: int = 0
    #: Per (kill, job): seconds from the SIGKILL to the start of the next attempt.
    rerun_s: list[float] = field(default_factory=list)
    chaos_s: float = 0.0
    #: Seconds from the end of the chaos to the drained queue (None: timed out).
    drain_s: float | None = None
    log_dir: str = ""
    leftovers: str = ""
    planned_failures: int = 0
    planned_give_ups: int = 0
    #: Dead jobs whose row keeps no error: a death nobody can explain.
    dead_without_error: int = 0
    #: The ledger's verdict; None when the task wrote no ledger (another ``--task``).
    ledger: chaos_ledger.Findings | None = None
    #: One line per ledger finding: job, runs, pids, times.
    evidence: list[str] = field(default_factory=list)
    #: Fault name -> what happened ("off" when not asked for).
    faults: dict[str, str] = field(default_factory=dict)

    @property
    def lost(self) -> int:
        return self.enqueued - self.succeeded - self.dead

    @property
    def ok(self) -> bool:
        return (self.lost == 0 and self.drain_s is not None and self.dead_without_error == 0
                and self.unclean_stops == 0 and (self.ledger is None or self.ledger.clean))

    def table(self) -> str:
        """A Markdown table, ready for the documentation."""
        c = self.config
        rerun = sorted(self.rerun_s)

        def seconds(value: float | None) -> str:
            return "-" if value is None else f"{value:.2f} s"

        ledger = self.ledger

        def ledger_count(count: int) -> str:
            return "-" if ledger is None else f"**{count:,}**"

        rows = [
            ("jobs enqueued", f"{self.enqueued:,}"),
            ("succeeded", f"{self.succeeded:,}"),
            ("dead", f"{self.dead:,}"),
            ("**lost (must be 0)**", f"**{self.lost:,}**"),
            ("planned to fail once / to give up", f"{self.planned_failures:,} / "
                                                  f"{self.planned_give_ups:,}"),
            ("dead with no error kept (must be 0)", f"{self.dead_without_error:,}"),
            ("runs in the execution ledger",
             "- (the task keeps none)" if ledger is None else f"{ledger.runs:,}"),
            ("**ran concurrently (must be 0)**",
             ledger_count(len(ledger.overlaps) if ledger else 0)),
            ("**final state differs from the last run's outcome (must be 0)**",
             ledger_count(len(ledger.wrong_final) if ledger else 0)),
            ("**re-ran without a crash (must be 0)**",
             ledger_count(ledger.rerun_jobs if ledger else 0)),
            ("most runs at once (a concurrency cap bounds it)",
             "-" if ledger is None else f"{ledger.most_at_once:,}"),
            ("dead after its last success died unrecorded with its process",
             "-" if ledger is None else f"{len(ledger.buried_after_lost_success):,}"),
            ("claimed more than once (attempts > 1)", f"{self.claimed_again:,}"),
            ("run more than once (2+ started attempts)", f"{self.ran_again:,}"),
            ("most claims of one job (attempts)", f"{self.max_attempts_seen}"),
            ("most runs of one job (started attempts)",
             f"{self.max_runs_seen} (max_attempts {self.max_attempts_allowed})"),
            ("workers killed (SIGKILL)", f"{self.kills:,}"),
            ("workers stopped by SIGTERM (rolling deploy)",
             "off" if c.sigterm_every_s is None else f"{self.stops:,}"),
            ("of which stopped hard by a second SIGTERM",
             "off" if c.sigterm_every_s is None else f"{self.hard_stops:,}"),
            ("stops that exited non-zero or were SIGKILLed (must be 0)",
             "off" if c.sigterm_every_s is None else f"{self.unclean_stops:,}"),
            ("runs still going when their worker's grace ended (or second SIGTERM came)",
             "off" if c.sigterm_every_s is None else f"{self.cut_by_stop:,}"),
            *((name, detail) for name, detail in self.faults.items()),
            ("jobs a killed worker held, seen to run again", f"{self.interrupted:,}"),
            ("worst crash-to-rerun", seconds(rerun[-1] if rerun else None)),
            ("median crash-to-rerun", seconds(statistics.median(rerun) if rerun else None)),
            ("unexpected process exits", f"{self.unexpected_exits:,}"),
            ("chaos, then drain", f"{self.chaos_s:.1f} s, then "
             + ("timed out" if self.drain_s is None else f"{self.drain_s:.1f} s")),
        ]
        width = max(len(name) for name, _ in rows)
        lines = [
            f"chaosjobs: {self.enqueued:,} jobs of {c.task_ms} ms on {c.workers} workers x "
            f"{c.concurrency} threads, SIGKILL every {c.kill_every_s:g} s for {c.duration_s:g} s; "
            + (f"SIGTERM every {c.sigterm_every_s:g} s with --grace {c.grace_s:g} ("
               + (f"a second SIGTERM every {c.second_sigterm_every} stops"
                  if c.second_sigterm_every else "never a second SIGTERM")
               + f"), {c.long_percent:g}% of jobs {c.long_ms} ms; "
               if c.sigterm_every_s is not None else "")
            + f"LEASE_MS {self.lease_ms}, SWEEP_INTERVAL_MS {self.sweep_interval_ms}, "
            f"seed {self.seed}",
            "",
            f"| {'figure':<{width}} | value |",
            f"|{'-' * (width + 2)}|------:|",
            *(f"| {name:<{width}} | {value} |" for name, value in rows),
        ]
        return "\n".join(lines)


def rerun_delays(kills: list[Kill], attempts: dict[str, list[Attempt]]
                 ) -> list[tuple[str, float]]:
    """For each kill and each job its worker held: (job id, seconds until it ran again).

    The worker held attempt ``n`` of a job if Redis showed it running with
    that attempt just before the kill (from the heartbeat's list), or if the
    worker's attempt ``n`` was the job's latest to start before the kill and
    did not fail by itself (a task error is a retry, not a crash). It "ran
    again" when attempt ``n + 1`` started. If ``n + 1`` never started (the
    job was dead, or was claimed by a worker that died before starting it),
    this crash's delay is not counted; the next one is measured on its own.
    """
    delays: list[tuple[str, float]] = []
    for kill in kills:
        held = dict(kill.held)
        for job_id, rows in attempts.items():
            before = [a for a in rows if a.started_at and a.started_at < kill.at]
            latest = max(before, key=lambda a: a.number, default=None)
            if (latest is not None and latest.worker_id == kill.worker_id
                    and latest.outcome not in TASK_FAILURES):
                held[job_id] = latest.number
        for job_id, number in held.items():
            again = [a.started_at for a in attempts.get(job_id, ())
                     if a.number == number + 1 and a.started_at and a.started_at >= kill.at]
            if again:
                delays.append((job_id, (again[0] - kill.at).total_seconds()))
    return delays
