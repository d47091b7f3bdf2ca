"""The chaos run's execution ledger: every run of the task, written outside the queue.

"Lost = 0" says every job ended; it does not say how it got there. The
queue's own records (attempt rows, Redis hashes) are written by the code
under test, so they cannot witness its mistakes: a job run twice at once,
or run again after it had already succeeded, may leave a perfectly
consistent history. The ledger is written by the task itself, around its
body, into plain files the queue never touches, and the chaos run compares
it with what it knows independently (which processes it killed, and when)
and with the mirror's final states.

Format: one JSON object per line, in one file per process
(``<pid>.jsonl``), a ``start`` line before the body and an ``end`` line
after it with the outcome. Lines are written with one ``write()`` on an
``O_APPEND`` descriptor and are far shorter than ``PIPE_BUF``, so lines of
threads of one process never interleave, and a SIGKILL leaves whole lines
only: the kernel has the bytes once ``write()`` returned, so nothing needs
flushing and a killed process's last ``start`` survives it. Times are
``time.time()``: every process runs on one machine, so one clock.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from reliable_jobs.exceptions import PermanentFailure

#: Environment variable naming the ledger directory; unset, nothing is written.
LEDGER_ENV = "RJ_CHAOS_LEDGER"
#: Outcomes of an ``end`` line.
SUCCEEDED = "succeeded"
#: The body raised an exception the queue retries (until ``max_attempts``).
FAILED = "failed"
#: The body raised :class:`PermanentFailure`: the job must end dead, never run again.
GAVE_UP = "gave_up"
#: Longest line written; below ``PIPE_BUF`` (4096 on Linux), so each write is atomic.
MAX_LINE = 1024

_fds: dict[tuple[int, str], int] = {}
_fds_lock = threading.Lock()


def _append(directory: str, record: Mapping[str, object]) -> None:
    line = (json.dumps(record, separators=(",", ":")) + "\n").encode()
    if len(line) > MAX_LINE:
        raise ValueError(f"ledger line of {len(line)} bytes; at most {MAX_LINE} are atomic")
    pid = os.getpid()
    with _fds_lock:
        # Keyed by pid as well: a forked child must open its own file.
        fd = _fds.get((pid, directory))
        if fd is None:
            fd = os.open(Path(directory) / f"{pid}.jsonl",
                         os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            _fds[(pid, directory)] = fd
    os.write(fd, line)


@contextlib.contextmanager
def ledger_run(job_id: str, attempt: int) -> Iterator[None]:
    """Record one run of a task body: a ``start`` line now, an ``end`` line with its outcome.

    Does nothing unless :data:`LEDGER_ENV` is set, so the chaos task costs
    nothing elsewhere. Exceptions pass through unchanged: the ledger only
    watches.
    """
    directory = os.environ.get(LEDGER_ENV)
    if not directory:
        yield
        return
    base = {"run": uuid.uuid4().hex[:16], "job": job_id, "attempt": attempt,
            "pid": os.getpid()}
    _append(directory, {**base, "event": "start", "t": time.time()})
    outcome = FAILED
    try:
        yield
        outcome = SUCCEEDED
    except PermanentFailure:
        outcome = GAVE_UP
        raise
    finally:
        _append(directory, {**base, "event": "end", "t": time.time(), "outcome": outcome})


@dataclass(frozen=True, slots=True)
class Run:
    """One run of the task body; ``end`` and ``outcome`` are None if its process died in it."""

    run: str
    job: str
    attempt: int
    pid: int
    start: float
    end: float | None = None
    outcome: str | None = None


@dataclass(slots=True)
class Ledger:
    runs: list[Run] = field(default_factory=list)
    #: Lines that are not a whole ledger record (should stay 0: writes are atomic).
    unreadable: int = 0


def read_ledger(directory: Path) -> Ledger:
    """Every run recorded under ``directory``, a start paired with its end by run id."""
    starts: dict[str, dict[str, Any]] = {}
    ends: dict[str, dict[str, Any]] = {}
    unreadable = 0
    for path in sorted(directory.glob("*.jsonl")):
        for line in path.read_text(errors="replace").splitlines():
            try:
                record = json.loads(line)
                event, run_id = record["event"], record["run"]
            except (ValueError, KeyError, TypeError):
                unreadable += 1
                continue
            if event == "start":
                starts[run_id] = record
            elif event == "end":
                ends[run_id] = record
            else:
                unreadable += 1
    runs = []
    for run_id, start in starts.items():
        end = ends.pop(run_id, None)
        runs.append(Run(
            run=run_id, job=str(start["job"]), attempt=int(start["attempt"]),
            pid=int(start["pid"]), start=float(start["t"]),
            end=None if end is None else float(end["t"]),
            outcome=None if end is None else str(end["outcome"]),
        ))
    unreadable += len(ends)  # an end without its start
    return Ledger(runs=sorted(runs, key=lambda r: (r.start, r.run)), unreadable=unreadable)


@dataclass(frozen=True, slots=True)
class Overlap:
    """Two runs of one job whose time spans intersect."""

    job: str
    first: Run
    second: Run


@dataclass(frozen=True, slots=True)
class WrongFinal:
    """A job whose final mirror state is not what its last completed run implies."""

    job: str
    state: str
    expected: str
    last: Run | None


@dataclass(frozen=True, slots=True)
class RerunWithoutCrash:
    """A run whose previous run of the same job was neither interrupted nor a retryable failure."""

    job: str
    previous: Run
    run: Run


@dataclass(slots=True)
class Findings:
    runs: int = 0
    jobs_run: int = 0
    overlaps: list[Overlap] = field(default_factory=list)
    wrong_final: list[WrongFinal] = field(default_factory=list)
    reruns_without_crash: list[RerunWithoutCrash] = field(default_factory=list)
    #: Runs with no end whose process the run never saw die (a worker can
    #: only stop mid-body by dying): each is held open to the end of the run.
    open_runs: list[Run] = field(default_factory=list)
    #: Jobs that ended dead although their last completed run succeeded,
    #: because that success never reached the mirror (its process crashed
    #: first) and the job then ran out of attempts: what G3 allows.
    buried_after_lost_success: list[WrongFinal] = field(default_factory=list)
    unreadable: int = 0
    #: The most runs of any jobs alive at one moment (a run without an end
    #: lives until its process died): what a concurrency cap bounds.
    most_at_once: int = 0

    @property
    def rerun_jobs(self) -> int:
        return len({finding.job for finding in self.reruns_without_crash})

    @property
    def clean(self) -> bool:
        return not (self.overlaps or self.wrong_final or self.reruns_without_crash)


def expected_state(last: Run | None) -> str:
    """The final state the last completed run implies: only a success may end succeeded.

    A job whose every run was cut short (a task that kills its worker) can
    only end dead, through ``max_attempts``.
    """
    return "succeeded" if last is not None and last.outcome == SUCCEEDED else "dead"


@dataclass(frozen=True, slots=True)
class GracefulStop:
    """A worker stopped by SIGTERM that exited by itself: when its grace ended, when it exited.

    ``deadline`` is the end of its grace period, or its second SIGTERM if
    that came first (a hard stop).
    """

    deadline: float
    exited_at: float


def analyse(ledger: Ledger | Iterable[Run], *, deaths: Mapping[int, float],
            final_states: Mapping[str, str], ended_at: float,
            redis_losses: Iterable[float] = (), start_lag_s: float = 1.0,
            stops: Mapping[int, GracefulStop] | None = None,
            mirrored_successes: Mapping[str, set[int]] | None = None,
            crashed_at: Mapping[int, float] | None = None) -> Findings:
    """Check the ledger against the process deaths the run caused and the final states.

    ``deaths`` maps the pid of every worker process that died during the run
    (SIGKILLed by it, or exited by itself) to the time it was known dead;
    ``final_states`` maps every enqueued job id to its final mirror state;
    ``ended_at`` is when the run stopped its processes; ``redis_losses``
    are the times Redis lost everything (a FLUSHDB), a crash of every job
    it held: whatever was running then may run again, and so may a job
    marked started just before the loss whose body began just after it
    (a worker marks up to 16 jobs at once and runs them in turn), hence
    ``start_lag_s``: a loss that early before a run's start still counts.

    - Concurrent runs: two runs of one job whose spans [start, end]
      intersect, where a run without an end lasts until its process died
      (or, if it never died, until ``ended_at``).
    - Wrong final state: only a job whose last completed run succeeded may
      end ``succeeded``; any other finished job must be ``dead``. Jobs not
      finished are the ``lost`` count's business and are skipped.
    - Re-run without a crash: a run whose previous run of the job (by start
      time) neither failed retryably nor had its process die between that
      previous run's start and this run's start (while it ran the job or
      still held it, unacked), nor Redis lose its data in that window. A job
      first run in a process killed later is excused only for kills inside
      that window.
    - A graceful stop (``stops``: pid -> its deadline and exit) is no crash:
      a run that ended before its worker's deadline must never run again
      (its outcome was recorded in the grace period). Only a run still going
      at the deadline (cut short by the exit, or ended too late for its
      outcome to be recorded) may run again, and only after its process
      exited: the job is left to its lease, never handed back while the
      process may still run it. A run with no end in such a process lasts
      until the process exited.
    - ``crashed_at``: for a process in ``deaths`` whose crash began before
      it died (a second SIGTERM: the worker drops what it has not
      committed at once, then exits), when it began. A re-run is excused
      from then on; its runs still last until the death.
    - ``mirrored_successes`` (job -> the attempts the mirror recorded as
      succeeded), when given: a job that ended dead although its last
      completed run succeeded is no wrong final state if that success never
      reached the mirror and its process crashed (or was stopped past its
      deadline) after the run ended: the success died with the process, the
      job ran out of attempts. It is listed apart.
    """
    stops = stops or {}
    crashed_at = crashed_at or {}
    losses = sorted(redis_losses)
    runs = list(ledger.runs if isinstance(ledger, Ledger) else ledger)
    findings = Findings(runs=len(runs),
                        unreadable=ledger.unreadable if isinstance(ledger, Ledger) else 0)
    by_job: dict[str, list[Run]] = defaultdict(list)
    for run in runs:
        by_job[run.job].append(run)
    findings.jobs_run = len(by_job)

    def until(run: Run) -> float:
        if run.end is not None:
            return run.end
        stop = stops.get(run.pid)
        return deaths.get(run.pid, stop.exited_at if stop is not None else ended_at)

    findings.open_runs = [run for run in runs if run.end is None and run.pid not in deaths
                          and run.pid not in stops]
    findings.most_at_once = most_at_once([(run.start, until(run)) for run in runs])
    for job, job_runs in by_job.items():
        job_runs.sort(key=lambda r: (r.start, r.run))
        for index, first in enumerate(job_runs):
            for second in job_runs[index + 1:]:
                if second.start < until(first):
                    findings.overlaps.append(Overlap(job, first, second))
        for previous, run in itertools.pairwise(job_runs):
            if previous.outcome == FAILED:
                continue
            died = deaths.get(previous.pid)
            if died is not None and previous.start <= min(
                    died, crashed_at.get(previous.pid, died)) <= run.start:
                continue
            if any(previous.start - start_lag_s <= lost <= run.start for lost in losses):
                continue
            stop = stops.get(previous.pid)
            if (stop is not None and (previous.end is None or previous.end > stop.deadline)
                    and until(previous) <= run.start):
                continue
            findings.reruns_without_crash.append(RerunWithoutCrash(job, previous, run))
    for job, state in final_states.items():
        if state not in ("succeeded", "dead"):
            continue
        completed = [run for run in by_job.get(job, ()) if run.end is not None]
        last = max(completed, key=lambda r: (r.end or 0.0, r.start), default=None)
        expected = expected_state(last)
        if state == expected:
            continue
        wrong = WrongFinal(job, state, expected, last)
        if last is not None and mirrored_successes is not None and state == "dead" \
                and last.attempt not in mirrored_successes.get(job, ()) \
                and lost_with_its_process(last, deaths, stops):
            findings.buried_after_lost_success.append(wrong)
        else:
            findings.wrong_final.append(wrong)
    return findings


def most_at_once(spans: Iterable[tuple[float, float]]) -> int:
    """The most (start, end) spans open at one moment; an end before a start at a tie."""
    events = sorted([(start, 1) for start, _ in spans] + [(end, -1) for _, end in spans])
    alive = most = 0
    for _, step in sorted(events, key=lambda e: (e[0], e[1])):
        alive += step
        most = max(most, alive)
    return most


def lost_with_its_process(run: Run, deaths: Mapping[int, float],
                          stops: Mapping[int, GracefulStop]) -> bool:
    """Whether ``run``'s process ended, by a crash or past a stop's deadline, after it ran."""
    died = deaths.get(run.pid)
    if died is not None:
        return run.end is not None and died >= run.end
    stop = stops.get(run.pid)
    return stop is not None and run.end is not None and run.end > stop.deadline


def clock(t: float | None) -> str:
    """``HH:MM:SS.mmm`` UTC, the form worker logs can be searched for."""
    if t is None:
        return "-"
    return datetime.fromtimestamp(t, UTC).strftime("%H:%M:%S.%f")[:-3]


def describe_run(run: Run, deaths: Mapping[int, float],
                 stops: Mapping[int, GracefulStop] | None = None) -> str:
    died = deaths.get(run.pid)
    stop = (stops or {}).get(run.pid)
    return (f"attempt {run.attempt} pid {run.pid} {clock(run.start)}-{clock(run.end)} "
            f"{run.outcome or 'no end'}"
            + (f" (pid died {clock(died)})" if died is not None
               else f" (pid stopped: grace ended {clock(stop.deadline)}, exited "
                    f"{clock(stop.exited_at)})" if stop is not None
               else " (pid never killed)"))


def evidence(findings: Findings, deaths: Mapping[int, float], *, limit: int = 20,
             stops: Mapping[int, GracefulStop] | None = None) -> list[str]:
    """One line per finding (at most ``limit`` of each kind): job, runs, pids, times (UTC)."""
    lines: list[str] = []
    for overlap in findings.overlaps[:limit]:
        lines.append(f"ran concurrently: job {overlap.job}: "
                     f"{describe_run(overlap.first, deaths, stops)} | "
                     f"{describe_run(overlap.second, deaths, stops)}")
    for wrong in findings.wrong_final[:limit]:
        lines.append(f"final state differs: job {wrong.job} is {wrong.state}, its last completed "
                     f"run says {wrong.expected}: "
                     + (describe_run(wrong.last, deaths, stops) if wrong.last
                        else "no completed run"))
    for rerun in findings.reruns_without_crash[:limit]:
        lines.append(f"re-ran without a crash: job {rerun.job}: "
                     f"{describe_run(rerun.previous, deaths, stops)} then "
                     f"{describe_run(rerun.run, deaths, stops)}")
    for wrong in findings.buried_after_lost_success[:limit]:
        lines.append(f"dead after its last success died unrecorded with its process "
                     f"(allowed): job {wrong.job}: "
                     + (describe_run(wrong.last, deaths, stops) if wrong.last else "-"))
    for run in findings.open_runs[:limit]:
        lines.append(f"run with no end in a process never seen dying: job {run.job}: "
                     f"{describe_run(run, deaths, stops)}")
    if findings.unreadable:
        lines.append(f"{findings.unreadable} unreadable ledger line(s)")
    return lines
