"""The repository stands on its own, and what its prose points at exists.

Every document a file names is inside the repository; every module, script,
class attribute and migration a docstring, comment or note names is one the
code has (such pointers drifted as code moved: a ``worker.py`` that became a
package, a method renamed, a migration misnumbered).
"""

from __future__ import annotations

import importlib
import inspect
import re
import subprocess

from .helpers import REPO

#: A path to a document, as prose and comments write them.
DOC_REFERENCE = re.compile(r"(?<![\w/.])((?:docs|bench)/[\w./-]+\.md)")
#: A source file named in the package's prose: ``worker.py``, scripts/recover.lua.
SOURCE_REFERENCE = re.compile(r"(?<![\w/.])([\w/]+\.(?:py|lua))\b")
#: Paths the package's prose names as examples of a user's project, not as its own files.
EXAMPLE_PATHS = re.compile(r"^(?:myapp|mysite|path/to)/|^/?(?:tasks|jobs)\.py$")
#: A class attribute named in a docstring: ``LeaseKeeper.beat``.
ATTRIBUTE_REFERENCE = re.compile(r"``([A-Z]\w*)\.(\w+)(?:\(\))?``")
#: A migration named in prose: "migration 0008" or "migration `0008_task_stats_indexes`".
MIGRATION_REFERENCE = re.compile(r"[Mm]igrations?\s+`?(\d{4})(_\w+)?`?")
MIGRATIONS = REPO / "reliable_jobs" / "migrations"


def tracked_text_files() -> list[str]:
    listed = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True,
                            check=True).stdout.split()
    return [name for name in listed if name.endswith((".py", ".md", ".lua", ".cfg", ".toml"))
            or name.startswith(("scripts/", ".ci/"))]


def test_nothing_points_outside_the_repository() -> None:
    # Given every tracked source, script and document
    outside = "../" + "shared"  # spelled in two parts so this file does not name it
    offenders = [name for name in tracked_text_files()
                 if outside in (REPO / name).read_text(errors="replace")]
    # Then none of them refers to a folder beside the checkout
    assert offenders == []


def test_every_referenced_document_exists() -> None:
    # Given every docs/... or bench/... document a tracked file names
    referenced = {match for name in tracked_text_files()
                  for match in DOC_REFERENCE.findall((REPO / name).read_text(errors="replace"))}
    # Then each of them is in the repository
    assert referenced, "the README names its design document"
    assert sorted(ref for ref in referenced if not (REPO / ref).is_file()) == []


def package_files() -> list[str]:
    return [name for name in tracked_text_files()
            if name.startswith("reliable_jobs/") and name.endswith((".py", ".lua"))]


def test_every_source_file_the_package_names_exists() -> None:
    # Given every .py or .lua path the package's docstrings and comments name
    tracked = set(tracked_text_files())
    missing = []
    for name in package_files():
        for ref in SOURCE_REFERENCE.findall((REPO / name).read_text()):
            if EXAMPLE_PATHS.search(ref):
                continue
            # Then it is a file of the repository (named in full, or by its end)
            if ref not in tracked and not any(path.endswith("/" + ref) for path in tracked):
                missing.append(f"{name}: {ref}")
    assert missing == []


def package_classes() -> dict[str, list[type]]:
    """Every class defined in the package's modules (migrations aside), by name."""
    classes: dict[str, list[type]] = {}
    for name in package_files():
        if not name.endswith(".py") or "/migrations/" in name:
            continue
        module = importlib.import_module(name.removesuffix(".py").replace("/", ".")
                                         .removesuffix(".__init__"))
        for value in vars(module).values():
            if inspect.isclass(value) and value.__module__.startswith("reliable_jobs"):
                classes.setdefault(value.__name__, [])
                if value not in classes[value.__name__]:
                    classes[value.__name__].append(value)
    return classes


def has_attribute(cls: type, attribute: str) -> bool:
    return (hasattr(cls, attribute)
            or attribute in getattr(cls, "__dataclass_fields__", {})
            or any(attribute in getattr(base, "__annotations__", {}) for base in cls.__mro__))


def test_every_class_attribute_the_package_names_exists() -> None:
    # Given every ``Class.attribute`` the package's docstrings name, for its own classes
    classes = package_classes()
    missing = []
    for name in package_files():
        for owner, attribute in ATTRIBUTE_REFERENCE.findall((REPO / name).read_text()):
            # Then that class (one of that name) has that attribute
            if owner in classes and not any(has_attribute(cls, attribute)
                                            for cls in classes[owner]):
                missing.append(f"{name}: {owner}.{attribute}")
    assert missing == []


def test_every_migration_the_prose_names_is_named_in_full_and_exists() -> None:
    # Given every migration the changelog, the README and the docs name
    migrations = {path.stem for path in MIGRATIONS.glob("0*.py")}
    documents = ["CHANGELOG.md", "README.md",
                 *(name for name in tracked_text_files() if name.startswith("docs/"))]
    found = [(name, number, rest) for name in documents
             for number, rest in MIGRATION_REFERENCE.findall((REPO / name).read_text())]
    assert found, "the changelog names its migrations"
    # Then each is named by its file name, so a wrong number cannot pass, and it exists
    assert [f"{name}: {number}{rest}" for name, number, rest in found
            if f"{number}{rest}" not in migrations] == []


def test_a_migrations_notes_name_only_earlier_migrations() -> None:
    # Given the comments of each migration
    for path in sorted(MIGRATIONS.glob("0*.py")):
        prose = "\n".join(line for line in path.read_text().splitlines()
                          if line.lstrip().startswith("#"))
        own = int(path.stem[:4])
        named = [int(number) for number in re.findall(r"\b(0\d{3})\b", prose)]
        # Then every migration they name comes before it
        assert [number for number in named if number >= own] == [], path.name


def test_recovery_never_reads_heartbeats_as_the_contract_says() -> None:
    # Given docs/design.md: recovery never reads a heartbeat, only leases
    assert "Recovery never reads it" in (REPO / "docs" / "design.md").read_text()
    # Then the sweep, the worker's maintenance and the recovery scripts name no heartbeat key
    recovery = ["reliable_jobs/sweep.py", "reliable_jobs/worker/maintenance.py",
                "reliable_jobs/scripts/recover.lua", "reliable_jobs/scripts/expired.lua"]
    assert [name for name in recovery
            if re.search(r"heartbeat|worker_key|workers_index|:workers?\b",
                         (REPO / name).read_text())] == []
