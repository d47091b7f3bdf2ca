"""Priorities end to end: the admin's column, filter and action, and a rebuild from the mirror.

Real Redis and PostgreSQL, Django's test client; the action goes through the
broker (reprioritize.lua) and the mirror records what Redis did.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
import redis
from django.contrib.admin.models import LogEntry
from django.test import Client
from django.utils import timezone

from reliable_jobs import staff
from reliable_jobs.backend import ReliableJobsBackend
from reliable_jobs.keys import QueueKeys
from reliable_jobs.models import Job
from reliable_jobs.sweep import Sweep
from testproject.demo import tasks as demo

from .helpers import backdate
from .test_admin import CHANGELIST, change_url, configured_backend, staff_client

pytestmark = pytest.mark.django_db(transaction=True)
KEYS = QueueKeys("rj", "default")


@pytest.fixture
def backend(rj_settings: Callable[..., dict[str, str]]) -> ReliableJobsBackend:
    return configured_backend()


def act(client: Client, priority: Any, *job_ids: str, prefix: str = "") -> list[str]:
    response = client.post(CHANGELIST, {"action": "reprioritize_jobs", "index": 0,
                                        "priority": priority,
                                        "_selected_action": list(job_ids)}, follow=True)
    assert response.status_code == 200
    return [str(m) for m in response.context["messages"]]


def waiting(redis_client: redis.Redis) -> dict[str, list[str]]:
    """Every priority list of the default queue that holds ids."""
    lists = {"0": redis_client.lrange(KEYS.queued, 0, -1)}
    for band in redis_client.zrange(KEYS.bands, 0, -1):
        lists[band] = redis_client.lrange(KEYS.band(int(band)), 0, -1)
    return {band: ids for band, ids in lists.items() if ids}


# -- rebuild ----------------------------------------------------------------------


def test_a_job_redis_lost_is_rebuilt_at_its_priority(
    backend: ReliableJobsBackend, redis_client: redis.Redis
) -> None:
    # Given: a priority 30 job whose Redis side is lost (hash and list entry)
    result = demo.add.using(priority=30).enqueue(1, 2)
    redis_client.delete(KEYS.job(result.id), KEYS.band(30), KEYS.bands)
    backdate(result.id)

    # When: reconcile runs
    report = Sweep(backend.parts).reconcile()

    # Then: it is pushed again at priority 30, a generation later
    assert report.pushed == 1
    assert waiting(redis_client) == {"30": [result.id]}
    assert redis_client.hget(KEYS.job(result.id), "priority") == "30"
    assert redis_client.hget(KEYS.job(result.id), "gen") == "1"


def test_unique_and_bulk_enqueues_keep_the_priority(
    backend: ReliableJobsBackend, redis_client: redis.Redis
) -> None:
    # When: a unique task and a bulk enqueue are given priorities
    unique = demo.unique_add.using(priority=12).enqueue(1, 2)
    bulk = backend.enqueue_many(demo.add.using(priority=-3), [((1, 1), {}), ((2, 2), {})])

    # Then: each waits on its own priority's list, and the rows say so
    assert waiting(redis_client) == {"12": [unique.id], "-3": [r.id for r in reversed(bulk)]}
    assert Job.objects.get(pk=unique.id).priority == 12
    assert {job.priority for job in Job.objects.filter(pk__in=[r.id for r in bulk])} == {-3}


# -- the changelist -----------------------------------------------------------------


def test_the_changelist_shows_and_filters_by_priority(
    backend: ReliableJobsBackend, django_user_model: Any
) -> None:
    # Given: jobs at 5, 0 and -5, and a viewer
    raised = demo.add.using(priority=5).enqueue(1, 1)
    plain = demo.add.enqueue(2, 2)
    lowered = demo.add.using(priority=-5).enqueue(3, 3)
    viewer = staff_client(django_user_model, "view_job")

    # When: they open the list, then filter it three ways
    page = viewer.get(CHANGELIST).content.decode()
    shown = {choice: [str(job.pk) for job in viewer.get(
        CHANGELIST, {"priority": choice}).context["cl"].result_list]
        for choice in ("raised", "default", "lowered")}

    # Then: the column is there, and each filter keeps its jobs only
    assert "column-priority" in page
    assert shown == {"raised": [raised.id], "default": [plain.id], "lowered": [lowered.id]}
    # and a viewer is offered no priority action
    assert 'value="reprioritize_jobs"' not in page


# -- the action ------------------------------------------------------------------------


def test_staff_raise_a_queued_job_through_the_broker_and_the_mirror_records_it(
    backend: ReliableJobsBackend, django_user_model: Any, redis_client: redis.Redis
) -> None:
    # Given: two plain jobs, and staff holding the priority permission
    first = demo.add.enqueue(1, 1)
    second = demo.add.enqueue(2, 2)
    boss = staff_client(django_user_model, "view_job", "reprioritize_job")
    assert 'value="reprioritize_jobs"' in boss.get(CHANGELIST).content.decode()

    # When: they give the second one priority 40
    said = act(boss, "40", second.id)

    # Then: Redis runs it first, the row says 40, and the change is logged
    assert said == [f"Job {second.id} now has priority 40 (it had 0)."]
    assert Job.objects.get(pk=second.id).priority == 40
    assert LogEntry.objects.get(object_id=second.id).change_message == said[0]
    assert waiting(redis_client)["40"] == [second.id]
    claimed = backend.broker.claim("default", count=5, lease_ms=60_000)
    assert [j.id for j in claimed.jobs] == [second.id, first.id]
    assert claimed.garbage == []


def test_the_action_needs_its_own_permission(
    backend: ReliableJobsBackend, django_user_model: Any, redis_client: redis.Redis
) -> None:
    # Given: a queued job, and staff who may cancel, retry and requeue, but not this
    queued = demo.add.enqueue(1, 1)
    other = staff_client(django_user_model, "view_job", "retry_job", "cancel_job",
                         "requeue_job")
    before = (waiting(redis_client), redis_client.hgetall(KEYS.job(queued.id)))

    # When: they post the action anyway
    said = act(other, "9", queued.id)

    # Then: it is ignored; nothing moved
    assert said == ["No action selected."]
    assert 'value="reprioritize_jobs"' not in other.get(CHANGELIST).content.decode()
    assert (waiting(redis_client), redis_client.hgetall(KEYS.job(queued.id))) == before
    assert Job.objects.get(pk=queued.id).priority == 0


@pytest.mark.parametrize("given", ["", "101", "-101", "high", "2.5"])
def test_a_missing_or_bad_priority_changes_nothing(
    backend: ReliableJobsBackend, django_user_model: Any, redis_client: redis.Redis, given: str
) -> None:
    queued = demo.add.enqueue(1, 1)
    boss = staff_client(django_user_model, "view_job", "reprioritize_job")
    before = waiting(redis_client)

    said = act(boss, given, queued.id)

    assert said == [f"Give the new priority, a whole number from -100 to 100 (not {given!r}), "
                    "next to the action: no job was changed."]
    assert waiting(redis_client) == before
    assert Job.objects.get(pk=queued.id).priority == 0


def test_a_running_or_finished_job_keeps_its_priority(
    backend: ReliableJobsBackend, django_user_model: Any, redis_client: redis.Redis
) -> None:
    # Given: a job a worker claimed (Redis: running, the row may still say
    # queued), and a scheduled job
    running = demo.add.enqueue(1, 1)
    assert backend.broker.claim("default", count=1, lease_ms=60_000).jobs
    later = demo.add.using(run_after=timezone.now() + timedelta(hours=1)).enqueue(2, 2)
    boss = staff_client(django_user_model, "view_job", "reprioritize_job")

    # When: staff change both
    said = act(boss, "-20", running.id, later.id)

    # Then: the running one is refused as Redis sees it; the scheduled one changes
    # and will be promoted onto its new band
    assert said == [f"Job {later.id} now has priority -20 (it had 0).",
                    f"Job {running.id} is running in Redis: its priority was not changed."]
    assert Job.objects.get(pk=running.id).priority == 0
    assert Job.objects.get(pk=later.id).priority == -20
    assert redis_client.hget(KEYS.job(later.id), "priority") == "-20"


def test_the_action_runs_from_the_job_page(
    backend: ReliableJobsBackend, django_user_model: Any, redis_client: redis.Redis
) -> None:
    # Given: a queued job's page
    queued = demo.add.enqueue(1, 1)
    boss = staff_client(django_user_model, "view_job", "reprioritize_job")
    page = boss.get(change_url(queued.id)).content.decode()
    assert 'value="reprioritize_jobs"' in page

    # When: staff pick "change priority" there, with a new priority
    response = boss.post(change_url(queued.id), {
        "CHANGE_FORM-action": "reprioritize_jobs", "CHANGE_FORM-priority": "3",
        "_selected_action": queued.id, "index": 0,
    }, follow=True)

    # Then: the job has it
    assert [str(m) for m in response.context["messages"]] == [
        f"Job {queued.id} now has priority 3 (it had 0)."]
    assert Job.objects.get(pk=queued.id).priority == 3
    assert waiting(redis_client) == {"0": [queued.id], "3": [queued.id]}  # old copy: a stray


def test_staff_reprioritize_refuses_what_the_row_says_is_not_waiting(
    backend: ReliableJobsBackend, redis_client: redis.Redis
) -> None:
    # Given: a job whose row says it succeeded
    done = demo.add.enqueue(1, 1)
    Job.objects.filter(pk=done.id).update(state="succeeded")

    # When / Then: the action refuses it before asking Redis
    outcome = staff.reprioritize(backend.parts, done.id, 5)
    assert not outcome.done
    assert outcome.message == (f"Job {done.id} is succeeded: only a queued or scheduled job's "
                               "priority can be changed; it was not changed.")
    assert redis_client.hget(KEYS.job(done.id), "priority") is None
