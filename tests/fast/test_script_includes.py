"""The Lua include mechanism: shared helpers spliced into each script at load.

Each operation stays one script with one SHA; these tests pin that the
splice happens, that a mistake in it is a clear error, and that every shared
helper is in use (an unused include is dead code that still looks shared).
That the spliced scripts compile on a real server is in tests/test_scripts.py.
"""

from __future__ import annotations

from importlib import resources

import pytest

from reliable_jobs import scripts

INCLUDE_NAMES = sorted(
    path.name.removesuffix(".lua")
    for path in resources.files(scripts).joinpath("include").iterdir()
    if path.name.endswith(".lua")
)


def test_every_script_loads_with_its_includes_spliced_in() -> None:
    # Given every script the package ships
    for name in scripts.SCRIPT_NAMES:
        # When its source is read
        text = scripts.source(name)
        # Then no include line is left, and its own header still opens it
        assert "--- @include" not in text, name
        assert text.startswith(f"--[[\n  {name}:"), name


def test_every_include_is_used_by_some_script() -> None:
    raw = {
        name: resources.files(scripts).joinpath(f"{name}.lua").read_text(encoding="utf-8")
        for name in scripts.SCRIPT_NAMES
    }
    for helper in INCLUDE_NAMES:
        users = [name for name, text in raw.items() if f'--- @include "{helper}"' in text]
        assert users, f"include/{helper}.lua is spliced into no script"


def test_an_unknown_include_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="no Lua include named 'nope'"):
        scripts._splice_includes("demo", '--- @include "nope"\n')


def test_a_script_may_not_include_a_helper_twice() -> None:
    text = '--- @include "fence"\n--- @include "fence"\n'
    with pytest.raises(ValueError, match="includes 'fence' twice"):
        scripts._splice_includes("demo", text)


def test_the_include_line_is_replaced_by_the_helper_text() -> None:
    text = 'local a = 1\n--- @include "server_clock"\nreturn a\n'
    spliced = scripts._splice_includes("demo", text)
    assert spliced.startswith("local a = 1\n")
    assert "local function now_ms()" in spliced
    assert spliced.endswith("\nreturn a\n")


#: Text that only a shared helper may spell: the snippet, and the include
#: that owns it. A script that writes one itself has a copy that can drift.
SHARED_SNIPPETS = {
    "redis.call('TIME')": "server_clock",
    "RPUSH', wake_key": "wake_marker",
    "local function count_of": "count_of",
    "job[1] == 'running' and job[2] ==": "fence",
    "local function band_of": "band_of",
}


def test_no_script_spells_a_shared_snippet_itself() -> None:
    # Given the raw text of every script, before the includes are spliced in
    for name in scripts.SCRIPT_NAMES:
        text = resources.files(scripts).joinpath(f"{name}.lua").read_text(encoding="utf-8")
        for snippet, helper in SHARED_SNIPPETS.items():
            # Then none writes a shared helper's snippet: it includes the helper
            assert snippet not in text, (
                f'{name}.lua spells {snippet!r}; use --- @include "{helper}"')


def test_each_shared_snippet_is_spelled_by_its_include() -> None:
    # The snippets above must be real text of their includes, or the test
    # before would pass against nothing.
    for snippet, helper in SHARED_SNIPPETS.items():
        assert snippet in scripts.include_source(helper), helper
