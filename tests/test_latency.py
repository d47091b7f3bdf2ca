"""Queue latency (latency.lua), its warning, and the worker's line per attempt.

Ages are measured on the Redis server's clock from times the scripts wrote;
a test moves those times back (writing the hash or the scheduled score, as
set-up) rather than waiting, so every expected age is known to the second.
"""

from __future__ import annotations

import json
import logging
import re
import sys
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta
from io import StringIO
from typing import Any

import pytest
import redis
from django.core.management import CommandError, call_command
from django.test import Client
from django.utils import timezone

from reliable_jobs import dashboard
from reliable_jobs.backendchecks import with_ids
from reliable_jobs.broker import Broker
from reliable_jobs.checks import check_log_format
from reliable_jobs.keys import QueueKeys
from reliable_jobs.logformat import JsonLinesFormatter
from testproject.demo import tasks as demo

from .helpers import REDIS_URL, Processes
from .test_admin import configured_backend
from .test_dashboard import enqueue_on_shard
from .test_scripts import enqueue

pytestmark = pytest.mark.django_db(transaction=True)
Q = "work"
KEYS = QueueKeys("rj", Q)
DASHBOARD = "/admin/reliable_jobs/job/dashboard/"
#: Slack on an age read a moment after it was set (the test's own pace).
SLACK_MS = 5_000


@pytest.fixture
def broker(redis_client: redis.Redis) -> Iterator[Broker]:
    found = Broker(REDIS_URL, "rj")
    yield found
    found.close()


def backdate(client: redis.Redis, job_id: str, field: str, ms: int, *,
             keys: QueueKeys = KEYS) -> None:
    """Move a time a script wrote into a job hash ``ms`` into the past (test set-up)."""
    now_ms = int(client.hget(keys.job(job_id), field) or 0)
    assert now_ms, f"{field} was not written"
    client.hset(keys.job(job_id), field, now_ms - ms)


def assert_age(age_ms: int | None, expected_ms: int) -> None:
    assert age_ms is not None
    assert expected_ms <= age_ms < expected_ms + SLACK_MS, age_ms


# -- latency.lua -----------------------------------------------------------------


def test_an_empty_queue_has_no_age(broker: Broker) -> None:
    # When nothing was ever enqueued
    found = broker.latency(Q)

    # Then
    assert (found.queued, found.oldest_ready_ms, found.oldest_due_ms) == (0, None, None)


def test_the_oldest_ready_job_is_the_next_one_to_run(
    broker: Broker, redis_client: redis.Redis
) -> None:
    # Given three jobs, the first enqueued a minute ago, the second 30 s ago
    enqueue(broker, "first", "second", "third")
    backdate(redis_client, "first", "enqueued_ms", 60_000)
    backdate(redis_client, "second", "enqueued_ms", 30_000)

    # When latency is read
    found = broker.latency(Q)

    # Then it is the first job's age
    assert (found.queued, found.oldest_ready_id) == (3, "first")
    assert_age(found.oldest_ready_ms, 60_000)

    # And once that job is claimed, the second one's
    assert broker.claim(Q, count=1, lease_ms=60_000).jobs[0].id == "first"
    assert_age(broker.latency(Q).oldest_ready_ms, 30_000)


def test_cancelled_ids_at_the_oldest_end_are_skipped(
    broker: Broker, redis_client: redis.Redis
) -> None:
    # Given the two oldest jobs cancelled while queued (their ids stay on the
    # list as tombstones until a claim drops them)
    enqueue(broker, "gone-1", "gone-2", "waiting")
    for job_id in ("gone-1", "gone-2"):
        backdate(redis_client, job_id, "enqueued_ms", 600_000)
        assert broker.cancel(Q, job_id) == (True, "queued")
    backdate(redis_client, "waiting", "enqueued_ms", 20_000)

    # Then the oldest job that will run is the one reported
    found = broker.latency(Q)
    assert found.oldest_ready_id == "waiting"
    assert_age(found.oldest_ready_ms, 20_000)


def test_a_due_job_waiting_for_promotion_then_counts_from_its_promotion(
    broker: Broker, redis_client: redis.Redis
) -> None:
    # Given a job enqueued an hour ago to run later, whose due time passed 30 s ago
    now_ms = broker.server_time_ms()
    enqueue(broker, "later", due_ms=now_ms + 60_000)
    backdate(redis_client, "later", "enqueued_ms", 3_600_000)
    redis_client.zadd(KEYS.scheduled, {"later": now_ms - 30_000}, xx=True)

    # When latency is read before promote runs
    before = broker.latency(Q)

    # Then the due job has waited 30 s for promotion, and nothing is ready
    assert before.oldest_due_id == "later"
    assert_age(before.oldest_due_ms, 30_000)
    assert before.oldest_ready_ms is None

    # And once promoted, it is ready since its promotion, not since its enqueue
    assert broker.promote(Q) == 1
    after = broker.latency(Q)
    assert after.oldest_due_ms is None
    assert after.oldest_ready_id == "later"
    assert_age(after.oldest_ready_ms, 0)


def test_a_job_scheduled_in_the_future_is_not_due(broker: Broker) -> None:
    # Given a job due in a minute
    enqueue(broker, "later", due_ms=broker.server_time_ms() + 60_000)

    # Then it has no age yet
    assert broker.latency(Q).oldest_due_ms is None


def test_requeue_and_revive_make_a_job_ready_now(
    broker: Broker, redis_client: redis.Redis
) -> None:
    # Given a job enqueued an hour ago to run in an hour, run now by staff
    now_ms = broker.server_time_ms()
    enqueue(broker, "waiting", due_ms=now_ms + 3_600_000)
    backdate(redis_client, "waiting", "enqueued_ms", 3_600_000)
    assert broker.requeue(Q, "waiting") == (True, "scheduled")

    # Then it is ready since now
    assert_age(broker.latency(Q).oldest_ready_ms, 0)

    # And a job that died an hour after its enqueue, revived by staff, is too
    job = broker.claim(Q, count=1, lease_ms=60_000).jobs[0]
    assert broker.nack(Q, [(*job.fence, -1, "builtins.RuntimeError: no")]) == [True]
    backdate(redis_client, "waiting", "ready_ms", 3_600_000)
    assert broker.revive(Q, "waiting", extra_attempts=1)
    assert_age(broker.latency(Q).oldest_ready_ms, 0)


def test_a_claim_says_how_long_the_job_waited(
    broker: Broker, redis_client: redis.Redis
) -> None:
    # Given a job ready for 45 s
    enqueue(broker, "patient")
    backdate(redis_client, "patient", "enqueued_ms", 45_000)

    # When a worker claims it
    job = broker.claim(Q, count=1, lease_ms=60_000).jobs[0]

    # Then the claim reports the wait, on the server's clock
    assert_age(job.waited_ms, 45_000)


# -- the warning: dashboard and jobstats ----------------------------------------------


def test_a_late_queue_is_flagged_on_the_dashboard_and_in_jobstats(
    rj_settings: Callable[..., dict[str, str]], admin_client: Client,
    redis_client: redis.Redis,
) -> None:
    # Given a 10 s warning, a job on "emails" ready for two minutes, and one on
    # "default" ready for a moment
    rj_settings(queues=["default", "emails"], LATENCY_WARNING_MS=10_000)
    late = demo.add.using(queue_name="emails").enqueue(1, 1)
    demo.add.enqueue(2, 2)
    backdate(redis_client, late.id, "enqueued_ms", 120_000, keys=QueueKeys("rj", "emails"))

    # When staff look
    page = admin_client.get(DASHBOARD).content.decode()
    text, document = StringIO(), StringIO()
    call_command("jobstats", stdout=text, stderr=StringIO())
    call_command("jobstats", "--json", stdout=document, stderr=StringIO())

    # Then "emails" is in the warning colour, "default" is not
    emails = page[page.index('data-queue="emails"'):]
    emails = emails[:emails.index("</tr>")]
    default = page[page.index('data-queue="default"'):]
    default = default[:default.index("</tr>")]
    assert 'class="num rj-oldest-ready rj-over"' in emails
    assert "2 min 0 s" in emails or "2 min 1 s" in emails
    assert "rj-over" not in default
    # And jobstats marks it and says why
    printed = text.getvalue()
    assert "Latency warning: queue 'emails'" in printed
    emails_line = next(line for line in printed.splitlines() if line.startswith("emails"))
    assert emails_line.endswith(" !               -"), emails_line
    found = {q["name"]: q for q in json.loads(document.getvalue())["queues"]}
    assert found["emails"]["late"] is True and found["default"]["late"] is False
    assert 120_000 <= found["emails"]["oldest_ready_ms"] < 120_000 + SLACK_MS


def test_no_warning_when_the_option_is_none(
    rj_settings: Callable[..., dict[str, str]], admin_client: Client,
    redis_client: redis.Redis,
) -> None:
    # Given the warning turned off, and a job ready for an hour
    rj_settings(LATENCY_WARNING_MS=None)
    job = demo.add.enqueue(1, 1)
    backdate(redis_client, job.id, "enqueued_ms", 3_600_000, keys=QueueKeys("rj", "default"))

    # Then the age is shown, never in the warning colour
    page = admin_client.get(DASHBOARD).content.decode()
    assert "1 h 0 min" in page
    assert "rj-over" not in page


def test_each_shard_has_its_latency(
    rj_settings: Callable[..., dict[str, str]], redis_client: redis.Redis
) -> None:
    # Given queue "q" in 2 shards, shard 1 holding a job ready for 90 s
    rj_settings(queues=["q"], SHARDS={"q": 2}, LATENCY_WARNING_MS=60_000)
    backend = configured_backend()
    enqueue_on_shard(backend, "q", 0)
    slow = enqueue_on_shard(backend, "q", 1)
    backdate(redis_client, slow, "enqueued_ms", 90_000, keys=QueueKeys("rj", "q#1"))

    # When the queue lines are read
    (line,) = dashboard.queue_counts(backend)

    # Then the queue has the oldest shard's age, and each shard its own
    assert [s.shard for s in line.shards] == [0, 1]
    assert_age(line.oldest_ready_ms, 90_000)
    assert line.ready_late and line.shards[1].ready_late and not line.shards[0].ready_late
    assert line.shards[0].oldest_ready_ms is not None
    assert line.shards[0].oldest_ready_ms < 60_000
    # And jobstats --json lists the shards the same way
    out = StringIO()
    call_command("jobstats", "--json", stdout=out, stderr=StringIO())
    (queue,) = json.loads(out.getvalue())["queues"]
    assert [(s["name"], s["shard"], s["queued"], s["late"]) for s in queue["shards"]] == [
        ("q", 0, 1, False), ("q#1", 1, 1, True)]


@pytest.mark.parametrize("value", [0, -5, "60000", 1.5, True])
def test_a_bad_latency_warning_is_e003(rj_settings: Callable[..., dict[str, str]],
                                       value: Any) -> None:
    # Given a LATENCY_WARNING_MS that is not a whole number >= 1
    rj_settings(LATENCY_WARNING_MS=value)

    # Then the backend's check says so
    problems = with_ids(configured_backend().config.problems)
    assert ("reliable_jobs.E003", f"OPTIONS['LATENCY_WARNING_MS'] must be a whole number >= 1, "
            f"not {value!r}.") in problems


# -- one line per attempt ---------------------------------------------------------


def json_lines(output: str) -> list[dict[str, Any]]:
    """The JSON objects among a process's output lines (it also prints burst progress)."""
    return [json.loads(line) for line in output.splitlines() if line.startswith("{")]


@pytest.mark.slow
def test_json_lines_give_each_attempt_its_fields(
    rj_settings: Callable[..., dict[str, str]], processes: Processes
) -> None:
    # Given a job that fails all 3 attempts and one that succeeds
    env = rj_settings()
    failing = demo.always_fail.enqueue("boom")
    fine = demo.add.enqueue(2, 3)

    # When a burst worker runs them with JSON lines, at -v 1 and then (again) at -v 2
    worker = processes.manage("runworker", "--burst", "--log-format", "json", env=env)
    assert worker.wait(timeout=60) == 0, processes.log(worker)
    quiet = processes.log(worker)

    # Then each failed attempt is one JSON object with every field, and no traceback
    attempts = [line for line in json_lines(quiet) if line.get("event") == "attempt"]
    assert [(a["job"], a["attempt"], a["outcome"], a["next"]) for a in attempts] == [
        (failing.id, 1, "failed", "retry"), (failing.id, 2, "failed", "retry"),
        (failing.id, 3, "failed", "dead")]
    for line in attempts:
        assert line["task"] == "testproject.demo.tasks.always_fail"
        assert (line["queue"], line["shard"], line["max_attempts"]) == ("default", 0, 3)
        assert line["error"] == "builtins.RuntimeError: boom"
        assert line["duration_ms"] >= 0 and line["queued_ms"] >= 0
        assert line["level"] in ("INFO", "WARNING") and line["message"].startswith("Job ")
    assert attempts[0]["retry_in_ms"] > 0 and attempts[2]["retry_in_ms"] is None
    # And the success has no line at -v 1, and nothing is printed as a traceback
    assert fine.id not in quiet
    assert "Traceback" not in quiet

    # When another job runs at -v 2
    second = demo.add.enqueue(4, 5)
    worker = processes.manage("runworker", "--burst", "--log-format", "json", "-v", "2",
                              env=env)
    assert worker.wait(timeout=60) == 0, processes.log(worker)

    # Then its success is a line too
    (done,) = [line for line in json_lines(processes.log(worker))
               if line.get("event") == "attempt"]
    assert (done["job"], done["outcome"], done["attempt"]) == (second.id, "succeeded", 1)
    assert "error" not in done


@pytest.mark.slow
def test_text_lines_name_the_queue_and_time_in_queue(
    rj_settings: Callable[..., dict[str, str]], processes: Processes
) -> None:
    # Given a job that fails its 3 attempts
    env = rj_settings()
    failing = demo.always_fail.enqueue("boom")

    # When a burst worker runs it with the default format
    worker = processes.manage("runworker", "--burst", env=env)
    assert worker.wait(timeout=60) == 0, processes.log(worker)

    # Then each line is a sentence with the queue and the time in queue
    lines = [line for line in processes.log(worker).splitlines() if failing.id in line]
    assert len(lines) == 3, lines
    assert " attempt 3/3 failed in " in lines[2]
    assert re.search(r"\(queue default, \d+ ms in queue\): builtins\.RuntimeError: boom; dead\.$",
                     lines[2]), lines[2]
    assert not any(line.startswith("{") for line in lines)


def test_a_bad_log_format_setting_stops_runworker(
    rj_settings: Callable[..., dict[str, str]], settings: Any
) -> None:
    # Given a RELIABLE_JOBS_LOG_FORMAT runworker does not know
    rj_settings()
    settings.RELIABLE_JOBS_LOG_FORMAT = "xml"

    # Then runworker refuses to start, saying what it accepts, and so does the check
    with pytest.raises(CommandError, match="RELIABLE_JOBS_LOG_FORMAT must be 'text' or 'json'"):
        call_command("runworker", "--burst")
    assert [m.id for m in check_log_format()] == ["reliable_jobs.E014"]
    settings.RELIABLE_JOBS_LOG_FORMAT = "json"
    assert check_log_format() == []


def test_the_formatter_keeps_a_traceback_on_one_line() -> None:
    # Given a record with an exception, formatted as a JSON line
    try:
        raise ValueError("bad\nthing")
    except ValueError:
        record = logging.LogRecord("reliable_jobs.worker", logging.ERROR, __file__, 1,
                                   "it broke: %s", ("here",), exc_info=sys.exc_info())

    # When it is formatted
    line = JsonLinesFormatter().format(record)

    # Then it is one line of JSON holding the message and the traceback
    assert "\n" not in line
    found = json.loads(line)
    assert found["message"] == "it broke: here" and found["level"] == "ERROR"
    assert "ValueError: bad\nthing" in found["exc"]
    assert timezone.now() - timedelta(minutes=1) < datetime.fromisoformat(found["ts"])
