"""The documentation: the site builds without a warning, and every code block is checked.

tests/test_readme.py runs the Python blocks in a generated project; this file
checks every other kind (docs/CONTRIBUTING.md, "The documentation", lists
them): shell commands name real commands and flags, data blocks parse and
name real things, output samples look like the real output, and the
reference pages list exactly what the code defines.
"""

from __future__ import annotations

import ast
import configparser
import contextlib
import dataclasses
import importlib
import importlib.util
import io
import json
import re
import subprocess
import sys
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import redis
import yaml
from django.core.management import call_command, get_commands, load_command_class

from reliable_jobs.compat import Task
from reliable_jobs.conf import OPTION_NAMES
from reliable_jobs.tasks import ReliableTask

from .docblocks import (
    DOCS,
    DOCS_PAGES,
    KINDS,
    README,
    Block,
    blocks,
    every_block,
    is_standalone_settings,
    project_blocks,
    shell_blocks,
    shell_commands,
)
from .helpers import REPO
from .test_acl import MINIMAL_ACL, OPTIONAL_ACL

#: Most lines the README may have: a short README, the rest in docs/.
README_MAX_LINES = 300
#: Commands a shell block may run that are not this project's: their own tools.
OTHER_TOOLS = {"jq", "redis-cli", "sudo", "apt-get"}


def blocks_of(lang: str) -> list[Block]:
    return [block for block in every_block() if block.lang == lang]


def where(block: Block, problem: str) -> str:
    return f"{block.where}: {problem}"


# -- the site --------------------------------------------------------------------------


@pytest.mark.slow
def test_the_site_builds_without_a_warning(tmp_path: Path) -> None:
    # When Sphinx builds the site with warnings as errors (as scripts/test does)
    done = subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html",
         str(DOCS), str(tmp_path / "html")],
        cwd=REPO, capture_output=True, text=True, timeout=300)

    # Then it succeeds, with every page in the table of contents
    assert done.returncode == 0, done.stderr
    built = {path.relative_to(tmp_path / "html").with_suffix("")
             for path in (tmp_path / "html").rglob("*.html")}
    sources = {path.relative_to(DOCS).with_suffix("") for path in DOCS.rglob("*.md")}
    assert sources - built == set()


def test_the_readme_is_short() -> None:
    # Given the README
    lines = README.read_text().splitlines()
    # Then it is short, and it has one benchmark table (the history lives in docs/)
    assert len(lines) <= README_MAX_LINES
    assert sum(1 for line in lines if re.match(r"\|-", line)) == 1


def markdown_links(page: Path) -> list[str]:
    text = re.sub(r"^(`{3,}).*?^\1", "", page.read_text(), flags=re.MULTILINE | re.DOTALL)
    text = re.sub(r"`[^`\n]*`", "", text)
    return re.findall(r"\]\(([^)\s]+)\)", text)


def heading_slugs(page: Path) -> set[str]:
    """The anchors MyST (and GitHub) give the page's headings."""
    slugs = set()
    for title in re.findall(r"^#{1,3} (.+)$", page.read_text(), flags=re.MULTILINE):
        slug = re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")
        slugs.add(slug)
    return slugs


def test_every_readme_link_resolves() -> None:
    # Given the README's links into the repository (Sphinx checks the site's own)
    links = [link for link in markdown_links(README) if "://" not in link]
    assert links, "the README links to the documentation"
    for link in links:
        path, _, anchor = link.partition("#")
        target = REPO / path
        # Then each names a file that exists, and a heading of it that exists
        assert target.is_file(), link
        assert not anchor or anchor in heading_slugs(target), link


# -- every block is of a kind that is checked --------------------------------------------


def test_every_block_is_of_a_checked_kind() -> None:
    # Given every code block of the README and the site
    found = every_block()
    assert len(found) > 30
    # Then each is of a kind a test checks, and every Python block compiles
    assert [block.where for block in found if block.lang not in KINDS] == []
    for block in blocks_of("python"):
        compile(block.text, block.where, "exec")


def test_every_python_block_is_run() -> None:
    # Given the Python blocks test_readme.py pastes into its projects or runs in their
    # shells, and those checked on their own here
    run = {block.where for page_list in ([README], DOCS_PAGES)
           for pasted in project_blocks(page_list).values() for block in pasted}
    run |= {block.where for block in shell_blocks([README, *DOCS_PAGES])}
    standalone = {block.where for block in blocks_of("python") if is_standalone_settings(block)}
    # Then no Python block is left out
    assert [block.where for block in blocks_of("python")
            if block.where not in run | standalone] == []


# -- Python blocks that cannot be pasted --------------------------------------------------


def pip_packages(page: Path) -> set[str]:
    """The packages the page's ``pip install`` lines name (extras as the extra's name)."""
    names = set()
    for block in blocks(page):
        if block.lang != "sh":
            continue
        for command in shell_commands(block.text):
            if command[:2] == ["pip", "install"]:
                names |= {word.lower() for word in command[2:]}
    return names


def test_standalone_settings_blocks_name_what_exists() -> None:
    # Given the settings blocks checked on their own (an elided list, an exporter)
    standalone = [block for block in blocks_of("python") if is_standalone_settings(block)]
    assert standalone
    for block in standalone:
        tree = ast.parse(block.text)
        # Then each module they import exists, or is one their page says to install
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                try:
                    module = importlib.import_module(node.module)
                except ModuleNotFoundError:
                    package = "-".join(node.module.split(".")[:3]).replace("_", "-")
                    assert package in pip_packages(block.page), where(block, node.module)
                    continue
                for alias in node.names:
                    assert hasattr(module, alias.name), where(block, alias.name)
        # And every app a settings block lists imports
        namespace: dict[str, Any] = {}
        if "import " not in block.text:
            exec(block.text, namespace)
            for app in namespace.get("INSTALLED_APPS", []):
                importlib.import_module(app)


# -- shell commands ----------------------------------------------------------------------


@cache
def command_options(name: str) -> frozenset[str]:
    """The option strings ``manage.py NAME`` accepts (its argparse parser)."""
    command = load_command_class(get_commands()[name], name)
    parser = command.create_parser("manage.py", name)
    return frozenset(parser._option_string_actions)


@cache
def extras() -> frozenset[str]:
    config = configparser.ConfigParser()
    config.read(REPO / "setup.cfg")
    return frozenset(config["options.extras_require"])


def flags(words: list[str]) -> list[str]:
    return [word.split("=", 1)[0] for word in words if word.startswith("-") and word != "-"]


def command_problems(words: list[str]) -> list[str]:
    """What is wrong with one shell command a page shows (nothing, for a good one)."""
    problems = []
    while words and re.fullmatch(r"[A-Z_]+=.*", words[0]):
        name, value = words.pop(0).split("=", 1)
        if name == "RJ_OPTIONS":
            problems += [f"unknown OPTIONS key {key}" for key in json.loads(value)
                         if key not in OPTION_NAMES]
        elif name == "REDIS_URL":
            redis.Redis.from_url(value).close()
    if not words:
        return problems
    program, *rest = words
    if Path(program).name.startswith("python") or program == "django-admin":
        if program == "django-admin":
            rest = ["manage.py", *rest]
        if rest[:1] == ["-m"]:
            if importlib.util.find_spec(rest[1]) is None:
                problems.append(f"no module {rest[1]}")
        elif rest[:1] == ["manage.py"]:
            name, *arguments = rest[1:]
            if name not in get_commands():
                problems.append(f"no command {name}")
            else:
                problems += [f"{name} has no {flag}" for flag in flags(arguments)
                             if flag not in command_options(name)]
        else:
            script = REPO / rest[0]
            if not script.is_file():
                problems.append(f"no file {rest[0]}")
            else:
                problems += [f"{rest[0]} has no {flag}" for flag in flags(rest[1:])
                             if flag not in script.read_text()]
    elif program == "pip":
        for word in rest[1:]:
            wanted = re.search(r"\[([\w,]+)\]", word)
            if wanted:
                problems += [f"no extra {extra}" for extra in wanted.group(1).split(",")
                             if extra not in extras()]
    elif program.startswith("scripts/"):
        if not (REPO / program).is_file():
            problems.append(f"no script {program}")
    elif program not in OTHER_TOOLS:
        problems.append(f"unknown program {program}")
    return problems


def test_every_shell_command_names_real_commands_and_flags() -> None:
    # Given every command of every shell block
    checked = 0
    for block in blocks_of("sh"):
        for command in shell_commands(block.text):
            # Then its command, flags, extras, scripts and settings exist
            assert command_problems(command) == [], where(block, " ".join(command))
            checked += 1
    assert checked > 15


def test_the_commands_reference_synopses_name_real_flags() -> None:
    # Given each "- `command [--flag ...]`:" synopsis of the commands reference
    page = DOCS / "reference" / "commands.md"
    synopses = re.findall(r"^- `(\w+) ([^`]*)`:", page.read_text(), flags=re.MULTILINE)
    assert {name for name, _ in synopses} >= {"runworker", "recoverjobs", "jobstats",
                                               "checkworkers", "prunejobs", "chaosjobs",
                                               "benchjobs"}
    # Then each flag it names is one the command accepts
    for name, synopsis in synopses:
        assert [flag for flag in re.findall(r"--[\w-]+", synopsis)
                if flag not in command_options(name)] == [], name


def test_the_problem_checker_refuses_what_does_not_exist() -> None:
    # Given commands that name what does not exist
    # Then each is refused
    assert command_problems(["python", "manage.py", "runworker", "--no-such-flag"])
    assert command_problems(["python", "manage.py", "nosuchcommand"])
    assert command_problems(["pip", "install", "/path/to/checkout[nosuchextra]"])
    assert command_problems(["RJ_OPTIONS={\"LEASE\": 1}", "python", "manage.py", "check"])
    assert command_problems(["scripts/nosuchscript"])
    assert command_problems(["curl", "http://example.com"])
    assert not command_problems(["python", "manage.py", "runworker", "--queue", "q"])


# -- data blocks -------------------------------------------------------------------------


@cache
def metric_names() -> frozenset[str]:
    """Every metric reliable_jobs/metrics.py defines, as Prometheus exposes it."""
    source = (REPO / "reliable_jobs" / "metrics.py").read_text()
    counters = {f"reliable_jobs_{name}_total" for name in re.findall(r'counter\("(\w+)"', source)}
    return frozenset(counters | set(re.findall(r'"(reliable_jobs_\w+)"', source)))


def test_yaml_blocks_parse_and_name_real_commands_and_metrics() -> None:
    for block in blocks_of("yaml"):
        document = yaml.safe_load(block.text)
        text = json.dumps(document)
        # Then every metric an alert reads exists
        named = set(re.findall(r"reliable_jobs_\w+", text))
        assert named - metric_names() == set(), block.where
        # And every container command is a real command with real flags
        for container in document.get("containers", []) if isinstance(document, dict) else []:
            if "command" in container:
                assert command_problems(list(container["command"])) == [], block.where
    assert blocks_of("yaml")


def test_ini_blocks_parse_and_start_real_commands() -> None:
    for block in blocks_of("ini"):
        unit = configparser.ConfigParser(interpolation=None, strict=False)
        unit.read_string(block.text.replace("\\\n", " "))
        start = unit["Service"]["ExecStart"]
        # Then the unit's command is a real command with real flags
        assert command_problems(start.split()) == [], block.where
    assert blocks_of("ini")


def test_json_blocks_parse() -> None:
    for block in blocks_of("json"):
        json.loads(block.text)
    assert blocks_of("json")


def jobstats_output(*args: str) -> str:
    out = io.StringIO()
    # It exits 1 when a server did not answer; the shape is what is checked.
    with contextlib.suppress(SystemExit):
        call_command("jobstats", *args, stdout=out, stderr=io.StringIO())
    return out.getvalue()


def example(page: str, lang: str, starts: str) -> Block:
    found = [block for block in blocks(DOCS / page)
             if block.lang == lang and block.text.lstrip().startswith(starts)]
    assert len(found) == 1, (page, starts)
    return found[0]


@pytest.mark.django_db
def test_the_jobstats_examples_have_the_commands_shape(redis_client: redis.Redis) -> None:
    # Given the jobstats table and the jobstats --json object the operating guide shows
    table = example("howto/operating.md", "text", "queue ")
    document = json.loads(example("howto/operating.md", "json", "{\n  \"backend\"").text)

    # When the command runs
    printed = json.loads(jobstats_output("--json"))
    header = next(line for line in jobstats_output().splitlines() if line.startswith("queue "))

    # Then the example has the keys it prints, and the table its columns
    assert sorted(document) == sorted(printed)
    assert sorted(document["tasks"]) == sorted(printed["tasks"])
    columns = re.split(r"\s{2,}", header.strip())
    assert re.split(r"\s{2,}", table.text.splitlines()[0].strip()) == columns


def test_the_log_line_examples_have_the_workers_format() -> None:
    # Given the worker's failure line, as logformat.py writes it
    source = (REPO / "reliable_jobs" / "logformat.py").read_text()
    failure = re.search(r'"(Job %s %s attempt %d/%d %s in %.1f ms \(queue %s, %s\): %s; %s\.)"',
                        source)
    assert failure, "logformat.py's failure line"
    pattern = re.escape(failure.group(1)).replace("%s", ".+?").replace("%d", r"\d+")
    pattern = pattern.replace(re.escape("%.1f"), r"[\d.]+")
    # Then the text example is that line after a time stamp and a level
    line = example("howto/operating.md", "text", "20").text.strip()
    assert re.fullmatch(r"[\d-]+ [\d:,]+ (?:INFO|WARNING) " + pattern, line), line
    # And the JSON example's fields are fields the formatter writes
    record = json.loads(example("howto/operating.md", "json", '{"ts"').text)
    assert [key for key in record if f'"{key}"' not in source] == []


def test_the_acl_example_is_the_acl_the_tests_run_under() -> None:
    # Given the minimal ACL the security guide shows
    text = example("howto/security.md", "text", "ACL SETUSER").text
    rules: list[str] = []
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        words = line.split()
        if words[:2] == ["ACL", "SETUSER"]:
            words = [word for word in words[3:] if word != "on" and not word.startswith(">")]
        rules += words
    # Then it is exactly the one tests/test_acl.py runs real workers under
    assert rules == [*MINIMAL_ACL, *OPTIONAL_ACL]


# -- the reference lists what the code defines ----------------------------------------------


def test_the_checks_reference_lists_every_check_id() -> None:
    source = "".join((REPO / "reliable_jobs" / name).read_text()
                     for name in ("checks.py", "backendchecks.py"))
    in_code = set(re.findall(r'"(reliable_jobs\.[EW]\d{3})"', source))
    page = (DOCS / "reference" / "checks.md").read_text()
    listed = set(re.findall(r"^\| `(reliable_jobs\.[EW]\d{3})`", page, flags=re.MULTILINE))
    assert listed == in_code


def test_the_options_reference_lists_every_task_option() -> None:
    own = {field.name for field in dataclasses.fields(ReliableTask)} - {
        field.name for field in dataclasses.fields(Task)}
    page = (DOCS / "reference" / "options.md").read_text()
    section = page[page.index("## Task options"):]
    listed = set(re.findall(r"^\| `([a-z_]+)` \|", section, flags=re.MULTILINE))
    assert listed == own


def test_the_metrics_reference_lists_every_metric() -> None:
    page = (DOCS / "reference" / "metrics.md").read_text()
    listed = set(re.findall(r"^\| `(reliable_jobs_\w+)`", page, flags=re.MULTILINE))
    assert listed == metric_names()



def test_every_plain_block_is_an_example_a_test_checks() -> None:
    # Given the blocks with no language: output samples and the ACL
    plain = [block.text.split(maxsplit=1)[0] for block in blocks_of("text")]
    # Then each is one the tests above compare with the real thing
    assert sorted(plain) == sorted(["queue", "2026-12-01", "ACL"])
