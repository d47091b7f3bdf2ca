"""Workflows (``after=``, chain, group, chord) against real Redis and the real database.

The database decides when a waiting job runs: these tests end jobs every
way a job ends (a worker's success, a death, a staff cancel, a sweep's
bury) and check that each dependent runs exactly once, after all its
dependencies succeeded, or is settled by its failure policy. Races are
played with real concurrent transactions.
"""

from __future__ import annotations

import random
import threading
import time
from typing import Any

import pytest
import redis
from django.db import connections, transaction

from reliable_jobs import mirror, staff, workflows
from reliable_jobs.canvas import DAG, chain, chord, group
from reliable_jobs.compat import InvalidTask, task_backends
from reliable_jobs.jobids import short_id
from reliable_jobs.mirror import AttemptRecord
from reliable_jobs.models import Dependency, Job, JobState, Workflow
from reliable_jobs.sweep import Sweep
from testproject.demo import tasks as demo

from .helpers import backdate, drain_here

pytestmark = pytest.mark.django_db(transaction=True)

QUEUED = "rj:{default}:queued"


def state(result: Any) -> str:
    return Job.objects.get(pk=result.id).state


def succeed(job_id: str, value: Any = None) -> None:
    """Record a success of attempt 1 in the mirror, as a worker's batch does."""
    mirror.record("default", [AttemptRecord(job_id=str(job_id), attempt=1,
                                            job_state=JobState.SUCCEEDED, outcome="succeeded",
                                            return_value=value)])


def test_a_chain_runs_in_order_and_passes_results(rj_settings: Any,
                                                  redis_client: redis.Redis) -> None:
    # Given: add(1, 2) then add(result, 10) then add(result, 100)
    flow = chain(demo.add.s(1, 2), demo.add.s(10).with_results(),
                 demo.add.s(100).with_results()).enqueue(name="sums")

    # Then: only the first job is in Redis; the others wait, as rows only
    first, second, third = flow.results
    assert [state(r) for r in flow.results] == ["queued", "waiting", "waiting"]
    assert redis_client.lrange(QUEUED, 0, -1) == [first.id]

    # When: a worker drains the queue
    drain_here()

    # Then: each ran after the one before, with its result first in its arguments
    rows = {str(row.pk): row for row in Job.objects.all()}
    assert [rows[r.id].return_value for r in flow.results] == [3, 13, 113]
    assert rows[third.id].args == [13, 100]
    assert rows[second.id].started_at >= rows[first.id].finished_at
    assert workflows.progress(flow.id) == {"succeeded": 3, "total": 3, "done": 3, "failed": 0,
                                           "skipped": 0}
    assert Workflow.objects.get().name == "sums"


def test_a_chord_calls_back_once_with_every_result_in_order(rj_settings: Any) -> None:
    # Given: a chord of 20 members whose callback sums their results
    flow = chord(group(*(demo.add.s(i, 1) for i in range(20))),
                 demo.total.s(extra=1000).with_results()).enqueue()

    # When
    drain_here()

    # Then: the callback ran once, with the list of results in the group's order
    callback = Job.objects.get(pk=flow.last.id)
    assert callback.state == JobState.SUCCEEDED
    assert callback.args[0] == [i + 1 for i in range(20)]
    assert callback.return_value == sum(range(1, 21)) + 1000
    assert callback.attempt_set.count() == 1


def test_after_waits_for_existing_jobs_and_for_ended_ones(rj_settings: Any) -> None:
    # Given: one job that already succeeded, one still queued
    done, pending = demo.add.enqueue(1, 1), demo.add.enqueue(2, 2)
    succeed(done.id, 2)

    # When: a job waits for both
    later = demo.total.using(after=[done, pending], pass_results=True).enqueue(extra=0)

    # Then: it waits for the queued one only; its end releases it
    assert state(later) == JobState.WAITING
    assert Job.objects.get(pk=later.id).waiting_for == 1
    succeed(pending.id, 4)
    row = Job.objects.get(pk=later.id)
    assert (row.state, row.args) == (JobState.QUEUED, [[2, 4]])


def test_after_ended_jobs_only_is_queued_and_pushed_at_once(
        rj_settings: Any, redis_client: redis.Redis) -> None:
    first = demo.add.enqueue(1, 1)
    succeed(first.id, 2)
    later = demo.add.using(after=[first]).enqueue(5, 5)
    assert state(later) == JobState.QUEUED
    assert later.id in redis_client.lrange(QUEUED, 0, -1)


def test_a_dead_dependency_cancels_its_dependents_in_cascade(rj_settings: Any) -> None:
    # Given: a -> b -> c, and d waiting for a with the "run" policy
    flow = chain(demo.add.s(1, 1), demo.add.s(1, 1), demo.add.s(1, 1)).enqueue()
    a, b, c = flow.results
    d = demo.total.using(after=[a], pass_results=True, on_failure="run").enqueue()

    # When: a dies
    mirror.bury("default", a.id, attempts=1, gen=0, error="RuntimeError: boom")

    # Then: b and c are cancelled, saying why; d runs with the failure in its results
    for dependent in (b, c):
        row = Job.objects.get(pk=dependent.id)
        assert row.state == JobState.CANCELLED
        assert row.last_error.startswith("reliable_jobs.exceptions.UpstreamFailed: job ")
    row = Job.objects.get(pk=d.id)
    assert row.state == JobState.QUEUED
    assert row.args == [[{"failed": "dead", "job": a.id, "error": "RuntimeError: boom"}]]


def test_staff_cancel_of_a_waiting_job_cancels_what_waits_for_it(rj_settings: Any) -> None:
    flow = chain(demo.add.s(1, 1), demo.add.s(2, 2), demo.add.s(3, 3)).enqueue()
    outcome = staff.cancel(task_backends["default"].parts, flow.results[1].id)
    assert outcome.done, outcome.message
    assert [state(r) for r in flow.results] == ["queued", "cancelled", "cancelled"]


def test_a_lost_release_push_is_pushed_by_reconcile(rj_settings: Any,
                                                    redis_client: redis.Redis) -> None:
    # Given: b waits for a; a's success commits but the push of b is lost
    # (the process died between the commit and the push)
    flow = chain(demo.add.s(1, 1), demo.add.s(2, 2)).enqueue()
    a, b = flow.results
    redis_client.delete(QUEUED)
    from reliable_jobs.mirror import dependencies
    receivers = dependencies.jobs_released.receivers
    dependencies.jobs_released.receivers = []
    dependencies.jobs_released.sender_receivers_cache.clear()
    try:
        succeed(a.id, 2)
    finally:
        dependencies.jobs_released.receivers = receivers
        dependencies.jobs_released.sender_receivers_cache.clear()
    assert state(b) == JobState.QUEUED
    assert redis_client.llen(QUEUED) == 0

    # When: reconcile runs after its grace
    backdate(b.id)
    Sweep(task_backends["default"].parts).reconcile()

    # Then: b is in Redis, and runs
    assert redis_client.lrange(QUEUED, 0, -1) == [b.id]
    drain_here()
    assert state(b) == JobState.SUCCEEDED


def test_two_last_dependencies_ending_at_once_release_their_dependent_once(
        rj_settings: Any) -> None:
    """The race of a fan-in: a and b end in two concurrent transactions.

    Without the dependent's row lock each would count the other's edge as
    pending (neither sees the other's uncommitted write) and the callback
    would never fire; the lock makes the second wait and see 0.
    """
    flow = chord(group(demo.add.s(1, 1), demo.add.s(2, 2)), demo.total.s().with_results()
                 ).enqueue()
    a, b, callback = flow.results
    released: list[Any] = []
    entered = threading.Event()

    def end_b() -> None:
        try:
            entered.set()
            succeed(b.id, 4)
        finally:
            connections.close_all()

    # When: a's transaction settles (holding the callback's row), then b's
    # transaction starts settling while a's has not committed
    with transaction.atomic():
        succeed(a.id, 2)
        other = threading.Thread(target=end_b)
        other.start()
        entered.wait(5)
        time.sleep(0.5)  # b's transaction runs until it needs the callback's row
        released.append(state(callback))
    other.join(10)

    # Then: still waiting inside a's transaction; released exactly once after
    assert released == [JobState.WAITING]
    row = Job.objects.get(pk=callback.id)
    assert (row.state, row.waiting_for, row.args) == (JobState.QUEUED, 0, [[2, 4]])


def test_an_upstream_ending_while_after_is_enqueued_is_not_missed(rj_settings: Any) -> None:
    """The race of ``after=``: the upstream ends while the dependent's insert is uncommitted.

    The share lock makes the upstream's write wait for the insert's commit,
    so its settle sees the new edge; without it the edge would stay
    unsettled and the dependent wait for ever.
    """
    upstream = demo.add.enqueue(1, 1)
    ended = threading.Event()

    def end_upstream() -> None:
        try:
            succeed(upstream.id, 2)
            ended.set()
        finally:
            connections.close_all()

    with transaction.atomic():
        later = demo.add.using(after=[upstream]).enqueue(3, 3)
        other = threading.Thread(target=end_upstream)
        other.start()
        time.sleep(0.5)  # the upstream's write waits for this commit (or ends, unlocked)
    other.join(10)
    assert ended.is_set()
    assert state(later) == JobState.QUEUED


def test_a_unique_task_cannot_join_a_workflow(rj_settings: Any) -> None:
    from .test_unique import report
    with pytest.raises(InvalidTask):
        chain(demo.add.s(1, 1), report.s(1)).enqueue()
    assert not Job.objects.exists()
    assert not Dependency.objects.exists()


def test_a_cancelled_dependent_stays_cancelled_when_its_other_dependencies_succeed(
        rj_settings: Any) -> None:
    # Given: a chord whose first member dies (the callback is cancelled)
    flow = chord(group(demo.add.s(1, 1), demo.add.s(2, 2)), demo.total.s().with_results()
                 ).enqueue()
    a, b, callback = flow.results
    mirror.bury("default", a.id, attempts=1, gen=0, error="RuntimeError: boom")
    assert state(callback) == JobState.CANCELLED

    # When: the other member succeeds, settling the callback's last edge
    succeed(b.id, 4)

    # Then: the callback is not brought back to run
    assert state(callback) == JobState.CANCELLED
    assert workflows.progress(flow.id)["failed"] == 2


def test_a_workflow_rolled_back_leaves_nothing(rj_settings: Any,
                                               redis_client: redis.Redis) -> None:
    with pytest.raises(RuntimeError), transaction.atomic():
        chord(group(*(demo.add.s(i, i) for i in range(50))), demo.total.s()).enqueue()
        raise RuntimeError("rolled back")
    assert not Job.objects.exists() and not Dependency.objects.exists()
    assert not Workflow.objects.exists()
    assert redis_client.llen(QUEUED) == 0


def test_a_chord_callback_waits_for_its_last_member(rj_settings: Any,
                                                    redis_client: redis.Redis) -> None:
    # Given: a chord of three, its members ending one write at a time
    flow = chord(group(demo.add.s(1, 0), demo.add.s(2, 0), demo.add.s(3, 0)),
                 demo.total.s().with_results()).enqueue()
    *members, callback = flow.results

    # When / Then: the callback waits until the last member's write, not one before
    for done, member in enumerate(members, 1):
        assert state(callback) == JobState.WAITING
        assert Job.objects.get(pk=callback.id).waiting_for == 3 - (done - 1)
        succeed(member.id, done)
    row = Job.objects.get(pk=callback.id)
    assert (row.state, row.args) == (JobState.QUEUED, [[1, 2, 3]])
    assert callback.id in redis_client.lrange(QUEUED, 0, -1)


def test_a_callback_on_completion_runs_after_every_member_ended_with_the_failures_visible(
        rj_settings: Any) -> None:
    # Given: a batch whose second member fails for good, and a callback that
    # runs once every member has ended, whatever the outcome ("run" policy)
    flow = chord(group(demo.add.s(1, 1), demo.give_up.s("no"), demo.add.s(2, 2)),
                 demo.total.s(extra=100).with_results().if_failed("run")).enqueue()

    # When
    drain_here()

    # Then: the callback ran once, the dead member's place holding its failure
    callback = Job.objects.get(pk=flow.last.id)
    assert callback.state == JobState.SUCCEEDED
    ok, failed, ok_too = callback.args[0]
    assert (ok, ok_too) == (2, 4)
    assert failed["failed"] == "dead" and failed["job"] == flow.results[1].id
    assert "no" in failed["error"]
    assert callback.return_value == 106
    assert workflows.progress(flow.id) == {"succeeded": 3, "dead": 1, "total": 4, "done": 3,
                                           "failed": 1, "skipped": 0}


def test_a_random_dag_runs_each_job_once_after_all_its_dependencies(rj_settings: Any) -> None:
    # Given: 120 jobs in layers up to 12 wide, each waiting for up to 4 earlier ones
    rng = random.Random(25)
    dag, waits = DAG(), {}
    layer = [dag.add(demo.add.s(0, 0))]
    for _ in range(12):
        width = rng.randint(1, 12)
        new_layer = []
        for _ in range(width):
            after = rng.sample(layer, min(len(layer), rng.randint(1, 4)))
            index = dag.add(demo.total.s(extra=1).with_results(), after=after)
            waits[index] = after
            new_layer.append(index)
        layer = new_layer + rng.sample(layer, min(len(layer), 2))
    flow = dag.enqueue(name="random")
    assert len(flow.results) == len(dag.nodes)

    # When
    drain_here()

    # Then: every job succeeded once, each started after all it waits for ended
    rows = {str(row.pk): row for row in Job.objects.all()}
    ids = [r.id for r in flow.results]
    assert all(rows[i].state == JobState.SUCCEEDED for i in ids)
    for index, after in waits.items():
        row = rows[ids[index]]
        assert row.attempt_set.count() == 1
        for upstream in after:
            assert row.started_at >= rows[ids[upstream]].finished_at
        assert row.args[0] == [rows[ids[u]].return_value for u in after]


def test_a_dag_refuses_a_call_waiting_for_one_not_added_yet() -> None:
    dag = DAG()
    dag.add(demo.add.s(1, 1))
    with pytest.raises(InvalidTask):
        dag.add(demo.add.s(2, 2), after=[1])


def test_the_admin_shows_a_workflows_progress_and_what_each_job_waits_for(
        rj_settings: Any, admin_client: Any) -> None:
    # Given: a chord of two whose first member succeeded
    flow = chord(group(demo.add.s(1, 1), demo.add.s(2, 2)), demo.total.s().with_results()
                 ).enqueue(name="nightly")
    a, b, callback = flow.results
    succeed(a.id, 2)

    # When staff open the workflow list, its page, and its jobs
    listing = admin_client.get("/admin/reliable_jobs/workflow/").content.decode()
    page = admin_client.get(f"/admin/reliable_jobs/workflow/{flow.id}/change/").content.decode()
    jobs = admin_client.get(f"/admin/reliable_jobs/job/?workflow__id__exact={flow.id}")

    # Then: its name and progress, each job with its state, an edge per dependency
    assert "nightly" in listing
    assert "rj-node-waiting" in page and "rj-node-succeeded" in page
    assert short_id(a.id) in page and short_id(b.id) in page
    assert page.count('class="rj-edge"') == 2
    assert jobs.status_code == 200
    assert short_id(callback.id) in jobs.content.decode()


def test_without_the_app_config_a_waiting_job_gets_a_clear_error_and_writes_nothing(
        rj_settings: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    # Given: the workflow writers never registered (reliable_jobs not in INSTALLED_APPS)
    rj_settings()
    from reliable_jobs import canvas
    monkeypatch.setattr(canvas, "ENQUEUE", {})
    first = demo.add.enqueue(1, 2)

    # When/Then: a job that waits for another, and a chain, are refused with the fix
    with pytest.raises(InvalidTask, match="INSTALLED_APPS"):
        demo.add.using(after=[first]).enqueue(3, 4)
    with pytest.raises(InvalidTask, match="INSTALLED_APPS"):
        chain(demo.add.s(1, 2), demo.add.s(3, 4)).enqueue()
    assert Job.objects.count() == 1
