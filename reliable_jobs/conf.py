"""The backend's OPTIONS, typed, with defaults, validated once.

Options are read when the backend is built (Django rebuilds backends when
``TASKS`` changes, so ``override_settings`` works). Problems are collected,
not raised, so the system check can report all of them; the backend raises
``ImproperlyConfigured`` only when used with bad options. A problem says its
kind (:class:`ProblemKind`), not a check id: ``checks.py`` owns the ids.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, fields
from difflib import get_close_matches
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from .flow import NO_LIMITS, Limits, parse_queue_limits, parse_task_options
from .keys import FAIR_GROUP_RE, MAX_FAIR_WEIGHT, MAX_SHARDS, PREFIX_RE, is_valid_queue_name
from .redaction import SafeExceptionReporterFilter, mask_password

#: Redis URL schemes accepted by ``redis.Redis.from_url``.
REDIS_SCHEMES = ("redis", "rediss", "unix", "redis+cluster", "rediss+cluster")


class ProblemKind(enum.Enum):
    """What sort of settings mistake a problem is; ``backendchecks.PROBLEM_IDS`` gives its id."""

    UNKNOWN_OPTION = enum.auto()
    BAD_REDIS_URL = enum.auto()
    BAD_VALUE = enum.auto()
    BAD_MAX_ATTEMPTS = enum.auto()
    BAD_NAME = enum.auto()
    RENEWAL_NOT_SHORTER_THAN_LEASE = enum.auto()
    GRACE_SHORTER_THAN_LEASE = enum.auto()
    UNKNOWN_DATABASE = enum.auto()
    APP_NOT_INSTALLED = enum.auto()
    BAD_SHARDS = enum.auto()
    BAD_SCHEDULE = enum.auto()
    BAD_LIMITS = enum.auto()
    BAD_FAIR_WEIGHTS = enum.auto()


#: One problem: its kind and a whole-sentence message.
Problem = tuple[ProblemKind, str]


@dataclass(frozen=True, slots=True)
class BackendOptions:
    """Every OPTIONS key of ``ReliableJobsBackend``, with its default."""

    #: Redis server URL: ``redis://``, ``rediss://`` (TLS) or ``unix://``.
    REDIS_URL: str = "redis://127.0.0.1:6379/0"
    #: First part of every Redis key, so several projects can share a server.
    PREFIX: str = "rj"
    #: Django database alias holding the job mirror.
    DATABASE: str = "default"
    #: Claims per job before it is dead (a task may override it).
    MAX_ATTEMPTS: int = 3
    #: First retry delay in milliseconds; doubles on each attempt.
    RETRY_BASE_MS: int = 1_000
    #: Cap on the retry delay in milliseconds.
    RETRY_MAX_MS: int = 300_000
    #: Wall-clock limit per attempt in milliseconds, or None for no limit.
    TIMEOUT_MS: int | None = None
    #: Lease length in milliseconds: a job whose worker stops renewing for
    #: this long is recovered by the sweep. Renewals come from a thread that
    #: only talks to Redis, so a short lease costs nothing but those calls.
    LEASE_MS: int = 10_000
    #: How often a worker renews the leases it holds, in milliseconds
    #: (default: a third of LEASE_MS).
    RENEW_INTERVAL_MS: int | None = None
    #: Jobs a worker may hold claimed beyond those running, so that one
    #: claim script call fetches a batch; None (the default) follows the
    #: jobs' pace: as many as its threads finish in about 50 ms (worker/pace.py).
    PREFETCH: int | None = None
    #: How often a worker runs promote and recover itself, in milliseconds.
    SWEEP_INTERVAL_MS: int = 1_000
    #: Reconcile leaves a job alone until its row has been unchanged this
    #: long, in milliseconds (at least LEASE_MS), so it never races a push or
    #: a mirror write that is on its way.
    RECONCILE_GRACE_MS: int = 60_000
    #: Largest encoded arguments accepted by enqueue, in bytes.
    MAX_PAYLOAD_BYTES: int = 1024 * 1024
    #: Starvation guard: while jobs of several priorities wait in a queue,
    #: one claim in FAIR_SHARE takes the job that has waited longest
    #: whatever its priority (the others go highest priority first); 0
    #: means strict priority. See docs/howto/priorities.md.
    FAIR_SHARE: int = 10
    #: Weights of fair groups, e.g. {"acme": 3}: a group takes that many jobs
    #: per turn of its queue's rotation; unlisted groups take 1. See
    #: docs/howto/fair-shares.md.
    FAIR_WEIGHTS: dict[str, int] = field(default_factory=dict)
    #: Shards per queue, e.g. {"emails": 4}: each shard is a queue of its own
    #: (its own hash tag, so its own cluster slot); unlisted queues have one.
    SHARDS: dict[str, int] = field(default_factory=dict)
    #: A queue whose oldest ready (or due scheduled) job has waited longer
    #: than this, in milliseconds, is shown in the warning colour on the
    #: dashboard and flagged by jobstats; None turns the warning off.
    LATENCY_WARNING_MS: int | None = 60_000
    #: Periodic jobs declared in settings: {name: {"task": path, "cron": "0 3 * * *",
    #: "tz": ..., or "every_ms": ..., "args": [...], "kwargs": {...},
    #: "catch_up": "all" | "last" | "none", "queue": ...}} (see periodic/declared.py).
    SCHEDULE: dict[str, Any] = field(default_factory=dict)
    #: Flow control per queue: {queue: {"rate_limit": "100/s", "concurrency": 5}},
    #: enforced by the claim script across every worker (see flow.py).
    QUEUE_LIMITS: dict[str, Any] = field(default_factory=dict)
    #: Per-task limits set in settings, {task path: {"rate_limit": ...,
    #: "concurrency": ...}}; each one set wins over the task's own option.
    TASK_OPTIONS: dict[str, Any] = field(default_factory=dict)
    #: What parse() found wrong, as (kind, message) pairs.
    problems: tuple[Problem, ...] = field(default=(), compare=False)

    @property
    def renew_interval_ms(self) -> int:
        return self.RENEW_INTERVAL_MS or max(1, self.LEASE_MS // 3)

    def queue_limits(self, queue: str) -> Limits:
        """The flow limits of ``queue`` (a logical queue name), NO_LIMITS when none."""
        return parse_queue_limits(self.QUEUE_LIMITS)[0].get(queue, NO_LIMITS)

    def task_limits(self) -> dict[str, Limits]:
        """OPTIONS['TASK_OPTIONS'] as limits by task path."""
        return parse_task_options(self.TASK_OPTIONS)[0]


OPTION_NAMES = tuple(f.name for f in fields(BackendOptions) if f.name.isupper())
#: The defaults (class attributes of a slots dataclass are descriptors, not values).
DEFAULTS = BackendOptions()

#: Options that must be whole numbers, with their smallest allowed value.
_MINIMUMS = {
    "MAX_ATTEMPTS": 1,
    "RETRY_BASE_MS": 0,
    "RETRY_MAX_MS": 0,
    "TIMEOUT_MS": 1,
    "LEASE_MS": 100,
    "RENEW_INTERVAL_MS": 10,
    "PREFETCH": 0,
    "SWEEP_INTERVAL_MS": 10,
    "RECONCILE_GRACE_MS": 0,
    "MAX_PAYLOAD_BYTES": 64,
    "FAIR_SHARE": 0,
    "LATENCY_WARNING_MS": 1,
}
_OPTIONAL = {"TIMEOUT_MS", "RENEW_INTERVAL_MS", "PREFETCH", "LATENCY_WARNING_MS"}


def parse(raw: Any) -> BackendOptions:
    """Build options from a TASKS OPTIONS dict, collecting every problem.

    Each problem is ``(kind, whole-sentence message)``; a bad value falls
    back to its default so the rest can still be checked.
    """
    problems: list[Problem] = []
    if not isinstance(raw, dict):
        return BackendOptions(problems=((ProblemKind.BAD_VALUE, "OPTIONS must be a dict."),))
    values: dict[str, Any] = {}
    for key, value in raw.items():
        if key not in OPTION_NAMES:
            close = get_close_matches(str(key).upper(), OPTION_NAMES, n=1)
            known = f"did you mean {close[0]!r}? Known" if close else "known"
            problems.append(
                (ProblemKind.UNKNOWN_OPTION, f"Unknown OPTIONS key {key!r}; {known} keys are "
                 f"{', '.join(OPTION_NAMES)}.")
            )
            continue
        if key in _MINIMUMS:
            if value is None and key in _OPTIONAL:
                values[key] = None
                continue
            minimum = _MINIMUMS[key]
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                kind = (ProblemKind.BAD_MAX_ATTEMPTS if key == "MAX_ATTEMPTS"
                        else ProblemKind.BAD_VALUE)
                problems.append(
                    (kind, f"OPTIONS[{key!r}] must be a whole number >= {minimum}, "
                     f"not {value!r}.")
                )
                continue
        values[key] = value
    if "REDIS_URL" in values and values["REDIS_URL"] in (None, ""):
        # An environment variable that is not set: the default is used, and
        # the system check warns (W002) instead of failing at import.
        del values["REDIS_URL"]
    url = values.get("REDIS_URL", DEFAULTS.REDIS_URL)
    url_problem = redis_url_problem(url)
    if url_problem:
        problems.append((ProblemKind.BAD_REDIS_URL, url_problem))
        values.pop("REDIS_URL", None)
    prefix = values.get("PREFIX", DEFAULTS.PREFIX)
    if not isinstance(prefix, str) or not PREFIX_RE.fullmatch(prefix):
        problems.append(
            (ProblemKind.BAD_NAME, f"OPTIONS['PREFIX'] {prefix!r} is not usable in a Redis key: "
             "use 1 to 100 letters, digits, '.', '_' or '-'.")
        )
        values.pop("PREFIX", None)
    shards = values.get("SHARDS", {})
    if not isinstance(shards, dict) or not all(
        is_valid_queue_name(q) and isinstance(n, int) and not isinstance(n, bool)
        and 1 <= n <= MAX_SHARDS for q, n in shards.items()
    ):
        problems.append(
            (ProblemKind.BAD_SHARDS, f"OPTIONS['SHARDS'] must map queue names to a number of "
             f"shards from 1 to {MAX_SHARDS}, not {shards!r}.")
        )
        values.pop("SHARDS", None)
    weights = values.get("FAIR_WEIGHTS", {})
    if not isinstance(weights, dict) or not all(
        isinstance(group, str) and FAIR_GROUP_RE.fullmatch(group)
        and isinstance(weight, int) and not isinstance(weight, bool)
        and 1 <= weight <= MAX_FAIR_WEIGHT for group, weight in weights.items()
    ):
        problems.append(
            (ProblemKind.BAD_FAIR_WEIGHTS, f"OPTIONS['FAIR_WEIGHTS'] must map fair groups (1 to "
             f"100 letters, digits, '.', '_', ':', '@' or '-') to a weight from 1 to "
             f"{MAX_FAIR_WEIGHT}, not {weights!r}.")
        )
        values.pop("FAIR_WEIGHTS", None)
    if "SCHEDULE" in values:
        from .periodic.declared import from_options

        _, schedule_problems = from_options(values["SCHEDULE"], backend="")
        problems += [(ProblemKind.BAD_SCHEDULE, message) for message in schedule_problems]
        if not isinstance(values["SCHEDULE"], dict):
            values.pop("SCHEDULE")
    for name, parse_one in (("QUEUE_LIMITS", parse_queue_limits),
                            ("TASK_OPTIONS", parse_task_options)):
        if name in values:
            _, limit_problems = parse_one(values[name])
            problems += [(ProblemKind.BAD_LIMITS, message) for message in limit_problems]
            if limit_problems:
                values.pop(name)
    if not isinstance(values.get("DATABASE", "default"), str):
        problems.append((ProblemKind.BAD_VALUE,
                         "OPTIONS['DATABASE'] must be a database alias."))
        values.pop("DATABASE")
    options = BackendOptions(**values)
    if options.renew_interval_ms >= options.LEASE_MS:
        problems.append(
            (ProblemKind.RENEWAL_NOT_SHORTER_THAN_LEASE,
             f"OPTIONS['RENEW_INTERVAL_MS'] ({options.renew_interval_ms}) "
             f"must be shorter than OPTIONS['LEASE_MS'] ({options.LEASE_MS}), or leases "
             "expire between renewals.")
        )
    if options.RECONCILE_GRACE_MS < options.LEASE_MS:
        problems.append(
            (ProblemKind.GRACE_SHORTER_THAN_LEASE,
             f"OPTIONS['RECONCILE_GRACE_MS'] ({options.RECONCILE_GRACE_MS})"
             f" must be at least OPTIONS['LEASE_MS'] ({options.LEASE_MS}), or reconcile could "
             "push a healthy job twice.")
        )
    if options.RETRY_MAX_MS < options.RETRY_BASE_MS:
        problems.append(
            (ProblemKind.BAD_VALUE, "OPTIONS['RETRY_MAX_MS'] must be at least "
             "OPTIONS['RETRY_BASE_MS'].")
        )
    return BackendOptions(**values, problems=tuple(problems))


def redis_url_problem(url: object) -> str:
    """Say what is wrong with a REDIS_URL value, or return "" when it is usable.

    The URL is parsed here, port included, so that a malformed one is a
    BAD_REDIS_URL problem (E002) from ``parse()`` rather than a ValueError from
    ``urlsplit`` (at backend build time) or from redis-py (in the reachability
    check). Messages show the URL with its password masked: check output ends
    up in CI logs.
    """
    if not isinstance(url, str):
        return (f"OPTIONS['REDIS_URL'] must be a redis://, rediss://, unix:// or "
                f"redis+cluster:// URL, not {url!r}.")
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 -- raises ValueError for a port that is not 0 to 65535
    except ValueError:
        # Not the ValueError's text: it can quote part of the netloc (the password).
        return (f"OPTIONS['REDIS_URL'] {mask_password(url)!r} cannot be parsed: check its "
                "host, its port (a number from 0 to 65535) and its brackets.")
    if parts.scheme not in REDIS_SCHEMES:
        return (f"OPTIONS['REDIS_URL'] must be a redis://, rediss://, unix:// or "
                f"redis+cluster:// URL, not {mask_password(url)!r}.")
    # redis-py reads the database index from the path (/<n>) or ?db=<n>, and
    # silently uses 0 for anything it cannot read: say so instead.
    indexes = [v for k, v in parse_qsl(parts.query, keep_blank_values=True) if k == "db"]
    if parts.scheme != "unix" and parts.path not in ("", "/"):
        indexes.append(parts.path[1:])
    for index in indexes:
        if not index.isdigit() or not index.isascii():
            return (f"OPTIONS['REDIS_URL'] {mask_password(url)!r} names database {index!r}: "
                    "a Redis database index is a whole number, e.g. redis://host:6379/0.")
        if parts.scheme.endswith("+cluster") and int(index) != 0:
            return (f"OPTIONS['REDIS_URL'] {mask_password(url)!r} names database {index}: a "
                    "Redis Cluster has only database 0.")
    return ""


#: Settings written before the filter had a module of its own name
#: ``reliable_jobs.conf.SafeExceptionReporterFilter``; that path keeps working.
__all__ = ["SafeExceptionReporterFilter"]
