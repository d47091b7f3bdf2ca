"""Safe by default: what reaches the worker, Redis and the database, and misconfiguration.

Attacks are played for real: payloads pushed straight into Redis for a real
``runworker`` process, names that try to break out of their Redis keys,
hostile text that must reach PostgreSQL as data, secrets that must not reach
logs or error reports, and ``manage.py check --deploy`` on the production
settings. What the code's text alone shows (no module on the job path turns
data into code, passwords masked) is in tests/fast/test_security_rules.py.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import subprocess
import sys
import uuid
from io import StringIO
from pathlib import Path
from typing import Any

import pytest
import redis
from django.core import checks
from django.core.checks import run_checks
from django.core.management import call_command
from django.core.management.utils import get_random_secret_key
from django.db import connection
from django.views.debug import ExceptionReporter, SafeExceptionReporterFilter

from reliable_jobs import conf, redaction, tasks
from reliable_jobs.broker import NewJob
from reliable_jobs.compat import InvalidTask, TaskResultStatus, task, task_backends
from reliable_jobs.keys import QueueKeys
from reliable_jobs.models import Attempt, Job, JobState
from testproject.demo import tasks as demo
from tests import tasks as test_tasks

from .helpers import REDIS_URL, REPO, Processes

KEYS = QueueKeys("rj", "default")

#: Names that could break out of a Redis key or its {hash tag}, and why.
ESCAPING_NAMES = {
    "open brace": "a{b",
    "close brace": "a}b",
    "whole tag": "{other}",
    "colon": "default:queued",
    "space": "my queue",
    "unicode": "café",
    "cjk": "队列",
    "newline": "default\n",
    "empty": "",
    "101 characters": "q" * 101,
}


def reliable_jobs_messages() -> list[checks.CheckMessage]:
    return [m for m in run_checks() if (m.id or "").startswith("reliable_jobs.")]


def contents(client: redis.Redis, pattern: str) -> dict[str, Any]:
    """Each key matching ``pattern`` with its value."""
    found: dict[str, Any] = {}
    for key in client.scan_iter(pattern):
        kind = client.type(key)
        found[key] = (client.lrange(key, 0, -1) if kind == "list"
                      else client.zrange(key, 0, -1, withscores=True) if kind == "zset"
                      else client.hgetall(key) if kind == "hash" else client.get(key))
    return found


def push_raw(job_id: str, text: str) -> NewJob:
    """Write a job straight into Redis, as anyone with write access could."""
    job = NewJob(job_id, text, 3)
    task_backends["default"].broker.enqueue("default", [job])
    return job


# -- what reaches the worker -------------------------------------------------------


class PickleBomb:
    """Unpickling this runs ``touch <marker>``: a payload format must never be pickle."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.django_db(transaction=True)
@pytest.mark.slow
def test_worker_imports_and_runs_nothing_but_registered_tasks_of_installed_apps(
    rj_settings: Any, processes: Processes, redis_client: redis.Redis, tmp_path: Path
) -> None:
    # Given a module outside INSTALLED_APPS that the worker *could* import (it is on
    # its PYTHONPATH), which leaves a mark when imported and defines a task
    pwned = tmp_path / "pwned"
    outside = f"rj_outside_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{outside}.py").write_text(
        "import pathlib\n"
        f"pathlib.Path({str(tmp_path / 'imported')!r}).write_text('imported')\n"
        "from django.tasks import task\n\n\n"
        "@task\n"
        f"def evil():\n    pathlib.Path({str(pwned)!r}).write_text('ran')\n"
    )
    env = rj_settings()
    worker_env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path),
                                                                os.environ.get("PYTHONPATH")]))}

    # And: payloads pushed straight into Redis naming everything but an allowed task
    hostile = {
        "os.system": {"task": "os.system", "args": [f"touch {pwned}"]},
        "subprocess.run": {"task": "subprocess.run", "args": [["touch", str(pwned)]]},
        "builtins.exec": {"task": "builtins.exec", "args": [f"open({str(pwned)!r}, 'w')"]},
        "importlib.import_module": {"task": "importlib.import_module", "args": [outside]},
        "a task outside INSTALLED_APPS": {"task": f"{outside}.evil"},
        "a task of a module no app owns": {"task": "tests.tasks.noop_task"},
        "shell syntax": {"task": f"os.system; touch {pwned}"},
        "a call": {"task": "testproject.demo.tasks.add(1, 2)"},
        "a forged log line": {"task": "testproject.demo.tasks.add\nWARNING forged line"},
        "a file path": {"task": "../../etc/passwd"},
        "key syntax": {"task": "rj:{other}:queued"},
        "not a string": {"task": ["os", "system"]},
    }
    jobs = {why: push_raw(str(uuid.uuid4()), json.dumps(body)) for why, body in hostile.items()}
    jobs["pickle"] = push_raw(str(uuid.uuid4()),
                              pickle.dumps(PickleBomb(pwned), protocol=0).decode("ascii"))
    good = demo.add.enqueue(2, 2)

    # When a worker drains the queue
    worker = processes.worker(env, "--burst", extra_env=worker_env)
    assert worker.wait(timeout=60) == 0, processes.log(worker)
    log = processes.log(worker)

    # Then nothing ran and the outside module was never even imported
    assert not pwned.exists()
    assert not (tmp_path / "imported").exists()

    # And: each hostile job is dead after one attempt, with its reason, and a
    # warning names it; the worker kept going and ran the good job
    for why, job in jobs.items():
        state = redis_client.hgetall(KEYS.job(job.id))
        assert (state["state"], state["attempts"]) == ("dead", "1"), (why, state)
        reason = state["last_error"]
        assert "UnknownTask" in reason or "MalformedPayload" in reason, (why, reason)
        assert "\n" not in reason
        assert any(line.split(" ")[2] == "WARNING" and job.id in line and line.endswith("dead.")
                   for line in log.splitlines() if line.startswith("20")), (why, log)
    assert "not a registered task" in redis_client.hget(KEYS.job(jobs["os.system"].id),
                                                        "last_error")
    assert "\nWARNING forged line" not in log
    assert demo.add.get_result(good.id).return_value == 4


def test_only_tasks_of_installed_apps_are_allowed(settings: Any) -> None:
    # Given tasks registered in this process: the demo app's, and the test suite's
    # (the ``tests`` package is importable but is not an installed app)
    assert "tests.tasks.noop_task" in tasks._registry
    assert test_tasks.noop_task.module_path == "tests.tasks.noop_task"

    # Then only the installed app's task may run; paths nobody registered, or that
    # are not text, find nothing
    assert tasks.lookup("testproject.demo.tasks.add") is demo.add
    assert tasks.lookup("tests.tasks.noop_task") is None
    assert tasks.lookup("os.system") is None
    assert tasks.lookup(["testproject.demo.tasks.add"]) is None

    # When the demo app is removed from INSTALLED_APPS, its tasks stop being allowed too
    settings.INSTALLED_APPS = [a for a in settings.INSTALLED_APPS if a != "testproject.demo"]
    assert tasks.lookup("testproject.demo.tasks.add") is None


# -- what reaches Redis: names cannot escape their keys ---------------------------------


@pytest.mark.parametrize("why", sorted(ESCAPING_NAMES))
def test_a_name_that_could_escape_its_keys_is_refused_at_configuration_time(
    rj_settings: Any, redis_client: redis.Redis, why: str
) -> None:
    name = ESCAPING_NAMES[why]

    # When it is used as a queue name in QUEUES, or as the key PREFIX
    rj_settings(queues=["default", name])
    as_queue = reliable_jobs_messages()
    rj_settings(PREFIX=name)
    as_prefix = reliable_jobs_messages()

    # Then the system check refuses each with E005, naming it
    assert [m.id for m in as_queue] == ["reliable_jobs.E005"]
    assert repr(name) in as_queue[0].msg
    assert [m.id for m in as_prefix] == ["reliable_jobs.E005"]
    assert repr(name) in as_prefix[0].msg

    # And: no key can be built from it, and no task can be enqueued on it
    with pytest.raises(ValueError, match="is not usable"):
        QueueKeys("rj", name)
    with pytest.raises(ValueError, match="is not usable"):
        QueueKeys(name, "default")
    rj_settings(queues=["default", name])
    with pytest.raises(InvalidTask):
        demo.add.using(queue_name=name).enqueue(1, 1)
    assert redis_client.dbsize() == 0


@pytest.mark.django_db(transaction=True)
@pytest.mark.slow
@pytest.mark.parametrize("variable", ["RJ_QUEUES", "RJ_PREFIX"])
def test_runworker_refuses_a_name_that_could_escape_its_keys(
    rj_settings: Any, processes: Processes, redis_client: redis.Redis, variable: str
) -> None:
    # Given a worker configured with a queue or prefix holding a hash tag
    env = rj_settings()
    value = "default,x}{default" if variable == "RJ_QUEUES" else "rj:{default}"

    # When it starts
    worker = processes.worker(env, "--burst", extra_env={variable: value})

    # Then it stops at its system checks with E005, having written nothing
    assert worker.wait(timeout=60) != 0
    assert "reliable_jobs.E005" in processes.log(worker)
    assert redis_client.dbsize() == 0


@pytest.mark.django_db(transaction=True)
@pytest.mark.slow
def test_task_names_never_reach_redis_keys(
    rj_settings: Any, processes: Processes, redis_client: redis.Redis
) -> None:
    # Given a job waiting on queue "other", and the keys Redis holds
    env = rj_settings(queues=["default", "other"])
    bystander = demo.add.using(queue_name="other").enqueue(1, 1)
    other_before = contents(redis_client, "*{other}*")

    # And: a task whose name is key syntax cannot even be enqueued
    def fake() -> None: ...

    fake.__qualname__ = "x}{other}:queued"
    with pytest.raises(InvalidTask, match="is not a dotted Python path"):
        task()(fake).enqueue()

    # When payloads whose task paths are key syntax are pushed to "default" and a
    # worker serving "default" runs, next to an ordinary job
    for path in ("rj:{other}:queued", "}{other}", "other", "rj:workers", "{default}"):
        push_raw(str(uuid.uuid4()), json.dumps({"task": path, "args": [], "kwargs": {}}))
    ordinary = demo.add.enqueue(2, 3)
    worker = processes.worker(env, "--burst", "--queue", "default")
    assert worker.wait(timeout=60) == 0, processes.log(worker)

    # Then queue "other" is exactly as it was, and every key in Redis is one of the
    # queues' own keys or a heartbeat: none was built from a task name
    assert contents(redis_client, "*{other}*") == other_before
    allowed = {getattr(QueueKeys("rj", q), name) for q in ("default", "other")
               for name in ("queued", "processing", "landing", "leases", "scheduled",
                            "dead", "wake")}
    for key in redis_client.scan_iter("*"):
        if key.startswith(("rj:{default}:job:", "rj:{other}:job:")):
            uuid.UUID(key.rsplit(":", 1)[1])  # a job id, nothing else
        else:
            assert key in allowed or key.startswith("rj:worker:") or key == "rj:workers", key
    assert demo.add.get_result(ordinary.id).return_value == 5
    assert Job.objects.get(pk=bystander.id).state == JobState.QUEUED


# -- what reaches the database: data, never SQL ----------------------------------------

HOSTILE_TEXT = [
    "'); DROP TABLE reliable_jobs_job; --",
    "%s %(x)s %% {0} {} $1 ?",
    "\\'\\\" ` ; -- /* */",
    "é ☃ 😀 ﷽",
    "<script>alert(1)</script>\"><img src=x onerror=alert(1)>",
    "\\u0000 is six characters here, not a NUL",
]


@pytest.mark.django_db(transaction=True)
@pytest.mark.slow
def test_hostile_text_reaches_the_database_as_data(
    rj_settings: Any, processes: Processes
) -> None:
    # Given jobs whose arguments, errors and results are SQL and format syntax
    env = rj_settings()
    echoes = [demo.fail_times.enqueue(text, 1) for text in HOSTILE_TEXT]
    failures = [demo.always_fail.enqueue(text) for text in HOSTILE_TEXT]

    # When a worker runs them (each echo fails once, then returns its text)
    worker = processes.worker(env, "--burst", "--concurrency", "2")
    assert worker.wait(timeout=90) == 0, processes.log(worker)

    # Then every value came back exactly, and the tables are intact
    for text, result in zip(HOSTILE_TEXT, echoes, strict=True):
        job = Job.objects.get(pk=result.id)
        assert job.args == [text, 1]
        assert job.return_value == text
        assert demo.fail_times.get_result(result.id).status == TaskResultStatus.SUCCESSFUL
        first = Attempt.objects.get(job=job, number=1)
        assert first.error == f"builtins.RuntimeError: {text}: planned failure on attempt 1 of 1"
    for text, result in zip(HOSTILE_TEXT, failures, strict=True):
        job = Job.objects.get(pk=result.id)
        assert (job.state, job.last_error) == (JobState.DEAD, f"builtins.RuntimeError: {text}")
    assert Job.objects.count() == 2 * len(HOSTILE_TEXT)
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM reliable_jobs_attempt")
        assert cursor.fetchone()[0] >= 4 * len(HOSTILE_TEXT)


@pytest.mark.parametrize(("where", "value", "fragment"), [
    ("an argument", ("a\x00b",), "args[0] contains a NUL character"),
    ("an argument", ("\udcff",), "args[0] contains a lone surrogate"),
    ("a keyword name", {"\x00": 1}, "keyword argument name '\\x00'"),
])
@pytest.mark.django_db(transaction=True)
def test_text_the_mirror_cannot_store_is_refused_at_enqueue(
    rj_settings: Any, redis_client: redis.Redis, where: str, value: Any, fragment: str
) -> None:
    # When a producer passes text PostgreSQL or UTF-8 cannot store
    args, kwargs = (value, {}) if isinstance(value, tuple) else ((), value)

    # Then enqueue refuses with a clear error (not a database error) and writes nothing
    with pytest.raises(InvalidTask, match=re.escape(fragment)):
        test_tasks.noop_task.enqueue(*args, **kwargs)
    assert Job.objects.count() == 0
    assert redis_client.dbsize() == 0


# -- secrets ------------------------------------------------------------------------


def test_error_reports_mask_the_redis_password(rj_settings: Any) -> None:
    # Given a backend whose REDIS_URL carries a password
    rj_settings(REDIS_URL="redis://worker:s3cret@127.0.0.1:6379/0")

    # When Django builds an error report (the debug page, the e-mail to ADMINS)
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        report = ExceptionReporter(None, *sys.exc_info()).get_traceback_text()

    # Then the project's filter masks the password (Django's own would not:
    # it hides settings by name, and REDIS_URL does not look secret)
    assert "s3cret" not in report
    assert "redis://worker:***@127.0.0.1:6379/0" in report
    default = SafeExceptionReporterFilter().get_safe_settings()
    assert "s3cret" in default["TASKS"]["default"]["OPTIONS"]["REDIS_URL"]
    # and the path settings written before redaction.py existed still names it
    assert conf.SafeExceptionReporterFilter is redaction.SafeExceptionReporterFilter


# -- misconfiguration ------------------------------------------------------------------


@pytest.mark.parametrize("value", ["absent", None, ""])
def test_a_missing_redis_url_is_a_warning_not_an_error(
    settings: Any, redis_client: redis.Redis, value: Any
) -> None:
    # Given a backend whose REDIS_URL is not set (an environment variable missing)
    options: dict[str, Any] = {} if value == "absent" else {"REDIS_URL": value}
    settings.TASKS = {"default": {"BACKEND": "reliable_jobs.backend.ReliableJobsBackend",
                                  "OPTIONS": options}}

    # When the checks run (building the backend connected to nothing)
    backend = task_backends["default"]
    messages = [m for m in reliable_jobs_messages() if m.id != "reliable_jobs.W001"]

    # Then W002 warns that the default is used; nothing fails
    assert [m.id for m in messages] == ["reliable_jobs.W002"]
    assert messages[0].level == checks.WARNING
    assert conf.DEFAULTS.REDIS_URL in messages[0].msg
    assert backend.config.REDIS_URL == conf.DEFAULTS.REDIS_URL
    assert backend.problems() == []


def test_a_typo_in_options_is_an_error_that_suggests_the_key(rj_settings: Any) -> None:
    # Given OPTIONS with a misspelt key
    rj_settings(lease_ms=5_000)

    # Then E001 names it and suggests the right one
    messages = reliable_jobs_messages()
    assert [m.id for m in messages] == ["reliable_jobs.E001"]
    assert "Unknown OPTIONS key 'lease_ms'; did you mean 'LEASE_MS'?" in messages[0].msg


def test_backend_settings_open_no_connection(settings: Any) -> None:
    # Given a backend whose Redis does not exist
    settings.TASKS = {"default": {"BACKEND": "reliable_jobs.backend.ReliableJobsBackend",
                                  "OPTIONS": {"REDIS_URL": "redis://:s3cret@127.0.0.1:1/0"}}}

    # When it is built, and its checks run
    backend = task_backends["default"]
    assert "broker" not in vars(backend)  # nothing connected at build time
    stderr = StringIO()
    call_command("check", stdout=StringIO(), stderr=stderr)

    # Then the check warns (W001) with the password masked, and does not fail
    assert "reliable_jobs.W001" in stderr.getvalue()
    assert "s3cret" not in stderr.getvalue()


def production_env(**overrides: str) -> dict[str, str]:
    db = connection.settings_dict
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RJ_", "DJANGO_"))}
    env.update({
        "DJANGO_SETTINGS_MODULE": "testproject.settings_production",
        "SECRET_KEY": get_random_secret_key(),
        "ALLOWED_HOSTS": "jobs.example.com",
        "DATABASE_URL": f"postgres://{db['USER'] or 'postgres'}@{db['HOST'] or '127.0.0.1'}:"
                        f"{db['PORT'] or 5432}/{db['NAME']}",
        "REDIS_URL": REDIS_URL,
        "DEBUG": "true",  # ignored: production settings never run with DEBUG
    })
    env.update(overrides)
    return env


def manage(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(REPO / "manage.py"), *args], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.slow
def test_check_deploy_passes_for_the_production_settings() -> None:
    # When manage.py check --deploy runs on the production settings, failing on warnings
    done = manage("check", "--deploy", "--fail-level", "WARNING", env=production_env())

    # Then it finds nothing at all to complain about
    assert done.returncode == 0, done.stdout + done.stderr
    assert "System check identified no issues" in done.stdout


@pytest.mark.slow
@pytest.mark.parametrize("missing", ["SECRET_KEY", "ALLOWED_HOSTS", "DATABASE_URL", "REDIS_URL"])
def test_production_settings_refuse_to_guess_a_missing_secret_or_url(missing: str) -> None:
    # When one of the required variables is not set
    done = manage("check", env=production_env(**{missing: ""}))

    # Then nothing starts, and the error names the variable
    assert done.returncode != 0
    assert f"Set the {missing} environment variable" in done.stderr
