"""``BackendParts``: the few things of a backend that the layers under it need.

The sweep and the staff actions need a backend's alias, settings, queues,
Redis side and per-task options, not the backend: receiving it would make
them import ``backend`` (at least for its type) while ``backend`` imports
them, one import circle. ``backend.parts`` hands them this small frozen
object instead, so imports run one way (see docs/design.md, "Layers").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .broker import Broker
    from .compat import Task
    from .conf import BackendOptions


def task_option(config: BackendOptions, task: Task[..., Any], name: str) -> Any:
    """A task's own option, or the backend default (``timeout_ms`` -> TIMEOUT_MS)."""
    value = getattr(task, name, None)
    return value if value is not None else getattr(config, name.upper())


@dataclass(frozen=True, slots=True)
class BackendParts:
    """One backend's alias, settings, queues and Redis side (``ReliableJobsBackend.parts``)."""

    #: The backend's alias in TASKS, which its jobs' rows carry.
    alias: str
    #: Its parsed OPTIONS.
    config: BackendOptions
    #: The queues it serves (TASKS[alias]['QUEUES']).
    queues: frozenset[str]
    #: Its Redis side.
    broker: Broker
    #: The flow spec a rebuilt job carries again (``tasks.rebuilt_flow`` with
    #: the backend's OPTIONS['TASK_OPTIONS']): (task path, args, kwargs) -> spec.
    flow_of: Callable[[str, list[Any], dict[str, Any]], str] = lambda path, args, kwargs: ""

    def task_option(self, task: Task[..., Any], name: str) -> Any:
        """A task's own option, or this backend's default (see :func:`task_option`)."""
        return task_option(self.config, task, name)
