"""Reading the Lua scripts' source for the keys they touch (no server needed).

The rule these check: a script touches only keys that arrive through KEYS
(Redis Cluster routes a script by its declared keys), each bound to a local
named after the header's line for it. tests/fast/test_script_keys.py checks
every script's text with them; tests/test_scripts.py checks, on a real
server, that the keys the broker passes are the ones the headers declare.
"""

from __future__ import annotations

import re

#: Commands the scripts use whose first argument is their only key.
ONE_KEY_COMMANDS = frozenset({
    "EXISTS", "GET", "HDEL", "HGET", "HINCRBY", "HMGET", "HSET", "LINDEX", "LLEN", "LPOP", "LPOS",
    "LPUSH", "LRANGE", "LREM", "LTRIM", "PEXPIRE", "PTTL", "RPOP", "RPUSH", "SET", "ZADD",
    "ZCARD", "ZINCRBY", "ZRANGE", "ZRANGEBYSCORE", "ZREM", "ZREMRANGEBYSCORE",
    "ZREVRANGEBYSCORE", "ZSCORE",
})


#: Commands whose every argument is a key.
ALL_KEY_COMMANDS = frozenset({"DEL"})


#: Commands that touch no key.
KEYLESS_COMMANDS = frozenset({"TIME"})


def strip_lua_comments(source: str) -> str:
    source = re.sub(r"--\[\[.*?\]\]", "", source, flags=re.DOTALL)
    return re.sub(r"--[^\n]*", "", source)


def scan_call(text: str, start: int) -> tuple[list[str], int]:
    """Read the arguments of a call whose "(" ends at ``start``; skip quoted strings.

    Returns the top-level arguments and the index just past the closing ")".
    """
    arguments: list[str] = []
    current, depth, quote, index = "", 1, "", start
    while depth:
        char = text[index]
        index += 1
        if quote:
            quote = "" if char == quote and text[index - 2] != "\\" else quote
        elif char in "'\"":
            quote = char
        elif char in "({[":
            depth += 1
        elif char in ")}]":
            depth -= 1
            if not depth:
                break
        elif char == "," and depth == 1:
            arguments.append(current.strip())
            current = ""
            continue
        current += char
    arguments.append(current.strip())
    return arguments, index


def redis_calls(code: str) -> list[list[str]]:
    """The argument lists of every redis.call / redis.pcall in ``code``."""
    return [scan_call(code, match.end())[0]
            for match in re.finditer(r"redis\.p?call\(", code)]


def header_keys(source: str) -> list[tuple[int, str]]:
    """(index, name) for each ``KEYS[i] name`` line of a script's header."""
    header = re.match(r"--\[\[(.*?)\]\]", source, flags=re.DOTALL)
    assert header, "the script does not open with a --[[ ]] header"
    prefixes = ("job prefix", "band prefix", "flow prefix", "rota prefix", "group prefix")
    return [(int(index), " ".join(rest.split()[:2]) if rest.startswith(prefixes)
             else rest.split()[0])
            for index, rest in re.findall(r"^\s*KEYS\[(\d+)\]\s+(.+)$", header.group(1),
                                          flags=re.MULTILINE)]


def key_problems(source: str) -> list[str]:
    """Every way ``source`` touches a key that did not arrive through KEYS."""
    code = strip_lua_comments(source)
    problems: list[str] = []
    bound = dict(re.findall(r"\blocal\s+(\w+)\s*=\s*KEYS\[(\d+)\]", code))
    if code.count("KEYS") != len(bound):
        problems.append("KEYS is used other than in `local name = KEYS[i]`")
    job_prefix = next((name for name in bound if name == "job_prefix"), None)
    # A priority band's list is band_prefix .. priority (keys.QueueKeys.band).
    # So is a fair rotation (rota_prefix .. priority) and a fair group's list
    # (group_prefix .. a local holding "priority:group"): see keys.QueueKeys.
    list_prefixes = [name for name in bound if name in ("band_prefix", "rota_prefix",
                                                        "group_prefix")]
    # A limit's keys are flow_prefix .. kind .. wire name (keys.QueueKeys.flow).
    flow_prefix = next((name for name in bound if name == "flow_prefix"), None)
    plain_keys = {name for name in bound
                  if name not in (job_prefix, flow_prefix) and name not in list_prefixes}
    job_keys: set[str] = set()
    if job_prefix:
        job_keys = set(re.findall(rf"\blocal\s+(\w+)\s*=\s*{job_prefix}\s*\.\.\s*\w+\s*$", code,
                                  flags=re.MULTILINE))
    for name in plain_keys | job_keys:
        # A job key local may be bound in several loops, each time to a job hash.
        bindings = 1 if name in plain_keys else len(re.findall(
            rf"\blocal\s+{name}\s*=\s*{job_prefix}\s*\.\.\s*\w+\s*$", code, flags=re.MULTILINE))
        if len(re.findall(rf"(?<![.\w]){name}\s*=(?!=)", code)) != bindings:
            problems.append(f"the key local {name} is assigned something other than its key")
    appended: dict[str, set[str]] = {}
    for table, value in re.findall(r"(\w+)\[#\1\s*\+\s*1\]\s*=\s*(\w+)", code):
        appended.setdefault(table, set()).add(value)
    key_tables = {table for table, values in appended.items() if values <= job_keys}

    def is_key(expression: str) -> bool:
        unpacked = re.fullmatch(r"unpack\((\w+)(?:,.*)?\)", expression)
        return (expression in plain_keys or expression in job_keys
                or bool(job_prefix and re.fullmatch(rf"{job_prefix}\s*\.\.\s*\w+", expression))
                or any(re.fullmatch(rf"{prefix}\s*\.\.\s*\w+", expression)
                       for prefix in list_prefixes)
                or bool(flow_prefix and re.fullmatch(rf"{flow_prefix}\s*\.\.\s*'\w+:'\s*\.\.\s*\w+",
                                                     expression))
                or bool(unpacked and unpacked.group(1) in key_tables))

    for arguments in redis_calls(code):
        command = re.fullmatch(r"'(\w+)'|\"(\w+)\"", arguments[0])
        if not command:
            problems.append(f"the command {arguments[0]} is not a string literal")
            continue
        name = (command.group(1) or command.group(2)).upper()
        if name in KEYLESS_COMMANDS:
            continue
        if name in ONE_KEY_COMMANDS:
            keys = arguments[1:2]
        elif name in ALL_KEY_COMMANDS:
            keys = arguments[1:]
        else:
            problems.append(f"{name}: unknown command, add it to the tables in this test")
            continue
        problems += [f"{name} {key}: not a key from KEYS" for key in keys if not is_key(key)]
    return problems

