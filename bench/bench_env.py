"""Keep ``bench/.venv`` installed with the frameworks the comparison runs.

Celery, RQ, Dramatiq and the ``django.tasks`` backends (django-tasks-db,
django-tasks-redis, django-tasks-rq) are what we measure against, never what we depend
on, so they live in a virtual environment of their own beside this file
(git-ignored), together with an editable install of this project so that
every contender runs on the same interpreter and the same redis-py.

Standard library only: this module runs under whichever ``python3`` started
``compare.py``, before the environment exists.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENV = ROOT / "bench" / ".venv"
VENV_PYTHON = VENV / "bin" / "python"
#: Where ``--ref`` snapshots of this project are unpacked, one folder per commit.
SNAPSHOTS = VENV / "snapshots"
#: What ``pip install`` gets, besides ``-e ROOT[fast]``. Unpinned on purpose:
#: the comparison is against each project's current release, and the versions
#: actually installed are printed with every table.
CONTENDERS = ("celery[redis]", "rq", "dramatiq[redis]", "redis", "hiredis",
              # The django.tasks backends a Django user would pick instead.
              "django-tasks-db", "django-tasks-redis", "django-tasks-rq")
#: Written after a successful install; holds a digest of what was asked for.
STAMP = VENV / ".bench-installed"
#: Seconds pip may take (a cold install downloads a few dozen wheels).
PIP_TIMEOUT_S = 900


def find_python() -> str:
    """Return a Python >= 3.12 exactly as ``scripts/_find_python.sh`` chooses it.

    Reused rather than reimplemented so the benchmark runs on the interpreter
    the project's own scripts would pick (pyenv shims that fail included).
    """
    script = ROOT / "scripts" / "_find_python.sh"
    found = subprocess.run(
        ["bash", "-c", f'source "{script}" && find_python'],
        capture_output=True, text=True, timeout=60, check=False,
    )
    if found.returncode != 0:
        raise SystemExit(found.stderr.strip() or "No Python >= 3.12 found.")
    return found.stdout.strip()


def snapshot(ref: str) -> tuple[str, Path]:
    """Unpack commit ``ref`` of this repository (once); return its full hash and folder.

    The working tree of a shared checkout changes under a long run (others
    edit and migrate it); a commit does not, and the table can name it.
    """
    found = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--verify", f"{ref}^{{commit}}"],
                           capture_output=True, text=True, timeout=60, check=False)
    if found.returncode != 0:
        raise SystemExit(f"--ref {ref!r} is not a commit of {ROOT}: {found.stderr.strip()}")
    commit = found.stdout.strip()
    folder = SNAPSHOTS / commit[:12]
    if not folder.exists():
        partial = folder.with_name(folder.name + ".partial")
        partial.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", commit],
                                 capture_output=True, timeout=120, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(partial)], input=archive, timeout=120,
                       check=True)
        partial.rename(folder)
    return commit, folder


def wanted_digest(project: Path) -> str:
    """Digest of the requirements, the project's folder and metadata: a change reinstalls."""
    digest = hashlib.sha256("\n".join([*CONTENDERS, str(project)]).encode())
    for name in ("setup.cfg", "pyproject.toml"):
        digest.update((project / name).read_bytes())
    return digest.hexdigest()


def venv_usable() -> bool:
    check = subprocess.run(
        [str(VENV_PYTHON), "-c", "import sys; sys.exit(sys.version_info < (3, 12))"],
        capture_output=True, timeout=60, check=False,
    ) if VENV_PYTHON.exists() else None
    return check is not None and check.returncode == 0


def ensure_venv(project: Path, *, upgrade: bool = False) -> None:
    """Create ``bench/.venv`` if needed; install the contenders and ``-e project[fast]``."""
    if VENV.exists() and not venv_usable():
        raise SystemExit(f"{VENV} exists but is not a Python >= 3.12 venv; remove it and rerun.")
    if not VENV.exists():
        python = find_python()
        print(f"bench: creating {VENV} with {python}", file=sys.stderr)
        subprocess.run([python, "-m", "venv", str(VENV)], check=True, timeout=300)
    want = wanted_digest(project)
    if not upgrade and STAMP.exists() and STAMP.read_text() == want:
        return
    print("bench: installing " + ", ".join(CONTENDERS) + f" and -e {project}[fast] "
          "(the first time takes a minute)", file=sys.stderr)
    command = [str(VENV_PYTHON), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    if upgrade:
        command.append("--upgrade")
    subprocess.run([*command, *CONTENDERS, "-e", f"{project}[fast]"], check=True,
                   timeout=PIP_TIMEOUT_S)
    STAMP.write_text(want)


def in_venv() -> bool:
    """Whether this interpreter is the benchmark's own (``sys.prefix`` is the venv)."""
    return Path(sys.prefix).resolve() == VENV.resolve()


def reexec_in_venv(script: Path, argv: list[str]) -> None:
    """Replace this process by ``script`` run with the venv's interpreter."""
    os.execv(str(VENV_PYTHON), [str(VENV_PYTHON), str(script), *argv])
