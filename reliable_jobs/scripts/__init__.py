"""The Lua scripts, one file per operation, loaded once and called by SHA.

redis-py's ``register_script`` sends ``EVALSHA`` and reloads the source on
``NOSCRIPT`` (a restarted or flushed server), so callers never manage SHAs.

A line ``--- @include "name"`` in a script is replaced by the text of
``include/<name>.lua`` when the source is read (as BullMQ splices its
``--- @include`` files): the wake-marker push, the fencing test, the clock
read and the counter and priority clamps are written once, and each
operation is still one script with one SHA and its own header.
"""

from __future__ import annotations

import re
from functools import cache
from importlib import resources

#: ``--- @include "name"`` on a line of its own.
_INCLUDE_LINE = re.compile(r'^--- @include "([a-z_]+)"[ \t]*$', re.MULTILINE)

#: Every script this package ships, by name (``<name>.lua`` beside this file).
SCRIPT_NAMES = (
    "ack",
    "cancel",
    "claim",
    "debounce",
    "enqueue",
    "expired",
    "extend",
    "latency",
    "nack",
    "pause",
    "promote",
    "purge",
    "recover",
    "release",
    "reprioritize",
    "requeue",
    "revive",
    "snooze",
    "start",
    "wake",
)


@cache
def source(name: str) -> str:
    """Return the Lua source of the script ``name``."""
    if name not in SCRIPT_NAMES:
        raise ValueError(f"There is no script named {name!r}.")
    text = resources.files(__package__).joinpath(f"{name}.lua").read_text(encoding="utf-8")
    return _splice_includes(name, text)


def include_source(name: str) -> str:
    """Return the Lua text of the shared helper ``include/<name>.lua``."""
    path = resources.files(__package__).joinpath("include", f"{name}.lua")
    if not path.is_file():
        raise ValueError(f"There is no Lua include named {name!r} (looked for include/{name}.lua).")
    return path.read_text(encoding="utf-8")


def _splice_includes(script: str, text: str) -> str:
    """Replace each ``--- @include`` line of ``script`` with its helper's text.

    Helpers do not include others, and a script includes each helper once: a
    second copy would redefine its locals, which Lua allows silently.
    """
    seen: set[str] = set()

    def splice(match: re.Match[str]) -> str:
        helper = match.group(1)
        if helper in seen:
            raise ValueError(f"Script {script!r} includes {helper!r} twice.")
        seen.add(helper)
        body = include_source(helper)
        if _INCLUDE_LINE.search(body):
            raise ValueError(f"Lua include {helper!r} includes another; includes do not nest.")
        return body.rstrip("\n")

    return _INCLUDE_LINE.sub(splice, text)
