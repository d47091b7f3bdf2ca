"""System checks of ``ReliableJobsBackend``: one stable id per misconfiguration.

Checks run the way ``manage.py check`` runs them (``run_checks()`` and
``call_command("check")``) with ``TASKS`` overridden; Redis is the real one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from io import StringIO
from pathlib import Path
from typing import Any

import pytest
import redis
from django.core import checks
from django.core.checks import run_checks
from django.core.exceptions import ImproperlyConfigured
from django.core.management import call_command
from django.core.management.base import SystemCheckError
from django.db import DEFAULT_DB_ALIAS, connections

from reliable_jobs.compat import task_backends
from reliable_jobs.models import Job
from tests import tasks as test_tasks

from .helpers import REDIS_URL

Configure = Callable[..., dict[str, str]]

#: A port where no Redis listens: the connection is refused at once.
REDIS_DOWN_URL = "redis://127.0.0.1:1/0"


def reliable_jobs_messages() -> list[checks.CheckMessage]:
    """What ``manage.py check`` would report about reliable_jobs."""
    return [m for m in run_checks() if (m.id or "").startswith("reliable_jobs.")]


def assert_whole_sentences(message: checks.CheckMessage) -> None:
    assert message.msg[0].isupper(), message.msg
    assert message.msg.endswith("."), message.msg
    if message.hint:
        assert message.hint[0].isupper() and message.hint.endswith("."), message.hint


def test_good_configuration_has_no_messages(rj_settings: Configure) -> None:
    # Given: the suite's configuration (fast leases, the real Redis)
    # When: the checks run
    # Then: reliable_jobs has nothing to say
    assert reliable_jobs_messages() == []
    call_command("check", stdout=StringIO(), stderr=StringIO())


def test_default_options_have_no_messages(settings: Any, redis_client: redis.Redis) -> None:
    # Given: only REDIS_URL set: every other option at its default
    settings.TASKS = {"default": {
        "BACKEND": "reliable_jobs.backend.ReliableJobsBackend",
        "OPTIONS": {"REDIS_URL": REDIS_URL},
    }}

    # Then: the defaults are a valid configuration
    assert reliable_jobs_messages() == []


@pytest.mark.parametrize(
    ("options", "check_id", "fragment"),
    [
        ({"LEASE_SM": 1_000}, "E001", "Unknown OPTIONS key 'LEASE_SM'"),
        ({"REDIS_URL": "http://127.0.0.1:6379/0"}, "E002",
         "redis://, rediss://, unix:// or redis+cluster://"),
        ({"SHARDS": {"default": 0}}, "E010", "number of shards from 1 to 1024"),
        ({"REDIS_URL": "127.0.0.1:6379"}, "E002", "'127.0.0.1:6379'"),
        ({"REDIS_URL": 6379}, "E002", "not 6379"),
        ({"REDIS_URL": "redis://127.0.0.1:notaport/0"}, "E002", "notaport"),
        ({"REDIS_URL": "redis://127.0.0.1:99999/0"}, "E002", "99999"),
        ({"REDIS_URL": "redis://[::1/0"}, "E002", "[::1"),
        ({"REDIS_URL": "redis://127.0.0.1:6379/abc"}, "E002", "names database 'abc'"),
        ({"REDIS_URL": "redis://127.0.0.1:6379/0?db=x"}, "E002", "names database 'x'"),
        ({"REDIS_URL": "redis+cluster://127.0.0.1:7000/3"}, "E002", "only database 0"),
        ({"PREFETCH": "20"}, "E003", "OPTIONS['PREFETCH'] must be a whole number >= 0, not '20'"),
        ({"PREFETCH": -1}, "E003", "OPTIONS['PREFETCH'] must be a whole number >= 0"),
        ({"TIMEOUT_MS": 1.5}, "E003", "OPTIONS['TIMEOUT_MS']"),
        ({"SWEEP_INTERVAL_MS": True}, "E003", "not True"),
        ({"MAX_PAYLOAD_BYTES": None}, "E003", "not None"),
        ({"DATABASE": 1}, "E003", "OPTIONS['DATABASE'] must be a database alias"),
        ({"RETRY_BASE_MS": 500, "RETRY_MAX_MS": 100}, "E003", "OPTIONS['RETRY_MAX_MS']"),
        ({"MAX_ATTEMPTS": 0}, "E004", "OPTIONS['MAX_ATTEMPTS'] must be a whole number >= 1"),
        ({"MAX_ATTEMPTS": -3}, "E004", "not -3"),
        ({"PREFIX": "r{j}"}, "E005", "'r{j}' is not usable in a Redis key"),
        ({"PREFIX": "a:b"}, "E005", "'a:b'"),
        ({"PREFIX": ""}, "E005", "''"),
        ({"RENEW_INTERVAL_MS": 1_000}, "E006", "must be shorter than OPTIONS['LEASE_MS']"),
        ({"RENEW_INTERVAL_MS": 5_000}, "E006", "(5000)"),
        ({"RECONCILE_GRACE_MS": 500}, "E007", "must be at least OPTIONS['LEASE_MS']"),
        ({"DATABASE": "nope"}, "E008", "'nope', which is not in DATABASES"),
    ],
    ids=lambda value: ",".join(f"{k}={v!r}" for k, v in value.items())
    if isinstance(value, dict) else None,
)
def test_each_misconfiguration_has_its_check_id(
    rj_settings: Configure, options: dict[str, Any], check_id: str, fragment: str
) -> None:
    # Given: the suite's configuration (LEASE_MS 1000) with one thing wrong
    rj_settings(**options)

    # When: the checks run
    messages = reliable_jobs_messages()

    # Then: exactly that check fires, as an error in a whole sentence naming the culprit
    assert [m.id for m in messages] == [f"reliable_jobs.{check_id}"], messages
    message = messages[0]
    assert message.level == checks.ERROR
    assert message.msg.startswith("TASKS['default']")
    assert fragment in message.msg
    assert_whole_sentences(message)


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("http://:s3cret@127.0.0.1:6379/0", "http://:***@127.0.0.1:6379/0"),
        ("redis://user:s3cret@127.0.0.1:notaport/0", "redis://user:***@127.0.0.1:notaport/0"),
        ("redis://:s3cret/x@127.0.0.1:6379/0", "redis://:***@127.0.0.1:6379/0"),
    ],
)
def test_bad_redis_url_message_hides_the_password(
    rj_settings: Configure, url: str, shown: str
) -> None:
    # Given: a bad REDIS_URL carrying a password (check output ends up in CI logs)
    rj_settings(REDIS_URL=url)

    # When: the checks run
    messages = reliable_jobs_messages()

    # Then: E002 shows the URL with the password masked, and nothing of the password
    assert [m.id for m in messages] == ["reliable_jobs.E002"]
    assert repr(shown) in messages[0].msg
    assert "s3cret" not in messages[0].msg
    assert_whole_sentences(messages[0])


def test_queue_name_with_braces_is_e005(rj_settings: Configure) -> None:
    # Given: a queue whose name would break the {queue} hash tag
    rj_settings(queues=["default", "bad{queue}"])

    # When: the checks run
    messages = reliable_jobs_messages()

    # Then: E005 names the queue and says what is allowed
    assert [m.id for m in messages] == ["reliable_jobs.E005"]
    assert "'bad{queue}'" in messages[0].msg
    assert_whole_sentences(messages[0])


def test_options_that_are_not_a_dict_are_e003(settings: Any) -> None:
    # Given: OPTIONS written as a list
    settings.TASKS = {"default": {
        "BACKEND": "reliable_jobs.backend.ReliableJobsBackend",
        "OPTIONS": [("REDIS_URL", REDIS_URL)],
    }}

    # When: the checks run
    messages = [m for m in reliable_jobs_messages() if m.level == checks.ERROR]

    # Then: E003 says OPTIONS must be a dict
    assert [m.id for m in messages] == ["reliable_jobs.E003"]
    assert "OPTIONS must be a dict." in messages[0].msg


def test_every_problem_is_reported_at_once(rj_settings: Configure) -> None:
    # Given: a typo, a bad MAX_ATTEMPTS, a bad prefix and an unknown database together
    rj_settings(LEASE_SM=1, MAX_ATTEMPTS=0, PREFIX="a{b}", DATABASE="nope")

    # When: the checks run
    messages = reliable_jobs_messages()

    # Then: each has its own message
    assert sorted(m.id or "" for m in messages) == [
        "reliable_jobs.E001", "reliable_jobs.E004", "reliable_jobs.E005", "reliable_jobs.E008",
    ]
    for message in messages:
        assert_whole_sentences(message)


def test_app_not_installed_is_e009(rj_settings: Configure, settings: Any) -> None:
    # Given: the backend configured, but reliable_jobs missing from INSTALLED_APPS
    settings.INSTALLED_APPS = [a for a in settings.INSTALLED_APPS if a != "reliable_jobs"]

    # When: the backend's checks run
    messages = task_backends["default"].check()

    # Then: E009 says to add the app
    assert [m.id for m in messages] == ["reliable_jobs.E009"]
    assert "INSTALLED_APPS" in messages[0].msg
    assert_whole_sentences(messages[0])


def test_unreachable_redis_is_a_warning_not_an_exception(rj_settings: Configure) -> None:
    # Given: REDIS_URL names a port where nothing listens, with a password
    rj_settings(REDIS_URL="redis://:s3cret@127.0.0.1:1/0")

    # When: the checks run
    messages = reliable_jobs_messages()

    # Then: W001 warns (Redis may start after the web app) and hides the password
    assert [m.id for m in messages] == ["reliable_jobs.W001"]
    assert messages[0].level == checks.WARNING
    assert "does not answer" in messages[0].msg
    assert "s3cret" not in messages[0].msg
    assert "redis://:***@127.0.0.1:1/0" in messages[0].msg
    assert_whole_sentences(messages[0])

    # Then: manage.py check prints it and still succeeds
    stderr = StringIO()
    call_command("check", stdout=StringIO(), stderr=stderr)
    assert "reliable_jobs.W001" in stderr.getvalue()


def test_manage_py_check_fails_on_an_error(rj_settings: Configure) -> None:
    # Given: a typo in OPTIONS
    rj_settings(LEASE_SM=1_000)

    # When / Then: manage.py check stops with the check id
    with pytest.raises(SystemCheckError, match=r"reliable_jobs\.E001"):
        call_command("check", stdout=StringIO(), stderr=StringIO())


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    ("options", "fragment"),
    [
        ({"LEASE_SM": 1_000}, "Unknown OPTIONS key 'LEASE_SM'"),
        ({"REDIS_URL": "http://127.0.0.1:6379/0"}, "OPTIONS['REDIS_URL']"),
        ({"MAX_ATTEMPTS": 0}, "OPTIONS['MAX_ATTEMPTS']"),
        ({"RENEW_INTERVAL_MS": 1_000}, "OPTIONS['RENEW_INTERVAL_MS']"),
        ({"DATABASE": "nope"}, "OPTIONS['DATABASE']"),
    ],
    ids=lambda value: ",".join(f"{k}={v!r}" for k, v in value.items())
    if isinstance(value, dict) else None,
)
def test_enqueue_on_a_misconfigured_backend_raises_improperly_configured(
    rj_settings: Configure, redis_client: redis.Redis, options: dict[str, Any], fragment: str
) -> None:
    # Given: a backend with one misconfiguration
    rj_settings(**options)

    # When / Then: enqueue refuses, naming the backend and the problem
    with pytest.raises(ImproperlyConfigured, match=r"^TASKS\['default'\] is misconfigured") as e:
        test_tasks.noop_task.enqueue()
    assert fragment in str(e.value)

    # Then: nothing was written
    assert Job.objects.count() == 0
    assert redis_client.dbsize() == 0


def test_a_redis_that_may_evict_keys_is_a_warning(rj_settings: Configure, valkey_url: str
                                                   ) -> None:
    # Given: a Redis (here Valkey) whose maxmemory-policy evicts keys
    client = redis.Redis.from_url(valkey_url, decode_responses=True)
    before = client.config_get("maxmemory-policy")["maxmemory-policy"]
    rj_settings(REDIS_URL=valkey_url)
    try:
        client.config_set("maxmemory-policy", "allkeys-lru")

        # When: the deployment checks run (the ordinary ones never ask)
        assert reliable_jobs_messages() == []
        messages = [m for m in run_checks(include_deployment_checks=True)
                    if (m.id or "").startswith("reliable_jobs.")]

        # Then: W003 names the policy and the fix
        assert [m.id for m in messages] == ["reliable_jobs.W003"]
        assert "allkeys-lru" in messages[0].msg and "noeviction" in (messages[0].hint or "")
        assert_whole_sentences(messages[0])

        # When: the policy is noeviction, Then: nothing is said
        client.config_set("maxmemory-policy", "noeviction")
        assert [m for m in run_checks(include_deployment_checks=True)
                if (m.id or "").startswith("reliable_jobs.")] == []
    finally:
        client.config_set("maxmemory-policy", before)
        client.close()


def test_a_database_index_redis_does_not_have_says_so(rj_settings: Configure) -> None:
    # Given: a database index beyond the server's 16
    rj_settings(REDIS_URL="redis://127.0.0.1:6379/99")

    # When: the checks run
    messages = reliable_jobs_messages()

    # Then: W001 says Redis refused, and points at the index, not at waiting
    assert [m.id for m in messages] == ["reliable_jobs.W001"]
    assert "refused" in messages[0].msg
    assert "database index" in (messages[0].hint or "")


#: The alias of the SQLite database the E016 tests add beside the suite's.
SQLITE_ALIAS = "sqlite_trial"


@pytest.fixture
def sqlite_database(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, django_db_blocker: Any
                    ) -> Iterator[Callable[[dict[str, Any]], str]]:
    """Add a SQLite database with the given OPTIONS to DATABASES; return its alias.

    Django's model checks open it (to ask its features): a file of the
    test's own, so the suite's database stays closed to these tests.
    """
    from django.conf import settings

    def add(options: dict[str, Any]) -> str:
        entry = {"ENGINE": "django.db.backends.sqlite3", "NAME": str(tmp_path / "trial.sqlite3"),
                 "OPTIONS": options}
        monkeypatch.setitem(settings.DATABASES, SQLITE_ALIAS, entry)
        configured = connections.configure_settings({DEFAULT_DB_ALIAS: dict(entry)})
        monkeypatch.setitem(connections.settings, SQLITE_ALIAS, configured[DEFAULT_DB_ALIAS])
        return SQLITE_ALIAS

    with django_db_blocker.unblock():
        yield add
    if hasattr(connections._connections, SQLITE_ALIAS):
        getattr(connections._connections, SQLITE_ALIAS).close()
        delattr(connections._connections, SQLITE_ALIAS)


@pytest.mark.parametrize("options", [{}, {"transaction_mode": "DEFERRED"}, {"timeout": 20}],
                         ids=["no OPTIONS", "DEFERRED", "timeout only"])
def test_a_sqlite_mirror_without_immediate_transactions_is_e016(
    rj_settings: Configure, sqlite_database: Callable[[dict[str, Any]], str],
    options: dict[str, Any]
) -> None:
    # Given: the job mirror on SQLite in Django's default transaction mode
    # (BEGIN DEFERRED: select_for_update() locks nothing there)
    rj_settings(DATABASE=sqlite_database(options))

    # When: the checks run
    messages = reliable_jobs_messages()

    # Then: E016, an error in whole sentences, whose hint shows the setting to use
    assert [m.id for m in messages] == ["reliable_jobs.E016"], messages
    message = messages[0]
    assert message.level == checks.ERROR
    assert f"{SQLITE_ALIAS!r} is SQLite" in message.msg
    assert f"DATABASES['{SQLITE_ALIAS}']['OPTIONS']['transaction_mode'] = 'IMMEDIATE'" in (
        message.hint or "")
    assert_whole_sentences(message)
    with pytest.raises(SystemCheckError, match=r"reliable_jobs\.E016"):
        call_command("check", stdout=StringIO(), stderr=StringIO())


@pytest.mark.parametrize("mode", ["IMMEDIATE", "immediate", "EXCLUSIVE"])
def test_a_sqlite_mirror_with_immediate_transactions_passes(
    rj_settings: Configure, sqlite_database: Callable[[dict[str, Any]], str], mode: str
) -> None:
    # Given: the job mirror on SQLite whose transactions take the write lock at BEGIN
    rj_settings(DATABASE=sqlite_database({"transaction_mode": mode}))

    # When / Then: the checks are silent
    assert reliable_jobs_messages() == []


def test_e016_never_fires_on_postgresql(rj_settings: Configure) -> None:
    # Given: the suite's PostgreSQL mirror, which has no transaction_mode option
    assert connections["default"].vendor == "postgresql", "run on the suite's PostgreSQL"
    assert "transaction_mode" not in connections["default"].settings_dict["OPTIONS"]

    # When / Then: no E016
    assert [m for m in reliable_jobs_messages() if m.id == "reliable_jobs.E016"] == []
