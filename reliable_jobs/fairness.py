"""Fair shares: which tenant (fair group) a job belongs to, and the groups' weights.

A task with ``fair_key`` gives each job a *fair group*: the value of one of
the call's arguments (``fair_key="account_id"``) or what a function of the
call's arguments returns (``fair_key=lambda account_id, **_: account_id``).
Within a queue and a priority the claim takes the groups in turn (weighted
round robin, see scripts/claim.lua), so one group's backlog never holds
back another's jobs for longer than one turn of every group waiting. The
group is stored on the job's row (``Job.fair_key``) so a rebuild from the
mirror puts the job back in its group.

A group is a short name: it becomes part of a Redis key and of the
weights claim.lua parses, hence the narrow alphabet of
:data:`~reliable_jobs.keys.FAIR_GROUP_RE`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

from . import callargs
from .compat import FairKey, InvalidTask
from .keys import FAIR_GROUP_RE

__all__ = ["FairKey", "FairTask", "as_group", "check_options", "group_for"]


class FairTask(Protocol):
    """What this module reads of a task (a ``ReliableTask``)."""

    @property
    def fair_key(self) -> FairKey | None: ...
    @property
    def func(self) -> Callable[..., Any]: ...
    @property
    def takes_context(self) -> bool: ...
    @property
    def module_path(self) -> str: ...


def check_options(task: FairTask) -> None:
    """Raise InvalidTask, with the fix, for a ``fair_key`` that cannot work."""
    fair_key = task.fair_key
    if fair_key is None or callable(fair_key):
        return
    if not isinstance(fair_key, str) or not fair_key:
        raise InvalidTask(
            f"fair_key must be a function of the call's arguments or the name of one "
            f"argument, not {fair_key!r}.")
    parameters = callargs.parameters(task)
    if fair_key not in parameters and not callargs.has_extra_keywords(task):
        raise InvalidTask(
            f"fair_key names {fair_key!r}, which is not an argument of "
            f"{task.func.__qualname__}() (it takes {', '.join(parameters) or 'none'}).")


def group_for(task: FairTask, args: Sequence[Any], kwargs: dict[str, Any]) -> str:
    """The fair group of one call of ``task``: '' when it has none.

    A key of None means no group (the job waits with the others of no
    group, which take one turn together); an integer is written in decimal.
    """
    fair_key = task.fair_key
    if fair_key is None:
        return ""
    if callable(fair_key):
        try:
            value = fair_key(*args, **kwargs)
        except TypeError as exc:
            raise InvalidTask(
                f"The fair_key function of {task.module_path} cannot be called with these "
                f"arguments ({exc}).") from None
    else:
        arguments = callargs.bind(task, args, kwargs, purpose="fair group", flatten_extra=True)
        value = arguments.get(fair_key)
    return as_group(value, task.module_path)


def as_group(value: object, where: str) -> str:
    """``value`` as a fair group ('' for None), or InvalidTask saying why it is not one."""
    if value is None:
        return ""
    if isinstance(value, int) and not isinstance(value, bool):
        value = str(value)
    if not isinstance(value, str) or not FAIR_GROUP_RE.fullmatch(value):
        raise InvalidTask(
            f"The fair key of {where} is {value!r}: a fair group must be a whole number or "
            "1 to 100 letters, digits, '.', '_', ':', '@' or '-' (or None for no group).")
    return value
