"""The task class of this backend, and the allow-list of runnable tasks.

``@task(max_attempts=5, retry_base_ms=500, timeout_ms=60_000)`` (and the
unique options, ``unique_for_ms=60_000``, the flow limits, ``rate_limit="10/s"``,
``concurrency=2``, ``rate_key=``, ``concurrency_key=``, ``fair_key="account_id"``, and
``debounce_ms=2_000`` with ``max_wait_ms=``) works
because Django's ``task()`` passes extra keyword arguments to the backend's
``task_class``. Every such task registers itself by its import path when it
is created. A worker fills the registry at start-up (:func:`discover` imports
each installed app's ``tasks`` module) and then runs only what
:func:`lookup` allows: a registered task whose function belongs to an
installed app. It never imports a path it read from Redis: payloads are
data, not code, and a path is only ever a dictionary key here.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from django.apps import apps
from django.core.signals import setting_changed
from django.dispatch import receiver
from django.utils.module_loading import autodiscover_modules

from . import debounce, fairness
from .canvas import POLICIES, Signature
from .compat import FairKey, InvalidTask, Task, UniqueBy
from .flow import Limits, check_task_options, task_flow
from .unique import check_options

_registry: dict[str, Task[..., Any]] = {}
#: Paths lookup() already found allowed.
_allowed: dict[str, Task[..., Any]] = {}
_lock = threading.Lock()


@dataclass(frozen=True, slots=True, kw_only=True)
class ReliableTask(Task):  # type: ignore[type-arg]  # generic only in django-stubs
    """A ``django.tasks.Task`` with per-task retry and time limits, and unique jobs.

    Each retry or time option left at None takes the backend's OPTIONS
    default; the unique options have no backend default.
    """

    #: Claims before the job is dead (OPTIONS['MAX_ATTEMPTS']).
    max_attempts: int | None = None
    #: First retry delay in ms, doubling per attempt (OPTIONS['RETRY_BASE_MS']).
    retry_base_ms: int | None = None
    #: Cap on the retry delay in ms (OPTIONS['RETRY_MAX_MS']).
    retry_max_ms: int | None = None
    #: Wall-clock limit per attempt in ms (OPTIONS['TIMEOUT_MS']).
    timeout_ms: int | None = None
    #: For how long (ms, from enqueue or run_after) an equal call returns the
    #: unfinished job instead of enqueueing another; None: every call is a job.
    unique_for_ms: int | None = None
    #: What makes calls equal: a function of the call's arguments, or the
    #: names of the arguments that count (None: all of them). See unique.py.
    unique_by: UniqueBy | None = None
    #: Whether a running job still counts (by default only queued and
    #: scheduled ones do: a call made while the job runs enqueues another).
    unique_while_running: bool = False
    #: At most this many jobs of the task start per period ("100/s", "6000/m",
    #: "10/500ms"), across every worker (see flow.py); None: no rate limit.
    rate_limit: str | None = None
    #: At most this many of its jobs run at once, across every worker.
    concurrency: int | None = None
    #: A function of the call's arguments: each value it returns gets its own
    #: rate limit (per customer, per host); None: one limit for the task.
    rate_key: Callable[..., Any] | None = None
    #: Likewise for the concurrency cap.
    concurrency_key: Callable[..., Any] | None = None
    #: The job's fair group (tenant): the name of one argument, or a function
    #: of the call's arguments returning a str, an int or None (no group).
    #: Groups of one queue and priority take turns (fairness.py).
    fair_key: FairKey | None = None
    #: Ids of the jobs each job of this task waits for (``using(after=...)``):
    #: enqueued as ``waiting``, it is pushed once all of them succeeded.
    after: tuple[str, ...] = ()
    #: Whether those jobs' results come first in its arguments (a list, in ``after``'s order).
    pass_results: bool = False
    #: What it does when one of them ends dead or cancelled: "cancel" or "run" (canvas.py).
    on_failure: str = "cancel"
    #: Equal calls (by the unique key, so unique_for_ms is needed) this close
    #: together in ms make one run, with the last call's arguments, this long
    #: after the last call: each call pushes the run back (debounce.py).
    debounce_ms: int | None = None
    #: While calls keep pushing a debounced run back, it is due at most this
    #: long (ms) after the first of them; None: only debounce_ms decides.
    max_wait_ms: int | None = None

    def __post_init__(self) -> None:
        # Zero-argument super() does not work in a slots dataclass.
        Task.__post_init__(self)
        for name, minimum in (("max_attempts", 1), ("retry_base_ms", 0),
                              ("retry_max_ms", 0), ("timeout_ms", 1), ("unique_for_ms", 1),
                              ("debounce_ms", 1), ("max_wait_ms", 1)):
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or value < minimum
            ):
                raise InvalidTask(f"{name} must be a whole number >= {minimum}, not {value!r}.")
        if isinstance(self.unique_by, list):
            # Frozen dataclasses hash their fields: keep the names as a tuple.
            object.__setattr__(self, "unique_by", tuple(self.unique_by))
        check_options(self)
        debounce.check_options(self)
        problem = check_task_options(self.rate_limit, self.concurrency, self.rate_key,
                                     self.concurrency_key)
        if problem:
            raise InvalidTask(problem)
        fairness.check_options(self)
        if self.on_failure not in POLICIES:
            raise InvalidTask(f"on_failure must be one of {POLICIES}, not {self.on_failure!r}.")
        register(self)

    def using(self, *, after: Iterable[Any] | None = None,
              pass_results: bool | None = None, on_failure: str | None = None,
              **changes: Any) -> ReliableTask:
        """Django's ``using()``, and ``after=[result, ...]``: wait for those jobs first.

        ``after`` takes results (or job ids); ``pass_results=True`` puts
        their return values, as a list, in front of the arguments;
        ``on_failure`` says what happens when one of them ends dead or
        cancelled (see canvas.py).
        """
        task: ReliableTask = Task.using(self, **changes)  # type: ignore[assignment]  # replace(self)
        extra: dict[str, Any] = {}
        if after is not None:
            extra["after"] = tuple(str(getattr(item, "id", item)) for item in after)
        if pass_results is not None:
            extra["pass_results"] = pass_results
        if on_failure is not None:
            extra["on_failure"] = on_failure
        return replace(task, **extra) if extra else task

    def s(self, *args: Any, **kwargs: Any) -> Signature:
        """This task's call with these arguments, for a workflow (``canvas.chain`` ...)."""
        return Signature(self, args, kwargs)


def register(task: Task[..., Any]) -> None:
    """Allow workers to run ``task`` (the first task seen for a path wins)."""
    with _lock:
        _registry.setdefault(task.module_path, task)


def registered() -> list[Task[..., Any]]:
    """Every task registered in this process so far (for system checks)."""
    with _lock:
        return list(_registry.values())


def registered_as(task_path: str) -> Task[..., Any] | None:
    """The task registered for ``task_path`` in this process, or None; imports nothing.

    For reading a task's options (a rebuild's flow limits), never for
    running it: :func:`lookup` decides what a worker may run.
    """
    with _lock:
        return _registry.get(task_path)


def rebuilt_flow(path: str, args: list[Any], kwargs: dict[str, Any], *,
                 overrides: Mapping[str, Limits]) -> str:
    """The flow spec a rebuilt job of ``path`` carries again (see mirror.rebuilt_job).

    The task is looked up in this process's registry (workers and the sweep
    discover every installed app's tasks); an unknown task is rebuilt with
    its OPTIONS['TASK_OPTIONS'] limits (``overrides``) only, and a key
    function that now fails on the call's arguments gives no key limit.
    """
    task = registered_as(path)
    if task is None:
        discover()  # a staff process may not have imported the tasks modules yet
        task = registered_as(path)
    flow = task_flow(task, path, overrides)
    if flow is None:
        return ""
    try:
        return flow.spec(args, kwargs)
    except ValueError:
        return ""


def lookup(task_path: object) -> Task[..., Any] | None:
    """Return the task a worker may run for ``task_path``, or None; imports nothing.

    Allowed: a task registered in this process whose function lives in an
    installed app (``myapp.tasks.send`` for the app ``myapp``). A task that
    some other module happened to define (a library, a script, a test
    module) is refused, like any unknown path.
    """
    if not isinstance(task_path, str):
        return None
    allowed = _allowed.get(task_path)
    if allowed is not None:
        return allowed
    task = _registry.get(task_path)
    if task is None or not apps.ready:
        return None
    module = getattr(task.func, "__module__", None)
    if not isinstance(module, str) or apps.get_containing_app_config(module) is None:
        return None
    # Installed apps do not change while a process runs: remember the answer
    # (get_containing_app_config walks every app, on the worker's hot path).
    _allowed[task_path] = task
    return task


@receiver(setting_changed)
def _forget_allowed(*, setting: str, **kwargs: Any) -> None:
    """Tests may change INSTALLED_APPS: decide again."""
    if setting == "INSTALLED_APPS":
        _allowed.clear()


def discover() -> int:
    """Import every installed app's ``tasks`` module; return how many tasks are known."""
    autodiscover_modules("tasks")
    return len(_registry)
