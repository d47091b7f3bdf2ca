"""The code blocks of the README and of the documentation site, found and sorted by kind.

Every block is run or checked by the suite (docs/CONTRIBUTING.md, "The
documentation", says how each kind is): ``tests/test_readme.py`` pastes the
Python blocks into a generated project and runs them there, and
``tests/test_docs.py`` checks the rest. A block of a kind nobody handles
fails ``test_every_block_is_of_a_checked_kind``.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

from .helpers import REPO

README = REPO / "README.md"
DOCS = REPO / "docs"
#: A Python block's first line names the file it goes in: ``# myapp/tasks.py ...``.
TARGET = re.compile(r"#\s*([\w/]+\.py)\b")
#: A fenced block: its fence, its info string (the language), its text.
FENCE = re.compile(r"^(`{3,})([^\n`]*)\n(.*?)^\1[ \t]*$", flags=re.MULTILINE | re.DOTALL)
#: MyST directives (```{toctree}, ```{include}): Sphinx reads them, the build checks them.
DIRECTIVE = re.compile(r"\{[\w-]+\}")
#: The pages whose Python blocks run together in one generated project (tests/test_readme.py):
#: the tutorial, then the how-to pages. The README's example runs in a project of its own.
DOCS_PAGES = [DOCS / "tutorial.md", *sorted((DOCS / "howto").glob("*.md"))]
#: Languages of blocks, each with its checker (see docs/CONTRIBUTING.md).
KINDS = ("python", "sh", "json", "yaml", "ini", "text")


@dataclass(frozen=True)
class Block:
    """One fenced code block of a Markdown page."""

    page: Path
    line: int
    lang: str
    text: str

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line}"

    @property
    def target(self) -> str | None:
        """The project file a Python block goes in, when its first line names one."""
        found = TARGET.match(self.text)
        return found.group(1) if found and self.lang == "python" else None


def pages() -> list[Path]:
    """The README and every page of the site (docs/**/*.md, bench/README.md is included)."""
    return [README, *sorted(DOCS.rglob("*.md"))]


def blocks(page: Path) -> list[Block]:
    """The code blocks of ``page`` in order, MyST directives left out."""
    text = page.read_text()
    found = []
    for match in FENCE.finditer(text):
        info = match.group(2).strip()
        if DIRECTIVE.match(info):
            continue
        found.append(Block(page, text.count("\n", 0, match.start()) + 1,
                           info.split()[0] if info else "text", match.group(3)))
    return found


def every_block() -> list[Block]:
    return [block for page in pages() for block in blocks(page)]


def project_blocks(page_list: list[Path]) -> dict[str, list[Block]]:
    """The Python blocks of these pages that name a project file, by file, in page order.

    A settings block that elides part of a list (``# ...``) or imports a
    library the suite does not install cannot be pasted: see
    :func:`is_standalone_settings`.
    """
    by_file: dict[str, list[Block]] = {}
    for page in page_list:
        for block in blocks(page):
            if block.target and not is_standalone_settings(block):
                by_file.setdefault(block.target, []).append(block)
    return by_file


def shell_blocks(page_list: list[Path]) -> list[Block]:
    """The Python blocks of these pages that name no file: run in ``manage.py shell``."""
    return [block for page in page_list for block in blocks(page)
            if block.lang == "python" and not block.target]


def is_standalone_settings(block: Block) -> bool:
    """A settings block checked on its own: it elides (``# ...``) or needs a missing library."""
    return bool(block.target and block.target.endswith("settings.py")
                and ("# ..." in block.text or "opentelemetry.exporter" in block.text))


def shell_commands(text: str) -> list[list[str]]:
    """The commands of a shell block: continuation lines joined, comments and pipes split off."""
    commands = []
    for line in text.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        while words:
            if "|" in words:
                cut = words.index("|")
                commands.append(words[:cut])
                words = words[cut + 1:]
            else:
                commands.append(words)
                words = []
    return [command for command in commands if command]
