"""Workflow builders: ``chain``, ``group``, ``chord`` and ``DAG`` of task calls, as plain data.

A :class:`Signature` is one call not enqueued yet (``task.s(*args,
**kwargs)``); the builders combine them, and ``.enqueue()`` hands the whole
graph to the task's backend, which writes every job and every dependency
in one transaction (``workflows.py``). Nothing here touches Redis or the
database: a builder only says which call waits for which.

Results travel only when asked: a signature made ``.with_results()``
receives, as its first argument, the return value of the one job it waits
for, or the list of the return values of the jobs it waits for (a group's,
in the group's order). What a dependent does when a job it waits for ends
dead or cancelled is its ``on_failure`` policy: ``"cancel"`` (the default:
it is cancelled, and so, in turn, are the jobs that wait for it) or
``"run"`` (it runs once every job it waits for has ended; a failed one's
place in its results holds ``{"failed": state, "job": id, "error": ...}``)
or ``"only"`` (a callback on failure: it runs as soon as the first job it
waits for fails, and is cancelled as not needed when they all succeed).
:func:`batch` puts the three kinds of callback on a group.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from .compat import InvalidTask, Task, task_backends

#: How workflows are written: ``"plan"`` (a compiled workflow) and ``"after"``
#: (``task.using(after=...)`` calls), each taking the backend first. Set when
#: the app is ready (apps.py) from workflows.py, a layer above this module.
ENQUEUE: dict[str, Callable[..., Any]] = {}

#: The on_failure policies (models.OnFailure's values).
POLICIES = ("cancel", "run", "only")
#: How an upstream's result reaches its dependent (models.PassResult's values).
PASS_NO, PASS_VALUE, PASS_LIST = 0, 1, 2


@dataclass(frozen=True, slots=True)
class Signature:
    """One call of a task, to be enqueued as part of a workflow."""

    task: Task[..., Any]
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    #: Whether the results of the jobs it waits for come first in its arguments.
    results: bool = False
    #: What it does when a job it waits for ends dead or cancelled.
    on_failure: str = "cancel"

    def with_results(self) -> Signature:
        """This call, receiving what the jobs it waits for returned as its first argument."""
        return replace(self, results=True)

    def if_failed(self, policy: str) -> Signature:
        """This call, with ``policy`` (``"cancel"``, ``"run"`` or ``"only"``) for a failed
        upstream."""
        if policy not in POLICIES:
            raise InvalidTask(f"on_failure must be one of {POLICIES}, not {policy!r}.")
        return replace(self, on_failure=policy)

    def enqueue(self, *, name: str = "") -> WorkflowHandle:
        """Enqueue this call alone, as a workflow of one job."""
        return _enqueue(self, name)


@dataclass(frozen=True, slots=True)
class Node:
    """One job of a compiled workflow: its call and what it waits for.

    ``waits`` holds (index of the upstream node, how its result passes,
    its place in the list).
    """

    call: Signature
    waits: tuple[tuple[int, int, int], ...] = ()


@dataclass(slots=True)
class Plan:
    """A workflow compiled into nodes in dependency order (upstreams first)."""

    nodes: list[Node] = field(default_factory=list)

    def add(self, part: Part, after: Sequence[int], passes: int) -> list[int]:
        """Append ``part``, each of its first jobs waiting for ``after``; its last jobs."""
        if isinstance(part, Signature):
            mode = PASS_NO if not part.results else passes
            waits = tuple((upstream, mode, position) for position, upstream in enumerate(after))
            self.nodes.append(Node(part, waits))
            return [len(self.nodes) - 1]
        if isinstance(part, Group):
            tails: list[int] = []
            for member in part.parts:
                tails.extend(self.add(member, after, passes))
            return tails
        if isinstance(part, Chain):
            tails, previous = list(after), None
            for step in part.parts:
                # A step after one call gets its value; after a group, the list.
                mode = (passes if previous is None
                        else PASS_VALUE if isinstance(previous, Signature) else PASS_LIST)
                tails, previous = self.add(step, tails, mode), step
            return tails
        raise InvalidTask(f"A workflow is made of task.s(...) calls, chains and groups, "
                          f"not {type(part).__name__}.")


@dataclass(frozen=True, slots=True)
class Chain:
    """Parts run one after the other: each waits for every last job of the one before."""

    parts: tuple[Part, ...]

    def enqueue(self, *, name: str = "") -> WorkflowHandle:
        """Enqueue every job of the chain in one transaction."""
        return _enqueue(self, name)


@dataclass(frozen=True, slots=True)
class Group:
    """Parts that run side by side; what follows a group waits for all of them."""

    parts: tuple[Part, ...]

    def enqueue(self, *, name: str = "") -> WorkflowHandle:
        """Enqueue every job of the group in one transaction."""
        return _enqueue(self, name)


Part = Signature | Chain | Group


def chain(*parts: Part) -> Chain:
    """``a`` then ``b`` then ...: ``chain(a.s(1), b.s().with_results())``."""
    if not parts:
        raise InvalidTask("A chain needs at least one part.")
    return Chain(tuple(parts))


def group(*parts: Part) -> Group:
    """Parts that run side by side (``group(*(a.s(i) for i in range(10)))``)."""
    if not parts:
        raise InvalidTask("A group needs at least one part.")
    return Group(tuple(parts))


def chord(header: Group | Sequence[Part], callback: Signature) -> Chain:
    """``callback`` once every part of ``header`` has succeeded: exactly once, never early."""
    members = header if isinstance(header, Group) else group(*header)
    return Chain((members, callback))


def batch(members: Group | Sequence[Part], *, on_success: Signature | None = None,
          on_complete: Signature | None = None, on_death: Signature | None = None) -> Chain:
    """A group with callbacks, each waiting for every member (a chord with up to three).

    - ``on_success`` runs once every member succeeded (a chord's callback;
      cancelled if one ends dead or cancelled);
    - ``on_complete`` runs once every member has ended, whatever the outcome
      (policy ``"run"``);
    - ``on_death`` runs as soon as the first member ends dead or cancelled,
      once, and is cancelled as not needed if every member succeeds (policy
      ``"only"``).

    Which runs is decided by the database, in the transaction of the write
    that settles it (``mirror/dependencies.py``). The callbacks' results come
    after the members', in the order given here.
    """
    given = {"cancel": on_success, "run": on_complete, "only": on_death}
    if not any(call is not None for call in given.values()):
        raise InvalidTask("A batch needs at least one callback: on_success, on_complete or "
                          "on_death (a group alone is a batch without callbacks).")
    if not all(call is None or isinstance(call, Signature) for call in given.values()):
        raise InvalidTask("A batch's callbacks are task.s(...) calls.")
    callbacks = [call.if_failed(policy) for policy, call in given.items() if call is not None]
    members = members if isinstance(members, Group) else group(*members)
    return Chain((members, callbacks[0] if len(callbacks) == 1 else Group(tuple(callbacks))))


class DAG:
    """Any acyclic graph, by hand: each call added after the calls it waits for.

    ``dag.add(call, after=[i, j])`` returns the new call's index; ``after``
    names calls added before it, so the graph cannot hold a cycle. A call
    made ``.with_results()`` receives the list of its upstreams' results,
    in ``after``'s order.
    """

    def __init__(self) -> None:
        self.nodes: list[Node] = []

    def add(self, call: Signature, after: Sequence[int] = ()) -> int:
        """Add ``call``, waiting for the calls at indexes ``after``; its index."""
        if not isinstance(call, Signature):
            raise InvalidTask("A DAG is made of task.s(...) calls.")
        for upstream in after:
            if not 0 <= upstream < len(self.nodes):
                raise InvalidTask(f"after= names call {upstream}, which was not added before.")
        mode = PASS_LIST if call.results else PASS_NO
        self.nodes.append(Node(call, tuple(
            (upstream, mode, position) for position, upstream in enumerate(dict.fromkeys(after)))))
        return len(self.nodes) - 1

    def enqueue(self, *, name: str = "") -> WorkflowHandle:
        """Enqueue every job of the graph in one transaction (results in ``add`` order)."""
        return _enqueue(self, name)


def compile_plan(part: Part | DAG) -> Plan:
    """The nodes of ``part``, upstreams before the jobs that wait for them."""
    if isinstance(part, DAG):
        if not part.nodes:
            raise InvalidTask("A workflow needs at least one job.")
        return Plan(list(part.nodes))
    plan = Plan()
    plan.add(part, [], PASS_LIST)
    if not plan.nodes:
        raise InvalidTask("A workflow needs at least one job.")
    return plan


@dataclass(frozen=True, slots=True)
class WorkflowHandle:
    """What enqueueing a workflow returns: its id and each job's result, in node order."""

    id: str
    results: list[Any]

    @property
    def last(self) -> Any:
        """The result of the workflow's last job (a chord's callback, a chain's last step)."""
        return self.results[-1]


def _enqueue(part: Part | DAG, name: str) -> WorkflowHandle:
    """Compile ``part`` and give it to the backend of its first task."""
    plan = compile_plan(part)
    backend = task_backends[plan.nodes[0].call.task.backend]
    if not hasattr(backend, "parts"):
        raise InvalidTask(f"Backend {backend.alias!r} cannot enqueue workflows: use "
                          "reliable_jobs' backend, with 'reliable_jobs' in INSTALLED_APPS.")
    result: WorkflowHandle = writer("plan")(backend, plan, name=name)
    return result


def writer(kind: str) -> Callable[..., Any]:
    """The workflow writer ``kind`` of :data:`ENQUEUE`, or InvalidTask saying what is missing."""
    try:
        return ENQUEUE[kind]
    except KeyError:
        raise InvalidTask("Jobs that wait for others (workflows, after=) need 'reliable_jobs' "
                          "in INSTALLED_APPS: its app config registers how they are "
                          "written.") from None
