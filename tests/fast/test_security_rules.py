"""Safe by construction, read from the code: no path from data to code, no password shown.

The attacks played for real (hostile payloads for a real worker, names
against a real Redis, text against PostgreSQL) are in tests/test_security.py.
"""

from __future__ import annotations

import ast

import pytest

from reliable_jobs import redaction

from ..helpers import REPO

#: Modules on the path from Redis to a running task, and the sweep (each
#: module of the broker, mirror and worker packages counts).
JOB_PATH_MODULES = ("isolation", "payload", "retry", "sweep", "tasks",
                    *sorted(f"{package}/{path.stem}" for package in ("broker", "mirror", "worker")
                            for path in (REPO / "reliable_jobs" / package).glob("*.py")))


#: Anything that turns data into code or objects.
FORBIDDEN_IMPORTS = {"pickle", "cPickle", "marshal", "shelve", "dill", "cloudpickle",
                     "jsonpickle", "yaml", "importlib"}


#: Builtins that run text as code.
FORBIDDEN_BUILTINS = {"eval", "exec", "compile", "__import__", "breakpoint"}


#: Functions (by name, whatever their module) that import or deserialise.
FORBIDDEN_CALLS = {"import_module", "import_string", "__import__", "loads", "load"}


@pytest.mark.parametrize("module", JOB_PATH_MODULES)
def test_no_module_on_the_job_path_can_turn_data_into_code(module: str) -> None:
    # Given the source of a module a payload passes through
    tree = ast.parse((REPO / "reliable_jobs" / f"{module}.py").read_text())

    # Then it imports no deserialiser or importer and calls none: json.loads only
    for node in ast.walk(tree):
        where = f"{module}.py line {getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Import):
            assert not {a.name.split(".")[0] for a in node.names} & FORBIDDEN_IMPORTS, where
        elif isinstance(node, ast.ImportFrom):
            assert (node.module or "").split(".")[0] not in FORBIDDEN_IMPORTS, where
            assert not {a.name for a in node.names} & FORBIDDEN_CALLS, where
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            assert node.func.id not in FORBIDDEN_BUILTINS | FORBIDDEN_CALLS, where
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr in FORBIDDEN_CALLS):
            assert node.func.attr == "loads", where
            assert getattr(node.func.value, "id", "") == "json", where


@pytest.mark.parametrize(("url", "shown"), [
    ("redis://user:s3cret@h:6379/0", "redis://user:***@h:6379/0"),
    ("rediss://:s3cret@h:6380/2", "rediss://:***@h:6380/2"),
    ("redis://:s3c?ret@h/0", "redis://:***@h/0"),
    ("redis://h:6379/0?password=s3cret&db=1", "redis://h:6379/0?password=***&db=1"),
    ("unix:///run/redis.sock?db=3&password=s3cret", "unix:///run/redis.sock?db=3&password=***"),
    ("rediss://u:s3cret@h/0?ssl_password=s3cret&ssl_ca_certs=/ca.pem",
     "rediss://u:***@h/0?ssl_password=***&ssl_ca_certs=/ca.pem"),
    ("redis://h:6379/0", "redis://h:6379/0"),
])
def test_mask_password_hides_every_password_a_redis_url_can_carry(url: str, shown: str) -> None:
    # When a URL is shown in a log line or a check message
    # Then its password is masked wherever redis-py would read one from
    assert redaction.mask_password(url) == shown
    assert "s3cret" not in redaction.mask_password(url)

