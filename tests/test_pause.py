"""Pause, resume and drain a queue: the scripts, the mirror, the sweep, commands and workers.

Real Redis and PostgreSQL. Script-level tests use a Broker under a key
prefix of their own; backend-level ones go through the backend's methods and
the management commands; worker-level ones run real workers and read the
execution ledger (contrib/verify/chaos_ledger.py), which the task writes
itself, to say what started when.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Iterator
from io import StringIO
from pathlib import Path
from typing import Any

import pytest
from django.core.management import CommandError, call_command

from reliable_jobs import pausing
from reliable_jobs.broker import Applied, Broker, NewJob
from reliable_jobs.compat import task_backends
from reliable_jobs.contrib.verify.chaos_ledger import LEDGER_ENV, read_ledger
from reliable_jobs.contrib.verify.tasks import chaos_job
from reliable_jobs.models import Job, JobState, QueuePause
from reliable_jobs.sweep import Sweep
from reliable_jobs.worker import Worker

from .helpers import REDIS_URL, Processes, backdate, wait_until, worker_in_thread
from .test_admin import staff_client

Q = "work"
PAYLOAD = '{"task":"tests.tasks.noop_task","args":[],"kwargs":{}}'


@pytest.fixture
def broker() -> Iterator[Broker]:
    b = Broker(REDIS_URL, f"p{uuid.uuid4().hex[:12]}")
    yield b
    for key in b.client.scan_iter(match=f"{b.prefix}:*", count=1_000):
        b.client.delete(key)
    b.close()


def enqueue(broker: Broker, *ids: str, queue: str = Q) -> None:
    for job_id in ids:  # one call each: the first id is the oldest
        assert broker.enqueue(queue, [NewJob(job_id, PAYLOAD, 3)]) == 1


def queued(broker: Broker, queue: str = Q) -> list[str]:
    """Ids on queued, the next to run first."""
    return list(reversed(broker.client.lrange(broker.keys(queue).queued, 0, -1)))


# -- the scripts -----------------------------------------------------------------


def test_a_paused_queue_claims_nothing_and_a_resumed_one_claims_again(broker: Broker) -> None:
    # Given three queued jobs on a paused queue
    enqueue(broker, "a", "b", "c")
    assert broker.set_paused(Q, True)
    broker.client.delete(broker.keys(Q).wake)

    # When a worker claims
    result = broker.claim(Q, count=10, lease_ms=60_000)

    # Then nothing is taken, the reply says paused, and no marker wakes anyone
    assert (result.jobs, result.paused, result.remaining, result.hold_ms) == ([], True, 0, -1)
    assert queued(broker) == ["a", "b", "c"]
    assert broker.client.llen(broker.keys(Q).wake) == 0

    # When it is resumed: the marker is pushed, and the next claim takes the jobs in order
    assert broker.set_paused(Q, False)
    assert broker.client.llen(broker.keys(Q).wake) == 1
    result = broker.claim(Q, count=10, lease_ms=60_000)
    assert [j.id for j in result.jobs] == ["a", "b", "c"] and not result.paused


def test_a_moved_id_goes_back_to_the_head_of_queued_when_paused(broker: Broker) -> None:
    # Given a worker that moved the next job onto landing with BLMOVE, then the pause
    enqueue(broker, "a", "b")
    k = broker.keys(Q)
    moved = broker.client.blmove(k.queued, k.landing, 1, "RIGHT", "LEFT")
    assert moved == "a"
    broker.set_paused(Q, True)

    # When it claims with that id
    result = broker.claim(Q, count=1, lease_ms=60_000, moved_id="a")

    # Then the id is back at the head, nothing is on landing or leased
    assert result.jobs == [] and result.paused
    assert queued(broker) == ["a", "b"]
    assert broker.client.llen(k.landing) == 0 and broker.client.zcard(k.leases) == 0


def test_a_claim_in_flight_when_the_pause_returned_does_not_start(broker: Broker) -> None:
    # Given jobs claimed just before the pause (the claim ran, the worker has
    # not started them yet)
    enqueue(broker, "a", "b")
    claimed = broker.claim(Q, count=2, lease_ms=60_000).jobs
    assert len(claimed) == 2

    # When the pause returns, then the worker marks them started
    broker.set_paused(Q, True)
    marked = broker.start(Q, [job.fence for job in claimed])

    # Then neither may start: each is to be handed back unstarted
    assert marked == [Applied.PAUSED, Applied.PAUSED]
    assert not any(marked)
    # And handing them back gives their attempts back, ready for the resume
    assert broker.release(Q, [(*job.fence, False) for job in claimed]) == [Applied.DONE] * 2
    broker.set_paused(Q, False)
    again = broker.claim(Q, count=2, lease_ms=60_000).jobs
    assert sorted(j.id for j in again) == ["a", "b"]
    assert broker.start(Q, [job.fence for job in again]) == [Applied.DONE] * 2


def test_a_cancel_or_an_expired_lease_wins_over_the_pause_at_start(broker: Broker) -> None:
    # Given two claimed jobs, one cancelled and one whose lease ran out, on a paused queue
    enqueue(broker, "a", "b")
    a, b = broker.claim(Q, count=2, lease_ms=60_000).jobs
    broker.cancel(Q, a.id)
    broker.client.zadd(broker.keys(Q).leases, {b.id: 1})
    broker.set_paused(Q, True)

    # Then start says what it said before pauses existed
    assert broker.start(Q, [a.fence, b.fence]) == [Applied.CANCELLED, Applied.EXPIRED]


def test_pausing_twice_keeps_the_first_time_and_resuming_twice_does_nothing(
        broker: Broker) -> None:
    assert broker.set_paused(Q, True, since_ms=1_000)
    assert not broker.set_paused(Q, True, since_ms=2_000)
    assert broker.paused_since([Q, "other"]) == {Q: 1_000}
    assert broker.set_paused(Q, False)
    assert not broker.set_paused(Q, False)
    assert broker.paused_since([Q]) == {}


def test_a_paused_queue_waits_on_its_marker_not_on_blmove(broker: Broker) -> None:
    # Given a paused queue with work that a claim found paused
    enqueue(broker, "a")
    broker.set_paused(Q, True)
    broker.claim(Q, count=1, lease_ms=60_000)
    broker.client.delete(broker.keys(Q).wake)

    # When a worker waits on it alone, then it takes nothing off queued
    assert broker.wait([Q], 0.05) is None
    assert queued(broker) == ["a"]

    # And a resume wakes it at once
    broker.set_paused(Q, False)
    assert broker.wait([Q], 1.0) == (Q, None)


# -- the backend, the mirror and the sweep -------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_pause_is_kept_in_the_database_and_resume_removes_it(rj_settings: Any) -> None:
    rj_settings(queues=["default", "emails"])
    backend = task_backends["default"]

    assert pausing.pause_queue("emails", by="alice")
    assert not pausing.pause_queue("emails")
    row = QueuePause.objects.get()
    assert (row.backend, row.queue, row.paused_by) == ("default", "emails", "alice")
    states = {s.queue: s for s in pausing.queue_pauses()}
    assert states["emails"].paused and states["emails"].drained
    assert (states["emails"].flagged, states["emails"].shards) == (1, 1)
    assert not states["default"].paused

    assert pausing.resume_queue("emails")
    assert not pausing.resume_queue("emails")
    assert not QueuePause.objects.exists()
    assert backend.broker.paused_since(["emails"]) == {}


@pytest.mark.django_db(transaction=True)
def test_an_unknown_queue_is_refused_with_the_queues_served(rj_settings: Any) -> None:
    rj_settings(queues=["default", "emails"])
    with pytest.raises(pausing.UnknownQueue, match="its queues are: default, emails"):
        pausing.pause_queue("nope")
    assert not QueuePause.objects.exists()


@pytest.mark.django_db(transaction=True)
def test_every_shard_of_a_sharded_queue_is_paused(rj_settings: Any) -> None:
    # Given a queue split into 3 shards
    rj_settings(SHARDS={"default": 3})
    backend = task_backends["default"]

    # When it is paused, then every shard carries the flag and claims nothing
    pausing.pause_queue("default")
    shards = ["default", "default#1", "default#2"]
    assert sorted(backend.broker.paused_since(shards)) == shards
    for shard in shards:
        backend.broker.enqueue(shard, [NewJob(f"j-{shard}", PAYLOAD, 3)])
        assert backend.broker.claim(shard, count=5, lease_ms=60_000).paused

    # And resume clears them all
    pausing.resume_queue("default")
    assert backend.broker.paused_since(shards) == {}


@pytest.mark.django_db(transaction=True)
def test_a_pause_survives_a_flush_the_sweep_puts_it_back_before_reconcile_pushes(
        rj_settings: Any, redis_client: Any) -> None:
    # Given a paused queue with an unfinished job in the mirror
    rj_settings()
    backend = task_backends["default"]
    result = chaos_job.using(backend="default").enqueue(0.0)
    pausing.pause_queue("default")
    backdate(str(result.id))  # past RECONCILE_GRACE_MS

    # When Redis loses everything (FLUSHDB on the suite's own index) and
    # reconcile runs
    redis_client.flushdb()
    assert backend.broker.paused_since(["default"]) == {}
    report = Sweep(backend.parts).reconcile()

    # Then the flag is back first, the job was pushed again, and no claim takes it
    assert report.repaused == 1 and report.pushed == 1
    assert backend.broker.paused_since(["default"])
    claim = backend.broker.claim("default", count=5, lease_ms=60_000)
    assert claim.paused and claim.jobs == []
    assert Job.objects.get(pk=result.id).state == JobState.QUEUED

    # And a routine sweep pass puts a lost flag back too
    redis_client.flushdb()
    assert Sweep(backend.parts).redis_pass().repaused == 1


@pytest.mark.django_db(transaction=True)
def test_the_sweep_never_puts_back_a_flag_a_resume_removed(rj_settings: Any) -> None:
    rj_settings()
    backend = task_backends["default"]
    pausing.pause_queue("default")
    pausing.resume_queue("default")
    assert Sweep(backend.parts).redis_pass().repaused == 0
    assert backend.broker.paused_since(["default"]) == {}


# -- the commands -------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_pausequeue_and_resumequeue(rj_settings: Any) -> None:
    rj_settings(queues=["default", "emails"])
    out = StringIO()
    call_command("pausequeue", "emails", "default", stdout=out)
    call_command("pausequeue", "emails", stdout=out)
    call_command("resumequeue", "emails", "default", stdout=out)
    assert out.getvalue().splitlines() == [
        "Paused queue 'emails'.", "Paused queue 'default'.", "Queue 'emails' was already paused.",
        "Resumed queue 'emails'.", "Resumed queue 'default'."]
    assert not QueuePause.objects.exists()


@pytest.mark.django_db(transaction=True)
def test_the_commands_refuse_an_unknown_queue_before_pausing_any(rj_settings: Any) -> None:
    rj_settings(queues=["default", "emails"])
    for command in ("pausequeue", "resumequeue"):
        with pytest.raises(CommandError, match=r"Unknown queue\(s\) 'nope': TASKS\['default'\] "
                                               r"serves default, emails\."):
            call_command(command, "default", "nope")
    assert not QueuePause.objects.exists()


@pytest.mark.django_db(transaction=True)
def test_pausequeue_drain_waits_for_running_jobs_and_says_when_it_gave_up(
        rj_settings: Any) -> None:
    # Given a job that holds a lease (it runs)
    rj_settings()
    backend = task_backends["default"]
    backend.broker.enqueue("default", [NewJob("running", PAYLOAD, 3)])
    job = backend.broker.claim("default", count=1, lease_ms=60_000).jobs[0]

    # When the queue is drained with a short timeout, then it says so and stays paused
    with pytest.raises(CommandError, match=r"Timed out after 0.2 s with jobs still running on "
                                           r"'default' \(1 running\); the queues stay paused\."):
        call_command("pausequeue", "default", "--drain", "--timeout", "0.2", stdout=StringIO())
    assert QueuePause.objects.filter(queue="default").exists()

    # And once the job ends, the drain returns at once
    backend.broker.ack("default", [job.fence])
    out = StringIO()
    call_command("pausequeue", "default", "--drain", "--timeout", "5", stdout=out)
    assert "Queue 'default' is drained: none of its jobs runs." in out.getvalue()


# -- workers ------------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_prefetched_jobs_of_a_worker_do_not_start_after_the_pause(
        rj_settings: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        app_log: list[logging.LogRecord]) -> None:
    # Given a worker with one thread that claims ahead (prefetch): one job
    # runs for a while, the next ones wait in its hand, claimed
    rj_settings(PREFETCH=8, LEASE_MS=5_000, RECONCILE_GRACE_MS=5_000)
    monkeypatch.setenv(LEDGER_ENV, str(tmp_path))
    backend = task_backends["default"]
    backend.enqueue_many(chaos_job, [((0.8,), {})] + [((0.0,), {})] * 5)
    budgets = {job.pk: job.max_attempts for job in Job.objects.all()}
    worker = Worker(backend, queues=["default"], concurrency=1, scheduler=False)
    with worker_in_thread(worker):
        wait_until(lambda: read_ledger(tmp_path).runs, message="the first job to start")
        wait_until(lambda: backend.broker.counts("default").running == 6,
                   message="the others to be claimed ahead")

        # When the queue is paused while they wait in the worker's hand
        pausing.pause_queue("default")
        paused_at = time.time()

        # Then once the running job ends, none of them starts, and each is back on queued
        wait_until(lambda: backend.broker.counts("default").queued == 5, timeout=10,
                   message="the claimed jobs to be handed back")
        assert [run.start for run in read_ledger(tmp_path).runs if run.start > paused_at] == []
        wait_until(lambda: backend.broker.counts("default").running == 0, timeout=10,
                   message="the running job to be acked")

        # And after the resume each runs once, the attempt it was handed back
        # with given back (its budget one higher: attempt numbers never go down)
        pausing.resume_queue("default")
        wait_until(lambda: Job.objects.filter(state=JobState.SUCCEEDED).count() == 6,
                   timeout=20, message="every job to succeed")
    assert len(read_ledger(tmp_path).runs) == 6
    # (the worker said so, once each way)
    said = [r.getMessage() for r in app_log if r.getMessage() in (
        "Queue 'default' is paused: claiming none of its jobs until it is resumed.",
        "Queue 'default' is resumed.")]
    assert said == ["Queue 'default' is paused: claiming none of its jobs until it is resumed.",
                    "Queue 'default' is resumed."]
    charged = {str(job.pk): job.attempts - (job.max_attempts - budgets[job.pk])
               for job in Job.objects.all()}
    assert set(charged.values()) == {1}, charged


@pytest.mark.django_db(transaction=True)
@pytest.mark.slow
def test_real_workers_stop_at_the_pause_and_start_again_at_the_resume(
        rj_settings: Any, processes: Processes, tmp_path: Path) -> None:
    # Given two worker processes busy with short jobs
    env = rj_settings()
    backend = task_backends["default"]
    backend.enqueue_many(chaos_job, [((0.02,), {})] * 400)
    workers = [processes.worker(env, "--concurrency", "4", extra_env={LEDGER_ENV: str(tmp_path)})
               for _ in range(2)]
    wait_until(lambda: len(read_ledger(tmp_path).runs) >= 20, timeout=60,
               message="jobs to run")

    # When the queue is paused
    pausing.pause_queue("default")
    paused_at = time.time()
    time.sleep(1.0)

    # Then no run starts more than 100 ms after the pause returned
    late = [run.start - paused_at for run in read_ledger(tmp_path).runs
            if run.start > paused_at]
    assert max(late, default=0.0) < 0.1, late
    done = len(read_ledger(tmp_path).runs)
    assert done < 400

    # And a drain returns once nothing runs: every run the ledger has ended by then
    state = pausing.drain_queue("default", timeout_s=10)
    drained_at = time.time()
    assert state.drained
    assert all(run.end is not None and run.end <= drained_at
               for run in read_ledger(tmp_path).runs)

    # And after the resume the rest runs
    pausing.resume_queue("default")
    wait_until(lambda: Job.objects.filter(state=JobState.SUCCEEDED).count() == 400,
               timeout=60, message="every job to succeed")
    processes.stop_many(*workers)


# -- the admin and jobstats -----------------------------------------------------------

DASHBOARD = "/admin/reliable_jobs/job/dashboard/default/"
PAUSE_URL = "/admin/reliable_jobs/job/dashboard/default/pause/"


@pytest.mark.django_db(transaction=True)
def test_staff_with_the_permission_pause_and_resume_from_the_dashboard(
        rj_settings: Any, django_user_model: Any) -> None:
    # Given staff who may view jobs and pause queues
    rj_settings(queues=["default", "emails"])
    client = staff_client(django_user_model, "view_job", "pause_queue")
    assert 'value="pause"' in client.get(DASHBOARD).content.decode()

    # When they pause a queue from the dashboard
    response = client.post(PAUSE_URL, {"queue": "emails", "action": "pause"}, follow=True)

    # Then it is paused, by them, and the dashboard says so with a Resume button
    said = [str(m) for m in response.context["messages"]]
    assert said == ["Paused queue 'emails': no job of it starts from now on; jobs already "
                    "running finish."]
    assert QueuePause.objects.get().paused_by == "staff"
    page = response.content.decode()
    assert "paused" in page and "drained: nothing runs" in page and 'value="resume"' in page

    # And resuming works the same way; an unknown queue is a message, not an error page
    client.post(PAUSE_URL, {"queue": "emails", "action": "resume"})
    assert not QueuePause.objects.exists()
    response = client.post(PAUSE_URL, {"queue": "nope", "action": "pause"}, follow=True)
    said = [str(m) for m in response.context["messages"]]
    assert any("'nope' is not served by task backend 'default'" in m for m in said), said


@pytest.mark.django_db(transaction=True)
def test_pausing_from_the_admin_needs_its_own_permission(
        rj_settings: Any, django_user_model: Any) -> None:
    # Given staff who may do every job action but not pause
    rj_settings()
    client = staff_client(django_user_model, "view_job", "retry_job", "cancel_job",
                          "requeue_job", "reprioritize_job")

    # Then the dashboard offers no button, and a forged post is refused
    assert 'value="pause"' not in client.get(DASHBOARD).content.decode()
    assert client.post(PAUSE_URL, {"queue": "default", "action": "pause"}).status_code == 403
    assert client.get(PAUSE_URL).status_code == 405
    assert not QueuePause.objects.exists()


@pytest.mark.django_db(transaction=True)
def test_jobstats_shows_the_paused_queues(rj_settings: Any) -> None:
    rj_settings(queues=["default", "emails"])
    pausing.pause_queue("emails", by="ops")
    out = StringIO()
    call_command("jobstats", stdout=out)
    assert "Paused queues (no job of them starts; resume with resumequeue):" in out.getvalue()
    assert "  emails  since " in out.getvalue() and " by ops  drained, nothing runs" in (
        out.getvalue())
    out = StringIO()
    call_command("jobstats", "--json", stdout=out)
    queues = {q["name"]: q for q in json.loads(out.getvalue())["queues"]}
    assert queues["default"]["paused"] is None
    assert queues["emails"]["paused"]["drained"] and queues["emails"]["paused"]["by"] == "ops"
