"""A whole workflow in the admin and from Python: its graph, its progress, retry from
failed, cancel the rest, and callbacks on success, on completion and on failure.

Real Redis and PostgreSQL, Django's test client, real staff users with
exactly the permissions a test names. Jobs end through the real scripts and
mirror (``run_attempt``: a simulated worker) or a real burst worker in this
process (``drain_here``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import redis
from django.db import DEFAULT_DB_ALIAS, connections, transaction
from django.test import Client
from django.test.utils import CaptureQueriesContext

from reliable_jobs import staff, workflow_svg, workflows
from reliable_jobs.backend import ReliableJobsBackend
from reliable_jobs.canvas import batch, chain, chord, group
from reliable_jobs.compat import InvalidTask
from reliable_jobs.keys import QueueKeys
from reliable_jobs.mirror import dependencies
from reliable_jobs.models import Attempt, Job, JobState
from testproject.demo import tasks as demo

from .helpers import drain_here
from .test_admin import configured_backend, make_dead, run_attempt, staff_client

pytestmark = pytest.mark.django_db(transaction=True)
KEYS = QueueKeys("rj", "default")
UNFINISHED = (JobState.WAITING, JobState.QUEUED, JobState.SCHEDULED, JobState.RUNNING)


@pytest.fixture
def backend(rj_settings: Callable[..., dict[str, str]]) -> ReliableJobsBackend:
    return configured_backend()


@pytest.fixture
def boss(django_user_model: Any) -> Client:
    return staff_client(django_user_model, "view_workflow", "view_job", "retry_workflow",
                        "cancel_workflow", username="boss")


def page_url(workflow_id: str) -> str:
    return f"/admin/reliable_jobs/workflow/{workflow_id}/change/"


def states(flow: Any) -> list[str]:
    rows = {str(pk): state for pk, state in
            Job.objects.filter(workflow_id=flow.id).values_list("pk", "state")}
    return [rows[r.id] for r in flow.results]


def row(result: Any) -> Job:
    return Job.objects.get(pk=result.id)


def act_on_page(client: Client, workflow_id: str, action: str) -> tuple[int, list[str]]:
    """Post an action from the workflow's page; the status and the messages shown."""
    response = client.post(page_url(workflow_id), {
        "CHANGE_FORM-action": action, "_selected_action": workflow_id, "index": 0},
        follow=True)
    messages = [str(m) for m in response.context["messages"]] if response.context else []
    return response.status_code, messages


# -- the graph -----------------------------------------------------------------


def test_the_page_draws_a_chord_with_each_jobs_state_and_links(
        backend: ReliableJobsBackend, boss: Client) -> None:
    # Given: a chord of three whose first member succeeded, second died, third is
    # queued; the callback was cancelled by the death
    flow = chord(group(demo.add.s(1, 1), demo.add.s(2, 2), demo.add.s(3, 3)),
                 demo.total.s().with_results()).enqueue(name="nightly")
    a, b, c, callback = flow.results
    run_attempt(backend, a.id, outcome="succeeded")
    make_dead(backend, b.id, attempts=1)

    # When staff open its page
    page = boss.get(page_url(flow.id)).content.decode()

    # Then: an SVG with one box per job, coloured by state, each linking to its job
    assert page.count("<div class=\"rj-graph\"><svg") == 1
    for result, shown in ((a, "succeeded"), (b, "dead"), (c, "queued"),
                          (callback, "upstream_failed")):
        assert f'href="/admin/reliable_jobs/job/{result.id}/change/" class="rj-node ' \
               f'rj-node-{shown}"' in page
    assert page.count('class="rj-edge"') == 3
    assert ">add<" in page and ">total<" in page
    assert "cancelled: upstream failed" in page
    # and the progress, as workflows.progress() counts it
    assert "1 succeeded, 2 failed, 0 skipped of 4" in page


def test_the_page_reads_a_bounded_number_of_queries_whatever_the_size(
        backend: ReliableJobsBackend, boss: Client) -> None:
    # Given: a chord of 3 and a chord of 300 (a drawing each), and one of 700 (counts)
    small = chord(group(*(demo.add.s(i, 0) for i in range(3))), demo.total.s()).enqueue()
    big = chord(group(*(demo.add.s(i, 0) for i in range(300))), demo.total.s()).enqueue()
    huge = chord(group(*(demo.add.s(i, 0) for i in range(700))), demo.total.s()).enqueue()
    boss.get(page_url(small.id))  # the session's and the content types' first reads
    counted = []
    for flow in (small, big, huge):
        with CaptureQueriesContext(connections[DEFAULT_DB_ALIAS]) as queries:
            response = boss.get(page_url(flow.id))
        assert response.status_code == 200
        counted.append(len(queries))

    # Then: the same number of queries for each (no query per job), and few
    assert counted[0] == counted[1] == counted[2], counted
    assert counted[0] <= 12, counted


def test_a_big_workflow_shows_counts_per_layer_and_says_why(
        backend: ReliableJobsBackend, boss: Client, monkeypatch: pytest.MonkeyPatch) -> None:
    # Given: a chain of a 600-member group and a callback, above the drawing's bound
    flow = chord(group(*(demo.add.s(i, 0) for i in range(600))), demo.total.s()).enqueue()
    make_dead(backend, flow.results[0].id, attempts=1)

    # When / Then: no drawing, a line per layer with its jobs by state, and why
    page = boss.get(page_url(flow.id)).content.decode()
    assert "rj-graph" not in page
    assert f"601 jobs: above {workflow_svg.DRAW_LIMIT} the graph is not drawn" in page
    table = page[page.index('class="rj-layers"'):]
    assert ('<tr><th>0</th><td class="num">599</td><td class="num">1</td><td class="num"></td>'
            "</tr>") in table
    assert ('<tr><th>1</th><td class="num"></td><td class="num"></td><td class="num">1</td>'
            "</tr>") in table
    assert '<th class="num">cancelled: upstream failed</th>' in table

    # And above the layering's bound, the jobs by state only
    monkeypatch.setattr(workflow_svg, "LAYER_LIMIT", 100)
    page = boss.get(page_url(flow.id)).content.decode()
    assert "601 jobs: above 100 neither the graph nor its layers are shown" in page
    assert "<th>queued</th><td class=\"num\">599</td>" in page


# -- permissions -----------------------------------------------------------------


def test_staff_without_the_permissions_see_no_action_and_cannot_forge_one(
        backend: ReliableJobsBackend, django_user_model: Any,
        redis_client: redis.Redis) -> None:
    # Given: a workflow with a dead member, and staff who may view but not act
    flow = chord(group(demo.add.s(1, 1), demo.add.s(2, 2)), demo.total.s()).enqueue()
    make_dead(backend, flow.results[0].id, attempts=1)
    viewer = staff_client(django_user_model, "view_workflow", "view_job",
                          "retry_job", "cancel_job", username="viewer")
    before = states(flow)

    # When they open the list and the page, then post both actions anyway
    listing = viewer.get("/admin/reliable_jobs/workflow/").content.decode()
    page = viewer.get(page_url(flow.id)).content.decode()
    forged = [act_on_page(viewer, flow.id, name)
              for name in ("retry_from_failed", "cancel_the_rest")]
    listed = viewer.post("/admin/reliable_jobs/workflow/", {
        "action": "cancel_the_rest", "index": 0, "_selected_action": [flow.id]}, follow=True)

    # Then: no action offered (the job permissions do not grant them); the forged
    # ones are refused and nothing moved
    for text in (listing, page):
        assert "retry_from_failed" not in text and "cancel_the_rest" not in text
    assert all(status in (400, 403) or not said for status, said in forged), forged
    assert [str(m) for m in listed.context["messages"]] in ([], ["No action selected."])
    assert states(flow) == before

    # And staff without view_workflow cannot open the page at all
    outsider = staff_client(django_user_model, "view_job", username="outsider")
    assert outsider.get(page_url(flow.id)).status_code == 403


def test_each_workflow_action_needs_its_own_permission(
        backend: ReliableJobsBackend, django_user_model: Any) -> None:
    # Given: staff who may retry workflows but not cancel them
    flow = chord(group(demo.add.s(1, 1), demo.add.s(2, 2)), demo.total.s()).enqueue()
    retrier = staff_client(django_user_model, "view_workflow", "retry_workflow",
                           username="retrier")

    # When / Then: only retry is offered; cancel, posted anyway, changes nothing
    page = retrier.get(page_url(flow.id)).content.decode()
    assert 'value="retry_from_failed"' in page and 'value="cancel_the_rest"' not in page
    act_on_page(retrier, flow.id, "cancel_the_rest")
    assert states(flow) == ["queued", "queued", "waiting"]
    status, said = act_on_page(retrier, flow.id, "retry_from_failed")
    assert status == 200 and said == [f"Workflow {flow.id}: 0 dead job(s) queued again, "
                                      "0 job(s) cancelled by a failure waiting again."]


# -- retry from failed -------------------------------------------------------------


def test_retry_from_failed_makes_a_failed_chord_complete_with_one_callback_run(
        backend: ReliableJobsBackend, boss: Client) -> None:
    # Given: a chord whose second member died, so its callback was cancelled
    flow = chord(group(demo.add.s(1, 1), demo.add.s(2, 2), demo.add.s(3, 3)),
                 demo.total.s(extra=100).with_results()).enqueue()
    a, b, _c, callback = flow.results
    run_attempt(backend, a.id, outcome="succeeded")
    make_dead(backend, b.id, attempts=1)
    assert row(callback).state == JobState.CANCELLED

    # When staff retry the workflow from its page
    status, said = act_on_page(boss, flow.id, "retry_from_failed")

    # Then: the dead member is queued again, the callback waits for it alone
    assert status == 200
    assert said == [f"Workflow {flow.id}: 1 dead job(s) queued again, 1 job(s) cancelled by "
                    "a failure waiting again."]
    assert (row(callback).state, row(callback).waiting_for) == (JobState.WAITING, 2)

    # When a worker runs what is left
    drain_here()

    # Then: the workflow completes, the callback ran exactly once with every result
    done = row(callback)
    assert done.state == JobState.SUCCEEDED
    assert done.args == [[{"ok": True}, 4, 6], ] and done.attempt_set.count() == 1
    assert done.last_error == ""
    assert workflows.progress(flow.id) == {"succeeded": 4, "total": 4, "done": 4, "failed": 0,
                                           "skipped": 0}


def test_retry_failed_puts_back_a_cascade_and_leaves_staff_cancels(
        backend: ReliableJobsBackend) -> None:
    # Given: a -> b -> c (a died: b and c cancelled in cascade), and d, a
    # sibling staff cancelled, with e waiting for d
    flow = chain(demo.add.s(1, 1), demo.add.s(2).with_results(),
                 demo.add.s(3).with_results()).enqueue()
    a, b, c = flow.results
    make_dead(backend, a.id, attempts=1)
    other = chain(demo.add.s(5, 5), demo.add.s(6, 6)).enqueue()
    d, _e = other.results
    staff.cancel(backend.parts, d.id)

    # When
    outcome = workflows.retry_failed(flow.id)
    untouched = workflows.retry_failed(other.id)

    # Then: a is queued again, b and c wait (b for a, c for b); the staff
    # cancel stays, and so does what it cancelled
    assert outcome.waiting == sorted([b.id, c.id])
    assert states(flow) == ["queued", "waiting", "waiting"]
    assert untouched.waiting == [] and untouched.acted == []
    assert untouched.message.endswith("2 cancelled job(s) stay cancelled.")
    assert states(other) == ["cancelled", "cancelled"]

    # When a worker drains: each runs once, in order, with its upstream's result
    drain_here()
    assert [row(r).return_value for r in flow.results] == [2, 4, 7]
    assert [row(r).attempt_set.count() for r in flow.results] == [2, 1, 1]


def test_retry_failed_brings_back_a_dependent_whose_upstream_succeeded_since(
        backend: ReliableJobsBackend) -> None:
    # Given: a chord whose member died, was retried by staff alone and succeeded:
    # its callback stayed cancelled (an edge is settled once)
    flow = chord(group(demo.add.s(1, 1), demo.add.s(2, 2)), demo.total.s().with_results()
                 ).enqueue()
    a, b, callback = flow.results
    make_dead(backend, a.id, attempts=1)
    run_attempt(backend, b.id, outcome="succeeded")
    assert staff.retry(backend.parts, a.id).done
    run_attempt(backend, a.id, outcome="succeeded")
    assert row(callback).state == JobState.CANCELLED

    # When
    outcome = workflows.retry_failed(flow.id)

    # Then: no job to retry, and the callback is released at once, with both results
    assert outcome.acted == [] and outcome.waiting == [callback.id]
    released = row(callback)
    assert (released.state, released.args) == (JobState.QUEUED, [[{"ok": True}, {"ok": True}]])


def test_a_retried_member_ending_while_its_dependents_are_put_back_is_not_missed(
        backend: ReliableJobsBackend) -> None:
    """The race of retry from failed: the retried job succeeds while the put-back of
    its dependent is uncommitted. The share lock on the upstream makes its write wait
    for the put-back's commit, so its settle sees the edge again; without it the edge
    would stay unsettled and the callback wait for ever."""
    flow = chord(group(demo.add.s(1, 1)), demo.total.s().with_results()).enqueue()
    a, callback = flow.results
    make_dead(backend, a.id, attempts=1)
    assert staff.retry(backend.parts, a.id).done
    ended = threading.Event()

    def succeed_a() -> None:
        try:
            run_attempt(backend, a.id, outcome="succeeded")
            ended.set()
        finally:
            connections.close_all()

    with transaction.atomic():
        assert dependencies.put_back("default", flow.id) == [callback.id]
        other = threading.Thread(target=succeed_a)
        other.start()
        time.sleep(0.5)  # a's mirror write waits for this commit (or ends, unlocked)
    other.join(10)
    assert ended.is_set()
    assert (row(callback).state, row(callback).args) == (JobState.QUEUED, [[{"ok": True}]])


# -- cancel the rest -----------------------------------------------------------------


def test_cancel_the_rest_leaves_nothing_runnable(
        backend: ReliableJobsBackend, boss: Client, redis_client: redis.Redis) -> None:
    # Given: a batch whose members are running, queued and succeeded, with
    # callbacks on success and on completion waiting
    flow = batch([demo.add.s(1, 1), demo.add.s(2, 2), demo.add.s(3, 3)],
                 on_success=demo.total.s(), on_complete=demo.total.s()).enqueue()
    a, b, _c, on_success, on_complete = flow.results
    run_attempt(backend, a.id, outcome="succeeded")
    run_attempt(backend, b.id, outcome="running")
    attempts = Attempt.objects.count()

    # When staff cancel the rest
    status, said = act_on_page(boss, flow.id, "cancel_the_rest")

    # Then: every unfinished job is cancelled; the callback on completion was
    # never released (it never reached Redis)
    assert status == 200
    assert said == [f"Workflow {flow.id}: 2 waiting job(s) and 2 queued, scheduled or running "
                    "job(s) cancelled."]
    assert states(flow) == ["succeeded", "cancelled", "cancelled", "cancelled", "cancelled"]
    assert not redis_client.exists(KEYS.job(on_complete.id))
    assert not redis_client.exists(KEYS.job(on_success.id))

    # And a worker finds nothing to run
    drain_here()
    assert not Job.objects.filter(workflow_id=flow.id, state__in=UNFINISHED).exists()
    assert Attempt.objects.count() == attempts
    assert redis_client.llen(KEYS.queued) == 0

    # And retry from failed does not bring back what staff cancelled
    assert workflows.retry_failed(flow.id).waiting == []
    assert states(flow) == ["succeeded", "cancelled", "cancelled", "cancelled", "cancelled"]


# -- callbacks on a batch ------------------------------------------------------------


def test_a_batch_with_a_failure_runs_its_death_and_completion_callbacks_once(
        backend: ReliableJobsBackend) -> None:
    # Given: a batch of three whose second member fails for good
    flow = batch([demo.add.s(1, 1), demo.give_up.s("no"), demo.add.s(2, 2)],
                 on_success=demo.total.s(extra=1).with_results(),
                 on_complete=demo.total.s(extra=2).with_results(),
                 on_death=demo.total.s(extra=3).with_results()).enqueue()
    *members, on_success, on_complete, on_death = flow.results

    # When
    drain_here()

    # Then: on success was cancelled by the failure; on completion and on death ran once
    assert row(on_success).state == JobState.CANCELLED
    for callback in (on_complete, on_death):
        done = row(callback)
        assert done.state == JobState.SUCCEEDED and done.attempt_set.count() == 1
    failure = row(on_death).args[0][1]
    assert failure["failed"] == "dead" and failure["job"] == members[1].id
    assert workflows.progress(flow.id)["skipped"] == 0


def test_a_death_callback_runs_at_the_first_failure_not_at_the_end(
        backend: ReliableJobsBackend) -> None:
    flow = batch([demo.add.s(1, 1), demo.add.s(2, 2)], on_death=demo.total.s()).enqueue()
    a, b, on_death = flow.results
    make_dead(backend, a.id, attempts=1)
    assert row(on_death).state == JobState.QUEUED  # b has not ended
    run_attempt(backend, b.id, outcome="succeeded")
    assert row(on_death).state == JobState.QUEUED


def test_a_batch_that_succeeds_skips_its_death_callback(backend: ReliableJobsBackend) -> None:
    flow = batch([demo.add.s(1, 1), demo.add.s(2, 2)], on_success=demo.total.s().with_results(),
                 on_death=demo.total.s()).enqueue()
    a, b, on_success, on_death = flow.results
    run_attempt(backend, a.id, outcome="succeeded")
    assert row(on_death).state == JobState.WAITING
    run_attempt(backend, b.id, outcome="succeeded")

    skipped = row(on_death)
    assert skipped.state == JobState.CANCELLED
    assert skipped.last_error.startswith("reliable_jobs.exceptions.CallbackNotNeeded: ")
    assert row(on_success).state == JobState.QUEUED
    counts = workflows.progress(flow.id)
    assert (counts["done"], counts["failed"], counts["skipped"]) == (2, 0, 1)
    assert workflows.retry_failed(flow.id).waiting == []  # nothing to retry
    assert row(on_death).state == JobState.CANCELLED


def test_two_failures_at_once_release_the_death_callback_once(
        backend: ReliableJobsBackend) -> None:
    """Two members die in two concurrent transactions: the callback's row lock makes
    the second wait, then find it no longer waiting."""
    flow = batch([demo.add.s(1, 1), demo.add.s(2, 2)],
                 on_death=demo.total.s().with_results()).enqueue()
    a, b, on_death = flow.results
    seen: list[str] = []

    def bury_b() -> None:
        try:
            make_dead(backend, b.id, attempts=1)
        finally:
            connections.close_all()

    with transaction.atomic():
        make_dead(backend, a.id, attempts=1)
        other = threading.Thread(target=bury_b)
        other.start()
        time.sleep(0.5)
        seen.append(row(on_death).state)
    other.join(10)
    assert seen == [JobState.QUEUED]
    released = row(on_death)
    assert released.state == JobState.QUEUED and len(released.args[0]) == 2
    assert released.args[0][0]["failed"] == "dead" and released.args[0][1] is None


def test_a_batch_needs_a_callback_made_of_calls() -> None:
    with pytest.raises(InvalidTask):
        batch([demo.add.s(1, 1)])
    with pytest.raises(InvalidTask):
        batch([demo.add.s(1, 1)], on_death=chain(demo.add.s(1, 1)))  # type: ignore[arg-type]


def test_cancel_many_applies_cancels_rules_and_sentences_to_each_job(
        backend: ReliableJobsBackend, redis_client: redis.Redis) -> None:
    # Given: a succeeded job, a running one, a queued one, a waiting one, and a gone id
    done, running, queued, upstream = (demo.add.enqueue(i, i) for i in range(4))
    run_attempt(backend, done.id, outcome="succeeded")
    run_attempt(backend, running.id, outcome="running")
    waiting = demo.add.using(after=[upstream]).enqueue(9, 9)
    gone = "01234567-89ab-7def-8123-456789abcdef"

    # When
    outcomes = staff.cancel_many(backend.parts, [done.id, running.id, queued.id, waiting.id,
                                                 gone])

    # Then: each as staff.cancel says it, in the order asked
    assert [o.message for o in outcomes] == [
        f"Job {done.id} has finished (succeeded): there is nothing to cancel.",
        f"Job {running.id} was cancelled while running: its worker stops it and it will not "
        "run again.",
        f"Job {queued.id} was cancelled (queued, taken off Redis): it will not run.",
        f"Job {waiting.id} was cancelled while it waited for other jobs: it will not run, nor "
        "will the jobs waiting for it.",
        f"Job {gone} no longer exists (pruned?).",
    ]
    assert [row(r).state for r in (done, running, queued, waiting, upstream)] == [
        "succeeded", "cancelled", "cancelled", "cancelled", "queued"]
    assert redis_client.hget(KEYS.job(queued.id), "state") == "cancelled"
