"""``ReliableJobsBackend``: the ``django.tasks`` backend of reliable_jobs.

The backend is thin: it validates and enqueues (a database row in the
caller's transaction, then a Redis push on commit), and reads results from
the mirror. Running jobs is the worker's business (the ``worker`` package).

Nothing here imports the models (``models``, ``mirror``, ``staff``) at
module level: Django loads this module for ``manage.py check`` even when
``reliable_jobs`` is missing from INSTALLED_APPS, and a model import would
then be a RuntimeError traceback instead of the E009 that says how to fix
it. Types come from them under TYPE_CHECKING. ``backendchecks`` is
imported where it is used: it names this class for its types, and imports
run one way (see docs/design.md, "Layers").
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterable, Sequence
from functools import cached_property, partial
from typing import TYPE_CHECKING, Any, cast

from django.apps import apps
from django.conf import settings
from django.core import checks
from django.core.exceptions import ImproperlyConfigured
from django.utils import timezone
from django.utils.module_loading import import_string

from . import canvas, conf, telemetry
from .broker import REDIS_ERRORS, Broker, NewJob
from .compat import (
    BaseTaskBackend,
    InvalidTask,
    InvalidTaskBackend,
    Task,
    TaskResult,
    TaskResultDoesNotExist,
    task_backends,
    task_enqueued,
)
from .debounce import debounce_of
from .flow import Limits, TaskFlow, task_flow
from .keys import is_valid_queue_name
from .newjobs import Calls, Results, plan, push_on_commit
from .parts import BackendParts, task_option
from .reachability import ensure_reachable
from .results import job_result
from .signalwatch import SignalWatch
from .tasks import ReliableTask, lookup, rebuilt_flow

if TYPE_CHECKING:
    from .mirror import NewRow
    from .mirror.journal import JobProgress
    from .models import Job
    from .staff import StaffResult

logger = logging.getLogger("reliable_jobs")


class ReliableJobsBackend(BaseTaskBackend):
    """Redis lists for speed, the database for durability; see docs/design.md."""

    task_class = ReliableTask
    supports_defer = True
    supports_async_task = True
    supports_get_result = True
    #: Django's -100..100, higher claimed first, FIFO within a priority:
    #: priority 0 stays on the queue's plain list, every other priority in
    #: use has a list of its own (see docs/howto/priorities.md).
    supports_priority = True

    def __init__(self, alias: str, params: dict[str, Any]) -> None:
        super().__init__(alias, params)
        self.config = conf.parse(self.options)

    @cached_property
    def broker(self) -> Broker:
        """The Redis side, connected lazily (importing settings opens nothing)."""
        self._raise_if_misconfigured()
        return Broker(self.config.REDIS_URL, self.config.PREFIX,
                      fair_share=self.config.FAIR_SHARE, fair_weights=self.config.FAIR_WEIGHTS)

    @property
    def database(self) -> str:
        return self.config.DATABASE

    @cached_property
    def parts(self) -> BackendParts:
        """What the sweep and staff actions need of this backend (see ``parts.py``)."""
        return BackendParts(self.alias, self.config, frozenset(self.queues), self.broker,
                            flow_of=partial(rebuilt_flow, overrides=self._task_limits))

    @cached_property
    def _enqueued_watch(self) -> SignalWatch:
        """Whether ``task_enqueued`` sends would be seen (asked once an enqueue)."""
        return SignalWatch(task_enqueued, type(self), level=logging.DEBUG)

    def problems(self) -> list[conf.Problem]:
        """What is wrong with this backend's settings, as (kind, message) pairs.

        OPTIONS alone (``conf.parse``), plus what needs the rest of the
        settings: an unknown DATABASE alias would otherwise surface as a
        ConnectionDoesNotExist from the first enqueue.
        """
        problems = list(self.config.problems)
        if apps.apps_ready and not apps.is_installed("reliable_jobs"):
            # Here, not only in checks: Django runs the task checks only when
            # django.tasks was imported before `check` started, so the first
            # enqueue may be where this is seen, and it must say the fix
            # rather than fail on a model import.
            problems.append((
                conf.ProblemKind.APP_NOT_INSTALLED,
                "'reliable_jobs' is not in INSTALLED_APPS: add it, so that its models and "
                "commands exist.",
            ))
        if self.config.DATABASE not in settings.DATABASES:
            problems.append((
                conf.ProblemKind.UNKNOWN_DATABASE,
                f"OPTIONS['DATABASE'] is {self.config.DATABASE!r}, which is not in DATABASES.",
            ))
        return problems

    def _raise_if_misconfigured(self) -> None:
        if problems := self.problems():
            raise ImproperlyConfigured(f"TASKS[{self.alias!r}] is misconfigured: "
                                       + " ".join(message for _, message in problems))

    # -- per-task settings ---------------------------------------------

    def task_flow(self, task: object, path: str) -> TaskFlow | None:
        """The flow limits of ``task`` (None when unknown to this process), or None."""
        return task_flow(task, path, self._task_limits)

    @cached_property
    def _task_limits(self) -> dict[str, Limits]:
        return self.config.task_limits()

    def task_option(self, task: Task[..., Any], name: str) -> Any:
        """A task's own option, or the backend default (``timeout_ms`` -> TIMEOUT_MS)."""
        return task_option(self.config, task, name)

    # -- enqueue ---------------------------------------------------------

    def enqueue(  # type: ignore[override]  # results are typed per task in the stubs only
            self, task: Task[..., Any], args: Sequence[Any], kwargs: dict[str, Any],
    ) -> TaskResult[..., Any]:
        """Write the job row now and push it to Redis when the transaction commits.

        The bulk enqueue of one call. For a task with ``unique_for_ms``, an
        equal call's unfinished job (see ``unique.py``) is returned instead
        of a new one (a debounced task's takes the call: ``debounce.py``).
        """
        with telemetry.hook.enqueue(task.queue_name, task.module_path, 1) as trace:
            return self._enqueue(task, [(args, kwargs)], trace)[0]

    def enqueue_many(
        self, task: Task[..., Any], calls: Iterable[tuple[Sequence[Any], dict[str, Any]]]
    ) -> list[TaskResult[..., Any]]:
        """Enqueue many calls of one task: one bulk insert, one script call per 1,000.

        Every call is checked like ``enqueue()`` and nothing is written unless
        all pass. The hot path builds no model instance (see ``newjobs``).
        """
        calls = list(calls)
        with telemetry.hook.enqueue(task.queue_name, task.module_path, len(calls)) as trace:
            return self._enqueue(task, calls, trace)

    def _enqueue(self, task: Task[..., Any], calls: Calls, trace: str | None, *,
                 waiting_for: int = 0, workflow_id: str | None = None) -> Results:
        """The one enqueue: rows into the mirror, pushes on commit, results, signals."""
        self._raise_if_misconfigured()  # first: E009 before any model import
        if getattr(task, "after", ()) and not waiting_for:  # it waits for jobs: workflows.py
            return cast(Results, canvas.writer("after")(self, task, calls, trace))
        self.validate_task(task)
        ensure_reachable(task)
        from . import mirror  # not at module level: see the module docstring

        spec, now = debounce_of(task), timezone.now()
        if spec is not None and len(calls) > 1:  # each call debounces the one before it
            return [self._enqueue(task, [call], trace)[0] for call in calls]
        task = spec.task_at(task, now) if spec is not None else task
        build, rule = plan(self.parts, task, calls, now=now, trace=trace, debounce=spec,
                           flow=self.task_flow(task, task.module_path),
                           waiting_for=waiting_for, workflow_id=workflow_id)
        rows: Iterable[NewRow] = build.rows()
        if rule is not None or len(calls) == 1:
            rows = list(rows)  # every call checked (and keyed) before the first write
        held = mirror.insert_jobs(self.database, build.new_jobs(rows), unique=rule)
        results, fresh = build.settle(held, lambda job: job_result(job, task, backend=self.alias))
        push = spec.push(self.broker) if spec else self._push
        push_on_commit(push, self.database, build.pushes_of(fresh))
        if fresh and self._enqueued_watch.observed():
            for result in fresh:
                task_enqueued.send(type(self), task_result=result)
        return results

    def _push(self, queue: str, jobs: list[NewJob]) -> None:
        """Push committed jobs; if Redis is down the sweep's reconcile pushes them (G5)."""
        try:
            self.broker.enqueue(queue, jobs)
        except Exception as exc:
            logger.warning(
                "Redis refused the push of %d job(s) to queue %r (%s); they are safe in the "
                "database and the recovery sweep will push them.", len(jobs), queue, exc,
                exc_info=not isinstance(exc, REDIS_ERRORS),
            )

    def validate_task(self, task: Task[..., Any]) -> None:
        super().validate_task(task)
        if not is_valid_queue_name(task.queue_name):
            raise InvalidTask(
                f"Queue name {task.queue_name!r} cannot be used in Redis keys: use 1 to 100 "
                "letters, digits, '.', '_' or '-'."
            )

    # -- results ---------------------------------------------------------

    def get_result(self, result_id: str) -> TaskResult[..., Any]:
        from .models import Job

        try:
            job = Job.objects.using(self.database).get(pk=uuid.UUID(str(result_id)),
                                                        backend=self.alias)
        except (ValueError, Job.DoesNotExist):
            raise TaskResultDoesNotExist(result_id) from None
        return job_result(job, self._task_for(job), backend=self.alias,
                          attempts=list(job.attempt_set.all()))

    def get_progress(self, result_id: str) -> JobProgress:
        """What a job's task last reported (context.progress(), checkpoint()): mirror/journal."""
        from .mirror.journal import progress_of

        return progress_of(self.database, result_id, backend=self.alias)

    def _task_for(self, job: Job) -> Task[..., Any]:
        task = lookup(job.task_path)
        if task is None:
            # The path comes from our own table, written by enqueue(); it is
            # still resolved only to an existing Task object.
            try:
                task = import_string(job.task_path)
            except ImportError:
                task = None
        if not isinstance(task, Task):
            raise TaskResultDoesNotExist(
                f"Job {job.pk} names {job.task_path!r}, which is no longer a task."
            )
        return task

    # -- cancel ------------------------------------------------------------

    def cancel(self, result_id: str) -> StaffResult:
        """Cancel an unfinished job, whatever its state: see ``staff.cancel``.

        Returns a ``staff.StaffResult``: ``done`` says whether it was cancelled
        (False when it had already finished, or Redis does not hold it yet),
        ``message`` why, as a sentence. Raises ``TaskResultDoesNotExist``
        for an id this backend never enqueued.
        """
        from . import staff
        from .models import Job

        try:
            job_id = uuid.UUID(str(result_id))
        except ValueError:
            raise TaskResultDoesNotExist(result_id) from None
        if not Job.objects.using(self.database).filter(pk=job_id, backend=self.alias).exists():
            raise TaskResultDoesNotExist(result_id)
        return staff.cancel(self.parts, job_id)

    # -- checks ------------------------------------------------------------

    def check(self, **kwargs: Any) -> list[checks.CheckMessage]:
        from .backendchecks import check_backend  # see the module docstring

        return check_backend(self)


class BackendNotFound(LookupError):
    """TASKS has no reliable_jobs backend of that alias; the message says which way it is not."""


def find_backend(alias: str) -> ReliableJobsBackend:
    """The reliable_jobs backend ``TASKS[alias]``: the one look-up every caller goes through."""
    try:
        backend = task_backends[alias]
    except InvalidTaskBackend as exc:
        raise BackendNotFound(f"There is no task backend {alias!r} in TASKS ({exc}).") from None
    if not isinstance(backend, ReliableJobsBackend):
        raise BackendNotFound(
            f"TASKS[{alias!r}] uses {type(backend).__name__}, not ReliableJobsBackend.")
    return backend


def reliable_backends() -> list[ReliableJobsBackend]:
    """Every configured backend that is a reliable_jobs backend."""
    return [b for b in task_backends.all() if isinstance(b, ReliableJobsBackend)]
