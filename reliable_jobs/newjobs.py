"""The one builder of an enqueue: each call becomes a mirror row, a push and a result.

A single enqueue is the bulk enqueue of one call (procrastinate's shape), so
a new job is made in one place: here. The rows go to ``mirror.insert_jobs``
(which picks the statement); the pushes wait for the commit; the results
are what ``enqueue`` and ``enqueue_many`` return. No model is imported: the
row is the texts the payload was made of.
"""

from __future__ import annotations

import random
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any

from django.db import transaction

from . import fairness, payload, unique
from .broker import Broker, NewJob, epoch_ms
from .compat import InvalidTask, Task, TaskResult, TaskResultStatus
from .jobids import BATCH, new_job_ids
from .keys import shard_queue
from .results import ResultStamp, task_result
from .tasks import ReliableTask

if TYPE_CHECKING:
    from .debounce import Debounce
    from .flow import TaskFlow
    from .mirror import Absorb, UniqueRule
    from .mirror.records import NewJobs, NewRow
    from .models import Job
    from .parts import BackendParts

#: The status of a job just enqueued, queued or scheduled (``models.TASK_STATUS``).
NEW_JOB_STATUS = TaskResultStatus.READY

#: Calls of one task, as ``enqueue_many`` takes them.
Calls = Sequence[tuple[Sequence[Any], dict[str, Any]]]

#: What an enqueue returns: one result per call, in the calls' order.
type Results = list[TaskResult[..., Any]]

#: Jobs one push script call takes at most.
PUSH_CHUNK = 1000


def _checked(flow: TaskFlow) -> Callable[[list[Any], dict[str, Any]], str]:
    """``flow.spec``, its ValueError (a key that is not JSON) an InvalidTask for the caller."""
    def spec(args: list[Any], kwargs: dict[str, Any]) -> str:
        try:
            return flow.spec(args, kwargs)
        except ValueError as exc:
            raise InvalidTask(str(exc)) from None
    return spec


class NewJobsBuilder:
    """Makes the rows, pushes and results of one enqueue of ``task``'s ``calls``.

    ``rows()`` is read once, by the mirror's insert: each call is checked,
    encoded and given its push and result as its row is taken, so
    PostgreSQL works through one chunk of a COPY while the next is made. A
    call that fails its check stops the insert, which rolls back: nothing
    is written and nothing is pushed (pushes wait for the commit).
    """

    def __init__(self, task: Task[..., Any], calls: Calls, *, alias: str, now: datetime,
                 max_attempts: int, max_bytes: int, shards: int, trace: str | None,
                 keyed: bool, flow: TaskFlow | None = None, waiting_for: int = 0,
                 workflow_id: str | None = None) -> None:
        self.task, self.calls, self.alias, self.now = task, calls, alias, now
        #: Dependencies each job waits for (workflows): such jobs are not pushed.
        self.waiting_for, self.workflow_id = waiting_for, workflow_id
        self.max_attempts, self.shards, self.keyed = max_attempts, shards, keyed
        self.encode = payload.CallEncoder(task.module_path, max_bytes=max_bytes, trace=trace,
                                          flow=_checked(flow) if flow is not None else None)
        #: The jobs to push once the rows commit, by physical queue (shard).
        self.pushes: dict[str, list[NewJob]] = defaultdict(list)
        #: Each call's result, in the calls' order.
        self.results: list[TaskResult[..., Any]] = []
        #: Each call's unique key, in the calls' order (``keyed`` only).
        self.keys: list[str] = []

    def new_jobs(self, rows: Iterable[NewRow]) -> NewJobs:
        """The mirror's form of this enqueue, its rows ``rows`` (made by :meth:`rows`)."""
        from .mirror.records import NewJobs  # not at module level: see backend's docstring

        task = self.task
        return NewJobs.at(self.now, backend=self.alias, queue=task.queue_name,
                          task_path=task.module_path, priority=task.priority,
                          max_attempts=self.max_attempts, run_after=task.run_after, rows=rows,
                          waiting_for=self.waiting_for, workflow_id=self.workflow_id)

    def rows(self) -> Iterator[NewRow]:
        """Each call's row (see NewRow), its push and result recorded as it is made."""
        task, max_attempts, priority = self.task, self.max_attempts, self.task.priority
        due_ms, shards, encode = epoch_ms(task.run_after), self.shards, self.encode
        keyed, results, keys = self.keyed, self.results, self.keys
        fair = getattr(task, "fair_key", None) is not None
        # The first result is built whole and is the template of the others
        # (see ResultStamp); a single enqueue builds just that one.
        stamp: ResultStamp | None = None
        many = len(self.calls) > 1
        ids = new_job_ids(max(1, min(len(self.calls), BATCH)))
        pushes = self.pushes[shard_queue(task.queue_name, 0)]  # every job's, without shards
        shard, key, group = 0, None, ""
        for call_args, call_kwargs in self.calls:
            args, kwargs = list(call_args), dict(call_kwargs)
            text, args_json, kwargs_json = encode(args, kwargs)
            if keyed:
                key = unique.key_for(task, self.alias, args, kwargs)  # type: ignore[arg-type]  # keyed: a ReliableTask
                keys.append(key)
            if fair:
                group = fairness.group_for(task, args, kwargs)  # type: ignore[arg-type]  # fair: a ReliableTask
            job_id = next(ids)
            job = NewJob(job_id, text, max_attempts, due_ms, priority=priority, group=group)
            if shards > 1:
                shard = random.randrange(shards)  # producers spread jobs, workers drain all
                self.pushes[shard_queue(task.queue_name, shard)].append(job)
            else:
                pushes.append(job)
            if stamp is not None:
                results.append(stamp(job_id, args, kwargs))
            else:
                results.append(task_result(
                    task, job_id=job_id, status=NEW_JOB_STATUS, args=args, kwargs=kwargs,
                    backend=self.alias, enqueued_at=self.now))
                stamp = ResultStamp(results[0]) if many else None
            yield job_id, shard, args_json, kwargs_json, key, group

    def settle(self, held: Mapping[str, Job], result_of: Callable[[Job], TaskResult[..., Any]],
               ) -> tuple[list[TaskResult[..., Any]], list[TaskResult[..., Any]]]:
        """Each call's result, and the results of the jobs inserted (to push and signal).

        ``held`` is the mirror's answer: the unfinished job holding a key,
        by key, for the calls whose key another job holds (they get that
        job's result, ``result_of`` it). Equal calls of one enqueue share
        the first one's job, which was inserted. One result per job, so
        equal calls get the same object. Without keys every job is new.
        """
        if not self.keyed:
            return self.results, self.results
        by_key: dict[str, TaskResult[..., Any]] = {}
        fresh: list[TaskResult[..., Any]] = []
        for key, result in zip(self.keys, self.results, strict=True):
            if key not in by_key:
                holder = held.get(key)
                by_key[key] = result if holder is None else result_of(holder)
                if holder is None:
                    fresh.append(result)
        return [by_key[key] for key in self.keys], fresh

    def job(self, job_id: str) -> NewJob:
        """The push made for the call whose job id is ``job_id`` (a debounced call's payload)."""
        return next(job for jobs in self.pushes.values() for job in jobs if job.id == job_id)

    def pushes_of(self, results: Sequence[TaskResult[..., Any]]) -> dict[str, list[NewJob]]:
        """The pushes of the jobs whose ``results`` are given (those inserted), by queue.

        None for waiting jobs: the write that settles their last dependency
        makes them runnable and has them pushed (mirror/dependencies.py).
        """
        if self.waiting_for:
            return {}
        if results is self.results:
            return {queue: jobs for queue, jobs in self.pushes.items() if jobs}
        inserted = {result.id for result in results}
        kept = {queue: [job for job in jobs if job.id in inserted]
                for queue, jobs in self.pushes.items()}
        return {queue: jobs for queue, jobs in kept.items() if jobs}


def plan(parts: BackendParts, task: Task[..., Any], calls: Calls, *, now: datetime,
         trace: str | None, flow: TaskFlow | None, debounce: Debounce | None,
         waiting_for: int = 0, workflow_id: str | None = None,
         ) -> tuple[NewJobsBuilder, UniqueRule | None]:
    """The builder of one enqueue of ``task``'s ``calls`` on the backend ``parts``, and
    how its calls' unique keys are judged (a debounced task's: see debounce.py).

    ``waiting_for`` and ``workflow_id`` are a workflow's (workflows.py): jobs
    that wait for that many others, enqueued as ``waiting``.
    """
    config = parts.config
    build = NewJobsBuilder(
        task, calls, alias=parts.alias, now=now, trace=trace,
        max_attempts=parts.task_option(task, "max_attempts"),
        keyed=getattr(task, "unique_for_ms", None) is not None,
        max_bytes=config.MAX_PAYLOAD_BYTES, shards=config.SHARDS.get(task.queue_name, 1),
        flow=flow, waiting_for=waiting_for, workflow_id=workflow_id)
    absorb = debounce.absorb(parts.broker, build.job) if debounce is not None else None
    return build, unique_rule(task, config.DATABASE, parts.broker, absorb=absorb)


def unique_rule(task: Task[..., Any], database: str, broker: Broker, *,
                absorb: Absorb | None = None) -> UniqueRule | None:
    """How a unique task's calls are judged (None for another task), or InvalidTask.

    ``absorb`` is a debounced task's (see debounce.py): an equal call goes
    to the key's holder only if the holder takes it.
    """
    if getattr(task, "unique_for_ms", None) is None:
        return None
    from .mirror import UniqueRule  # not at module level: see backend's docstring

    assert isinstance(task, ReliableTask)  # unique_for_ms is one of its options
    problem = unique.database_problem(database)
    if problem:
        raise InvalidTask(problem)
    return UniqueRule(window_ms=task.unique_for_ms or 0, while_running=task.unique_while_running,
                      states_in_redis=lambda rows: unique.states_in_redis(broker, rows),
                      absorb=absorb)


def push_on_commit(push: Callable[[str, list[NewJob]], None], database: str,
                   by_shard: dict[str, list[NewJob]]) -> None:
    """Call ``push`` for the jobs (by physical queue) once the transaction commits, in chunks."""
    if not by_shard:
        return

    def on_commit() -> None:
        for physical, new_jobs in by_shard.items():
            for start in range(0, len(new_jobs), PUSH_CHUNK):
                push(physical, new_jobs[start:start + PUSH_CHUNK])

    transaction.on_commit(on_commit, using=database)
