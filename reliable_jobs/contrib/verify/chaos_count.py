"""Counting a chaos run: whether the queue drained, and the report of every job's end.

Reads only (the mirror's rows, Redis's counts, the execution ledger); the
run itself (:class:`~.chaos.ChaosRun`) starts, kills and stops processes.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from reliable_jobs.compat import Task
from reliable_jobs.models import Attempt, AttemptOutcome, Job, JobState
from reliable_jobs.worker.executor import MARK_AHEAD

from . import chaos_ledger
from .broker_reads import lease_count
from .chaos_report import ChaosConfig, ChaosReport, Fault, Kill, Stop, rerun_delays

if TYPE_CHECKING:
    from reliable_jobs.backend import ReliableJobsBackend

#: Job ids per database query (SQLite caps the variables of one statement).
ID_CHUNK = 500
#: Report rows of the two server faults.
FLUSH_FAULT = "Redis restarted empty (FLUSHDB)"
CUT_FAULT = "PostgreSQL cut off (TCP proxy)"


class ChaosCounting:
    """The counting half of :class:`~.chaos.ChaosRun`, which sets these attributes."""

    backend: ReliableJobsBackend
    config: ChaosConfig
    queue: str
    seed: int
    log_dir: Path
    ledger_dir: Path
    kills: list[Kill]
    stops: list[Stop]
    faults: list[Fault]
    deaths: dict[int, float]
    unexpected_exits: int
    _planned: tuple[int, int]

    def task(self) -> Task[..., Any]:
        raise NotImplementedError

    def _unfinished(self, ids: list[str]) -> int:
        finished = sum(
            Job.objects.using(self.backend.database).filter(
                pk__in=chunk, state__in=(JobState.SUCCEEDED, JobState.DEAD)).count()
            for chunk in _chunks(ids))
        return len(ids) - finished

    def _drained(self, ids: list[str]) -> bool:
        """Every job succeeded or dead in the mirror AND Redis holds nothing for the queue.

        The mirror alone is not enough: a worker killed after writing a
        success but before its ack leaves the job in Redis, to run again.
        """
        finished = 0
        for chunk in _chunks(ids):
            finished += Job.objects.using(self.backend.database).filter(
                pk__in=chunk, state__in=(JobState.SUCCEEDED, JobState.DEAD)).count()
        if finished < len(ids):
            return False
        counts = self.backend.broker.counts(self.queue)
        return not (counts.queued or counts.running or counts.scheduled
                    or lease_count(self.backend.broker, self.queue))

    def _report(self, ids: list[str], chaos_s: float, drain_s: float | None, *,
                ended_at: float) -> ChaosReport:
        database = self.backend.database
        report = ChaosReport(
            config=self.config, lease_ms=self.backend.config.LEASE_MS,
            sweep_interval_ms=self.backend.config.SWEEP_INTERVAL_MS,
            max_attempts_allowed=self.backend.task_option(self.task(), "max_attempts"),
            seed=self.seed, enqueued=len(ids), kills=len(self.kills),
            unexpected_exits=self.unexpected_exits, chaos_s=chaos_s, drain_s=drain_s,
            log_dir=str(self.log_dir), planned_failures=self._planned[0],
            planned_give_ups=self._planned[1], stops=len(self.stops),
            hard_stops=sum(1 for stop in self.stops if stop.second_at is not None),
            unclean_stops=sum(1 for stop in self.stops if stop.killed or stop.exit_code != 0),
        )
        states: Counter[str] = Counter()
        final_states: dict[str, str] = {}
        attempts: dict[str, list[Attempt]] = defaultdict(list)
        for chunk in _chunks(ids):
            for pk, state, last_error in Job.objects.using(database).filter(
                    pk__in=chunk).values_list("pk", "state", "last_error"):
                final_states[str(pk)] = state
                states[state] += 1
                if state == JobState.DEAD and not last_error:
                    report.dead_without_error += 1
            jobs = Job.objects.using(database).filter(pk__in=chunk)
            report.claimed_again += jobs.filter(attempts__gt=1).count()
            report.max_attempts_seen = max(
                report.max_attempts_seen,
                max(jobs.values_list("attempts", flat=True), default=0))
            for attempt in Attempt.objects.using(database).filter(job_id__in=chunk).only(
                    "job_id", "number", "worker_id", "started_at", "outcome"):
                attempts[str(attempt.job_id)].append(attempt)
        report.succeeded = states[JobState.SUCCEEDED]
        report.dead = states[JobState.DEAD]
        runs = [sum(1 for a in rows if a.started_at) for rows in attempts.values()]
        report.ran_again = sum(1 for count_ in runs if count_ > 1)
        report.max_runs_seen = max(runs, default=0)
        reruns = rerun_delays(self.kills, attempts)
        report.rerun_s = [delay for _, delay in reruns]
        report.interrupted = len({job_id for job_id, _ in reruns})
        cfg = self.config
        report.faults = {
            FLUSH_FAULT: "off" if cfg.flush_redis_at_s is None else "not reached",
            CUT_FAULT: "off" if cfg.cut_postgres_at_s is None else "not reached",
        } | {fault.name: fault.detail for fault in self.faults}
        mirrored_successes: dict[str, set[int]] = defaultdict(set)
        for job_id, rows in attempts.items():
            mirrored_successes[job_id] = {a.number for a in rows
                                          if a.outcome == AttemptOutcome.SUCCEEDED}
        self._check_ledger(report, final_states, ended_at, mirrored_successes)
        if report.lost or drain_s is None:
            report.leftovers = self._leftovers(ids, states)
        return report

    def _check_ledger(self, report: ChaosReport, final_states: dict[str, str],
                      ended_at: float, mirrored_successes: dict[str, set[int]]) -> None:
        """Read the execution ledger, check it, and keep the evidence next to the logs."""
        ledger = chaos_ledger.read_ledger(self.ledger_dir)
        if not ledger.runs:
            return  # a --task that keeps no ledger: nothing to check
        # Stops that ended cleanly: a second SIGTERM or an unclean exit is in
        # self.deaths already, as a crash.
        stops = {stop.pid: chaos_ledger.GracefulStop(stop.deadline, stop.exited_at)
                 for stop in self.stops if stop.exited_at and stop.pid not in self.deaths}
        findings = chaos_ledger.analyse(
            ledger, deaths=self.deaths, final_states=final_states, ended_at=ended_at,
            redis_losses=[fault.wall for fault in self.faults if fault.name == FLUSH_FAULT],
            start_lag_s=max(1.0, 2 * MARK_AHEAD * self.config.task_ms / 1000), stops=stops,
            mirrored_successes=mirrored_successes,
            crashed_at={stop.pid: stop.deadline for stop in self.stops
                        if stop.second_sent and stop.pid in self.deaths})
        report.ledger = findings
        deadlines = {stop.pid: stop.deadline for stop in self.stops if stop.exited_at}
        report.cut_by_stop = sum(
            1 for run in ledger.runs
            if (deadline := deadlines.get(run.pid)) is not None and run.start <= deadline
            and (run.end is None or run.end > deadline))
        report.evidence = chaos_ledger.evidence(findings, self.deaths, stops=stops)
        lines = [f"kill: worker {kill.worker_id} pid {kill.pid} dead at "
                 f"{chaos_ledger.clock(kill.died_at)}" for kill in self.kills]
        lines += [f"stop: worker {stop.worker_id} pid {stop.pid} SIGTERM at "
                  f"{chaos_ledger.clock(stop.signalled_at)}"
                  + (" and again" if stop.second_at is not None else "")
                  + f", deadline {chaos_ledger.clock(stop.deadline)}, exited "
                  f"{chaos_ledger.clock(stop.exited_at or None)} with {stop.exit_code}"
                  + (" (SIGKILLed)" if stop.killed else "") for stop in self.stops]
        lines += [f"fault: {fault.name} {fault.detail} ({chaos_ledger.clock(fault.wall)} UTC)"
                  for fault in self.faults]
        (self.log_dir / "ledger-findings.txt").write_text(
            "\n".join([*lines, *chaos_ledger.evidence(findings, self.deaths, limit=10**9,
                                                       stops=stops)])
            + "\n")

    def _leftovers(self, ids: list[str], states: Counter[str]) -> str:
        """What is still unfinished: the evidence a bug report needs."""
        counts = self.backend.broker.counts(self.queue)
        stuck = [
            f"{job.pk} {job.state} attempts={job.attempts} updated={job.updated_at:%H:%M:%S.%f}"
            for chunk in _chunks(ids)
            for job in Job.objects.using(self.backend.database).filter(pk__in=chunk).exclude(
                state__in=(JobState.SUCCEEDED, JobState.DEAD))[:10]
        ][:10]
        return (f"job states {dict(states)}; Redis: {counts.queued} queued, {counts.running} "
                f"running, {counts.scheduled} scheduled, "
                f"{lease_count(self.backend.broker, self.queue)} leases; first unfinished: "
                + ("; ".join(stuck) or "none"))


def _chunks(ids: list[str]) -> Iterator[list[str]]:
    for start in range(0, len(ids), ID_CHUNK):
        yield ids[start:start + ID_CHUNK]
