"""What every part of the broker shares: its clients, its key sets, its scripts.

:class:`BrokerCore` holds the connections and the registered scripts and
runs one script by name; the lifecycle, inspection and staff methods are
built on it (see :mod:`reliable_jobs.broker`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import redis
from redis.commands.core import Script

from .. import scripts
from ..keys import QueueKeys, shard_queue, shards_index, wake_marker
from .connection import SOCKET_TIMEOUT_S, connect, is_cluster_url


class BrokerCore:
    """Connections, key sets and scripts of one Redis server under one key prefix."""

    def __init__(self, url: str, prefix: str, *, fair_share: int = 0,
                 fair_weights: Mapping[str, int] | None = None) -> None:
        self.url = url
        self.prefix = prefix
        #: One claim in ``fair_share`` (while several priorities wait) takes
        #: the job that waited longest; 0: strict priority. See claim.lua.
        self.fair_share = fair_share
        #: The fair groups' weights as claim.lua takes them ('group=weight,...';
        #: unlisted groups take one job per turn).
        self.fair_weights = ",".join(f"{group}={weight}"
                                     for group, weight in sorted((fair_weights or {}).items()))
        #: Queues this process saw with priority bands in use: a worker
        #: waiting on one of them alone waits on its wake marker, which
        #: every band's push signals, instead of BLMOVE on priority 0's list.
        self._banded: set[str] = set()
        #: Queues (shards) whose last claim in this process found them paused:
        #: waited on by their wake marker, never with BLMOVE (see wait()).
        self._paused: set[str] = set()
        self.client = connect(url)
        #: On a cluster, multi-queue waits use markers in one shared slot.
        self.cluster = is_cluster_url(url)
        self._keys: dict[str, QueueKeys] = {}
        self._scripts: dict[str, Script] = {
            name: self.client.register_script(scripts.source(name))
            for name in scripts.SCRIPT_NAMES
        }
        self._blocking: redis.Redis | None = None
        #: The server refused LMPOP (Redis < 7): :meth:`woken` pipelines LPOPs.
        self._no_lmpop = False
        #: Shards this process recorded in their shards index, and when (monotonic s).
        self._registered: dict[str, float] = {}

    def keys(self, queue: str) -> QueueKeys:
        keys = self._keys.get(queue)
        if keys is None:
            keys = self._keys[queue] = QueueKeys(self.prefix, queue)
        return keys

    def _run(self, name: str, keys: Sequence[str], args: Sequence[Any]) -> Any:
        # An id read back from Redis may hold bytes that are not UTF-8 (lone
        # surrogates, see connect()): send it back as those same bytes.
        # redis-py's hiredis packer ignores encoding_errors, hence by hand.
        wire = [a.encode(errors="surrogateescape") if isinstance(a, str) else a for a in args]
        return self._scripts[name](keys=keys, args=wire)

    def physical_queues(self, queues: Iterable[str], shards: dict[str, int]) -> list[str]:
        """Every physical queue (shard) of ``queues``: configured, or ever written to."""
        queues = sorted(queues)
        with self.client.pipeline(transaction=False) as pipe:
            for queue in queues:
                pipe.zrange(shards_index(self.prefix, queue), 0, -1)
            used = pipe.execute()
        physical = {shard_queue(q, i) for q in queues for i in range(shards.get(q, 1))}
        physical |= {shard_queue(q, int(i)) for q, indexes in zip(queues, used, strict=True)
                     for i in indexes}
        return sorted(physical)

    def _wake(self, queue: str, ready: object) -> None:
        """On a cluster, signal waiting workers that ``queue`` may have work.

        Off a cluster the scripts push their in-slot marker themselves; on one
        the marker must live in the shared wake slot, which a script running
        in the queue's slot cannot touch. A lost signal (the process dies
        in between) only delays an idle worker until its next timed wait.
        """
        if self.cluster and ready:
            self._run("wake", (wake_marker(self.prefix, queue),), ())

    def close(self) -> None:
        self.client.close()
        if self._blocking is not None:
            self._blocking.close()

    def _blocking_client(self) -> redis.Redis:
        if self._blocking is None:
            # Longer than any block we ask for, so the client never times out
            # a healthy wait (docs/CONTRIBUTING.md: it would retry for many seconds).
            self._blocking = connect(self.url, socket_timeout=SOCKET_TIMEOUT_S + 5.0)
        return self._blocking
