"""The job history in the admin: changelist, filters, search, job page, escaping.

Real Redis and PostgreSQL, Django's test client. Jobs are moved through
their states with the broker's scripts and the mirror, the two calls a
worker makes, so each test sets up exactly the history it reads; the
browser test runs real workers.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest
from django.contrib.auth.models import Permission
from django.test import Client
from django.utils import timezone

from reliable_jobs import admin, changelist, mirror
from reliable_jobs.backend import ReliableJobsBackend
from reliable_jobs.compat import task_backends
from reliable_jobs.jobids import short_id
from reliable_jobs.mirror import AttemptRecord
from reliable_jobs.models import Attempt, AttemptOutcome, Job, JobState
from testproject.demo import tasks as demo

pytestmark = pytest.mark.django_db(transaction=True)

CHANGELIST = "/admin/reliable_jobs/job/"
TRACEBACK = 'Traceback (most recent call last):\n  File "x.py", line 1\nRuntimeError: {}'


def change_url(job_id: Any) -> str:
    return f"{CHANGELIST}{job_id}/change/"


# -- helpers shared by the admin, dashboard and browser tests ---------------


def configured_backend() -> ReliableJobsBackend:
    """The default backend as the test configured it (``rj_settings``)."""
    configured = task_backends["default"]
    assert isinstance(configured, ReliableJobsBackend)
    return configured


@pytest.fixture
def backend(rj_settings: Callable[..., dict[str, str]]) -> ReliableJobsBackend:
    return configured_backend()


def run_attempt(backend: ReliableJobsBackend, job_id: str, *, outcome: str,
                queue: str = "default", error: str = "", worker: str = "test-worker",
                delay_ms: int = 0) -> int:
    """Claim ``job_id`` and end its attempt as a worker would: mirror first, then Redis.

    ``outcome`` is 'succeeded', 'retry' (failed, retried after ``delay_ms``),
    'dead' (failed for good) or 'running' (left held). Returns the attempt.
    """
    broker = backend.broker
    broker.promote(queue)  # a retry waiting 0 ms is due at once
    claimed = broker.claim(queue, count=1, lease_ms=60_000)
    while not claimed.jobs and claimed.remaining:  # a cancelled job's id, dropped: claim on
        claimed = broker.claim(queue, count=1, lease_ms=60_000)
    assert [job.id for job in claimed.jobs] == [job_id], "another job was first in line"
    attempt, gen = claimed.jobs[0].attempt, claimed.jobs[0].gen
    broker.start(queue, [claimed.jobs[0].fence])
    now = timezone.now()
    database = backend.config.DATABASE
    if outcome == "running":
        mirror.record(database, [AttemptRecord(job_id, attempt, JobState.RUNNING,
                                               worker_id=worker, started_at=now, gen=gen)])
        return attempt
    if outcome == "succeeded":
        mirror.record(database, [AttemptRecord(
            job_id, attempt, JobState.SUCCEEDED, worker_id=worker, started_at=now,
            finished_at=now + timedelta(milliseconds=1500), outcome=AttemptOutcome.SUCCEEDED,
            return_value={"ok": True}, gen=gen)])
        assert broker.ack(queue, [(job_id, attempt, gen)]) == [True]
        return attempt
    dead = outcome == "dead"
    message = error or f"builtins.RuntimeError: attempt {attempt} failed"
    mirror.record(database, [AttemptRecord(
        job_id, attempt, JobState.DEAD if dead else JobState.SCHEDULED, worker_id=worker,
        started_at=now, finished_at=now + timedelta(milliseconds=250),
        outcome=AttemptOutcome.FAILED, error=message,
        traceback=TRACEBACK.format(message), gen=gen)])
    assert broker.nack(queue, [(job_id, attempt, gen, -1 if dead else delay_ms, message)]) == [
        True]
    return attempt


def make_dead(backend: ReliableJobsBackend, job_id: str, *, attempts: int = 3,
              queue: str = "default", error: str = "") -> None:
    """Fail ``job_id`` ``attempts`` times, the last one for good."""
    for _ in range(attempts - 1):
        run_attempt(backend, job_id, outcome="retry", queue=queue)
    run_attempt(backend, job_id, outcome="dead", queue=queue, error=error)


def staff_client(django_user_model: Any, *perms: str, username: str = "staff") -> Client:
    """A logged-in staff user holding exactly ``perms`` (codenames of reliable_jobs)."""
    user = django_user_model.objects.create_user(username, password="pw", is_staff=True)
    user.user_permissions.set(Permission.objects.filter(content_type__app_label="reliable_jobs",
                                                        codename__in=perms))
    client = Client()
    client.force_login(user)
    return client


def page_text(response: Any) -> str:
    return response.content.decode()


# -- the changelist ----------------------------------------------------------


def test_changelist_shows_every_column_newest_first(
    backend: ReliableJobsBackend, admin_client: Client
) -> None:
    # Given: an older dead job (3 attempts) and a newer succeeded one
    doomed = demo.always_fail.enqueue("doomed")
    make_dead(backend, doomed.id, error="builtins.RuntimeError: doomed\nsecond line")
    ok = demo.add.enqueue(1, 2)
    run_attempt(backend, ok.id, outcome="succeeded")

    # When staff open the changelist
    response = admin_client.get(CHANGELIST)

    # Then: both rows, newest first, with badge, attempts/max, duration and the
    # first line of the last error only
    assert response.status_code == 200
    text = page_text(response)
    assert text.index(ok.id) < text.index(doomed.id)
    assert '<span class="rj-badge rj-state-dead">Dead</span>' in text
    assert '<span class="rj-badge rj-state-succeeded">Succeeded</span>' in text
    assert "3/3" in text and "1/3" in text
    assert "builtins.RuntimeError: doomed" in text
    assert "second line" not in text
    assert "1.5 s" in text  # started -> finished of the succeeded job
    assert "Live dashboard" in text


def test_filters_on_state_queue_task_and_time(
    rj_settings: Callable[..., dict[str, str]], admin_client: Client
) -> None:
    # Given: jobs on two queues and two tasks, one enqueued two days ago
    rj_settings(queues=["default", "emails"])
    backend = configured_backend()
    c = demo.noop.enqueue()
    make_dead(backend, c.id, attempts=1)
    a = demo.add.enqueue(1, 1)
    b = demo.add.using(queue_name="emails").enqueue(2, 2)
    old = demo.noop.using(queue_name="emails").enqueue()
    Job.objects.filter(pk=old.id).update(enqueued_at=timezone.now() - timedelta(days=2))

    def listed(query: str) -> set[str]:
        response = admin_client.get(f"{CHANGELIST}?{query}")
        assert response.status_code == 200
        return {str(job.pk) for job in response.context["cl"].result_list}

    # Then each filter narrows the list, and filters combine
    assert listed("state__exact=dead") == {c.id}
    assert listed("queue=emails") == {b.id, old.id}
    assert listed(f"task={demo.noop.module_path}") == {c.id, old.id}
    assert listed("enqueued=24h") == {a.id, b.id, c.id}
    assert listed("enqueued=7d&queue=emails") == {b.id, old.id}
    assert listed("enqueued=older") == set()
    # And the filter sidebar offers the values present (found by skip scan)
    text = page_text(admin_client.get(CHANGELIST))
    assert "?queue=emails" in text and f"?task={demo.noop.module_path}" in text


def test_search_by_id_and_by_part_of_the_task_path(
    backend: ReliableJobsBackend, admin_client: Client
) -> None:
    # Given
    a = demo.add.enqueue(1, 1)
    b = demo.noop.enqueue()

    def found(term: str) -> set[str]:
        response = admin_client.get(CHANGELIST, {"q": term})
        return {str(job.pk) for job in response.context["cl"].result_list}

    # Then an id (or the short id the list shows, its end) finds its job, the
    # start of an id finds the jobs made at that time, a fragment of a task
    # path finds that task's jobs
    assert found(a.id) == {a.id}
    assert found(a.id.upper()) == {a.id}
    assert short_id(a.id) == a.id[-8:]
    assert found(short_id(a.id)) == {a.id}
    assert found(a.id[-12:]) == {a.id}
    assert short_id(a.id) in page_text(admin_client.get(CHANGELIST))
    assert a.id in found(a.id[:8]) and a.id in found(a.id[:13])  # with its dash
    assert found(a.id[:23]) == {a.id}
    assert found("NOOP") == {b.id}
    assert found("demo.tasks") == {a.id, b.id}
    assert found(str(uuid.uuid4())) == set()
    assert found("no such thing") == set()


def test_count_above_the_cap_is_the_planners_estimate(
    backend: ReliableJobsBackend, admin_client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given: more jobs than the exact-count cap (lowered for the test)
    monkeypatch.setattr(changelist, "COUNT_CAP", 5)
    backend.enqueue_many(demo.noop, [((), {})] * 12)

    # When
    response = admin_client.get(CHANGELIST)

    # Then the count is labelled as an estimate, and pages still work
    text = page_text(response)
    assert response.context["cl"].paginator.estimated
    assert response.context["cl"].result_count > 5
    assert "about" in text
    # And under the cap the count is exact
    monkeypatch.setattr(changelist, "COUNT_CAP", 100)
    response = admin_client.get(CHANGELIST)
    assert response.context["cl"].result_count == 12
    assert not response.context["cl"].paginator.estimated


# -- the job page --------------------------------------------------------------


def test_job_page_shows_json_traceback_and_every_attempt(
    backend: ReliableJobsBackend, admin_client: Client
) -> None:
    # Given: a job that failed twice, then succeeded (three attempts)
    result = demo.fail_times.enqueue("key", 2)
    run_attempt(backend, result.id, outcome="retry", worker="worker-a")
    run_attempt(backend, result.id, outcome="retry", worker="worker-b")
    run_attempt(backend, result.id, outcome="succeeded", worker="worker-c")

    # When
    response = admin_client.get(change_url(result.id))

    # Then: arguments and return value as indented JSON, the last traceback in
    # a <pre>, and three attempt rows with worker, duration and outcome
    assert response.status_code == 200
    text = page_text(response)
    assert '<pre class="rj-pre">[\n  &quot;key&quot;,\n  2\n]</pre>' in text
    assert '<pre class="rj-pre">{\n  &quot;ok&quot;: true\n}</pre>' in text
    assert "<p>Attempt 2:</p><pre class=\"rj-pre\">Traceback (most recent call last):" in text
    for worker in ("worker-a", "worker-b", "worker-c"):
        assert worker in text
    assert text.count('<span class="rj-badge rj-outcome-failed">Failed</span>') == 2
    assert text.count('<span class="rj-badge rj-outcome-succeeded">Succeeded</span>') == 1
    assert "250 ms" in text and "1.5 s" in text
    started = Attempt.objects.get(job_id=result.id, number=3).started_at
    assert re.search(rf'<td class="field-started">\s*<p>{admin.timestamp(started)}</p>', text)
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3}", str(admin.timestamp(started)))
    assert Attempt.objects.filter(job_id=result.id).count() == 3


def test_html_in_arguments_and_errors_renders_as_text(
    backend: ReliableJobsBackend, admin_client: Client
) -> None:
    # Given: a job whose argument and error carry markup
    evil = "<script>alert('rj')</script>"
    result = demo.always_fail.enqueue(evil)
    make_dead(backend, result.id, attempts=1, error=f"builtins.RuntimeError: <b>{evil}</b>")

    # When staff open the list and the job
    pages = [page_text(admin_client.get(CHANGELIST)),
             page_text(admin_client.get(change_url(result.id)))]

    # Then the markup is escaped everywhere, never live
    for text in pages:
        assert evil not in text
        assert "<b>" not in text
        assert "&lt;script&gt;alert(" in text
    assert "&lt;b&gt;&lt;script&gt;" in pages[1]


def test_the_admin_is_read_only(backend: ReliableJobsBackend, admin_client: Client) -> None:
    # Given
    result = demo.add.enqueue(1, 1)
    before = Job.objects.values().get(pk=result.id)

    # When a superuser tries to add, edit or delete through the admin
    add = admin_client.get(f"{CHANGELIST}add/")
    edit = admin_client.post(change_url(result.id), {"state": "dead", "_save": "Save"})
    delete = admin_client.post(f"{change_url(result.id)[:-len('change/')]}delete/",
                               {"post": "yes"})

    # Then none is possible, and the row is unchanged
    assert add.status_code == 403
    assert edit.status_code == 403
    assert delete.status_code == 403
    assert Job.objects.values().get(pk=result.id) == before


def test_migrations_match_the_models() -> None:
    # Given the models (permissions and indexes added for the admin)
    from django.core.management import call_command

    # Then no migration is missing
    call_command("makemigrations", "reliable_jobs", "--check", "--dry-run", verbosity=0)


def test_pretty_json_sorts_keys_and_keeps_unicode(
    backend: ReliableJobsBackend, admin_client: Client
) -> None:
    # Given
    result = demo.add.enqueue(1, 2)
    Job.objects.filter(pk=result.id).update(kwargs={"z": 1, "a": "é"})

    # Then
    text = page_text(admin_client.get(change_url(result.id)))
    assert json.dumps({"a": "é", "z": 1}, indent=2, ensure_ascii=False).replace(
        '"', "&quot;") in text
