"""The checks of one backend's settings: what ``ReliableJobsBackend.check()`` returns.

Django asks each task backend for its checks (``backend.check()``), and the
backend also runs them at start, since Django runs the task checks only for
some commands. They live here, beside the backend's layer, rather than in
``checks`` (the app's registered checks, one layer up): the backend imports
this module, never ``checks``, so imports run one way (docs/design.md,
"Layers"). ``checks`` lists every id; :data:`PROBLEM_IDS` names the id of
each kind of problem ``conf.parse`` and ``backend.problems()`` report.

Nothing here runs at import, and nothing registers a check.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from django.conf import settings
from django.core import checks
from redis.exceptions import ResponseError

from .broker import REDIS_ERRORS, connect
from .conf import DEFAULTS, Problem, ProblemKind
from .keys import is_valid_queue_name
from .redaction import mask_password

if TYPE_CHECKING:
    from .backend import ReliableJobsBackend

#: Seconds the reachability check waits for Redis.
PING_TIMEOUT_S = 1.0

#: The check id of each kind of problem ``conf.parse`` and ``backend.problems()`` report.
PROBLEM_IDS: dict[ProblemKind, str] = {
    ProblemKind.UNKNOWN_OPTION: "reliable_jobs.E001",
    ProblemKind.BAD_REDIS_URL: "reliable_jobs.E002",
    ProblemKind.BAD_VALUE: "reliable_jobs.E003",
    ProblemKind.BAD_MAX_ATTEMPTS: "reliable_jobs.E004",
    ProblemKind.BAD_NAME: "reliable_jobs.E005",
    ProblemKind.RENEWAL_NOT_SHORTER_THAN_LEASE: "reliable_jobs.E006",
    ProblemKind.GRACE_SHORTER_THAN_LEASE: "reliable_jobs.E007",
    ProblemKind.UNKNOWN_DATABASE: "reliable_jobs.E008",
    ProblemKind.APP_NOT_INSTALLED: "reliable_jobs.E009",
    ProblemKind.BAD_SHARDS: "reliable_jobs.E010",
    ProblemKind.BAD_SCHEDULE: "reliable_jobs.E011",
    ProblemKind.BAD_LIMITS: "reliable_jobs.E017",
    ProblemKind.BAD_FAIR_WEIGHTS: "reliable_jobs.E027",
}


def with_ids(problems: Iterable[Problem]) -> list[tuple[str, str]]:
    """``problems`` as (check id, message) pairs, as ``manage.py check`` shows them."""
    return [(PROBLEM_IDS[kind], message) for kind, message in problems]


def check_backend(backend: ReliableJobsBackend) -> list[checks.CheckMessage]:
    where = f"TASKS[{backend.alias!r}]"
    messages: list[checks.CheckMessage] = [
        checks.Error(f"{where}: {message}", id=check_id)
        for check_id, message in with_ids(backend.problems())
    ]
    for queue in sorted(backend.queues):
        if not is_valid_queue_name(queue):
            messages.append(checks.Error(
                f"{where}: queue name {queue!r} cannot be used in Redis keys.",
                hint="Use 1 to 100 letters, digits, '.', '_' or '-'.",
                id="reliable_jobs.E005",
            ))
    for queue in sorted(set(backend.config.SHARDS) - set(backend.queues)):
        messages.append(checks.Error(
            f"{where}: OPTIONS['SHARDS'] names {queue!r}, which is not in QUEUES.",
            hint="Shard a queue the backend serves, or remove the entry.",
            id="reliable_jobs.E010",
        ))
    messages += _check_schedules(where, backend)
    messages += _check_limits(where, backend)
    messages += _check_debounced_tasks(where, backend)
    options = backend.options
    if isinstance(options, dict) and options.get("REDIS_URL") in (None, ""):
        messages.append(checks.Warning(
            f"{where}: OPTIONS['REDIS_URL'] is not set, so the default "
            f"{DEFAULTS.REDIS_URL} is used.",
            hint="Set it from the environment (REDIS_URL=redis://... or rediss://...): a web "
                 "process and a worker that fall back to different servers never see each "
                 "other's jobs.",
            id="reliable_jobs.W002",
        ))
    if backend.config.DATABASE in settings.DATABASES:  # else E008 said so
        messages += _check_unique_tasks(where, backend)
        messages += _check_sqlite_transactions(where, backend.config.DATABASE)
    if not any(m.id == "reliable_jobs.E002" for m in messages):
        messages += _check_reachable(where, backend.config.REDIS_URL)
    return messages


def _check_limits(where: str, backend: ReliableJobsBackend) -> list[checks.CheckMessage]:
    """E018 and E019 (E017, a malformed limit, comes from conf.parse with the other options).

    E018: OPTIONS['QUEUE_LIMITS'] names a queue the backend does not serve,
    or OPTIONS['TASK_OPTIONS'] a task no installed app defines (a typo that
    would leave the task unlimited). E019: a limit on a sharded queue, which
    each shard would enforce on its own (a shard is a queue of its own).
    """
    config = backend.config
    messages: list[checks.CheckMessage] = []
    for queue in sorted(set(config.QUEUE_LIMITS) - set(backend.queues)):
        messages.append(checks.Error(
            f"{where}: OPTIONS['QUEUE_LIMITS'] names {queue!r}, which is not in QUEUES.",
            hint="Limit a queue the backend serves, or remove the entry.",
            id="reliable_jobs.E018",
        ))
    sharded = {q for q, n in config.SHARDS.items() if n > 1}
    for queue in sorted(sharded & set(config.QUEUE_LIMITS)):
        messages.append(checks.Error(
            f"{where}: queue {queue!r} has limits in OPTIONS['QUEUE_LIMITS'] and "
            f"{config.SHARDS[queue]} shards: each shard would enforce them on its own.",
            hint="Limit an unsharded queue (a shard is a queue of its own, in its own "
                 "cluster slot), or drop the queue's shards.",
            id="reliable_jobs.E019",
        ))
    if not config.TASK_OPTIONS or not apps_ready():
        return messages
    from .tasks import discover, lookup

    discover()
    for path in sorted(config.TASK_OPTIONS):
        task = lookup(path)
        if task is None:
            messages.append(checks.Error(
                f"{where}: OPTIONS['TASK_OPTIONS'] names {path!r}, which is not a task "
                "defined in an installed app's tasks module.",
                hint="Use the task's import path (myapp.tasks.send_mail), or remove the entry.",
                id="reliable_jobs.E018",
            ))
        elif task.queue_name in sharded:
            messages.append(checks.Error(
                f"{where}: OPTIONS['TASK_OPTIONS'] limits {path!r}, whose queue "
                f"{task.queue_name!r} has {config.SHARDS[task.queue_name]} shards: each "
                "shard would enforce the limits on its own.",
                hint="Run limited tasks on an unsharded queue.",
                id="reliable_jobs.E019",
            ))
    return messages


def _check_schedules(where: str, backend: ReliableJobsBackend) -> list[checks.CheckMessage]:
    """E012 and E013 (E011, a malformed entry, comes from conf.parse with the other options).

    Imports every installed app's ``tasks`` module, as a worker does, so that
    ``@periodic`` declarations are known.
    """
    if not apps_ready():
        return []  # E009 says why; the scheduler's module would import the models
    from .periodic.declared import clashes, decorated, from_options
    from .periodic.scheduler import declarations
    from .tasks import discover, lookup

    discover()
    messages: list[checks.CheckMessage] = []
    for declaration in declarations(backend.config, backend.alias):
        task = lookup(declaration.task_path)
        queue = declaration.queue or (task.queue_name if task is not None else None)
        if task is None:
            messages.append(checks.Error(
                f"{where}: schedule {declaration.name!r} names {declaration.task_path!r}, "
                "which is not a task defined in an installed app's tasks module.",
                hint="Point it at a task a worker runs (myapp/tasks.py), or remove the schedule.",
                id="reliable_jobs.E012",
            ))
        elif queue not in backend.queues:
            messages.append(checks.Error(
                f"{where}: schedule {declaration.name!r} enqueues on queue {queue!r}, which "
                "is not in QUEUES.",
                hint="Add the queue to QUEUES, or set the schedule's queue.",
                id="reliable_jobs.E012",
            ))
    from_settings, _ = from_options(backend.config.SCHEDULE, backend.alias)
    in_code = {d.name: d for d in decorated(backend.alias)}
    twice = {d.name for d in from_settings if d.name in in_code and in_code[d.name] != d}
    twice |= {name for name, found in clashes().items()
              if any(d.backend == backend.alias for d in found)}
    for name in sorted(twice):
        messages.append(checks.Error(
            f"{where}: schedule {name!r} is declared more than once, differently.",
            hint="Give each @periodic or OPTIONS['SCHEDULE'] entry a name of its own.",
            id="reliable_jobs.E013",
        ))
    return messages


def apps_ready() -> bool:
    from django.apps import apps

    return apps.ready and apps.is_installed("reliable_jobs")


def _check_unique_tasks(where: str, backend: ReliableJobsBackend) -> list[checks.CheckMessage]:
    """E015 when a unique task's jobs go to a database without partial indexes.

    Only tasks imported by the time ``check`` runs are seen; enqueue refuses
    the others with the same message.
    """
    from .tasks import ReliableTask, registered
    from .unique import database_problem

    unique = sorted(task.module_path for task in registered()
                    if isinstance(task, ReliableTask) and task.backend == backend.alias
                    and task.unique_for_ms is not None)
    problem = database_problem(backend.database) if unique else None
    if problem is None:
        return []
    return [checks.Error(
        f"{where}: {problem}",
        hint=f"Unique tasks: {', '.join(unique)}.",
        id="reliable_jobs.E015",
    )]


def _check_debounced_tasks(where: str,
                           backend: ReliableJobsBackend) -> list[checks.CheckMessage]:
    """W029 when a debounced task's quiet period is shorter than the sweep's interval.

    A worker's sweep promotes a scheduled job at its due time only if a
    sweep saw it before then (worker/maintenance.py): a job made and due
    between two sweeps waits for the second, up to SWEEP_INTERVAL_MS late,
    which outweighs the shorter quiet period the task asks for. Bad
    debounce options themselves are refused when the task is defined
    (InvalidTask); tasks imported by the time ``check`` runs are seen.
    """
    from .tasks import ReliableTask, registered

    interval = backend.config.SWEEP_INTERVAL_MS
    short = sorted(task.module_path for task in registered()
                   if isinstance(task, ReliableTask) and task.backend == backend.alias
                   and task.debounce_ms is not None and task.debounce_ms < interval)
    if not short:
        return []
    return [checks.Warning(
        f"{where}: {', '.join(short)} {'is' if len(short) == 1 else 'are'} debounced for less "
        f"than OPTIONS['SWEEP_INTERVAL_MS'] ({interval} ms), so each run may start more than "
        "its debounce_ms late.",
        hint="Lower SWEEP_INTERVAL_MS to at most debounce_ms (a sweep must see the job "
             "before it is due), or raise debounce_ms.",
        id="reliable_jobs.W029",
    )]


#: SQLite transaction modes that take the write lock at BEGIN.
LOCKING_SQLITE_MODES = frozenset({"IMMEDIATE", "EXCLUSIVE"})


def _check_sqlite_transactions(where: str, alias: str) -> list[checks.CheckMessage]:
    """E016 when the mirror is SQLite and its transactions do not lock at BEGIN.

    SQLite has no row locks: ``select_for_update()`` does nothing there.
    The mirror's writers (a worker's batch, the sweep, a staff action) read
    a row, act, then write it, and rely on no other writer committing in
    between. Under Django's default ``BEGIN`` (DEFERRED) a worker's late
    success commits between the sweep's read and its write, after the sweep
    acted in Redis on what it read; ``BEGIN IMMEDIATE`` makes the writers
    take turns, as the row locks make them on PostgreSQL.
    """
    from django.db import connections

    connection = connections[alias]
    if connection.vendor != "sqlite":
        return []
    mode = (connection.settings_dict.get("OPTIONS") or {}).get("transaction_mode")
    if isinstance(mode, str) and mode.upper() in LOCKING_SQLITE_MODES:
        return []
    said = f"transaction_mode {mode!r}" if mode else "Django's default transaction mode"
    return [checks.Error(
        f"{where}: the job mirror's database {alias!r} is SQLite with {said} (BEGIN "
        "DEFERRED), where select_for_update() locks nothing, so a worker's late success "
        "can slip between the recovery sweep's read of a job and its write.",
        hint=f"Take the write lock when each transaction begins: "
             f"DATABASES[{alias!r}]['OPTIONS']['transaction_mode'] = 'IMMEDIATE' "
             "(with a 'timeout' of some seconds, so writers wait for each other).",
        id="reliable_jobs.E016",
    )]


def _check_reachable(where: str, url: str) -> list[checks.CheckMessage]:
    client = connect(url, socket_timeout=PING_TIMEOUT_S)
    try:
        client.ping()
    except ResponseError as exc:
        # It answered, and refused: waiting will not help.
        return [checks.Warning(
            f"{where}: Redis at {mask_password(url)} refused the connection ({exc}).",
            hint="Check the database index (most servers have 0 to 15), the user name and "
                 "the password in REDIS_URL.",
            id="reliable_jobs.W001",
        )]
    except (*REDIS_ERRORS, OSError) as exc:  # type: ignore[misc]  # mypy cannot unpack a tuple[type, ...]
        return [checks.Warning(
            f"{where}: Redis at {mask_password(url)} does not answer ({exc}).",
            hint="Jobs enqueued now wait in the database until Redis is back and the "
                 "recovery sweep pushes them.",
            id="reliable_jobs.W001",
        )]
    finally:
        client.close()
    return []
