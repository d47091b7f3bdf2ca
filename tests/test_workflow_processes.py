"""Workflows with real worker processes: crashes between a release's commit and its push.

A worker whose mirror write makes a waiting job runnable pushes that job
after the commit; killed in between (crash point ``released_before_push``)
it leaves a queued row with no Redis job, which reconcile pushes once its
grace has passed. Every job still runs exactly once, in order.
"""

from __future__ import annotations

from typing import Any

import pytest
import redis

from reliable_jobs.canvas import chain, chord, group
from reliable_jobs.compat import task_backends
from reliable_jobs.models import Attempt, Job, JobState
from reliable_jobs.sweep import Sweep
from testproject.demo import tasks as demo

from .helpers import Processes, wait_until

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow, pytest.mark.crash]
CRASHED = 86  # faults.crash_point's exit code


def reconciled_until(predicate: Any) -> Any:
    """Run reconcile (as the sweep does on its timer) until ``predicate`` holds."""
    sweep = Sweep(task_backends["default"].parts)

    def check() -> Any:
        if predicate():
            return True
        sweep.reconcile()
        return False
    return check


def test_a_worker_killed_between_a_release_and_its_push_loses_nothing(
        rj_settings: Any, processes: Processes, redis_client: redis.Redis) -> None:
    # Given: a three-step chain and a worker armed to die right after the
    # commit that releases the second step, before pushing it
    env = rj_settings()
    flow = chain(demo.add.s(1, 1), demo.add.s(10).with_results(),
                 demo.add.s(100).with_results()).enqueue()
    victim = processes.worker(env, extra_env={"RJ_CRASH_AT": "released_before_push"})
    assert victim.wait(timeout=30) == CRASHED, processes.log(victim)
    second = Job.objects.get(pk=flow.results[1].id)
    assert second.state == JobState.QUEUED  # released in the mirror, never pushed
    assert str(second.id) not in redis_client.lrange("rj:{default}:queued", 0, -1)

    # When: a healthy worker runs, and reconcile runs after its grace
    survivor = processes.worker(env)
    ids = [r.id for r in flow.results]
    wait_until(reconciled_until(lambda: Job.objects.filter(
        pk__in=ids, state=JobState.SUCCEEDED).count() == 3), timeout=60, interval=0.3,
        message="the whole chain to succeed")

    # Then: every step ran once, in order, with the result before it
    rows = [Job.objects.get(pk=job_id) for job_id in ids]
    assert [row.return_value for row in rows] == [2, 12, 112]
    for row in rows:
        assert Attempt.objects.filter(job=row, outcome="succeeded").count() == 1
    assert rows[1].started_at >= rows[0].finished_at
    assert rows[2].started_at >= rows[1].finished_at
    assert processes.stop(survivor) == 0


def test_a_chord_under_killed_workers_calls_back_exactly_once(
        rj_settings: Any, processes: Processes) -> None:
    # Given: a chord of 200 members, and workers that die mid-task, then at the release
    env = rj_settings()
    flow = chord(group(*(demo.add.s(i, 0) for i in range(200))),
                 demo.total.s().with_results()).enqueue()
    for point, after in (("in_task", "40"), ("in_task", "90"), ("released_before_push", "0")):
        victim = processes.worker(env, "--concurrency", "2",
                                  extra_env={"RJ_CRASH_AT": point, "RJ_CRASH_AFTER": after})
        assert victim.wait(timeout=60) == CRASHED, processes.log(victim)

    # When: a healthy worker finishes, reconcile running
    survivor = processes.worker(env, "--concurrency", "2")
    callback_id = flow.last.id
    wait_until(reconciled_until(lambda: Job.objects.filter(
        pk=callback_id, state=JobState.SUCCEEDED).exists()), timeout=90, interval=0.3,
        message="the callback to succeed")

    # Then: every member succeeded; the callback ran once, with all 200 results
    members = [r.id for r in flow.results[:-1]]
    assert Job.objects.filter(pk__in=members, state=JobState.SUCCEEDED).count() == 200
    callback = Job.objects.get(pk=callback_id)
    assert callback.args == [list(range(200))]
    assert callback.return_value == sum(range(200))
    assert Attempt.objects.filter(job=callback).count() == 1
    assert processes.stop(survivor) == 0
