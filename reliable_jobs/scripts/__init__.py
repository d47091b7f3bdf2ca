"""The Lua scripts, one file per operation, loaded once and called by SHA.

redis-py's ``register_script`` sends ``EVALSHA`` and reloads the source on
``NOSCRIPT`` (a restarted or flushed server), so callers never manage SHAs.
"""

from __future__ import annotations

from functools import cache
from importlib import resources

#: Every script this package ships, by name (``<name>.lua`` beside this file).
SCRIPT_NAMES = (
    "ack",
    "cancel",
    "claim",
    "enqueue",
    "expired",
    "extend",
    "latency",
    "nack",
    "promote",
    "purge",
    "recover",
    "release",
    "requeue",
    "revive",
    "start",
    "wake",
)


@cache
def source(name: str) -> str:
    """Return the Lua source of the script ``name``."""
    if name not in SCRIPT_NAMES:
        raise ValueError(f"There is no script named {name!r}.")
    return resources.files(__package__).joinpath(f"{name}.lua").read_text(encoding="utf-8")
