"""The README's "Use it in your project" snippets run as pasted into a fresh project.

A newcomer copies them into what ``django-admin startproject`` and
``startapp`` generate; a snippet that fails there (``env`` undefined, an
``...`` placeholder) is the first thing they meet. This test does what they
would: it generates the project with the suite's Python, appends the
settings snippet to the generated settings, writes the app's files from the
others, and runs ``check``, ``migrate``, the view that enqueues, a burst
``runworker`` and ``recoverjobs`` as real processes against the suite's
Redis and a PostgreSQL database of its own.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import psycopg
import pytest
import redis
from django.db import connections

from reliable_jobs.sweep import SweepReport

from .helpers import REDIS_URL, REPO

README = REPO / "README.md"
#: Seconds any one command may take on a loaded 2-core machine (migrate is the slowest).
COMMAND_TIMEOUT_S = 120
#: A snippet's first line names the file it goes in: ``# myapp/tasks.py ...``.
TARGET = re.compile(r"#\s*([\w/]+\.py)\b")


def section(title: str) -> str:
    """The README text from heading ``title`` to the next heading of any level."""
    text = README.read_text()
    start = text.index(f"\n{title}\n")
    following = re.search(r"\n#{2,3} ", text[start + len(title) + 2:])
    assert following, title
    return text[start:start + len(title) + 2 + following.start()]


def python_snippets(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, flags=re.DOTALL)


def snippets_by_file() -> dict[str, str]:
    """Each Python snippet of "Use it in your project", keyed by the file it names."""
    by_file: dict[str, str] = {}
    for snippet in python_snippets(section("## Use it in your project")):
        target = TARGET.match(snippet)
        assert target, f"a README snippet does not say which file it goes in:\n{snippet}"
        by_file[target.group(1)] = snippet
    return by_file


@pytest.fixture
def fresh_database() -> Iterator[str]:
    """A PostgreSQL database of the test's own on the suite's server: its URL.

    Created and dropped here, so the generated project's migrations run on
    an empty database, as a newcomer's do.
    """
    suite = connections["default"].settings_dict
    if not suite["ENGINE"].endswith("postgresql"):
        pytest.fail("the README test needs the suite's PostgreSQL (DATABASE_URL=postgres://...)")
    user, password = suite["USER"] or "postgres", suite["PASSWORD"] or ""
    host, port = suite["HOST"] or "127.0.0.1", suite["PORT"] or 5432
    name = f"rj_readme_{uuid.uuid4().hex[:12]}"
    admin = psycopg.connect(host=host, port=port, user=user, password=password,
                            dbname="postgres", autocommit=True)
    try:
        admin.execute(f'CREATE DATABASE "{name}"')
        auth = f"{user}:{password}" if password else user
        yield f"postgres://{auth}@{host}:{port}/{name}"
    finally:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.close()


def test_every_snippet_names_its_file() -> None:
    # Given the Python snippets of "Use it in your project"
    # Then there are the three a newcomer needs, each saying where it goes
    assert sorted(snippets_by_file()) == ["myapp/tasks.py", "myapp/views.py",
                                          "mysite/settings.py"]


def pasted_project(site: Path, database_url: str) -> Callable[..., str]:
    """Generate a project and an app in ``site`` with Django's own commands and
    paste the README's snippets in (settings appended, the app's files written);
    return how to run a command there (``python ARGS``, which must succeed)."""
    site.mkdir()
    env = {**os.environ, "REDIS_URL": REDIS_URL, "DATABASE_URL": database_url,
           # this checkout's reliable_jobs, whatever the venv has installed
           "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}
    for name in ("DJANGO_SETTINGS_MODULE", "RJ_OPTIONS", "RJ_QUEUES", "RJ_PREFIX"):
        env.pop(name, None)

    def run(*args: str) -> str:
        done = subprocess.run([sys.executable, *args], cwd=site, env=env, capture_output=True,
                              text=True, timeout=COMMAND_TIMEOUT_S)
        assert done.returncode == 0, f"{args}:\n{done.stdout}\n{done.stderr}"
        return done.stdout

    run("-m", "django", "startproject", "mysite", ".")
    run("manage.py", "startapp", "myapp")
    for target, snippet in snippets_by_file().items():
        path = site / target
        if target.endswith("settings.py"):
            path.write_text(path.read_text() + "\n\n" + snippet)
        else:
            path.write_text(snippet)
    return run


@pytest.mark.slow
def test_snippets_run_as_pasted_in_a_generated_project(
    tmp_path: Path, fresh_database: str, redis_client: redis.Redis
) -> None:
    # Given a project and an app generated by Django's own commands, and the
    # README's snippets pasted in
    run = pasted_project(tmp_path / "site", fresh_database)

    # When the README's commands run, Then check and migrate pass
    run("manage.py", "check")
    run("manage.py", "migrate", "--no-input")

    # When the view signs a user up, Then one job is enqueued (after the commit)
    sign_up = (
        "from django.test import RequestFactory; from myapp.views import sign_up; "
        "r = sign_up(RequestFactory().post('/', {'username': 'ada', "
        "'email': 'ada@example.com'})); print(r.content.decode())"
    )
    job_id = json.loads(run("manage.py", "shell", "-c", sign_up).strip().splitlines()[-1])["job"]
    assert redis_client.llen("rj:{emails}:queued") == 1

    # When a burst worker serves the emails queue, and a recovery pass runs
    run("manage.py", "runworker", "--queue", "emails", "--burst")
    run("manage.py", "recoverjobs")

    # Then the view reports the job succeeded with the task's return value
    status = (
        "from django.test import RequestFactory; from myapp.views import job_status; "
        f"print(job_status(RequestFactory().get('/'), {job_id!r}).content.decode())"
    )
    reported = json.loads(run("manage.py", "shell", "-c", status).strip().splitlines()[-1])
    assert reported == {"status": "SUCCESSFUL", "value": "welcome sent to ada@example.com"}


@pytest.mark.slow
def test_the_settings_snippet_passes_check_on_sqlite(
    tmp_path: Path, redis_client: redis.Redis
) -> None:
    # Given the pasted project of a SQLite-only trial (DATABASE_URL=sqlite:///...)
    run = pasted_project(tmp_path / "site", f"sqlite:///{tmp_path / 'db.sqlite3'}")

    # When / Then check passes: the snippet's SQLite OPTIONS satisfy E016
    assert "System check identified no issues" in run("manage.py", "check")
    shown = run("manage.py", "shell", "-c", "from django.db import connection; "
                "print(connection.settings_dict['OPTIONS']['transaction_mode'])")
    assert shown.strip().splitlines()[-1] == "IMMEDIATE"


def test_every_recoverjobs_counter_is_explained() -> None:
    # Given the counters recoverjobs prints (SweepReport's fields)
    counters = list(SweepReport.__dataclass_fields__)
    assert "orphans" in counters

    # Then the README's Commands section explains each one
    commands = section("### Commands")
    assert [c for c in counters if f"  - `{c}`: " not in commands] == []

    # And so does `recoverjobs --help`
    done = subprocess.run([sys.executable, str(REPO / "manage.py"), "recoverjobs", "--help"],
                          cwd=REPO, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S,
                          env={**os.environ, "REDIS_URL": REDIS_URL})
    assert done.returncode == 0, done.stderr
    helped = " ".join(done.stdout.split())
    assert [c for c in counters if f"{c} (" not in helped] == []
