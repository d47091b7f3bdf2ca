"""The chaos run's execution ledger: each check can fail, and a clean history passes.

The chaos run asserts that three counts are 0; a count that can never be
anything else would prove nothing. These tests hand the analysis ledgers
written by hand (the JSON lines a task writes) with one defect each, and a
ledger of legitimate re-runs (after a kill, after a planned failure) that
must not be counted. No database or Redis: the analysis is pure.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from reliable_jobs.contrib.verify.chaos_ledger import (
    LEDGER_ENV,
    GracefulStop,
    analyse,
    evidence,
    ledger_run,
    read_ledger,
)
from reliable_jobs.exceptions import PermanentFailure

WORKER_A, WORKER_B, WORKER_C = 1001, 1002, 1003
T0 = 1_800_000_000.0


def write_ledger(directory: Path, runs: list[dict[str, Any]]) -> Path:
    """Write runs as a task would: a start line, and an end line unless its process died."""
    directory.mkdir(exist_ok=True)
    for number, run in enumerate(runs):
        base = {"run": f"r{number}", "job": run["job"], "attempt": run["attempt"],
                "pid": run["pid"]}
        lines = [{**base, "event": "start", "t": T0 + run["start"]}]
        if run.get("end") is not None:
            lines.append({**base, "event": "end", "t": T0 + run["end"],
                          "outcome": run["outcome"]})
        with open(directory / f"{run['pid']}.jsonl", "a") as file:
            file.writelines(json.dumps(line) + "\n" for line in lines)
    return directory


def run(job: str, attempt: int, pid: int, start: float, end: float | None,
        outcome: str | None = "succeeded") -> dict[str, Any]:
    return {"job": job, "attempt": attempt, "pid": pid, "start": start, "end": end,
            "outcome": outcome}


def test_two_runs_of_one_job_at_the_same_time_are_counted(tmp_path: Path) -> None:
    # Given: job j1 runs on worker A from 10.0 to 10.5 s and on worker B from
    # 10.2 s, while A still runs it (a stale worker, no kill in between)
    ledger = read_ledger(write_ledger(tmp_path / "ledger", [
        run("j1", 1, WORKER_A, 10.0, 10.5),
        run("j1", 2, WORKER_B, 10.2, 10.6),
        run("j2", 1, WORKER_A, 11.0, 11.1),
    ]))

    # When
    findings = analyse(ledger, deaths={}, final_states={"j1": "succeeded", "j2": "succeeded"},
                       ended_at=T0 + 20)

    # Then: one overlapping pair, and j1's second run is also a re-run no crash explains
    assert [(o.job, o.first.pid, o.second.pid) for o in findings.overlaps] == [
        ("j1", WORKER_A, WORKER_B)]
    assert [r.job for r in findings.reruns_without_crash] == ["j1"]
    assert findings.wrong_final == []
    assert not findings.clean
    lines = evidence(findings, {})
    assert any(line.startswith("ran concurrently: job j1") and str(WORKER_B) in line
               for line in lines), lines


def test_a_killed_runs_span_ends_when_its_process_died(tmp_path: Path) -> None:
    # Given: A started j1 at 10.0 s and was SIGKILLed (dead at 12.0 s) before
    # it ended; B ran j1 again from 11.5 s, before A was dead
    ledger = read_ledger(write_ledger(tmp_path / "ledger", [
        run("j1", 1, WORKER_A, 10.0, None, None),
        run("j1", 2, WORKER_B, 11.5, 11.6),
    ]))

    # When
    findings = analyse(ledger, deaths={WORKER_A: T0 + 12.0}, final_states={"j1": "succeeded"},
                       ended_at=T0 + 20)

    # Then: the overlap is counted, and so is the re-run: A was still alive
    # when B started j1, so no crash explains it yet
    assert [(o.first.pid, o.second.pid) for o in findings.overlaps] == [(WORKER_A, WORKER_B)]
    assert [r.run.pid for r in findings.reruns_without_crash] == [WORKER_B]


def test_a_rerun_without_a_kill_or_a_retryable_failure_is_counted(tmp_path: Path) -> None:
    # Given: j1 succeeded on A, whose process was never killed, then ran again on B;
    # j2 gave up (PermanentFailure) on B and ran again on C; j3 succeeded on C, C was
    # killed long after j3 ran again elsewhere
    ledger = read_ledger(write_ledger(tmp_path / "ledger", [
        run("j1", 1, WORKER_A, 10.0, 10.1),
        run("j1", 2, WORKER_B, 13.0, 13.1),
        run("j2", 1, WORKER_B, 10.0, 10.1, "gave_up"),
        run("j2", 2, WORKER_C, 12.0, 12.1, "gave_up"),
        run("j3", 1, WORKER_C, 10.0, 10.1),
        run("j3", 2, WORKER_A, 11.0, 11.1),
    ]))

    # When
    findings = analyse(ledger, deaths={WORKER_C: T0 + 15.0},
                       final_states={"j1": "succeeded", "j2": "dead", "j3": "succeeded"},
                       ended_at=T0 + 20)

    # Then: all three jobs are counted, with the runs as evidence
    assert sorted(r.job for r in findings.reruns_without_crash) == ["j1", "j2", "j3"]
    assert findings.rerun_jobs == 3
    assert findings.overlaps == []
    assert findings.wrong_final == []
    lines = evidence(findings, {WORKER_C: T0 + 15.0})
    assert any("re-ran without a crash: job j1" in line and "pid never killed" in line
               for line in lines), lines


def test_a_final_state_its_last_run_contradicts_is_counted(tmp_path: Path) -> None:
    # Given: j1's last run succeeded but the row says dead; j2's last run failed for good
    # but the row says succeeded; j3 succeeded with no run in the ledger at all
    ledger = read_ledger(write_ledger(tmp_path / "ledger", [
        run("j1", 1, WORKER_A, 10.0, 10.1),
        run("j2", 1, WORKER_A, 10.0, 10.1, "gave_up"),
    ]))

    # When
    findings = analyse(ledger, deaths={},
                       final_states={"j1": "dead", "j2": "succeeded", "j3": "succeeded"},
                       ended_at=T0 + 20)

    # Then
    assert sorted((w.job, w.state, w.expected) for w in findings.wrong_final) == [
        ("j1", "dead", "succeeded"), ("j2", "succeeded", "dead"), ("j3", "succeeded", "dead")]
    assert findings.overlaps == [] and findings.reruns_without_crash == []


def test_reruns_a_kill_or_a_planned_failure_explains_are_not_counted(tmp_path: Path) -> None:
    # Given: j1 was running on A when A was killed (dead at 10.2 s), then ran on B;
    # j2 had finished on A but was still held (unacked) when A died, then ran on B;
    # j3 failed retryably on B, then succeeded on C; j4 killed its worker on every
    # run (A, then C) and ended dead with no completed run; j5 gave up once, dead
    deaths = {WORKER_A: T0 + 10.2, WORKER_C: T0 + 14.0}
    ledger = read_ledger(write_ledger(tmp_path / "ledger", [
        run("j1", 1, WORKER_A, 10.0, None, None),
        run("j1", 2, WORKER_B, 11.5, 11.6),
        run("j2", 1, WORKER_A, 10.0, 10.1),
        run("j2", 2, WORKER_B, 11.5, 11.6),
        run("j3", 1, WORKER_B, 10.0, 10.1, "failed"),
        run("j3", 2, WORKER_C, 10.3, 10.4),
        run("j4", 1, WORKER_A, 10.1, None, None),
        run("j4", 2, WORKER_C, 13.0, None, None),
        run("j5", 1, WORKER_B, 12.0, 12.1, "gave_up"),
    ]))

    # When
    findings = analyse(ledger, deaths=deaths, ended_at=T0 + 20, final_states={
        "j1": "succeeded", "j2": "succeeded", "j3": "succeeded", "j4": "dead", "j5": "dead",
        "j6": "dead"})

    # Then
    assert findings.clean, evidence(findings, deaths)
    assert findings.open_runs == []
    assert (findings.runs, findings.jobs_run) == (9, 5)


def test_a_run_with_no_end_in_a_live_process_lasts_to_the_end(tmp_path: Path) -> None:
    # Given: A started j1 and never ended it, and A was never seen dying
    ledger = read_ledger(write_ledger(tmp_path / "ledger", [
        run("j1", 1, WORKER_A, 10.0, None, None),
        run("j1", 2, WORKER_B, 18.0, 18.1),
    ]))

    # When
    findings = analyse(ledger, deaths={}, final_states={"j1": "succeeded"}, ended_at=T0 + 20)

    # Then: it is reported, and held open until the run ended, so it overlaps B's run
    assert [r.pid for r in findings.open_runs] == [WORKER_A]
    assert len(findings.overlaps) == 1


def test_the_task_side_writes_a_start_and_an_end_with_the_outcome(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Given: a ledger directory, as chaosjobs hands it to its workers
    monkeypatch.setenv(LEDGER_ENV, str(tmp_path))

    # When: three runs end in a success, a retryable failure and a permanent one
    with ledger_run("j1", 1):
        pass
    with pytest.raises(RuntimeError), ledger_run("j2", 1):
        raise RuntimeError("boom")
    with pytest.raises(PermanentFailure), ledger_run("j3", 2):
        raise PermanentFailure("no")

    # Then: one file for this process, each run paired with its outcome
    assert [path.name for path in tmp_path.iterdir()] == [f"{os.getpid()}.jsonl"]
    ledger = read_ledger(tmp_path)
    assert ledger.unreadable == 0
    assert sorted((r.job, r.attempt, r.pid, r.outcome) for r in ledger.runs) == [
        ("j1", 1, os.getpid(), "succeeded"), ("j2", 1, os.getpid(), "failed"),
        ("j3", 2, os.getpid(), "gave_up")]
    assert all(r.end is not None and r.end >= r.start for r in ledger.runs)


def test_a_rerun_across_a_redis_loss_is_a_crash_but_not_one_after_it(tmp_path: Path) -> None:
    # Given: Redis lost its data at 10.05 s. j1 ran on A from 10.0 s (its
    # outcome not yet mirrored) and again on A at 10.4 s, rebuilt from the
    # mirror; j2 first ran at 11.2 s, well after the loss, and again at 11.5 s
    ledger = read_ledger(write_ledger(tmp_path / "ledger", [
        run("j1", 1, WORKER_A, 10.0, 10.04),
        run("j1", 1, WORKER_A, 10.4, 10.44),
        run("j2", 1, WORKER_A, 11.2, 11.24),
        run("j2", 1, WORKER_A, 11.5, 11.54),
    ]))

    # When
    findings = analyse(ledger, deaths={}, final_states={"j1": "succeeded", "j2": "succeeded"},
                       ended_at=T0 + 20, redis_losses=[T0 + 10.05])

    # Then: only j2's second run is unexplained
    assert [r.job for r in findings.reruns_without_crash] == ["j2"]


def test_a_job_marked_started_just_before_a_redis_loss_may_run_again(tmp_path: Path) -> None:
    # Given: j1 was marked started before Redis lost its data at 10.0 s, its
    # body began 5 ms later, and the rebuilt job ran again at 10.4 s
    ledger = read_ledger(write_ledger(tmp_path / "ledger", [
        run("j1", 1, WORKER_A, 10.005, 10.045),
        run("j1", 1, WORKER_B, 10.4, 10.44),
    ]))

    # When / Then: within the start lag it is a crash; with no lag it is not
    excused = analyse(ledger, deaths={}, final_states={"j1": "succeeded"}, ended_at=T0 + 20,
                      redis_losses=[T0 + 10.0], start_lag_s=1.0)
    assert excused.reruns_without_crash == []
    strict = analyse(ledger, deaths={}, final_states={"j1": "succeeded"}, ended_at=T0 + 20,
                     redis_losses=[T0 + 10.0], start_lag_s=0.0)
    assert [r.job for r in strict.reruns_without_crash] == ["j1"]


def test_a_graceful_stop_excuses_only_runs_cut_by_its_deadline_and_rerun_after_its_exit(
    tmp_path: Path
) -> None:
    # Given: worker A got SIGTERM at 10.0 s with a 2 s grace (deadline 12.0 s)
    # and exited at 12.5 s. j1 ended within the grace period; j2 was still
    # running at the deadline (no end: its thread died with the process); j3
    # ended after the deadline, too late for its outcome; j4 was cut short
    # too, but handed back while A still ran it; j5 ended after the deadline
    # and ran again once it had ended (its outcome dropped), before A exited.
    ledger = read_ledger(write_ledger(tmp_path / "ledger", [
        run("j1", 1, WORKER_A, 9.0, 11.0),
        run("j1", 2, WORKER_B, 13.0, 13.1),
        run("j2", 1, WORKER_A, 9.5, None),
        run("j2", 2, WORKER_B, 14.0, 14.1),
        run("j3", 1, WORKER_A, 9.6, 12.2),
        run("j3", 2, WORKER_B, 14.5, 14.6),
        run("j4", 1, WORKER_A, 9.7, None),
        run("j4", 2, WORKER_C, 12.1, 12.2),
        run("j5", 1, WORKER_A, 9.8, 12.1),
        run("j5", 2, WORKER_C, 12.3, 12.4),
    ]))
    stops = {WORKER_A: GracefulStop(deadline=T0 + 12.0, exited_at=T0 + 12.5)}

    # When
    findings = analyse(ledger, deaths={}, final_states={}, ended_at=T0 + 20, stops=stops)

    # Then: j1 re-ran although its run ended within the grace period; j4 ran
    # again while its first run still went on; j2, j3 and j5 are excused
    assert sorted(r.job for r in findings.reruns_without_crash) == ["j1", "j4"]
    assert [(o.job, o.second.pid) for o in findings.overlaps] == [("j4", WORKER_C)]
    assert findings.open_runs == []
    lines = evidence(findings, {}, stops=stops)
    assert any("re-ran without a crash: job j1" in line and "pid stopped" in line
               for line in lines), lines


def test_a_job_buried_after_its_last_success_died_unrecorded_is_listed_apart(
    tmp_path: Path
) -> None:
    # Given: j1's last run succeeded on A, which was killed before that success
    # reached the mirror, and the job then ran out of attempts; j2's last
    # success did reach the mirror, yet j2 ended dead
    ledger = read_ledger(write_ledger(tmp_path / "ledger", [
        run("j1", 3, WORKER_A, 10.0, 10.5),
        run("j2", 1, WORKER_A, 10.0, 10.6),
    ]))

    # When
    findings = analyse(ledger, deaths={WORKER_A: T0 + 11.0},
                       final_states={"j1": "dead", "j2": "dead"}, ended_at=T0 + 20,
                       mirrored_successes={"j1": set(), "j2": {1}})

    # Then: j1 is what G3 allows, listed apart; j2 contradicts the mirror
    assert [w.job for w in findings.buried_after_lost_success] == ["j1"]
    assert [w.job for w in findings.wrong_final] == ["j2"]


def test_a_hard_stop_is_a_crash_from_its_second_sigterm(tmp_path: Path) -> None:
    # Given: A got its second SIGTERM at 12.0 s and was seen dead at 14.0 s;
    # j1's run on A had ended before (its outcome not committed), j2's had
    # not; both ran again on B at 13.0 s, before A was seen dead
    ledger = read_ledger(write_ledger(tmp_path / "ledger", [
        run("j1", 1, WORKER_A, 10.0, 10.5),
        run("j1", 2, WORKER_B, 13.0, 13.1),
        run("j2", 1, WORKER_A, 10.0, None),
        run("j2", 2, WORKER_B, 13.0, 13.1),
    ]))

    # When
    findings = analyse(ledger, deaths={WORKER_A: T0 + 14.0}, final_states={},
                       ended_at=T0 + 20, crashed_at={WORKER_A: T0 + 12.0})

    # Then: both re-runs follow the crash; j2's still overlaps its cut-short run
    assert findings.reruns_without_crash == []
    assert [o.job for o in findings.overlaps] == ["j2"]
