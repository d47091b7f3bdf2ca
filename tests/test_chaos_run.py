"""G1 under chaos: ``manage.py chaosjobs`` SIGKILLs real workers and loses nothing.

CI's short version of the chaos table of docs/explanation/guarantees.md: two workers, a kill every
1.5 s for 6 s, 300 jobs of 50 ms (long enough that jobs are running when
their worker dies), some planned to fail once or to give up, the Redis
database emptied at 1.5 s and PostgreSQL cut off from 3 s to 5.5 s. The
command itself starts the workers and the sweep, so the test runs it as a
user would, in a subprocess, and reads its table, including the execution
ledger's three checks (runs of one job at once, re-runs no crash explains,
final states the last run contradicts).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from django.core.management import CommandError, call_command

from reliable_jobs.models import Job
from testproject.demo import tasks as demo

from .helpers import Processes

pytestmark = pytest.mark.django_db(transaction=True)


def table_value(output: str, figure: str) -> str:
    """The value cell of one row of the printed Markdown table."""
    match = re.search(rf"^\| (?:\*\*)?{re.escape(figure)}(?:\*\*)?\s*\| (.+?) \|$", output,
                      re.MULTILINE)
    assert match, f"no row {figure!r} in:\n{output}"
    return match.group(1).strip("*").replace(",", "")


def processes_named(tag: str) -> list[str]:
    """Command lines of live processes mentioning ``tag`` (Linux /proc)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            text = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue  # exited while we looked
        if tag in text:
            found.append(text)
    return found


@pytest.mark.slow
@pytest.mark.crash
def test_chaos_run_loses_nothing(rj_settings: Any, processes: Processes) -> None:
    # Given: short leases (conftest's FAST_OPTIONS) and enough attempts that
    # no job can die from being held by three killed workers in a row
    env = rj_settings(MAX_ATTEMPTS=10)

    # When: chaosjobs kills a random worker every 1.5 s for 6 s under load,
    # empties Redis once and cuts PostgreSQL off for 2.5 s
    chaos = processes.manage(
        "chaosjobs", "--jobs", "300", "--workers", "2", "--concurrency", "2",
        "--kill-every", "1.5", "--duration", "6", "--task-ms", "50", "--drain-timeout", "40",
        "--fail-percent", "5", "--give-up-percent", "2", "--flush-redis-at", "1.5",
        "--cut-postgres-at", "3", "--cut-postgres-for", "2.5", "--seed", "7", env=env,
    )
    code = chaos.wait(timeout=120)
    output = processes.log(chaos)

    # Then: it exits 0, every job succeeded or is dead with its reason, none
    # lost, and the kills really interrupted jobs that then ran again
    assert code == 0, output
    assert table_value(output, "jobs enqueued") == "300"
    assert table_value(output, "planned to fail once / to give up") == "15 / 6"
    succeeded, dead = int(table_value(output, "succeeded")), int(table_value(output, "dead"))
    assert (succeeded, dead) == (294, 6), output
    assert table_value(output, "lost (must be 0)") == "0"
    assert table_value(output, "dead with no error kept (must be 0)") == "0"
    assert int(table_value(output, "workers killed (SIGKILL)")) >= 2
    assert int(table_value(output, "jobs a killed worker held, seen to run again")) >= 1
    assert int(table_value(output, "claimed more than once (attempts > 1)")) >= 1
    assert table_value(output, "worst crash-to-rerun").endswith(" s")
    assert Job.objects.filter(state="succeeded").count() == 294
    dead_errors = list(Job.objects.filter(state="dead").values_list("last_error", flat=True))
    assert len(dead_errors) == 6
    assert all("PermanentFailure: planned: gives up" in error for error in dead_errors), dead_errors
    # and the server faults happened while jobs were still unfinished
    assert table_value(output, "Redis restarted empty (FLUSHDB)").startswith("at "), output
    assert table_value(output, "PostgreSQL cut off (TCP proxy)").startswith("at "), output
    # and the execution ledger saw every job run, none twice at once, none
    # again without a crash, none ending other than its last run says
    assert int(table_value(output, "runs in the execution ledger")) >= 300
    assert table_value(output, "ran concurrently (must be 0)") == "0", output
    assert table_value(
        output, "final state differs from the last run's outcome (must be 0)") == "0", output
    assert table_value(output, "re-ran without a crash (must be 0)") == "0", output
    # and no worker it started outlives it
    assert processes_named(f"chaos-{chaos.pid}-") == []


@pytest.mark.slow
@pytest.mark.crash
def test_a_rolling_deploy_never_runs_a_job_twice_without_a_crash(
    rj_settings: Any, processes: Processes
) -> None:
    # Given: short leases, and jobs of which some outlive the workers' grace period
    # (reconcile waits longer than the long jobs run: a job running when Redis
    # lost its data is not rebuilt while its first run still goes on)
    env = rj_settings(MAX_ATTEMPTS=10, RECONCILE_GRACE_MS=5_000)

    # When: chaosjobs SIGTERMs a worker every 1.5 s (every third stop gets a
    # second SIGTERM), SIGKILLs one every 3 s, empties Redis once and cuts
    # PostgreSQL off once, while 5% of the jobs run 2 s against a 1 s grace
    chaos = processes.manage(
        "chaosjobs", "--jobs", "300", "--workers", "2", "--concurrency", "2",
        "--kill-every", "3", "--sigterm-every", "1.5", "--grace", "1", "--long-percent", "5",
        "--long-ms", "2000", "--duration", "9", "--task-ms", "30", "--drain-timeout", "60",
        "--flush-redis-at", "2", "--cut-postgres-at", "5", "--cut-postgres-for", "1.5",
        "--seed", "11", env=env,
    )
    code = chaos.wait(timeout=180)
    output = processes.log(chaos)

    # Then: it exits 0; workers were stopped, some past their grace with jobs
    # running; every stop was clean
    assert code == 0, output
    assert int(table_value(output, "workers stopped by SIGTERM (rolling deploy)")) >= 3, output
    assert int(table_value(output, "of which stopped hard by a second SIGTERM")) >= 1, output
    assert table_value(output, "stops that exited non-zero or were SIGKILLed (must be 0)") == "0"
    # and nothing was lost, nothing ran twice at once, nothing ran again that a
    # crash, a hard stop or a run cut short by the grace period does not explain
    assert table_value(output, "lost (must be 0)") == "0"
    assert table_value(output, "ran concurrently (must be 0)") == "0", output
    assert table_value(
        output, "final state differs from the last run's outcome (must be 0)") == "0", output
    assert table_value(output, "re-ran without a crash (must be 0)") == "0", output
    assert processes_named(f"chaos-{chaos.pid}-") == []


def test_chaos_refuses_a_queue_with_work(rj_settings: Any) -> None:
    # Given: a job nobody has run yet
    rj_settings()
    demo.add.enqueue(1, 2)

    # When / Then: the run refuses before starting anything
    with pytest.raises(CommandError, match="is not empty"):
        call_command("chaosjobs", jobs=10)


def test_chaos_refuses_an_unregistered_task(rj_settings: Any) -> None:
    rj_settings()
    with pytest.raises(CommandError, match="is not a registered task"):
        call_command("chaosjobs", jobs=10, task="os.system")
