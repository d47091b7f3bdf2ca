"""OpenTelemetry spans around enqueue and each attempt (the optional ``otel`` extra).

When ``opentelemetry-api`` can be imported, the app installs
:class:`TracingHook` at start-up (``telemetry.hook``); otherwise nothing
here runs and nothing is imported. Spans go to whatever tracer provider the
project configures (the SDK and an exporter); with none, the API's no-op
tracer makes them cost a few microseconds and carry nothing.

- ``enqueue <task>`` (kind PRODUCER) wraps ``enqueue()`` / ``enqueue_many()``,
  a child of the caller's current span (the request's, say). Its W3C
  ``traceparent`` goes into each job's payload (``payload.encode(trace=)``).
- ``run <task>`` (kind CONSUMER) wraps each attempt's task call, in the
  worker: a child of that enqueue span, so a request's trace shows the jobs
  it started, retries included. Task code that makes spans of its own
  nests them under it. A failure is recorded on the span (status ERROR).

A traceparent read from Redis is used only after ``payload.decode`` checked
its shape, and only to name a parent: it cannot make a worker sample, export
or run anything else.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import TYPE_CHECKING

from . import __version__, telemetry
from .keys import logical_queue

try:
    from opentelemetry import trace
    from opentelemetry.trace import SpanKind
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
except ImportError:
    trace = None  # type: ignore[assignment]

if TYPE_CHECKING:
    from .broker import ClaimedJob

#: ``messaging.system`` of every span, per OpenTelemetry's messaging conventions.
SYSTEM = "reliable_jobs"


def available() -> bool:
    return trace is not None


class TracingHook(telemetry.Hook):
    """Makes the enqueue and attempt spans, and carries the context between them."""

    def __init__(self) -> None:
        self.tracer = trace.get_tracer("reliable_jobs", __version__)
        self.propagator = TraceContextTextMapPropagator()

    def enqueue(self, queue: str, task: str, count: int) -> AbstractContextManager[str | None]:
        return self._enqueue(queue, task, count)

    @contextmanager
    def _enqueue(self, queue: str, task: str, count: int) -> Iterator[str | None]:
        attributes: dict[str, str | int] = {
            "messaging.system": SYSTEM, "messaging.operation.type": "send",
            "messaging.destination.name": queue, "reliable_jobs.task": task}
        if count != 1:
            attributes["messaging.batch.message_count"] = count
        with self.tracer.start_as_current_span(f"enqueue {task}", kind=SpanKind.PRODUCER,
                                               attributes=attributes):
            carrier: dict[str, str] = {}
            self.propagator.inject(carrier)
            yield carrier.get("traceparent")

    def attempt(self, job: ClaimedJob, task: str,
                trace: str | None) -> AbstractContextManager[object]:
        return self._attempt(job, task, trace)

    @contextmanager
    def _attempt(self, job: ClaimedJob, task: str, traceparent: str | None) -> Iterator[None]:
        parent = (self.propagator.extract({"traceparent": traceparent})
                  if traceparent is not None else None)
        with self.tracer.start_as_current_span(
            f"run {task}", context=parent, kind=SpanKind.CONSUMER,
            attributes={"messaging.system": SYSTEM, "messaging.operation.type": "process",
                        "messaging.destination.name": logical_queue(job.queue),
                        "messaging.message.id": job.id, "reliable_jobs.task": task,
                        "reliable_jobs.attempt": job.attempt},
        ):
            yield


def install() -> None:
    """Make spans from now on, if opentelemetry-api is installed (once per process)."""
    if available() and telemetry.installed(TracingHook) is None:
        telemetry.install(TracingHook())
