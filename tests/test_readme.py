"""The Python blocks of the README and the docs run as pasted into a fresh project.

A newcomer copies them into what ``django-admin startproject`` and
``startapp`` generate; a block that fails there (``env`` undefined, an
``...`` placeholder) is the first thing they meet. These tests do what they
would: generate the project with the suite's Python, append the settings
blocks to the generated settings, write the app's files from the others
(several blocks for one file joined in page order), and run ``check``,
``migrate``, the blocks that name no file (in ``manage.py shell``), a view
that enqueues, a burst ``runworker`` and ``recoverjobs`` as real processes
against the suite's Redis. The README's example runs on the generated
project's own SQLite database; the tutorial and the how-to pages together on
a PostgreSQL database of their own. docs/CONTRIBUTING.md says how every other
kind of block is checked (tests/test_docs.py).
"""

from __future__ import annotations

import json
import os
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

from .docblocks import DOCS, DOCS_PAGES, README, Block, project_blocks, shell_blocks
from .helpers import REDIS_URL, REPO

#: Seconds any one command may take on a loaded 2-core machine (migrate is the slowest).
COMMAND_TIMEOUT_S = 120
TUTORIAL = DOCS / "tutorial.md"
#: What a block naming no file may use without importing it: the app's tasks.
SHELL_PREAMBLE = "from myapp.tasks import *  # noqa: F403\n"


def generated_project(site: Path, env: dict[str, str],
                      by_file: dict[str, list[Block]]) -> Callable[..., str]:
    """``startproject mysite`` + ``startapp myapp`` in ``site``, the blocks pasted in.

    Returns ``run(*args)``: the suite's Python run in the project, its stdout
    returned, any failure an assertion naming the command and its output.
    """
    site.mkdir()

    def run(*args: str) -> str:
        done = subprocess.run([sys.executable, *args], cwd=site, env=env, capture_output=True,
                              text=True, timeout=COMMAND_TIMEOUT_S)
        assert done.returncode == 0, f"{args}:\n{done.stdout}\n{done.stderr}"
        return done.stdout

    run("-m", "django", "startproject", "mysite", ".")
    run("manage.py", "startapp", "myapp")
    for target, pasted in by_file.items():
        path = site / target
        text = "\n\n".join(block.text for block in pasted)
        if target.endswith(("settings.py", "urls.py")):
            path.write_text(path.read_text() + "\n\n" + text)
        else:
            path.write_text(text)
    return run


def run_shell_blocks(run: Callable[..., str], page_list: list[Path]) -> None:
    """Each block of these pages that names no file, in ``manage.py shell`` of the project."""
    for block in shell_blocks(page_list):
        run("manage.py", "shell", "-c", SHELL_PREAMBLE + block.text)


def clean_env(**variables: str) -> dict[str, str]:
    env = {**os.environ, "REDIS_URL": REDIS_URL,
           # this checkout's reliable_jobs, whatever the venv has installed
           "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1", **variables}
    for name in ("DJANGO_SETTINGS_MODULE", "RJ_OPTIONS", "RJ_QUEUES", "RJ_PREFIX",
                 "DATABASE_URL"):
        if name not in variables:
            env.pop(name, None)
    return env


def commands_page() -> str:
    return (DOCS / "reference" / "commands.md").read_text()


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
    # Given the Python blocks of the README's example and of the tutorial
    # Then each names the file it goes in: the few a newcomer needs
    assert sorted(project_blocks([README])) == ["myapp/tasks.py", "mysite/settings.py"]
    assert sorted(project_blocks([TUTORIAL])) == ["myapp/tasks.py", "myapp/views.py",
                                                  "mysite/settings.py"]


@pytest.mark.slow
def test_the_readme_example_runs_in_a_generated_project(
    tmp_path: Path, redis_client: redis.Redis
) -> None:
    # Given a generated project (its own SQLite database) with the README's example pasted in
    run = generated_project(tmp_path / "site", clean_env(), project_blocks([README]))

    # When the README's commands run, Then check and migrate pass
    run("manage.py", "check")
    run("manage.py", "migrate", "--no-input")

    # When its enqueue block runs, Then one job waits on the default queue
    run_shell_blocks(run, [README])
    assert redis_client.llen("rj:{default}:queued") == 1

    # When a burst worker serves it, and a recovery pass runs
    run("manage.py", "runworker", "--burst")
    run("manage.py", "recoverjobs")

    # Then the job succeeded with the task's return value
    status = ("from myapp.tasks import send_welcome; from reliable_jobs.models import Job; "
              "job = Job.objects.get(); r = send_welcome.get_result(str(job.pk)); "
              "print(r.status, r.return_value)")
    assert run("manage.py", "shell", "-c", status).strip().splitlines()[-1] == (
        "SUCCESSFUL welcome sent to user 42")


@pytest.mark.slow
def test_snippets_run_as_pasted_in_a_generated_project(
    tmp_path: Path, fresh_database: str, redis_client: redis.Redis
) -> None:
    # Given a project and an app generated by Django's own commands, with the
    # tutorial's and the how-to pages' blocks pasted in
    run = generated_project(tmp_path / "site", clean_env(DATABASE_URL=fresh_database),
                            project_blocks(DOCS_PAGES))

    # When the tutorial's commands run, Then check and migrate pass
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

    # And every block that names no file runs in the project's shell (its asserts too)
    assert shell_blocks(DOCS_PAGES), "the how-to pages have blocks to run in a shell"
    run_shell_blocks(run, DOCS_PAGES)


def test_every_recoverjobs_counter_is_explained() -> None:
    # Given the counters recoverjobs prints (SweepReport's fields)
    counters = list(SweepReport.__dataclass_fields__)
    assert "orphans" in counters

    # Then the reference's Commands page explains each one
    commands = commands_page()
    assert [c for c in counters if f"  - `{c}`: " not in commands] == []

    # And so does `recoverjobs --help`
    done = subprocess.run([sys.executable, str(REPO / "manage.py"), "recoverjobs", "--help"],
                          cwd=REPO, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S,
                          env={**os.environ, "REDIS_URL": REDIS_URL})
    assert done.returncode == 0, done.stderr
    helped = " ".join(done.stdout.split())
    assert [c for c in counters if f"{c} (" not in helped] == []
