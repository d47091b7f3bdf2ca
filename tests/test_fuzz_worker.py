"""Fuzz a real worker with hostile payloads pushed straight into Redis.

Each example writes a batch of generated job payloads into the work list, as
anyone with write access to Redis could (garbage text, JSON of every wrong
shape, strict-JSON violations, task paths that are not tasks, and calls of
registered tasks with arguments of any type), beside ordinary jobs enqueued
through the backend. A real ``runworker --burst`` process must drain it all
and exit cleanly: no crash, no thread lost, no job left behind; each hostile
job ends acked or dead with a reason the mirror can store, and the ordinary
jobs succeed.

Left out on purpose: registered tasks that sleep, hang, ask for a retry in a
caller-chosen delay or kill their process (they would, by design, hold a
burst worker for as long as their arguments say: the threat model of docs/howto/security.md
counts "run any registered task with any arguments" as what Redis write
access grants), and floats whose sum overflows (a task returning infinity
is the mirror bug reported with this suite). Derandomized, few examples,
each a real process: about ten seconds in all.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reliable_jobs import payload
from reliable_jobs.broker import NewJob
from reliable_jobs.compat import task_backends
from reliable_jobs.keys import QueueKeys
from testproject.demo import tasks as demo

from .helpers import Processes

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]
KEYS = QueueKeys("rj", "default")

#: Registered tasks whose run time does not depend on their arguments.
RUNNABLE = ["testproject.demo.tasks." + name for name in (
    "noop", "add", "always_fail", "give_up", "fail_times", "async_add", "isolated_add")]
#: Paths that are not allowed tasks, or not paths at all.
NOT_TASKS = ["os.system", "subprocess.run", "builtins.eval", "tests.tasks.noop_task",
             "testproject.demo.tasks", "testproject.demo.tasks.add.__call__",
             "testproject.demo.tasks.add\n", "rj:{default}:queued", ""]

#: Text redis-py can send (it cannot encode lone surrogates), NUL included.
text = st.text(alphabet=st.characters(codec="utf-8"), max_size=30)
values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(min_value=-(10**30), max_value=10**30),
              st.floats(min_value=-1e300, max_value=1e300), text),
    lambda children: st.one_of(st.lists(children, max_size=3),
                               st.dictionaries(text, children, max_size=3)),
    max_leaves=8,
)
calls = st.fixed_dictionaries(
    {"task": st.one_of(st.sampled_from(RUNNABLE), st.sampled_from(NOT_TASKS), text, values)},
    optional={"args": st.one_of(st.lists(values, max_size=3), values),
              "kwargs": st.one_of(st.dictionaries(text, values, max_size=2), values)},
).map(lambda call: json.dumps(call, ensure_ascii=False))
hostile_payloads = st.one_of(
    calls, calls, calls,
    text,
    st.sampled_from([
        '{"task": "testproject.demo.tasks.add", "args": [NaN, 1]}',
        '{"task": "testproject.demo.tasks.add", "args": [1e999, 1]}',
        '{"task": "testproject.demo.tasks.add", "args": [1, 2], "args": [3, 4]}',
        '{"task": "testproject.demo.tasks.add", "args": [' + "9" * 5_000 + ", 1]}",
        '{"task": "testproject.demo.tasks.add", "args": [' + "[" * 3_000 + "]" * 3_000 + "]}",
        '{"task": "testproject.demo.tasks.always_fail", "args": ["\\ud800"]}',
        '{"task": "testproject.demo.tasks.always_fail", "args": ["a\\u0000b"]}',
        '{"task": "testproject.demo.tasks.add", "kwargs": {"a\\u0000": 1, "b": 2}}',
        "[]", "null", "{}", "\x00",
    ]),
)


@settings(max_examples=6, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                 HealthCheck.data_too_large])
@given(batch=st.lists(hostile_payloads, min_size=8, max_size=16))
def test_a_worker_drains_any_hostile_batch_and_keeps_working(
    rj_settings: Any, processes: Processes, redis_client: redis.Redis, batch: list[str]
) -> None:
    # Given hostile payloads pushed straight into Redis, around two ordinary jobs
    env = rj_settings()
    redis_client.flushdb()
    first = demo.add.enqueue(1, 2)
    hostile = [NewJob(str(uuid.uuid4()), text, 3) for text in batch]
    task_backends["default"].broker.enqueue("default", hostile)
    last = demo.fail_times.enqueue("still here", 1)

    # When a burst worker drains the queue
    worker = processes.worker(env, "--burst", "--concurrency", "4")
    assert worker.wait(timeout=120) == 0, processes.log(worker)[-5000:]
    log = processes.log(worker)

    # Then no thread died, nothing is left in flight, and the ordinary jobs succeeded
    assert "Exception in thread" not in log
    assert (redis_client.llen(KEYS.queued), redis_client.llen(KEYS.landing),
            redis_client.zcard(KEYS.scheduled), redis_client.zcard(KEYS.leases)) == (0, 0, 0, 0)
    assert demo.add.get_result(first.id).return_value == 3
    assert demo.fail_times.get_result(last.id).return_value == "still here"

    # And: each hostile job was acked (it was a valid call) or is dead with a reason
    # the mirror can store
    for job in hostile:
        state = redis_client.hgetall(KEYS.job(job.id))
        if state:
            assert state["state"] == "dead", (job.payload, state)
            assert state["last_error"], job.payload
            assert payload.text_problem(state["last_error"]) == "", state["last_error"]
