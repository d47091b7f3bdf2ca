"""Workers and the sweep under the documented minimal Redis ACL, and over TLS.

docs/howto/security.md gives the ACL a deployment should give its processes: only the
commands reliable_jobs sends (found with MONITOR: the script calls, the
blocking waits, the counts, the heartbeats, the connection setup, and every
command the Lua scripts run, since Redis checks those against the caller's
ACL too), only on keys under the prefix. Here real ``runworker`` and
``recoverjobs`` processes run under exactly that ACL user, reached with a
username and password from the URL, and must do all their work without one
refusal in ``ACL LOG``; the password must never appear in their output. A
second test does the same over ``rediss://`` (TLS) against a Redis started
for the test, with the database index from the URL as well.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import redis

from reliable_jobs.compat import TaskResultStatus
from reliable_jobs.keys import QueueKeys
from reliable_jobs.models import Job, JobState
from testproject.demo import tasks as demo

from .helpers import REDIS_URL, Processes, wait_until

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

#: The minimal ACL of docs/howto/security.md for reliable_jobs processes (key prefix "rj"),
#: rule by rule. Commands the clients send: script calls (EVALSHA, and
#: SCRIPT LOAD after a restart), the blocking waits, a busy worker's look at
#: the wake markers of queues it skips (LMPOP, or LPOP before Redis 7), counts, reconcile's
#: HMGET, heartbeats, and connection setup. Commands the scripts run inside
#: Redis: the rest. The admin's dashboard also reads heartbeats (GET,
#: ZREVRANGE); workers read which shards of a queue exist (ZRANGE).
MINIMAL_ACL = (
    "resetkeys", "~rj:*", "resetchannels", "-@all",
    "+client|setname", "+select", "+ping",
    "+evalsha", "+script|load",
    "+blmove", "+blpop", "+lmpop", "+lpop", "+llen", "+zcard", "+hmget", "+zrange",
    "+set", "+get", "+del", "+zadd", "+zrem", "+zrevrange", "+zremrangebyscore",
    "+time", "+exists", "+hget", "+hset", "+hdel", "+lpos", "+lpush", "+rpush", "+lrange",
    "+lrem", "+ltrim", "+zscore", "+zrangebyscore", "+pexpire",
)
#: Redis >= 7.2 and Valkey know CLIENT SETINFO, which redis-py sends on
#: connecting (and tolerates a refusal of); older servers reject the rule.
OPTIONAL_ACL = ("+client|setinfo",)


def add_acl_user(admin: redis.Redis, name: str, password: str) -> None:
    admin.execute_command("ACL", "SETUSER", name, "reset", "on", f">{password}", *MINIMAL_ACL)
    for rule in OPTIONAL_ACL:
        try:
            admin.execute_command("ACL", "SETUSER", name, rule)
        except redis.ResponseError as exc:
            assert "Unknown command" in str(exc), exc


def denials(admin: redis.Redis, name: str) -> list[dict[str, Any]]:
    """ACL LOG entries (refused commands or keys) of user ``name``."""
    return [entry for entry in admin.acl_log(count=1_000) if entry.get("username") == name]


def with_user(url: str, user: str, password: str, *, db: int | None = None,
              scheme: str | None = None, query: str = "") -> str:
    parts = urlsplit(url)
    path = f"/{db}" if db is not None else parts.path
    return (f"{scheme or parts.scheme}://{user}:{password}@{parts.hostname}:{parts.port}{path}"
            + (f"?{query}" if query else ""))


@pytest.fixture
def acl_user(redis_client: redis.Redis) -> Iterator[tuple[str, str]]:
    """A Redis user with exactly the documented ACL; removed at teardown."""
    name, password = f"rj_acl_{uuid.uuid4().hex[:10]}", f"pw-{uuid.uuid4().hex}"
    add_acl_user(redis_client, name, password)
    try:
        yield name, password
    finally:
        redis_client.execute_command("ACL", "DELUSER", name)


def lease_expired(client: redis.Redis, leases: str, job_id: str) -> bool:
    deadline = client.zscore(leases, job_id)
    seconds, micros = client.time()
    return deadline is not None and deadline < seconds * 1000 + micros // 1000


def finished(*ids: str) -> bool:
    return Job.objects.filter(pk__in=ids, state__in=[JobState.SUCCEEDED, JobState.DEAD]
                              ).count() == len(ids)


def test_the_minimal_acl_refuses_everything_else(
    redis_client: redis.Redis, acl_user: tuple[str, str]
) -> None:
    # Given a client logged in as the ACL user
    name, password = acl_user
    client = redis.Redis.from_url(with_user(REDIS_URL, name, password), decode_responses=True)

    # Then it may use its own keys, but no other key and no dangerous command
    client.set("rj:worker:probe", "1", px=1_000)
    for forbidden in (lambda: client.set("other:key", "1"), client.flushall, client.flushdb,
                      lambda: client.keys("*"), lambda: client.config_get("*"),
                      lambda: client.eval("return 1", 0), client.client_list,
                      lambda: client.acl_list(), lambda: client.get("rjx:other"),
                      lambda: client.execute_command("SCRIPT", "FLUSH")):
        with pytest.raises(redis.exceptions.NoPermissionError):
            forbidden()
    client.close()


def test_worker_and_sweep_do_all_their_work_under_the_minimal_acl(
    rj_settings: Any, processes: Processes, redis_client: redis.Redis,
    acl_user: tuple[str, str]
) -> None:
    # Given the backend reaching Redis as the ACL user (URL from the environment)
    name, password = acl_user
    url = with_user(REDIS_URL, name, password)
    env = {**rj_settings(queues=["default", "other"], REDIS_URL=url), "REDIS_URL": url}

    # And: jobs of every kind, enqueued as that user: success, retry, failure, delay,
    # a coroutine, a task in a child process, and one on a second queue
    jobs = [demo.add.enqueue(1, 2), demo.fail_times.enqueue("again", 1),
            demo.always_fail.enqueue("no"), demo.retry_once_later.enqueue(50),
            demo.async_add.enqueue(2, 2), demo.isolated_add.enqueue(3, 3),
            demo.add.using(queue_name="other").enqueue(4, 4)]

    # When a worker blocks on one queue (BLMOVE) and another on two (BLPOP)
    one = processes.worker(env, "--queue", "default")
    two = processes.worker(env, "--queue", "default,other")
    wait_until(lambda: finished(*[r.id for r in jobs]), timeout=60, message="every job to end")
    for worker in (one, two):
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(timeout=30) == 0, processes.log(worker)

    # And: a worker dies holding a job, Redis loses another job, and recoverjobs runs
    keys = QueueKeys("rj", "default")
    held = demo.sleep_for.enqueue(0.5)
    crashed = processes.worker(env, "--queue", "default", extra_env={"RJ_CRASH_AT": "in_task"})
    assert crashed.wait(timeout=30) != 0
    lost = demo.add.enqueue(5, 5)
    redis_client.delete(keys.job(lost.id))
    redis_client.lrem(keys.queued, 0, lost.id)
    Job.objects.filter(pk=lost.id).update(updated_at=Job.objects.get(pk=lost.id).updated_at
                                          .replace(year=2000))
    wait_until(lambda: lease_expired(redis_client, keys.leases, held.id), timeout=10,
               message="the dead worker's lease to expire")
    sweep = processes.manage("recoverjobs", env=env)
    assert sweep.wait(timeout=60) == 0, processes.log(sweep)
    assert "requeued 1" in processes.log(sweep) and "pushed 1" in processes.log(sweep)
    burst = processes.worker(env, "--burst")
    assert burst.wait(timeout=60) == 0, processes.log(burst)

    # Then every job ended as its task says
    assert demo.add.get_result(jobs[0].id).return_value == 3
    assert demo.fail_times.get_result(jobs[1].id).return_value == "again"
    assert demo.always_fail.get_result(jobs[2].id).status == TaskResultStatus.FAILED
    assert demo.retry_once_later.get_result(jobs[3].id).return_value == 2
    assert demo.async_add.get_result(jobs[4].id).return_value == 4
    assert demo.isolated_add.get_result(jobs[5].id).return_value == 6
    assert demo.add.get_result(jobs[6].id).return_value == 8
    assert demo.sleep_for.get_result(held.id).status == TaskResultStatus.SUCCESSFUL
    assert demo.add.get_result(lost.id).return_value == 10

    # And: Redis refused nothing the ACL user sent (scripts' own commands included)
    assert denials(redis_client, name) == []

    # And: the password is in no output; the start-up line shows the URL masked
    outputs = [processes.log(p) for p in (one, two, crashed, sweep, burst)]
    assert all(password not in output for output in outputs)
    assert f"redis://{name}:***@" in outputs[0]


@pytest.fixture
def tls_redis(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """A Redis reached only over TLS, with a self-signed certificate for 127.0.0.1."""
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
         "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True, timeout=60,
    )
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen(
        ["redis-server", "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1",
         "--tls-cert-file", str(cert), "--tls-key-file", str(key), "--tls-ca-cert-file",
         str(cert), "--tls-auth-clients", "no", "--save", "", "--appendonly", "no",
         "--dir", str(tmp_path)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    admin_url = f"rediss://127.0.0.1:{port}/0?ssl_ca_certs={cert}"
    try:
        wait_until(lambda: _answers(admin_url), timeout=10, message="the TLS Redis to start")
        yield admin_url, cert
    finally:
        server.kill()
        server.wait(timeout=10)


def _answers(url: str) -> bool:
    try:
        with redis.Redis.from_url(url, socket_timeout=1) as client:
            return bool(client.ping())
    except redis.RedisError:
        return False


def test_worker_over_tls_with_an_acl_user_and_a_database_index(
    rj_settings: Any, processes: Processes, tls_redis: tuple[str, Path]
) -> None:
    # Given a TLS-only Redis with the minimal ACL user, and a URL carrying the
    # scheme, the user, the password and database 3
    admin_url, cert = tls_redis
    admin = redis.Redis.from_url(admin_url, decode_responses=True)
    name, password = "rj_tls_worker", f"pw-{uuid.uuid4().hex}"
    add_acl_user(admin, name, password)
    url = with_user(admin_url, name, password, db=3, scheme="rediss",
                    query=f"ssl_ca_certs={cert}")
    env = {**rj_settings(REDIS_URL=url), "REDIS_URL": url}

    # When jobs are enqueued, the server forgets its scripts (as after a restart),
    # and a burst worker runs the jobs, all through that URL
    results = [demo.add.enqueue(i, i) for i in range(3)]
    admin.script_flush()
    worker = processes.worker(env, "--burst")
    assert worker.wait(timeout=60) == 0, processes.log(worker)

    # Then they ran (the worker loaded the scripts again), Redis refused nothing,
    # and the password never showed
    assert [demo.add.get_result(r.id).return_value for r in results] == [0, 2, 4]
    assert denials(admin, name) == []
    log = processes.log(worker)
    assert password not in log
    assert f"rediss://{name}:***@127.0.0.1" in log

    # And: the keys live in database 3, none in database 0
    waiting = demo.add.enqueue(9, 9)
    in_db3 = redis.Redis.from_url(admin_url.replace("/0?", "/3?"), decode_responses=True)
    assert in_db3.lrange(QueueKeys("rj", "default").queued, 0, -1) == [waiting.id]
    assert admin.dbsize() == 0
    admin.close()
    in_db3.close()
