"""Schedules as the code declares them: ``@periodic`` on a task, or OPTIONS['SCHEDULE'].

Declarations live in code, next to the task; the database keeps only what
code cannot (enabled or not, which slots were enqueued). A worker's
scheduler fires the declarations its own code holds, so a schedule removed
from code stops firing once the workers run the new code, and its rows stay
as history.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from .timetable import Cron, Every, Timetable, TimetableError

#: The downtime policies: after an outage, enqueue every missed slot, only
#: the newest, or none. Slots found on time are always enqueued.
CATCH_UP = ("all", "last", "none")
DEFAULT_CATCH_UP = "last"
#: What a schedule name may hold (it is shown in the admin and logs, and keys
#: its slots).
NAME_RE = re.compile(r"[A-Za-z0-9_.:-]{1,200}")
#: Keys of one OPTIONS['SCHEDULE'] entry.
ENTRY_KEYS = ("task", "cron", "tz", "every_ms", "args", "kwargs", "catch_up", "queue")

_T = TypeVar("_T")


@dataclass(frozen=True, slots=True)
class Declaration:
    """One schedule: which task, when, with which fixed arguments."""

    name: str
    task_path: str
    timetable: Timetable
    backend: str = "default"
    args: tuple[Any, ...] = ()
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    catch_up: str = DEFAULT_CATCH_UP
    #: The queue to enqueue on (None: the task's own).
    queue: str | None = None

    @property
    def expression(self) -> str:
        return self.timetable.expression if isinstance(self.timetable, Cron) else ""

    @property
    def every_ms(self) -> int | None:
        return self.timetable.every_ms if isinstance(self.timetable, Every) else None

    @property
    def tz(self) -> str:
        return self.timetable.tz if isinstance(self.timetable, Cron) else "UTC"


def build(name: str, task_path: str, *, cron: str | None = None, tz: str = "UTC",
          every_ms: int | None = None, args: Sequence[Any] = (),
          kwargs: Mapping[str, Any] | None = None, catch_up: str = DEFAULT_CATCH_UP,
          queue: str | None = None, backend: str = "default") -> Declaration:
    """Validate and build a declaration; raise TimetableError (a ValueError) saying why not."""
    if not isinstance(name, str) or not NAME_RE.fullmatch(name):
        raise TimetableError(f"Schedule name {name!r} is not usable: use 1 to 200 letters, "
                             "digits, '.', '_', ':' or '-'.")
    if (cron is None) == (every_ms is None):
        raise TimetableError(f"Schedule {name!r} needs exactly one of a cron expression "
                             "and every_ms.")
    if cron is not None and not isinstance(cron, str):
        raise TimetableError(f"Schedule {name!r}: the cron expression must be a string.")
    if not isinstance(tz, str):
        raise TimetableError(f"Schedule {name!r}: tz must be an IANA time zone name.")
    if every_ms is not None and tz != "UTC":
        raise TimetableError(f"Schedule {name!r}: an interval counts in UTC; tz applies to "
                             "cron expressions only.")
    timetable: Timetable = Cron(cron, tz) if cron is not None else Every(every_ms)  # type: ignore[arg-type]  # one is set, checked above
    if catch_up not in CATCH_UP:
        raise TimetableError(f"Schedule {name!r}: catch_up must be one of "
                             f"{', '.join(map(repr, CATCH_UP))}, not {catch_up!r}.")
    if isinstance(args, (str, bytes)) or not isinstance(args, Sequence):
        raise TimetableError(f"Schedule {name!r}: args must be a list or tuple.")
    kwargs = {} if kwargs is None else kwargs
    if not isinstance(kwargs, Mapping) or not all(isinstance(k, str) for k in kwargs):
        raise TimetableError(f"Schedule {name!r}: kwargs must be a dict with string keys.")
    try:
        json.dumps([list(args), dict(kwargs)], allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise TimetableError(f"Schedule {name!r}: its arguments are not JSON ({exc}).") from None
    if queue is not None and not isinstance(queue, str):
        raise TimetableError(f"Schedule {name!r}: queue must be a queue name.")
    return Declaration(name=name, task_path=task_path, timetable=timetable, backend=backend,
                       args=tuple(args), kwargs=dict(kwargs), catch_up=catch_up, queue=queue)


# -- @periodic ---------------------------------------------------------------

_declared: dict[str, Declaration] = {}
#: Names declared twice with different definitions (reported by the checks).
_clashes: dict[str, list[Declaration]] = {}
_lock = threading.Lock()


def periodic(cron: str | None = None, *, tz: str = "UTC", every_ms: int | None = None,
             args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None,
             name: str | None = None, catch_up: str = DEFAULT_CATCH_UP,
             queue: str | None = None) -> Any:
    """Run the task below on a schedule: ``@periodic("0 3 * * *", tz="Europe/Berlin")``.

    Put it above ``@task``; stack several for several schedules (give each a
    ``name``: the default is the task's path). ``every_ms`` instead of a cron
    expression runs it at a fixed interval. A bad expression, interval, time
    zone or policy raises at import, with a sentence that says which.
    """

    def decorate(task: _T) -> _T:
        module_path = getattr(task, "module_path", None)
        if not isinstance(module_path, str) or not hasattr(task, "enqueue"):
            raise TypeError("@periodic goes above @task: it schedules a task, not a function.")
        declaration = build(name or module_path, module_path, cron=cron, tz=tz,
                            every_ms=every_ms, args=args, kwargs=kwargs, catch_up=catch_up,
                            queue=queue, backend=str(getattr(task, "backend", "default")))
        with _lock:
            earlier = _declared.setdefault(declaration.name, declaration)
            if earlier != declaration:
                _clashes.setdefault(declaration.name, [earlier]).append(declaration)
        return task

    return decorate


def decorated(backend: str) -> list[Declaration]:
    """The ``@periodic`` declarations of ``backend``'s tasks known to this process."""
    with _lock:
        return [d for d in _declared.values() if d.backend == backend]


def clashes() -> dict[str, list[Declaration]]:
    with _lock:
        return {name: list(found) for name, found in _clashes.items()}


# -- OPTIONS['SCHEDULE'] -----------------------------------------------------


def from_options(raw: object, backend: str) -> tuple[list[Declaration], list[str]]:
    """Parse OPTIONS['SCHEDULE'] ({name: {"task": path, "cron" or "every_ms": ...}}).

    Returns the declarations and a whole-sentence message per bad entry
    (reported as reliable_jobs.E011); a bad entry is left out.
    """
    if not isinstance(raw, dict):
        return [], [f"OPTIONS['SCHEDULE'] must map schedule names to entries, not {raw!r}."]
    found: list[Declaration] = []
    problems: list[str] = []
    for name, entry in raw.items():
        where = f"OPTIONS['SCHEDULE'][{name!r}]"
        if not isinstance(entry, dict):
            problems.append(f"{where} must be a dict with 'task' and 'cron' or 'every_ms'.")
            continue
        unknown = sorted(set(map(str, entry)) - set(ENTRY_KEYS))
        if unknown:
            problems.append(f"{where} has unknown key(s) {', '.join(unknown)}; known keys are "
                            f"{', '.join(ENTRY_KEYS)}.")
            continue
        task_path = entry.get("task")
        if not isinstance(task_path, str) or not task_path:
            problems.append(f"{where} needs 'task', the dotted path of a task.")
            continue
        try:
            found.append(build(
                name, task_path, cron=entry.get("cron"), tz=entry.get("tz", "UTC"),
                every_ms=entry.get("every_ms"), args=entry.get("args", ()),
                kwargs=entry.get("kwargs"), catch_up=entry.get("catch_up", DEFAULT_CATCH_UP),
                queue=entry.get("queue"), backend=backend))
        except TimetableError as exc:
            problems.append(f"{where}: {exc}")
    return found, problems
