"""Sharded queues: a queue split over N shards, and N changed while jobs flow."""

from __future__ import annotations

from typing import Any

import pytest
import redis
from redis.crc import key_slot

from reliable_jobs import broker as broker_module
from reliable_jobs.broker import NewJob
from reliable_jobs.compat import task_backends
from reliable_jobs.keys import QueueKeys, shard_queue, shards_index
from reliable_jobs.models import Job, JobState
from testproject.demo import tasks as demo

from .helpers import Processes, wait_until

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]


def all_done(ids: list[str], client: redis.Redis, shards: int) -> bool:
    if Job.objects.filter(pk__in=ids, state=JobState.SUCCEEDED).count() != len(ids):
        return False
    return not any(client.llen(QueueKeys("rj", shard_queue("default", i)).queued)
                   or client.zcard(QueueKeys("rj", shard_queue("default", i)).leases)
                   for i in range(shards))


def test_a_sharded_queue_spreads_jobs_over_slots_and_workers_drain_every_shard(
    rj_settings: Any, processes: Processes, redis_client: redis.Redis
) -> None:
    # Given: the default queue split into 4 shards
    env = rj_settings(SHARDS={"default": 4})

    # When: 200 jobs are enqueued (singly and in bulk)
    singles = [demo.add.enqueue(i, 0) for i in range(40)]
    bulk = task_backends["default"].enqueue_many(demo.add, [((i, 0), {}) for i in range(160)])
    ids = [r.id for r in singles + bulk]

    # Then: every shard got some, each shard is its own slot, and the ids are on
    # the shard their row names
    shards = {shard: Job.objects.filter(shard=shard).count() for shard in range(4)}
    assert all(count > 0 for count in shards.values()), shards
    assert len({key_slot(QueueKeys("rj", shard_queue("default", i)).queued.encode())
                for i in range(4)}) == 4
    for job in Job.objects.all()[:20]:
        assert redis_client.lpos(QueueKeys("rj", job.physical_queue).queued, str(job.pk)) \
            is not None
    # and one worker drains all four
    worker = processes.worker(env, "--burst", "--concurrency", "2")
    assert worker.wait(timeout=60) == 0, processes.log(worker)
    assert all_done(ids, redis_client, 4)


def test_changing_the_shard_count_while_jobs_flow_loses_nothing(
    rj_settings: Any, processes: Processes, redis_client: redis.Redis
) -> None:
    # Given: a worker configured with one shard, already running
    old_env = rj_settings(SHARDS={"default": 1})
    old_worker = processes.worker(old_env)
    ids: list[str] = []

    # When: producers go from 1 shard to 4, then back to 2, while it works
    ids += [demo.sleep_for.enqueue(0.01).id for _ in range(50)]
    rj_settings(SHARDS={"default": 4})
    ids += [demo.sleep_for.enqueue(0.01).id for _ in range(100)]
    assert Job.objects.filter(shard=3).exists()
    rj_settings(SHARDS={"default": 2})
    ids += [demo.sleep_for.enqueue(0.01).id for _ in range(50)]
    new_worker = processes.worker(rj_settings(SHARDS={"default": 2}))

    # Then: both workers drain every shard ever written to, shards 2 and 3
    # included (no longer configured anywhere), and every job succeeds
    wait_until(lambda: all_done(ids, redis_client, 4), timeout=60,
               message="every job on every shard to finish")
    workers = (old_worker, new_worker)
    for worker, code in zip(workers, processes.stop_many(*workers), strict=True):
        assert code == 0, processes.log(worker)


def test_a_producer_records_its_shard_again_after_redis_lost_the_index(
    rj_settings: Any, redis_client: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given: a producer that wrote to shard 1 (recorded in the shards index)
    rj_settings(SHARDS={"default": 2})
    broker = task_backends["default"].broker
    broker.enqueue("default#1", [NewJob("a", "{}", 3)])
    index = shards_index("rj", "default")
    assert redis_client.zrange(index, 0, -1) == ["1"]

    # When: Redis loses the index, and the producer writes to that shard again
    # once its record is older than REGISTER_EVERY_S (0 here, not 10 s)
    redis_client.delete(index)
    monkeypatch.setattr(broker_module, "REGISTER_EVERY_S", 0.0)
    broker.enqueue("default#1", [NewJob("b", "{}", 3)])

    # Then: the shard is recorded again, so workers keep draining it even if
    # SHARDS shrinks to 1
    assert redis_client.zrange(index, 0, -1) == ["1"]
    assert "default#1" in broker.physical_queues(["default"], {})
