"""``ReliableJobsBackend``: the ``django.tasks`` backend of reliable_jobs.

The backend is thin: it validates and enqueues (a database row in the
caller's transaction, then a Redis push on commit), and reads results from
the mirror. Running jobs is the worker's business (the ``worker`` package).

Nothing here imports the models (``models``, ``mirror``, ``staff``) at
module level: Django loads this module for ``manage.py check`` even when
``reliable_jobs`` is missing from INSTALLED_APPS, and a model import would
then be a RuntimeError traceback instead of the E009 that says how to fix
it. ``checks`` waits too: importing it registers the app's checks, which
only an installed app may do. Types come from them under TYPE_CHECKING.
"""

from __future__ import annotations

import logging
import random
import uuid
from collections import defaultdict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import fields, replace
from datetime import datetime
from functools import cached_property
from typing import TYPE_CHECKING, Any

from django.apps import apps
from django.conf import settings
from django.core import checks
from django.core.exceptions import ImproperlyConfigured
from django.db import transaction
from django.utils import timezone
from django.utils.module_loading import import_string

from . import conf, payload, telemetry, unique
from .broker import REDIS_ERRORS, Broker, NewJob, epoch_ms
from .compat import (
    BaseTaskBackend,
    InvalidTask,
    Task,
    TaskError,
    TaskResult,
    TaskResultDoesNotExist,
    TaskResultStatus,
    task_enqueued,
)
from .jobids import new_job_id, new_job_ids
from .keys import is_valid_queue_name, shard_queue
from .reachability import ensure_reachable
from .results import ResultStamp, task_result
from .signalwatch import SignalWatch
from .tasks import ReliableTask, lookup

if TYPE_CHECKING:
    from .mirror import NewJobs
    from .models import Attempt, Job
    from .staff import StaffResult

logger = logging.getLogger("reliable_jobs")

#: A job hash's state (see the scripts) as the mirror's JobState value; a
#: 'finished' tombstone is a rebuilt job that succeeded.
REDIS_TO_JOB_STATE = {"queued": "queued", "scheduled": "scheduled", "running": "running",
                      "dead": "dead", "finished": "succeeded", "cancelled": "cancelled"}

#: The status of a job just enqueued, queued or scheduled (``models.TASK_STATUS``).
NEW_JOB_STATUS = TaskResultStatus.READY


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
                      fair_share=self.config.FAIR_SHARE)

    @property
    def database(self) -> str:
        return self.config.DATABASE

    @cached_property
    def _enqueued_watch(self) -> SignalWatch:
        """Whether ``task_enqueued`` sends would be seen (enqueue_many asks once a call)."""
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
        problems = self.problems()
        if problems:
            raise ImproperlyConfigured(
                f"TASKS[{self.alias!r}] is misconfigured: "
                + " ".join(message for _, message in problems)
            )

    # -- per-task settings ---------------------------------------------

    def task_option(self, task: Task[..., Any], name: str) -> Any:
        """A task's own option, or the backend default (``timeout_ms`` -> TIMEOUT_MS)."""
        value = getattr(task, name, None)
        return value if value is not None else getattr(self.config, name.upper())

    # -- enqueue ---------------------------------------------------------

    def enqueue(  # type: ignore[override]  # results are typed per task in the stubs only
            self, task: Task[..., Any], args: Sequence[Any], kwargs: dict[str, Any],
    ) -> TaskResult[..., Any]:
        """Write the job row now and push it to Redis when the transaction commits.

        For a task with ``unique_for_ms``, an equal call's unfinished job
        (see ``unique.py``) is returned instead of a new one.
        """
        with telemetry.hook.enqueue(task.queue_name, task.module_path, 1) as trace:
            return self._enqueue(task, args, kwargs, trace)

    def _enqueue(self, task: Task[..., Any], args: Sequence[Any], kwargs: dict[str, Any],
                 trace: str | None) -> TaskResult[..., Any]:
        self._raise_if_misconfigured()  # first: E009 before any model import
        self.validate_task(task)
        ensure_reachable(task)
        from . import mirror  # not at module level: see the module docstring

        now = timezone.now()
        max_attempts = self.task_option(task, "max_attempts")
        if getattr(task, "unique_for_ms", None) is not None:
            text = payload.encode(task.module_path, tuple(args), dict(kwargs),
                                  max_bytes=self.config.MAX_PAYLOAD_BYTES, trace=trace)
            job = mirror_job(self.alias, task, args, kwargs, max_attempts=max_attempts, now=now,
                             shard=self._pick_shard(task.queue_name))
            new_job = NewJob(str(job.id), text, max_attempts, due_ms=epoch_ms(task.run_after),
                             priority=task.priority)
            return self._enqueue_unique(task, [(job, new_job)], now=now)[0]
        # No model instance: the row goes to the mirror as the texts the
        # payload was made of (as in enqueue_many), the result is built directly.
        args, kwargs = list(args), dict(kwargs)
        text, args_json, kwargs_json = payload.encode_call(
            task.module_path, args, kwargs, max_bytes=self.config.MAX_PAYLOAD_BYTES, trace=trace)
        job_id = new_job_id()
        shard = self._pick_shard(task.queue_name)
        new = self._new_jobs(task, now=now, max_attempts=max_attempts,
                             rows=[(job_id, shard, args_json, kwargs_json)])
        mirror.insert_new_jobs(self.database, new)
        physical = shard_queue(task.queue_name, shard)
        new_job = NewJob(job_id, text, max_attempts, epoch_ms(task.run_after),
                         priority=task.priority)
        transaction.on_commit(lambda: self._push(physical, [new_job]), using=self.database)
        result = task_result(task, job_id=job_id, status=NEW_JOB_STATUS, args=args,
                             kwargs=kwargs, backend=self.alias, enqueued_at=now)
        task_enqueued.send(type(self), task_result=result)
        return result

    def _new_jobs(self, task: Task[..., Any], *, now: datetime, max_attempts: int,
                  rows: Iterable[tuple[str, int, str, str]]) -> NewJobs:
        """The mirror's rows of an enqueue of ``task``: queued, or scheduled when deferred."""
        from . import mirror  # see enqueue()

        return mirror.NewJobs.at(now, backend=self.alias, queue=task.queue_name,
                                 task_path=task.module_path, priority=task.priority,
                                 max_attempts=max_attempts, run_after=task.run_after, rows=rows)

    def enqueue_many(
        self, task: Task[..., Any], calls: Iterable[tuple[Sequence[Any], dict[str, Any]]]
    ) -> list[TaskResult[..., Any]]:
        """Enqueue many calls of one task: one bulk insert, one script call per 1,000.

        Every call is checked like ``enqueue()`` and nothing is written unless
        all pass. The hot path builds no model instance: a call becomes a row
        for the mirror's COPY (text made once by the payload encoder), a
        ``NewJob`` and its ``TaskResult``.
        """
        calls = list(calls)
        with telemetry.hook.enqueue(task.queue_name, task.module_path, len(calls)) as trace:
            return self._enqueue_many(task, calls, trace)

    def _enqueue_many(self, task: Task[..., Any],
                      calls: list[tuple[Sequence[Any], dict[str, Any]]],
                      trace: str | None) -> list[TaskResult[..., Any]]:
        self._raise_if_misconfigured()
        self.validate_task(task)
        ensure_reachable(task)
        from . import mirror  # see enqueue()

        now = timezone.now()
        max_attempts = self.task_option(task, "max_attempts")
        due_ms = epoch_ms(task.run_after)
        if getattr(task, "unique_for_ms", None) is not None:
            made: list[tuple[Job, NewJob]] = []
            for args, kwargs in calls:
                text = payload.encode(task.module_path, tuple(args), dict(kwargs),
                                      max_bytes=self.config.MAX_PAYLOAD_BYTES, trace=trace)
                job = mirror_job(self.alias, task, args, kwargs, max_attempts=max_attempts,
                                 now=now, shard=self._pick_shard(task.queue_name))
                made.append((job, NewJob(str(job.id), text, max_attempts, due_ms=due_ms,
                                         priority=task.priority)))
            return self._enqueue_unique(task, made, now=now)
        encode = payload.CallEncoder(task.module_path, max_bytes=self.config.MAX_PAYLOAD_BYTES,
                                     trace=trace)
        by_shard: dict[str, list[NewJob]] = defaultdict(list)
        results: list[TaskResult[..., Any]] = []
        shards = self.config.SHARDS.get(task.queue_name, 1)
        pushes = by_shard[shard_queue(task.queue_name, 0)]  # every job's, without shards
        priority = task.priority
        new = self._new_jobs(task, now=now, max_attempts=max_attempts, rows=())
        stamp = ResultStamp(task_result(task, job_id="", status=NEW_JOB_STATUS, args=[],
                                        kwargs={}, backend=self.alias, enqueued_at=now))

        def rows() -> Iterator[tuple[str, int, str, str]]:
            # Each call is checked, encoded and given its push and result as
            # the COPY takes its row, so PostgreSQL works through one chunk of
            # rows while the next is made. A call that fails its check stops
            # the COPY, and the transaction rolls back: nothing is written.
            ids = new_job_ids()
            shard = 0
            for call_args, call_kwargs in calls:
                args, kwargs = list(call_args), dict(call_kwargs)
                text, args_json, kwargs_json = encode(args, kwargs)
                job_id = next(ids)
                job = NewJob(job_id, text, max_attempts, due_ms, priority=priority)
                if shards > 1:
                    shard = self._pick_shard(task.queue_name)
                    by_shard[shard_queue(task.queue_name, shard)].append(job)
                else:
                    pushes.append(job)
                results.append(stamp(job_id, args, kwargs))
                yield job_id, shard, args_json, kwargs_json

        with transaction.atomic(using=self.database):
            mirror.insert_new_jobs(self.database, replace(new, rows=rows()))
            self._push_on_commit({queue: jobs for queue, jobs in by_shard.items() if jobs})
        if self._enqueued_watch.observed():
            for result in results:
                task_enqueued.send(type(self), task_result=result)
        return results

    def _enqueue_unique(self, task: Task[..., Any], made: list[tuple[Job, NewJob]], *,
                        now: datetime) -> list[TaskResult[..., Any]]:
        """Enqueue calls of a unique task: each gets its new job, or the unfinished equal one.

        The rows and the check are in the caller's transaction, if any, so a
        rolled-back enqueue frees the key; only jobs that were inserted are
        pushed, on commit, and signalled.
        """
        from . import mirror  # see enqueue()

        assert isinstance(task, ReliableTask)  # unique_for_ms is one of its options
        problem = unique.database_problem(self.database)
        if problem:
            raise InvalidTask(problem)
        for job, _ in made:
            job.unique_key = unique.key_for(task, self.alias, job.args, job.kwargs)
        # No transaction of our own: inside the caller's, everything is in it;
        # outside one, each statement commits by itself, which is enough (the
        # index judges each INSERT, and a stale key given up stays given up),
        # and the push follows the rows' commit.
        holders = mirror.insert_unique_jobs(
            self.database, [job for job, _ in made], window_ms=task.unique_for_ms or 0,
            while_running=task.unique_while_running, now=now,
            states_in_redis=self._states_in_redis)
        by_shard: dict[str, list[NewJob]] = defaultdict(list)
        for (job, new_job), holder in zip(made, holders, strict=True):
            if holder is job:
                by_shard[job.physical_queue].append(new_job)
        if by_shard:
            self._push_on_commit(by_shard)
        results: dict[uuid.UUID, TaskResult[..., Any]] = {}
        for (job, _), holder in zip(made, holders, strict=True):
            if holder.pk not in results:
                results[holder.pk] = self._result(holder, task)
                if holder is job:
                    task_enqueued.send(type(self), task_result=results[holder.pk])
        return [results[holder.pk] for holder in holders]

    def _states_in_redis(self, rows: Sequence[Job]) -> dict[str, str]:
        """Each job's state as Redis has it (a JobState value), by id: ahead of its row.

        A claimed job whose task has not begun is still queued: it runs after
        the call that asks. Jobs Redis does not hold are left out, and so
        is every job when Redis cannot answer: the rows decide then.
        """
        try:
            progress = self.broker.progress([(row.physical_queue, str(row.pk)) for row in rows])
        except REDIS_ERRORS as exc:
            logger.warning("Redis did not say whether %d unique job(s) started (%s); their "
                           "database rows decide.", len(rows), exc)
            return {}
        states = {}
        for job_id, held in progress.items():
            state = REDIS_TO_JOB_STATE.get(held.state)
            if state == "running" and not held.started:
                state = "queued"
            if state is not None:
                states[job_id] = state
        return states

    def _push_on_commit(self, by_shard: dict[str, list[NewJob]]) -> None:
        """Push jobs (by physical queue) once the transaction commits, 1,000 per script call."""

        def push() -> None:
            for physical, new_jobs in by_shard.items():
                for start in range(0, len(new_jobs), 1000):
                    self._push(physical, new_jobs[start:start + 1000])

        transaction.on_commit(push, using=self.database)

    def _pick_shard(self, queue: str) -> int:
        """A random shard of ``queue``: producers spread jobs, workers drain all shards."""
        count = self.config.SHARDS.get(queue, 1)
        return random.randrange(count) if count > 1 else 0

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
        return self._result(job, self._task_for(job), attempts=list(job.attempt_set.all()))

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

    def _result(self, job: Job, task: Task[..., Any],
                attempts: list[Attempt] | None = None) -> TaskResult[..., Any]:
        from .models import FAILED_OUTCOMES

        attempts = attempts or []
        if job.queue != task.queue_name or job.run_after != task.run_after:
            task = _as_enqueued(task, queue_name=job.queue, run_after=job.run_after)
        result = task_result(
            task,
            job_id=str(job.pk),
            status=job.task_status,
            enqueued_at=job.enqueued_at,
            started_at=job.started_at,
            finished_at=job.finished_at,
            last_attempted_at=max((a.started_at for a in attempts if a.started_at), default=None),
            args=list(job.args),
            kwargs=dict(job.kwargs),
            backend=self.alias,
            errors=[
                TaskError(exception_class_path=a.exception_class_path or "builtins.Exception",
                          traceback=a.traceback or a.error)
                for a in attempts if a.outcome in FAILED_OUTCOMES
            ],
            worker_ids=[a.worker_id for a in attempts],
        )
        if result.status == TaskResultStatus.SUCCESSFUL:
            object.__setattr__(result, "_return_value", job.return_value)
        return result

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
        return staff.cancel(self, job_id)

    # -- checks ------------------------------------------------------------

    def check(self, **kwargs: Any) -> list[checks.CheckMessage]:
        from .checks import check_backend  # see the module docstring

        return check_backend(self)




def mirror_job(alias: str, task: Task[..., Any], args: Sequence[Any], kwargs: dict[str, Any], *,
               max_attempts: int, now: datetime, shard: int = 0) -> Job:
    """Build (unsaved) the Job row for one enqueue."""
    from .models import Job, JobState

    deferred = task.run_after is not None and task.run_after > now
    return Job(
        id=uuid.UUID(new_job_id()), backend=alias, queue=task.queue_name, shard=shard,
        task_path=task.module_path,
        args=list(args), kwargs=dict(kwargs), priority=task.priority,
        state=JobState.SCHEDULED if deferred else JobState.QUEUED,
        max_attempts=max_attempts, run_after=task.run_after, enqueued_at=now, updated_at=now,
    )


def _as_enqueued(task: Task[..., Any], *, queue_name: str,
                 run_after: datetime | None) -> Task[..., Any]:
    """Return ``task`` with the queue and run_after a job was enqueued with.

    Not ``task.using()``: that validates against today's settings, so the
    result of a job on a queue since removed from QUEUES could not be read,
    and it cannot set run_after back to None. A stored job is history, not a
    new request, so the copy is made without validating or registering it.
    """
    copy = object.__new__(type(task))
    for f in fields(task):
        object.__setattr__(copy, f.name, getattr(task, f.name))
    object.__setattr__(copy, "queue_name", queue_name)
    object.__setattr__(copy, "run_after", run_after)
    return copy
