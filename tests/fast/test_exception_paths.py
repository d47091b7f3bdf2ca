"""Error class paths the app records name real, importable exception classes.

Django's ``TaskError.exception_class`` imports the path an attempt recorded;
a path naming a class that does not exist makes reading a result's errors
raise ImportError. Read from the package's sources alone; a dead job's
result read back through the backend is in tests/test_exceptions.py.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from django.utils.module_loading import import_string

from reliable_jobs import exceptions

PACKAGE = Path(exceptions.__file__).resolve().parent

#: A dotted path into reliable_jobs.exceptions, as error texts start with.
PATH_RE = re.compile(r"reliable_jobs\.exceptions\.([A-Za-z_][A-Za-z0-9_]*)")


def recorded_paths() -> dict[str, list[str]]:
    """Every ``reliable_jobs.exceptions.X`` in the package's Python and Lua, with its files."""
    found: dict[str, list[str]] = {}
    for source in sorted([*PACKAGE.rglob("*.py"), *PACKAGE.rglob("*.lua")]):
        for match in PATH_RE.finditer(source.read_text(encoding="utf-8")):
            found.setdefault(match.group(0), []).append(str(source.relative_to(PACKAGE)))
    return found



def test_every_recorded_error_path_names_an_exception_class() -> None:
    # Given: the paths written in the package's sources
    paths = recorded_paths()
    # (the scan would catch the paths the app writes, were one typed by hand)
    assert PATH_RE.fullmatch(exceptions.class_path(exceptions.AttemptsExhausted))

    # Then: each imports, as TaskError.exception_class will, to an exception class
    for path, files in paths.items():
        try:
            found = import_string(path)
        except ImportError:
            pytest.fail(f"{path} (written in {', '.join(sorted(set(files)))}) does not import.")
        assert isinstance(found, type) and issubclass(found, BaseException), path


def test_no_script_or_module_types_an_exception_path_by_hand() -> None:
    # Given every Lua script and Python module of the package, exceptions.py aside
    for source in sorted([*PACKAGE.rglob("*.py"), *PACKAGE.rglob("*.lua")]):
        if source.name == "exceptions.py":
            continue
        text = source.read_text(encoding="utf-8")
        for match in PATH_RE.finditer(text):
            # Then a path appears only as a docstring's class reference; the
            # paths written into errors come from class_path (scripts get them
            # as ARGV from the broker)
            assert text[max(0, match.start() - 1)] in "~`", (
                f"{source.relative_to(PACKAGE)} types {match.group(0)} by hand; "
                "build it with exceptions.class_path().")


def test_class_path_is_the_importable_dotted_path() -> None:
    assert exceptions.class_path(exceptions.AttemptsExhausted) == \
        "reliable_jobs.exceptions.AttemptsExhausted"
    assert exceptions.class_path(ValueError) == "builtins.ValueError"
    assert import_string(exceptions.class_path(exceptions.LeaseExpired)) is exceptions.LeaseExpired

