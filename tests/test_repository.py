"""The repository stands on its own: every document it points at is inside it."""

from __future__ import annotations

import re
import subprocess

from .helpers import REPO

#: A path to a document, as prose and comments write them.
DOC_REFERENCE = re.compile(r"(?<![\w/.])((?:docs|bench)/[\w.-]+\.md)")


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
