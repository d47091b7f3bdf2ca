"""Every key a Lua script touches arrives through KEYS, as its header says.

Read from the scripts' text alone; that the broker passes the right keys is
checked on a real server in tests/test_scripts.py.
"""

from __future__ import annotations

import re

import pytest

from reliable_jobs import scripts
from reliable_jobs.keys import QueueKeys

from ..luakeys import header_keys, key_problems, redis_calls, strip_lua_comments


@pytest.mark.parametrize("name", scripts.SCRIPT_NAMES)
def test_every_key_a_script_touches_arrives_through_keys(name: str) -> None:
    # Given a script's source
    source = scripts.source(name)

    # When its redis.call arguments are read (all of them: the parser misses none)
    calls = redis_calls(strip_lua_comments(source))
    code = strip_lua_comments(source)
    assert len(calls) == code.count("redis.call(") + code.count("redis.pcall(") > 0
    problems = key_problems(source)

    # Then every key is a KEYS local or a job hash built from the KEYS job prefix
    assert problems == []


@pytest.mark.parametrize("name", scripts.SCRIPT_NAMES)
def test_a_script_header_names_each_keys_slot_it_binds(name: str) -> None:
    # Given a script's header and its code
    source = scripts.source(name)
    declared = header_keys(source)
    bound = re.findall(r"\blocal\s+(\w+)\s*=\s*KEYS\[(\d+)\]", strip_lua_comments(source))

    # Then the header lists KEYS[1..n] in order, and the code binds each to a
    # local named after it (queued -> queued_key, job prefix -> job_prefix)
    assert [index for index, _ in declared] == list(range(1, len(declared) + 1))
    expected = [(key.replace(" ", "_") if key.endswith(" prefix") else f"{key}_key", str(index))
                for index, key in declared]
    assert bound == expected
    for _, key in declared:
        assert hasattr(QueueKeys, key.replace(" ", "_")), f"QueueKeys has no {key!r}"


def test_the_key_check_catches_literal_and_argv_keys() -> None:
    # Given scripts that build keys the ways the rule forbids
    bad_scripts = {
        "literal": "local q = KEYS[1]\nredis.call('LPUSH', 'rj:{x}:queued', ARGV[1])",
        "argv": "local q = KEYS[1]\nredis.call('DEL', ARGV[1])",
        "built": "local q = KEYS[1]\nredis.call('LLEN', q .. ':other')",
        "keys inline": "redis.call('LLEN', KEYS[1])",
        "prefix alone": "local job_prefix = KEYS[1]\nredis.call('DEL', job_prefix)",
        "rebound": "local q = KEYS[1]\nq = ARGV[1]\nredis.call('LLEN', q)",
        "job key rebound": ("local job_prefix = KEYS[1]\nlocal k = job_prefix .. ARGV[1]\n"
                            "k = ARGV[2]\nredis.call('DEL', k)"),
        "mixed table": ("local job_prefix = KEYS[1]\nlocal k = job_prefix .. ARGV[1]\n"
                        "local t = {}\nt[#t + 1] = k\nt[#t + 1] = other\n"
                        "redis.call('DEL', unpack(t))"),
    }

    # When the check reads them
    # Then it finds a problem in each one
    for label, source in bad_scripts.items():
        assert key_problems(source), f"the check missed the {label!r} key"


@pytest.mark.parametrize("name", scripts.SCRIPT_NAMES)
def test_a_script_header_builds_keys_only_from_its_prefix_slots(name: str) -> None:
    # Given a script's header: its KEYS lines, and its prose
    source = scripts.source(name)
    header = re.match(r"--\[\[(.*?)\]\]", source, flags=re.DOTALL)
    assert header
    declared = dict(header_keys(source))

    # When the prose builds a key from a slot ("KEYS[i] .. p") or names one at all
    built = [int(index) for index in re.findall(r"KEYS\[(\d+)\]\s*\.\.", header.group(1))]
    named = [int(index) for index in re.findall(r"KEYS\[(\d+)\]", header.group(1))]

    # Then every slot it names is declared, and every slot it builds from is a prefix
    assert [index for index in named if index not in declared] == []
    assert [(index, declared[index]) for index in built
            if not declared[index].endswith(" prefix")] == []

