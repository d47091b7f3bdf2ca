"""Opening a Redis client: one server or a cluster, and the errors either raises.

Every connection the app opens to Redis comes from :func:`connect`, so the
timeouts, the retry policy on a cluster and the decoding of replies are
chosen once.
"""

from __future__ import annotations

import os
from typing import Any

import redis
from redis.backoff import ExponentialBackoff
from redis.cluster import RedisCluster
from redis.exceptions import RedisClusterException
from redis.retry import Retry

#: Seconds a client waits for a reply before giving up on a dead connection.
#: Blocking waits use their own client whose timeout exceeds the block time.
SOCKET_TIMEOUT_S = 10.0
#: Every error a Redis call can raise when the server or the network fails:
#: the cluster client's own errors are not RedisErrors.
REDIS_ERRORS: tuple[type[Exception], ...] = (redis.RedisError, RedisClusterException)

#: The errors a script (or a command) raises about the data it found, not
#: about the server or the network: a key of an unexpected type, a failed
#: script. They concern one queue; a sweep logs them and goes on.
SCRIPT_ERRORS: tuple[type[Exception], ...] = (redis.ResponseError,)

#: Retries of a call on a Redis Cluster after a connection error or timeout.
CLUSTER_RETRIES = 1

#: URL schemes that mean Redis Cluster (or a Valkey cluster): any one node's
#: address; the client discovers the others.
CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}


def is_cluster_url(url: str) -> bool:
    return url.split("://", 1)[0] in CLUSTER_SCHEMES


def connect(url: str, *, socket_timeout: float | None = SOCKET_TIMEOUT_S) -> Any:
    """Open a client for ``url`` that decodes replies to ``str``.

    ``redis+cluster://host:port`` (or ``rediss+cluster://``) opens a
    ``RedisCluster`` client instead. Connections are named
    ``reliable_jobs:<pid>`` so ``CLIENT LIST`` shows which process holds which.

    Bytes that are not UTF-8 (anyone who can write to Redis can put them in
    an id or a payload) decode to lone surrogates instead of raising
    UnicodeDecodeError in the middle of a claim; ``Broker._run`` sends such
    ids back as the same bytes, and the payload codec refuses the surrogates.
    """
    options: dict[str, Any] = {
        "decode_responses": True,
        "encoding_errors": "surrogateescape",
        "socket_timeout": socket_timeout,
        "socket_connect_timeout": 5.0,
        "client_name": f"reliable_jobs:{os.getpid()}",
    }
    scheme, rest = url.split("://", 1)
    if scheme in CLUSTER_SCHEMES:
        # redis-py's cluster client retries a call 10 times by default, each
        # waiting the full socket timeout on a hung node: about 110 s for one
        # call, longer than a lease, while one thread renews every queue's
        # leases. One retry (with a fresh slot map) rides out a failover.
        return RedisCluster.from_url(f"{CLUSTER_SCHEMES[scheme]}://{rest}",
                                     retry=Retry(ExponentialBackoff(cap=1.0, base=0.1),
                                                 CLUSTER_RETRIES), **options)
    return redis.Redis.from_url(url, health_check_interval=30, **options)
