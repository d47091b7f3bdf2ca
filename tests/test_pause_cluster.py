"""Pause on a real 3-master Redis Cluster: every shard of a sharded queue, each in its own slot.

The shards of one queue hash to different slots (``{default}``,
``{default#1}``, ...), so a pause cannot be one key: each shard carries its
own flag, set by pause.lua in that shard's slot, and read by the claim and
start scripts there. The cluster is private to this module (its own ports
and directories), so flushing it touches nobody else's keys.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from reliable_jobs import pausing
from reliable_jobs.broker import Applied, NewJob
from reliable_jobs.compat import task_backends
from reliable_jobs.keys import QueueKeys
from reliable_jobs.sweep import Sweep

from .redis_cluster import RedisClusterHarness

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]
SHARDS = ["default", "default#1", "default#2"]
PAYLOAD = '{"task":"x","args":[],"kwargs":{}}'


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisClusterHarness]:
    harness = RedisClusterHarness(tmp_path_factory.mktemp("cluster"), masters=3)
    harness.start()
    try:
        yield harness
    finally:
        harness.stop()


def test_every_shard_is_paused_on_its_own_master_and_a_flush_is_repaired(
        cluster: RedisClusterHarness, rj_settings: Any) -> None:
    # Given a queue of 3 shards on the cluster, spread over more than one master
    cluster.client().flushall()
    rj_settings(REDIS_URL=cluster.url, SHARDS={"default": 3})
    backend = task_backends["default"]
    broker = backend.broker
    prefix = backend.config.PREFIX
    assert len({cluster.master_port_of(QueueKeys(prefix, s).paused) for s in SHARDS}) > 1
    for shard in SHARDS:
        broker.enqueue(shard, [NewJob(f"in-flight-{shard}", PAYLOAD, 3)])
    in_flight = {shard: broker.claim(shard, count=1, lease_ms=60_000).jobs[0]
                 for shard in SHARDS}
    for shard in SHARDS:
        broker.enqueue(shard, [NewJob(f"waiting-{shard}", PAYLOAD, 3)])

    # When the queue is paused
    assert pausing.pause_queue("default")

    # Then every shard's flag is set, no claim takes a job, and no claim in
    # flight starts
    assert sorted(broker.paused_since(SHARDS)) == SHARDS
    for shard in SHARDS:
        assert broker.claim(shard, count=5, lease_ms=60_000).paused
        assert broker.start(shard, [in_flight[shard].fence]) == [Applied.PAUSED]

    # When the cluster loses everything, a sweep pass puts every flag back
    cluster.client().flushall()
    assert Sweep(backend.parts).redis_pass().repaused == len(SHARDS)
    assert sorted(broker.paused_since(SHARDS)) == SHARDS

    # And a resume clears every shard
    assert pausing.resume_queue("default")
    assert broker.paused_since(SHARDS) == {}
