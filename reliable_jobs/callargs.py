"""A call's arguments by parameter name, for the options computed from a call.

``unique_by`` and ``fair_key`` (and any option that names an argument) read
the same thing: the task's parameters as a caller passes them (the context
parameter of a ``takes_context`` task left out), and one call's arguments
bound to them with defaults filled in. One place binds them, so the two
options can never disagree on what an argument's value is.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from functools import lru_cache
from typing import Any, Protocol

from .compat import InvalidTask

__all__ = ["CalledTask", "bind", "has_extra_keywords", "parameters"]


class CalledTask(Protocol):
    """What this module reads of a task (a ``tasks.ReliableTask``, which it does not import)."""

    @property
    def func(self) -> Callable[..., Any]: ...
    @property
    def takes_context(self) -> bool: ...
    @property
    def module_path(self) -> str: ...


@lru_cache(maxsize=1024)
def _signature(func: Callable[..., Any]) -> inspect.Signature:
    return inspect.signature(func)


def parameters(task: CalledTask) -> dict[str, inspect.Parameter]:
    """The parameters a caller passes (the context parameter left out)."""
    found = dict(_signature(task.func).parameters)
    if task.takes_context and found:
        found.pop(next(iter(found)))
    return found


def has_extra_keywords(task: CalledTask) -> bool:
    """Whether the task takes ``**kwargs`` (so any name may be one of its arguments)."""
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters(task).values())


def bind(task: CalledTask, args: Sequence[Any], kwargs: dict[str, Any], *, purpose: str,
         flatten_extra: bool = False) -> dict[str, Any]:
    """The call's arguments by parameter name, defaults filled in, the context left out.

    ``flatten_extra`` puts the ``**kwargs`` parameter's own names beside the
    others (as a caller wrote them) instead of under the parameter's name.
    A call the task cannot take raises InvalidTask naming ``purpose`` (what
    could not be computed), as the enqueue would otherwise fail later, in
    the worker.
    """
    signature = _signature(task.func)
    try:
        bound = (signature.bind(None, *args, **kwargs) if task.takes_context
                 else signature.bind(*args, **kwargs))
    except TypeError as exc:
        raise InvalidTask(
            f"{task.module_path} cannot be called with these arguments ({exc}), so the "
            f"call's {purpose} cannot be computed.") from None
    bound.apply_defaults()
    arguments = dict(bound.arguments)
    if task.takes_context:
        arguments.pop(next(iter(signature.parameters)))
    if flatten_extra:
        for parameter in signature.parameters.values():
            if parameter.kind is inspect.Parameter.VAR_KEYWORD:
                arguments.update(arguments.pop(parameter.name, {}))
    return arguments
