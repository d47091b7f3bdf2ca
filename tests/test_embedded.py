"""The quickstart's choice of Redis and key prefix (``testproject.embedded``).

A demo that writes into db 0 of whatever answers on port 6379 under the
default prefix shares its queues with every other checkout on the machine.
The choice is tested against the suite's real Redis and a real embedded
Valkey started in a temporary directory.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import redis

from reliable_jobs.keys import PREFIX_RE
from testproject.embedded import (
    choose_redis_url,
    demo_prefix,
    embedded_socket_path,
    stop_embedded_valkey,
)

from .helpers import REDIS_URL, REPO

SUITE_REDIS = urlsplit(REDIS_URL)
#: A port where no Redis listens: the probe is refused at once.
NOTHING_LISTENS = 1


@pytest.fixture
def run_dir(tmp_path: Path) -> Iterator[Path]:
    """A run directory whose embedded Valkey, if a test starts one, is stopped after it."""
    yield tmp_path
    stop_embedded_valkey(tmp_path / "valkey")


def test_redis_url_from_the_environment_wins(run_dir: Path) -> None:
    # Given REDIS_URL set, even with RJ_EMBEDDED=1
    # When the demo chooses, Then it uses the URL it was given and starts nothing
    assert choose_redis_url("redis://example.invalid:6379/3", run_dir, force_embedded=True) == (
        "redis://example.invalid:6379/3", "REDIS_URL")
    assert not (run_dir / "valkey").exists()


def test_a_redis_answering_on_the_probed_port_is_used(run_dir: Path) -> None:
    # Given no REDIS_URL and the suite's Redis answering on the probed port
    # When the demo chooses
    url, description = choose_redis_url(None, run_dir, probe_host=SUITE_REDIS.hostname or "",
                                        probe_port=SUITE_REDIS.port or 6379)

    # Then it uses that server's db 0 and says so
    assert url == f"redis://{SUITE_REDIS.hostname}:{SUITE_REDIS.port or 6379}/0"
    assert "answering at" in description


@pytest.mark.parametrize("forced", [True, False], ids=["RJ_EMBEDDED=1", "nothing answers"])
def test_the_embedded_valkey_is_started_when_forced_or_nothing_answers(
    run_dir: Path, forced: bool
) -> None:
    # Given no REDIS_URL, and either RJ_EMBEDDED=1 beside a Redis that answers,
    # or no Redis on the probed port
    port = (SUITE_REDIS.port or 6379) if forced else NOTHING_LISTENS

    # When the demo chooses
    url, description = choose_redis_url(None, run_dir, force_embedded=forced,
                                        probe_host=SUITE_REDIS.hostname or "", probe_port=port)

    # Then it starts the embedded Valkey on this run directory's socket, which answers,
    # and says why it was chosen
    assert url == f"unix://{embedded_socket_path(run_dir / 'valkey')}?db=0"
    assert description.startswith("the embedded Valkey server at unix://")
    assert description.endswith("(RJ_EMBEDDED=1)") is forced
    client = redis.Redis.from_url(url)
    try:
        assert client.ping()
    finally:
        client.close()


def test_each_checkout_has_its_own_stable_prefix(tmp_path: Path) -> None:
    # Given two checkouts on one machine
    one, other = tmp_path / "one", tmp_path / "other"

    # Then each has a prefix of its own, the same on every run, usable in Redis keys
    assert demo_prefix(one) == demo_prefix(one)
    assert demo_prefix(one) != demo_prefix(other)
    assert demo_prefix(one).startswith("rjdemo-")
    assert PREFIX_RE.fullmatch(demo_prefix(one))


def settings_said(env: dict[str, str]) -> tuple[str, str]:
    """What ``testproject.settings`` chooses and prints, in a fresh process."""
    code = ("from django.conf import settings; "
            "print(settings.TASKS['default']['OPTIONS']['PREFIX'])")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                          text=True, timeout=60,
                          env={**env, "DJANGO_SETTINGS_MODULE": "testproject.settings"})
    assert done.returncode == 0, done.stderr
    return done.stdout.strip(), done.stderr


def test_the_demo_settings_use_the_checkout_prefix_on_a_server_they_found() -> None:
    # Given the test project's settings with no REDIS_URL, where a Redis answers on 6379
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "RJ_PREFIX")}
    env["DATABASE_URL"] = os.environ.get("DATABASE_URL", "sqlite:///unused.sqlite3")
    # (the probe is the default 127.0.0.1:6379; the suite's Redis is that server)
    assert (SUITE_REDIS.hostname, SUITE_REDIS.port or 6379) == ("127.0.0.1", 6379)

    # When they load
    prefix, printed = settings_said(env)

    # Then the keys go under this checkout's prefix, and the choice is printed
    assert prefix == demo_prefix(REPO)
    assert f"key prefix '{prefix}'" in printed
    assert "127.0.0.1:6379 (db 0)" in printed

    # And with REDIS_URL set the prefix stays the default one
    prefix, _ = settings_said({**env, "REDIS_URL": REDIS_URL})
    assert prefix == "rj"
