"""The live dashboard, ``jobstats`` and ``prunejobs``, on real Redis, PostgreSQL and workers."""

from __future__ import annotations

import signal
from collections.abc import Callable
from datetime import timedelta
from io import StringIO
from typing import Any

import pytest
import redis
from django.core.management import CommandError, call_command
from django.test import Client
from django.utils import timezone

from reliable_jobs import dashboard, payload
from reliable_jobs.backend import ReliableJobsBackend
from reliable_jobs.broker import NewJob
from reliable_jobs.keys import QueueKeys, shard_queue
from reliable_jobs.models import Attempt, AttemptOutcome, Job, JobState
from testproject.demo import tasks as demo

from .helpers import Processes, insert_row, wait_until
from .test_admin import (
    CHANGELIST,
    configured_backend,
    make_dead,
    run_attempt,
    staff_client,
)

pytestmark = pytest.mark.django_db(transaction=True)
DASHBOARD = "/admin/reliable_jobs/job/dashboard/"
KEYS = QueueKeys("rj", "default")


@pytest.fixture
def backend(rj_settings: Callable[..., dict[str, str]]) -> ReliableJobsBackend:
    return configured_backend()


def age(job_id: str, **delta: float) -> None:
    """Pretend a row was last changed ``delta`` ago (test set-up, not a mirror write)."""
    Job.objects.filter(pk=job_id).update(updated_at=timezone.now() - timedelta(**delta))


def stats(*args: str) -> str:
    out = StringIO()
    call_command("jobstats", *args, stdout=out, stderr=StringIO())
    return out.getvalue()


# -- queue counts and workers ----------------------------------------------------


def test_queue_counts_come_live_from_redis(
    rj_settings: Callable[..., dict[str, str]], admin_client: Client
) -> None:
    # Given: on "default" 2 queued, 1 running, 1 scheduled, 1 dead; on "emails" 1 queued
    rj_settings(queues=["default", "emails"])
    backend = configured_backend()
    running = demo.add.enqueue(0, 0)
    run_attempt(backend, running.id, outcome="running")
    dead = demo.always_fail.enqueue("x")
    make_dead(backend, dead.id, attempts=1)
    demo.add.enqueue(1, 1)
    demo.add.enqueue(2, 2)
    demo.add.using(run_after=timezone.now() + timedelta(hours=1)).enqueue(3, 3)
    demo.add.using(queue_name="emails").enqueue(4, 4)

    # When
    lines = {q.name: q for q in dashboard.queue_counts(backend)}
    page = admin_client.get(DASHBOARD)

    # Then
    assert lines["default"] == dashboard.QueueLine("default", 2, 1, 1, 1)
    assert lines["emails"] == dashboard.QueueLine("emails", 1, 0, 0, 0)
    text = page.content.decode()
    assert page.status_code == 200
    assert '<td class="num rj-queued">2</td>' in text
    assert '<td class="num rj-running">1</td>' in text
    assert f'href="{CHANGELIST}?queue=emails"' in text
    assert "all queues" in text  # the totals row
    printed = stats()
    assert "default          2          1          1          1" in printed
    assert "emails           1          0          0          0" in printed


@pytest.mark.slow
def test_a_live_worker_is_listed_and_leaves_when_it_stops(
    rj_settings: Callable[..., dict[str, str]], processes: Processes, admin_client: Client
) -> None:
    # Given: a real worker serving "default"
    env = rj_settings()
    backend = configured_backend()
    worker = processes.worker(env, "--worker-id", "dash-worker-1", "--concurrency", "2")

    # When its heartbeat arrives
    lines = wait_until(lambda: dashboard.workers(backend), message="a heartbeat")

    # Then it is listed with host, pid, queues and times, on the page and in jobstats
    (line,) = lines
    assert (line.id, line.pid, line.queues, line.jobs) == ("dash-worker-1", worker.pid,
                                                          ["default"], 0)
    assert line.host and line.since and line.since <= line.last_beat
    text = admin_client.get(DASHBOARD).content.decode()
    assert "1 worker alive" in text and "dash-worker-1" in text and str(worker.pid) in text
    assert f"dash-worker-1  host {line.host}  pid {worker.pid}  queues default" in stats()

    # And once it stops (goodbye) or is killed (its key expires), it is gone
    worker.send_signal(signal.SIGTERM)
    assert worker.wait(timeout=30) == 0
    assert dashboard.workers(backend) == []


def test_a_worker_killed_without_goodbye_is_not_listed(
    backend: ReliableJobsBackend, redis_client: redis.Redis
) -> None:
    # Given: a heartbeat whose key expired (SIGKILL leaves the index entry behind)
    backend.broker.heartbeat("ghost", {"id": "ghost", "queues": ["default"]}, ttl_ms=1)
    wait_until(lambda: not redis_client.exists("rj:worker:ghost"), message="the key to expire")

    # Then
    assert dashboard.workers(backend) == []


# -- sharded queues ----------------------------------------------------------------


def enqueue_on_shard(backend: ReliableJobsBackend, queue: str, shard: int,
                     run_after: Any = None) -> str:
    """Enqueue ``demo.noop`` on one chosen shard, as ``backend.enqueue`` does on a random one."""
    task = demo.noop.using(queue_name=queue, run_after=run_after)
    job_id = insert_row(task_path=task.module_path, queue=queue, backend=backend.alias,
                        shard=shard, run_after=run_after, database=backend.database)
    text = payload.encode(task.module_path, (), {}, max_bytes=backend.config.MAX_PAYLOAD_BYTES)
    due_ms = int(run_after.timestamp() * 1000) if run_after else 0
    assert backend.broker.enqueue(shard_queue(queue, shard),
                                  [NewJob(job_id, text, 3, due_ms=due_ms)]) == 1
    return job_id


def test_a_sharded_queue_counts_every_shard_on_one_line(
    rj_settings: Callable[..., dict[str, str]], admin_client: Client
) -> None:
    # Given: queue "q" in 3 shards: shard 0 has 1 queued; shard 1 has 2 queued and
    # 1 running; shard 2 has 1 scheduled and 1 dead; and shard 3, written to
    # before SHARDS shrank to 3, still holds 1 queued
    rj_settings(queues=["q"], SHARDS={"q": 3})
    backend = configured_backend()
    enqueue_on_shard(backend, "q", 0)
    running = enqueue_on_shard(backend, "q", 1)
    run_attempt(backend, running, outcome="running", queue="q#1")
    enqueue_on_shard(backend, "q", 1)
    enqueue_on_shard(backend, "q", 1)
    dead = enqueue_on_shard(backend, "q", 2)
    make_dead(backend, dead, attempts=1, queue="q#2")
    enqueue_on_shard(backend, "q", 2, run_after=timezone.now() + timedelta(hours=1))
    enqueue_on_shard(backend, "q", 3)

    # When
    lines = dashboard.queue_counts(backend)
    text = admin_client.get(DASHBOARD).content.decode()

    # Then: one line for "q", every shard summed, on the page and in jobstats
    assert lines == [dashboard.QueueLine("q", 4, 1, 1, 1)]
    assert '<td class="num rj-queued">4</td>' in text
    assert '<td class="num rj-running">1</td>' in text
    assert "q#" not in text
    printed = stats()
    assert "q                  4          1          1          1" in printed
    # And each shard follows on a line of its own (with its latency)
    assert "  shard 1          2          1          0          0" in printed
    assert "  shard 3          1          0          0          0" in printed


def test_healthy_jobs_on_any_shard_are_not_drift(
    rj_settings: Callable[..., dict[str, str]], admin_client: Client, redis_client: redis.Redis
) -> None:
    # Given: old unchanged rows of healthy jobs on shards 0, 1 and 2 (queued and
    # running), and one on shard 2 whose hash Redis lost
    rj_settings(queues=["q"], SHARDS={"q": 3}, RECONCILE_GRACE_MS=60_000)
    backend = configured_backend()
    running = enqueue_on_shard(backend, "q", 1)
    run_attempt(backend, running, outcome="running", queue="q#1")
    healthy = [running, enqueue_on_shard(backend, "q", 0), enqueue_on_shard(backend, "q", 1),
               enqueue_on_shard(backend, "q", 2)]
    lost = enqueue_on_shard(backend, "q", 2)
    redis_client.delete(QueueKeys("rj", "q#2").job(lost))
    for job_id in [*healthy, lost]:
        age(job_id, minutes=5)

    # When
    found = dashboard.drift(backend)

    # Then: only the lost job disagrees, on the dashboard, the changelist filter and jobstats
    assert (found.missing, found.dead_in_redis, found.checked) == ([lost], [], 5)
    assert "1 job disagrees" in admin_client.get(DASHBOARD).content.decode()
    listed = admin_client.get(CHANGELIST, {"drift": "default"}).context["cl"].result_list
    assert [str(job.pk) for job in listed] == [lost]
    assert "Drift: 1 of 5 unfinished jobs checked disagree with Redis: 1 missing from " \
           "Redis, 0 dead in Redis only." in stats()


# -- throughput ------------------------------------------------------------------


def test_throughput_counts_attempts_per_minute_over_the_last_hour(
    backend: ReliableJobsBackend, admin_client: Client
) -> None:
    # Given: attempts finished now, 5 minutes ago and 2 hours ago
    now = timezone.now().replace(second=30, microsecond=0)
    job = demo.add.enqueue(1, 1)
    five_ago, two_hours_ago = now - timedelta(minutes=5), now - timedelta(hours=2)
    outcomes = [(now, AttemptOutcome.SUCCEEDED), (now, AttemptOutcome.SUCCEEDED),
                (now, AttemptOutcome.FAILED), (five_ago, AttemptOutcome.TIMED_OUT),
                (five_ago, AttemptOutcome.RELEASED), (two_hours_ago, AttemptOutcome.SUCCEEDED)]
    Attempt.objects.bulk_create([
        Attempt(job_id=job.id, number=i + 1, finished_at=at, outcome=outcome)
        for i, (at, outcome) in enumerate(outcomes)])

    # When
    minutes = dashboard.throughput(backend, now=now)

    # Then: one entry per minute, oldest first; released attempts are not failures
    assert len(minutes) == 60
    assert minutes[-1].at == now.replace(second=0)
    assert (minutes[-1].succeeded, minutes[-1].failed) == (2, 1)
    assert (minutes[-6].succeeded, minutes[-6].failed) == (0, 1)
    assert sum(m.succeeded for m in minutes) == 2
    bars, peak = dashboard.chart(minutes)
    assert peak == 3 and len(bars) == 60
    assert bars[-1].ok_height == 80.0 and bars[-1].failed_height == 40.0
    assert bars[-1].title.endswith("2 succeeded, 1 failed")
    text = admin_client.get(DASHBOARD).content.decode()
    assert 'class="rj-chart"' in text and text.count('<rect class="rj-ok"') == 60
    assert "2 succeeded</span>" in text and "2 failed</span>" in text


# -- drift -------------------------------------------------------------------------


def test_drift_counts_rows_redis_lost_or_buried_and_links_to_them(
    rj_settings: Callable[..., dict[str, str]], admin_client: Client, redis_client: redis.Redis
) -> None:
    # Given: a healthy running job; one Redis lost; one dead in Redis whose row
    # still says running; and a fresh row Redis lost a moment ago (in grace)
    rj_settings(RECONCILE_GRACE_MS=60_000)
    backend = configured_backend()
    healthy = demo.add.enqueue(1, 1)
    lost = demo.add.enqueue(2, 2)
    buried = demo.add.enqueue(3, 3)
    fresh = demo.add.enqueue(4, 4)
    run_attempt(backend, healthy.id, outcome="running")
    run_attempt(backend, lost.id, outcome="running")
    run_attempt(backend, buried.id, outcome="running")
    backend.broker.nack("default", [(buried.id, 1, 0, -1, "builtins.RuntimeError: x")])
    redis_client.delete(KEYS.job(lost.id), KEYS.job(fresh.id))
    for job_id in (healthy.id, lost.id, buried.id):
        age(job_id, minutes=5)

    # When
    found = dashboard.drift(backend)

    # Then: only the two old disagreements count
    assert (found.missing, found.dead_in_redis, found.checked, found.complete) == (
        [lost.id], [buried.id], 3, True)
    text = admin_client.get(DASHBOARD).content.decode()
    assert "2 jobs disagree" in text
    assert f'href="{CHANGELIST}?drift=default"' in text
    listed = admin_client.get(CHANGELIST, {"drift": "default"}).context["cl"].result_list
    assert {str(job.pk) for job in listed} == {lost.id, buried.id}
    assert "Drift: 2 of 3 unfinished jobs checked disagree with Redis: 1 missing from " \
           "Redis, 1 dead in Redis only." in stats()

    # And after the recovery sweep there is none
    call_command("recoverjobs", stdout=StringIO())
    assert dashboard.drift(backend).count == 0
    assert "None." in admin_client.get(DASHBOARD).content.decode()


def test_drift_checks_a_bounded_number_of_rows(backend: ReliableJobsBackend) -> None:
    # Given: five old queued rows Redis lost
    results = backend.enqueue_many(demo.noop, [((), {})] * 5)
    for result in results:
        age(result.id, minutes=5)
    backend.broker.client.flushdb()

    # When the scan is limited to three
    found = dashboard.drift(backend, limit=3)

    # Then three are checked, and the result says it is partial
    assert (found.checked, found.count, found.complete) == (3, 3, False)


# -- the page itself --------------------------------------------------------------


def test_dashboard_needs_the_view_permission(
    backend: ReliableJobsBackend, django_user_model: Any
) -> None:
    # Given: staff without any reliable_jobs permission, and staff who may view
    nobody = staff_client(django_user_model, username="nobody")
    viewer = staff_client(django_user_model, "view_job", username="viewer")

    # Then only the viewer gets the page; an unknown backend is a 404
    assert nobody.get(DASHBOARD).status_code == 403
    assert viewer.get(DASHBOARD).status_code == 200
    assert viewer.get(f"{DASHBOARD}default/").status_code == 200
    assert viewer.get(f"{DASHBOARD}nope/").status_code == 404


def test_dashboard_and_jobstats_say_when_redis_is_down(
    rj_settings: Callable[..., dict[str, str]], admin_client: Client
) -> None:
    # Given: the backend pointed at a Redis that is not there
    rj_settings(REDIS_URL="redis://127.0.0.1:1/0")

    # When
    page = admin_client.get(DASHBOARD)

    # Then the page still renders, database numbers included, and names the problem
    text = page.content.decode()
    assert page.status_code == 200
    assert "Redis did not answer" in text and "Last hour" in text
    with pytest.raises(CommandError, match="a server did not answer") as raised:
        call_command("jobstats", stdout=StringIO(), stderr=StringIO())
    assert raised.value.returncode == 1


# -- prunejobs ----------------------------------------------------------------------


def test_prunejobs_deletes_old_finished_jobs_in_batches_and_nothing_else(
    backend: ReliableJobsBackend, redis_client: redis.Redis, settings: Any
) -> None:
    # Given: old succeeded, dead (hash kept in Redis) and cancelled jobs; an old
    # unfinished one; and a recently finished one
    old_ok = [demo.add.enqueue(i, i) for i in range(3)]
    for result in old_ok:
        run_attempt(backend, result.id, outcome="succeeded")
    old_dead = demo.always_fail.enqueue("x")
    make_dead(backend, old_dead.id, attempts=2)
    old_cancelled = demo.add.enqueue(9, 9)
    backend.broker.cancel("default", old_cancelled.id)
    Job.objects.filter(pk=old_cancelled.id).update(state=JobState.CANCELLED)
    old_queued = demo.add.enqueue(7, 7)
    recent = demo.add.enqueue(8, 8)
    for result in [*old_ok, old_dead, old_cancelled, old_queued]:
        age(result.id, days=40)
    run_attempt(backend, old_queued.id, outcome="running")
    age(old_queued.id, days=40)
    run_attempt(backend, recent.id, outcome="succeeded")
    assert redis_client.exists(KEYS.job(old_dead.id))
    settings.RELIABLE_JOBS_PRUNE_DAYS = 30

    # When prunejobs runs with the setting's default and batches of two
    out = StringIO()
    call_command("prunejobs", "--batch-size", "2", stdout=out)

    # Then the five old finished jobs and their five attempts are gone, the dead
    # job's hash with them; the unfinished and the recent jobs stay
    assert out.getvalue().strip() == (
        "Pruned 5 finished jobs older than 30 days (3 succeeded, 1 dead, 1 cancelled) and 5 "
        "attempts, in 4 batches; 1 dead job hashes freed in Redis. Unfinished jobs were not "
        "touched.")
    assert set(Job.objects.values_list("pk", flat=True)) == {
        Job.objects.get(pk=old_queued.id).pk, Job.objects.get(pk=recent.id).pk}
    assert Attempt.objects.filter(job_id__in=[old_queued.id, recent.id]).count() == 2
    assert not redis_client.exists(KEYS.job(old_dead.id))
    assert redis_client.zrange(KEYS.dead, 0, -1) == []

    # And --older-than wins over the setting, down to its floor: a job that
    # finished a moment ago stays (RECONCILE_GRACE_MS + LEASE_MS), one that
    # finished an hour ago goes
    call_command("prunejobs", "--older-than", "0", stdout=out)
    assert Job.objects.filter(pk=recent.id).exists()
    age(recent.id, hours=1)
    call_command("prunejobs", "--older-than", "0", stdout=out)
    assert set(Job.objects.values_list("state", flat=True)) == {JobState.RUNNING}


def test_prunejobs_refuses_bad_arguments(backend: ReliableJobsBackend,
                                         settings: Any) -> None:
    # Then
    with pytest.raises(CommandError, match="must be a number of days >= 0"):
        call_command("prunejobs", "--older-than", "-1")
    settings.RELIABLE_JOBS_PRUNE_DAYS = "soon"
    with pytest.raises(CommandError, match="not 'soon'"):
        call_command("prunejobs")
    with pytest.raises(CommandError, match="--batch-size"):
        call_command("prunejobs", "--older-than", "1", "--batch-size", "0")
    with pytest.raises(CommandError, match="no task backend 'nope'"):
        call_command("prunejobs", "--older-than", "1", "--backend", "nope")
