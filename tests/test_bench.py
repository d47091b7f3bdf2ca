"""``manage.py benchjobs`` with tiny sizes: the short benchmark CI runs to prove it works.

No speed is asserted (speed is the benchmark's business, and a shared CI
machine's figures mean nothing): each test checks that every line is printed
and that the run leaves no job behind in Redis or the database.
"""

from __future__ import annotations

import pstats
import re
from pathlib import Path
from typing import Any

import pytest
import redis

from reliable_jobs.models import Job

from .helpers import Processes

pytestmark = pytest.mark.django_db(transaction=True)


def bench(processes: Processes, env: dict[str, str], *args: str) -> tuple[int, str]:
    """Run ``manage.py benchjobs`` in a process of its own (its worker threads open
    database sessions that only the process's exit closes); return its exit code
    and output."""
    proc = processes.manage("benchjobs", *args, env=env)
    code = proc.wait(timeout=240)
    return code, processes.log(proc)


def test_short_bench_prints_every_figure_and_leaves_nothing_behind(
        rj_settings: Any, redis_client: redis.Redis, processes: Processes) -> None:
    # Given an idle queue
    env = rj_settings()

    # When the short benchmark runs with every part switched on
    code, output = bench(processes, env, "--jobs", "40", "--singles", "5", "--runs", "1",
                         "--latency-samples", "3", "--lengths", "", "--ack-depths", "20,60",
                         "--ack-sample", "10", "--many-queues", "5")
    assert code == 0, output

    # Then it prints each figure, the floor and ratios included
    for line in ("bulk enqueue", "single enqueue floor", "drain (1 process)",
                 "drain CPU µs/job", "enqueue takes", "enqueue-to-start latency",
                 "ratio 60 / 20 in flight", "5 queues configured, work on one"):
        assert line in output, output
    assert re.search(r"^\s+60\s+[\d.]+$", output, re.MULTILINE), output
    # and leaves neither rows nor queued, claimed or leased jobs
    assert Job.objects.count() == 0
    leftovers = [key for key in redis_client.keys("*")
                 if key.endswith((":queued", ":processing", ":leases", ":landing"))
                 or ":job:" in key or "rj-bench-" in key]
    assert leftovers == []


def test_sustained_mode_reports_each_round(rj_settings: Any, processes: Processes) -> None:
    # Given an idle queue
    env = rj_settings()

    # When a sustained run drains 50 jobs in rounds of 20 with no retention
    code, output = bench(processes, env, "--jobs", "20", "--sustained", "50",
                         "--retention-minutes", "0")
    assert code == 0, output

    # Then it reports three rounds (20, 40, 50 done), each pruning what had finished
    rounds = re.findall(r"^\s+(\d+)\s+[\d,]+\s+(\d+)\s", output, re.MULTILINE)
    assert [done for done, _ in rounds] == ["20", "40", "50"], output
    assert sum(int(pruned) for _, pruned in rounds) == 50, output
    assert "worker RSS at start" in output and "at the end" in output
    assert Job.objects.count() == 0


def test_refuses_bad_ack_depths(rj_settings: Any, processes: Processes) -> None:
    env = rj_settings()
    code, output = bench(processes, env, "--ack-depths", "0,10")
    assert code != 0 and "--ack-depths must be whole numbers" in output


def test_process_mode_times_a_real_runworker_in_a_stock_project(
        rj_settings: Any, redis_client: redis.Redis, processes: Processes,
        tmp_path: Path) -> None:
    # Given an idle queue, and a directory for the workers' profiles
    env = rj_settings()
    profiles = tmp_path / "profiles"

    # When the process benchmark runs both tasks once over a few jobs
    code, output = bench(processes, {**env, "BENCH_PROFILE_DIR": str(profiles)},
                         "--process", "--jobs", "5", "--runs", "1")
    assert code == 0, output

    # Then it prints a line per run and a median per task, every figure in it
    for task in ("no-op", "INCR + query"):
        assert re.search(rf"^{re.escape(task)}\s+5 jobs:\s+[\d,]+ jobs/s start to empty,"
                         r"\s+[\d,]+ from the first job, CPU\s+[\d,]+ µs/job, exit\s+[\d,]+ ms "
                         r"after empty, WAL [\d,]+ B/job", output, re.MULTILINE), output
        assert f"{task}, median of 1:" in output
    # and a cProfile of each worker, which pstats reads
    written = sorted(profiles.glob("runworker-*.prof"))
    assert [p.name for p in written] == ["runworker-incr_and_query-1.prof",
                                         "runworker-noop-1.prof"]
    assert pstats.Stats(str(written[0])).total_calls > 0
    # and leaves neither rows nor jobs nor the task's counter behind
    assert Job.objects.count() == 0
    leftovers = [key for key in redis_client.keys("*")
                 if key.endswith((":queued", ":processing", ":leases", ":landing"))
                 or ":job:" in key]
    assert leftovers == []
