"""The package stands on its own: ``python -m build`` makes a wheel and an sdist
that pass ``twine check``, carry what they must, and the wheel alone (in a
clean virtualenv, no repository on the path) passes ``django-admin check``
and ``migrate``, with the tooling commands only once the opt-in
``reliable_jobs.contrib.verify`` app is listed.

The build runs once per session, from a copy of the checkout's files (those
git tracks or would track), so the checkout itself is never written to.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from email.parser import Parser
from pathlib import Path

import pytest

import reliable_jobs

from .helpers import REDIS_URL, REPO

pytestmark = pytest.mark.slow

PACKAGE = REPO / "reliable_jobs"
#: Package data the wheel must carry (setup.cfg's package_data).
DATA_GLOBS = ("scripts/*.lua", "scripts/include/*.lua", "templates/**/*.html", "static/**/*.css",
              "static/**/*.js", "migrations/*.py", "py.typed")
#: What the sdist must carry beyond the package, so its tests run.
SDIST_FILES = ("tests/conftest.py", "tests/tasks.py", "tests/test_backend.py",
               "testproject/settings.py", "manage.py", "setup.cfg", "pyproject.toml",
               "MANIFEST.in", "CHANGELOG.md", "LICENSE", "README.md", "docs/design.md",
               "docs/conf.py", "docs/index.md", "docs/tutorial.md")
#: The opt-in app's commands, and files the wheel must carry for it to run.
VERIFY_COMMANDS = ("chaosjobs", "benchjobs")
VERIFY_FILES = (
    "reliable_jobs/contrib/__init__.py", "reliable_jobs/contrib/verify/__init__.py",
    "reliable_jobs/contrib/verify/apps.py", "reliable_jobs/contrib/verify/tasks.py",
    "reliable_jobs/contrib/verify/chaos.py", "reliable_jobs/contrib/verify/bench.py",
    *(f"reliable_jobs/contrib/verify/management/commands/{command}.py"
      for command in VERIFY_COMMANDS),
)
SUPPORTED_DJANGOS = ("5.2", "6.0", "6.1")
SUPPORTED_PYTHONS = ("3.12", "3.13")


@dataclass(frozen=True)
class Dist:
    wheel: Path
    sdist: Path


def source_files() -> list[str]:
    """The checkout's files as a fresh clone (plus new, unignored files) has them."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO, capture_output=True, check=True,
    ).stdout.decode().split("\0")
    return [name for name in listed if name and (REPO / name).is_file()]


def run(*args: str | Path, cwd: Path, env: dict[str, str] | None = None,
        timeout: float = 300) -> str:
    done = subprocess.run([str(a) for a in args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert done.returncode == 0, (
        f"{' '.join(map(str, args))} exited {done.returncode}:\n{done.stdout}\n{done.stderr}")
    return done.stdout


@pytest.fixture(scope="session")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Dist]:
    """``python -m build`` (sdist, then the wheel from the sdist) from a copy of the checkout."""
    root = tmp_path_factory.mktemp("packaging")
    source = root / "source"
    for name in source_files():
        target = source / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, target)
    out = root / "dist"
    run(sys.executable, "-m", "build", "--outdir", out, source, cwd=root)
    wheels, sdists = sorted(out.glob("*.whl")), sorted(out.glob("*.tar.gz"))
    assert len(wheels) == 1 and len(sdists) == 1, sorted(p.name for p in out.iterdir())
    yield Dist(wheel=wheels[0], sdist=sdists[0])


def test_twine_check_passes(dist: Dist) -> None:
    output = run(sys.executable, "-m", "twine", "check", "--strict", dist.wheel, dist.sdist,
                 cwd=dist.wheel.parent)
    assert output.count("PASSED") == 2, output


def test_wheel_carries_the_package_data_and_nothing_else(dist: Dist) -> None:
    names = set(zipfile.ZipFile(dist.wheel).namelist())
    expected = {
        f"reliable_jobs/{path.relative_to(PACKAGE)}"
        for pattern in DATA_GLOBS for path in PACKAGE.glob(pattern) if path.is_file()
    }
    assert "reliable_jobs/py.typed" in expected
    assert any(name.endswith(".lua") for name in expected)
    assert expected - names == set()
    assert {"reliable_jobs/compat.py", "reliable_jobs/worker/core.py"} <= names
    # and the opt-in verify app, whose commands the core app does not carry
    assert set(VERIFY_FILES) <= names
    assert {f"reliable_jobs/management/commands/{command}.py"
            for command in VERIFY_COMMANDS} & names == set()
    top_level = {name.split("/")[0] for name in names}
    assert {"tests", "testproject", "bench", "docs"} & top_level == set()


def test_wheel_metadata_names_the_supported_versions(dist: Dist) -> None:
    with zipfile.ZipFile(dist.wheel) as wheel:
        [metadata_name] = [n for n in wheel.namelist() if n.endswith(".dist-info/METADATA")]
        metadata = Parser().parsestr(wheel.read(metadata_name).decode())
    assert metadata["Version"] == reliable_jobs.__version__
    assert metadata["Requires-Python"] == ">=3.12"
    classifiers = set(metadata.get_all("Classifier") or [])
    assert {f"Framework :: Django :: {v}" for v in SUPPORTED_DJANGOS} <= classifiers
    assert {f"Programming Language :: Python :: {v}" for v in SUPPORTED_PYTHONS} <= classifiers
    requires = metadata.get_all("Requires-Dist") or []
    assert any(re.fullmatch(r"[Dd]jango<6\.2,>=5\.2|[Dd]jango>=5\.2,<6\.2", r) for r in requires)
    assert any(r.startswith("django-tasks") and 'extra == "django52"' in r for r in requires)
    assert metadata["Description-Content-Type"] == "text/markdown"


def test_sdist_carries_the_tests_and_what_they_need(dist: Dist) -> None:
    with tarfile.open(dist.sdist) as sdist:
        names = {name.split("/", 1)[1] for name in sdist.getnames() if "/" in name}
    assert set(SDIST_FILES) - names == set()
    tests = {str(p.relative_to(REPO)) for p in (REPO / "tests").rglob("test_*.py")
             if str(p.relative_to(REPO)) in source_files()}
    assert tests - names == set()
    assert not any("__pycache__" in name or name.endswith(".pyc") for name in names)


def test_sdist_tests_run_from_the_unpacked_sdist(dist: Dist, tmp_path: Path) -> None:
    with tarfile.open(dist.sdist) as sdist:
        sdist.extractall(tmp_path, filter="data")
    [unpacked] = tmp_path.iterdir()
    output = run(sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                 "tests/fast/test_keys.py", cwd=unpacked)
    assert re.search(r"\d+ passed", output), output


def test_wheel_alone_passes_check_and_migrate(dist: Dist, tmp_path: Path) -> None:
    """A clean virtualenv with only the wheel (and its dependencies) and a minimal project."""
    venv = tmp_path / "venv"
    # Without pip of its own (seeding one costs seconds): this interpreter's pip
    # installs into it (--python), so it holds only the wheel and its dependencies.
    run(sys.executable, "-m", "venv", "--without-pip", venv, cwd=tmp_path)
    python = venv / "bin" / "python"
    # (without PYTHONPATH: a checkout on it, with the .egg-info an editable
    # install leaves there, reads to pip as the package already installed)
    clean = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    run(sys.executable, "-m", "pip", "--python", python, "install", "--quiet",
        "--disable-pip-version-check", dist.wheel, cwd=tmp_path, env=clean)
    project = tmp_path / "project"
    project.mkdir()
    (project / "rj_check_settings.py").write_text(
        "import os\n"
        "SECRET_KEY = 'packaging-test'\n"
        "INSTALLED_APPS = ['django.contrib.contenttypes', 'django.contrib.auth',"
        " 'reliable_jobs']\n"
        "DATABASES = {'default': {'ENGINE': 'django.db.backends.sqlite3',"
        " 'NAME': os.path.join(os.path.dirname(__file__), 'db.sqlite3'),"
        " 'OPTIONS': {'transaction_mode': 'IMMEDIATE'}}}\n"
        "DEFAULT_AUTO_FIELD = 'django.db.models.BigAutoField'\n"
        "USE_TZ = True\n"
        "TASKS = {'default': {'BACKEND': 'reliable_jobs.backend.ReliableJobsBackend',"
        " 'OPTIONS': {'REDIS_URL': os.environ['REDIS_URL']}}}\n"
    )
    env = {key: value for key, value in os.environ.items()
           if key not in {"PYTHONPATH", "DJANGO_SETTINGS_MODULE", "VIRTUAL_ENV"}}
    env.update(PYTHONPATH=str(project), DJANGO_SETTINGS_MODULE="rj_check_settings",
               REDIS_URL=REDIS_URL, PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}")
    where = run(python, "-c", "import reliable_jobs; print(reliable_jobs.__file__)",
                cwd=project, env=env)
    assert Path(where.strip()).is_relative_to(venv), where
    output = run(venv / "bin" / "django-admin", "check", cwd=project, env=env)
    assert "System check identified no issues" in output, output
    run(venv / "bin" / "django-admin", "migrate", "--no-input", cwd=project, env=env)
    # and the core app alone registers none of the verify app's commands
    commands = run(venv / "bin" / "django-admin", "help", "--commands", cwd=project,
                   env=env).split()
    assert "runworker" in commands
    assert set(VERIFY_COMMANDS) & set(commands) == set()

    # When the project adds the verify app
    (project / "rj_verify_settings.py").write_text(
        "from rj_check_settings import *\n"
        "INSTALLED_APPS = [*INSTALLED_APPS, 'reliable_jobs.contrib.verify']\n"
    )
    env["DJANGO_SETTINGS_MODULE"] = "rj_verify_settings"

    # Then it passes check, has both commands, and the chaos run's default task
    # is one a worker of the default backend registers and runs
    output = run(venv / "bin" / "django-admin", "check", cwd=project, env=env)
    assert "System check identified no issues" in output, output
    commands = run(venv / "bin" / "django-admin", "help", "--commands", cwd=project,
                   env=env).split()
    assert set(VERIFY_COMMANDS) <= set(commands)
    found = run(python, "-c", "import django; django.setup()\n"
                "from reliable_jobs.contrib.verify.chaos import DEFAULT_TASK\n"
                "from reliable_jobs.tasks import discover, lookup\n"
                "discover(); task = lookup(DEFAULT_TASK); print(task and task.backend)",
                cwd=project, env=env)
    assert found.strip() == "default", found
