"""Flow control: rate limits and concurrency caps, per queue, per task and per key.

Every limit is enforced inside the claim script (scripts/claim.lua with the
``flow_limit`` include), on the Redis server's clock, so it holds across
every worker process: no worker claims a job it may not start.

- A **queue's** limits come from ``OPTIONS["QUEUE_LIMITS"]`` and travel with
  each claim (ARGV): its cap counts the queue's leases, its rate a sliding
  log of claims.
- A **task's** limits (``@task(rate_limit="10/s", concurrency=2)`` or
  ``OPTIONS["TASK_OPTIONS"]``), and a **key's** (``rate_key=`` or
  ``concurrency_key=``, a function of the call's arguments), travel with the
  job: the payload opens with a ``"flow"`` member naming each limit, so a
  claim needs no table of tasks and a rebuilt job carries them again.

This module only parses and spells limits; it imports nothing of Redis or
the ORM. The wire format of a job's limits (:func:`job_spec`) is read by
``flow_limit.lua`` and nowhere else.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

#: Most jobs one rate limit may admit per window: each admitted claim is one
#: entry of a sorted set (the sliding log) for one window.
MAX_RATE_COUNT = 100_000
#: Longest rate window, in milliseconds (one day).
MAX_WINDOW_MS = 86_400_000
#: Highest concurrency cap: a capped task's or key's running set is checked
#: member by member at a claim that reaches it.
MAX_CONCURRENCY = 10_000
#: How long a worker waits before trying a queue or a task held by its
#: concurrency cap again, in milliseconds (an ack anywhere may free a slot
#: at any moment; the claim cannot be told, so it looks again this soon).
CAP_RECHECK_MS = 10
#: Characters of the hex digest that names a key's limit (64 bits).
KEY_DIGEST_CHARS = 16

#: "100/s", "6000/m", "10/500ms", "2/3s", "50/h".
_RATE_RE = re.compile(r"\s*([0-9]+)\s*/\s*([0-9]*)\s*(ms|s|m|h)\s*")
_UNIT_MS = {"ms": 1, "s": 1_000, "m": 60_000, "h": 3_600_000}
#: The task options this module owns, in @task and in OPTIONS["TASK_OPTIONS"].
TASK_LIMIT_OPTIONS = ("rate_limit", "concurrency")
#: The queue options of OPTIONS["QUEUE_LIMITS"].
QUEUE_LIMIT_OPTIONS = ("rate_limit", "concurrency")

KeyFunction = Callable[..., Any]


@dataclass(frozen=True, slots=True)
class Rate:
    """At most ``count`` claims in any ``window_ms`` on the server's clock."""

    count: int
    window_ms: int

    def __str__(self) -> str:
        return f"{self.count}/{self.window_ms}ms"

    @property
    def per_second(self) -> float:
        return self.count * 1000 / self.window_ms


@dataclass(frozen=True, slots=True)
class Limits:
    """A rate and a concurrency cap, either may be None (no such limit)."""

    rate: Rate | None = None
    concurrency: int | None = None

    def __bool__(self) -> bool:
        return self.rate is not None or self.concurrency is not None

    def claim_args(self) -> tuple[int, int, int]:
        """ARGV[6..8] of claim.lua: rate count, window (ms), cap; 0 means none."""
        rate = self.rate
        return (rate.count if rate else 0, rate.window_ms if rate else 0,
                self.concurrency or 0)


NO_LIMITS = Limits()


def parse_rate(value: object) -> Rate:
    """Parse ``"100/s"`` (count per s, m, h, ms, or per ``<n>`` of them), or raise ValueError."""
    if isinstance(value, Rate):
        return value
    match = _RATE_RE.fullmatch(value) if isinstance(value, str) else None
    if match is None:
        raise ValueError(f"{value!r} is not a rate: write it as count/period, such as "
                         "'100/s', '6000/m', '50/h' or '10/500ms'.")
    count, span, unit = int(match[1]), int(match[2] or 1), match[3]
    window_ms = span * _UNIT_MS[unit]
    if not 1 <= count <= MAX_RATE_COUNT:
        raise ValueError(f"The rate {value!r} admits {count} jobs per window: use 1 to "
                         f"{MAX_RATE_COUNT} (a longer or shorter period keeps the same rate).")
    if not 1 <= window_ms <= MAX_WINDOW_MS:
        raise ValueError(f"The rate {value!r} has a window of {window_ms} ms: use 1 ms to "
                         f"{MAX_WINDOW_MS} ms (one day).")
    return Rate(count, window_ms)


def parse_concurrency(value: object) -> int:
    """A cap as a whole number from 1 to MAX_CONCURRENCY, or raise ValueError."""
    if isinstance(value, bool) or not isinstance(value, int) or not (
            1 <= value <= MAX_CONCURRENCY):
        raise ValueError(f"A concurrency cap must be a whole number from 1 to "
                         f"{MAX_CONCURRENCY}, not {value!r}.")
    return value


def parse_limits(raw: object, where: str, allowed: Sequence[str]) -> tuple[Limits, list[str]]:
    """Limits from ``{"rate_limit": ..., "concurrency": ...}``; problems as sentences."""
    if not isinstance(raw, Mapping):
        return NO_LIMITS, [f"{where} must be a dict with the keys {', '.join(allowed)}, "
                           f"not {raw!r}."]
    problems = [f"{where} has the unknown key {key!r}; known keys are {', '.join(allowed)}."
                for key in raw if key not in allowed]
    rate: Rate | None = None
    concurrency: int | None = None
    try:
        if raw.get("rate_limit") is not None:
            rate = parse_rate(raw["rate_limit"])
    except ValueError as exc:
        problems.append(f"{where}['rate_limit']: {exc}")
    try:
        if raw.get("concurrency") is not None:
            concurrency = parse_concurrency(raw["concurrency"])
    except ValueError as exc:
        problems.append(f"{where}['concurrency']: {exc}")
    return Limits(rate, concurrency), problems


def parse_queue_limits(raw: object) -> tuple[dict[str, Limits], list[str]]:
    """OPTIONS['QUEUE_LIMITS'] as {queue: Limits}, and what is wrong with it."""
    if not isinstance(raw, Mapping):
        return {}, [f"OPTIONS['QUEUE_LIMITS'] must map queue names to limits, not {raw!r}."]
    limits: dict[str, Limits] = {}
    problems: list[str] = []
    for queue, entry in raw.items():
        where = f"OPTIONS['QUEUE_LIMITS'][{queue!r}]"
        if not isinstance(queue, str) or not re.fullmatch(r"[A-Za-z0-9._-]{1,100}", queue):
            problems.append(f"{where}: {queue!r} is not a queue name (1 to 100 letters, "
                            "digits, '.', '_' or '-').")
            continue
        parsed, found = parse_limits(entry, where, QUEUE_LIMIT_OPTIONS)
        problems += found
        if parsed:
            limits[queue] = parsed
    return limits, problems


def parse_task_options(raw: object) -> tuple[dict[str, Limits], list[str]]:
    """OPTIONS['TASK_OPTIONS'] as {task path: Limits}, and what is wrong with it."""
    if not isinstance(raw, Mapping):
        return {}, [f"OPTIONS['TASK_OPTIONS'] must map task paths to options, not {raw!r}."]
    limits: dict[str, Limits] = {}
    problems: list[str] = []
    for path, entry in raw.items():
        where = f"OPTIONS['TASK_OPTIONS'][{path!r}]"
        if not isinstance(path, str) or not all(p.isidentifier() for p in path.split(".")):
            problems.append(f"{where}: {path!r} is not a dotted task path.")
            continue
        parsed, found = parse_limits(entry, where, TASK_LIMIT_OPTIONS)
        problems += found
        limits[path] = parsed
    return limits, problems


@dataclass(frozen=True, slots=True)
class TaskFlow:
    """One task's limits and key functions: what :meth:`spec` writes into each payload."""

    path: str
    limits: Limits
    rate_key: KeyFunction | None = None
    concurrency_key: KeyFunction | None = None

    def spec(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> str:
        """The ``"flow"`` member of one call's payload (see :func:`job_spec`).

        ValueError when a key function returns something JSON cannot hold.
        """
        rate, cap = self.limits.rate, self.limits.concurrency
        parts = []
        if rate is not None:
            name = _limit_name(self.path, self.rate_key, args, kwargs)
            parts.append(f"r/{rate.count}/{rate.window_ms}/{name}")
        if cap is not None:
            name = _limit_name(self.path, self.concurrency_key, args, kwargs)
            parts.append(f"c/{cap}/0/{name}")
        return "|".join(parts)


def _limit_name(path: str, key: KeyFunction | None, args: Sequence[Any],
                kwargs: Mapping[str, Any]) -> str:
    """The task path, or the path and a digest of the call's key: the limit's name."""
    if key is None:
        return path
    try:
        text = json.dumps(key(*args, **kwargs), sort_keys=True, separators=(",", ":"),
                          allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"The flow key of {path} is not JSON ({exc}): rate_key and "
                         "concurrency_key must return numbers, strings, lists, dicts, "
                         "booleans or None.") from None
    return f"{path}#{hashlib.sha256(text.encode()).hexdigest()[:KEY_DIGEST_CHARS]}"


def task_flow(task: object, path: str, overrides: Mapping[str, Limits]) -> TaskFlow | None:
    """The flow of ``task`` (a task object, or None when unknown), or None when unlimited.

    OPTIONS['TASK_OPTIONS'] (``overrides``) wins over the task's own options
    for each limit it sets, so operators retune a task without a deploy.
    """
    rate_limit = getattr(task, "rate_limit", None)
    own = Limits(parse_rate(rate_limit) if rate_limit is not None else None,
                 getattr(task, "concurrency", None))
    override = overrides.get(path, NO_LIMITS)
    limits = Limits(override.rate or own.rate, override.concurrency or own.concurrency)
    if not limits:
        return None
    return TaskFlow(path, limits, getattr(task, "rate_key", None),
                    getattr(task, "concurrency_key", None))


def check_task_options(rate_limit: object, concurrency: object, rate_key: object,
                       concurrency_key: object) -> str | None:
    """Why a task's flow options cannot work (a sentence), or None."""
    try:
        if rate_limit is not None:
            parse_rate(rate_limit)
        if concurrency is not None:
            parse_concurrency(concurrency)
    except ValueError as exc:
        return str(exc)
    for name, key, needs, value in (("rate_key", rate_key, "rate_limit", rate_limit),
                                    ("concurrency_key", concurrency_key, "concurrency",
                                     concurrency)):
        if key is not None and not callable(key):
            return f"{name} must be a function of the task's arguments, not {key!r}."
        if key is not None and value is None:
            return f"{name} has no effect without {needs}."
    return None


@dataclass(frozen=True, slots=True)
class LimitName:
    """A limit as the claim script names it: its kind (``rate``/``concurrency``) and name."""

    kind: str
    name: str

    @property
    def wire(self) -> str:
        """The member of the holds set and the tail of the limit's keys."""
        return f"{self.kind[0]}:{self.name}"

    @classmethod
    def from_wire(cls, wire: str) -> LimitName:
        kind, _, name = wire.partition(":")
        return cls("rate" if kind == "r" else "concurrency", name)

    @property
    def task_path(self) -> str:
        return self.name.split("#", 1)[0]

    @property
    def keyed(self) -> bool:
        return "#" in self.name


def job_spec(payload: str) -> str:
    """The ``"flow"`` member of a payload written by this package, or ''.

    The member is first (``{"flow":"...",``), so the claim script finds it
    with one anchored match and never parses the payload's JSON.
    """
    match = re.match(r'\{"flow":"([^"]*)"', payload)
    return match[1] if match else ""
