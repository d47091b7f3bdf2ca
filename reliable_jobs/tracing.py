"""OpenTelemetry spans around enqueue and each attempt (the optional ``otel`` extra).

When ``opentelemetry-api`` can be imported, the app installs
:class:`TracingHook` at start-up (``telemetry.hook``); otherwise nothing
here runs and nothing is imported. Spans go to whatever tracer provider the
project configures (the SDK and an exporter); until one is configured, no
span is made and each event costs one clock read (an enqueue inside a trace
propagated from elsewhere still passes that trace on to its jobs).

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

import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
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
#: While no global provider is configured, how often to look for one, in seconds:
#: a provider set later (in ``wsgi.py``, say) is used from at most this long after.
UNSET_RECHECK_S = 1.0


def available() -> bool:
    return trace is not None


class TracingHook(telemetry.Hook):
    """Makes the enqueue and attempt spans, and carries the context between them."""

    def __init__(self, provider: trace.TracerProvider | None = None) -> None:
        """Use ``provider``, or by default the global one (as configured at each event)."""
        self.propagator = TraceContextTextMapPropagator()
        self._fixed = provider
        self._provider: object = None
        self._tracer: trace.Tracer | None = None
        #: time.monotonic() after which an unset global provider is asked for again.
        self._recheck_at = 0.0

    def _tracer_now(self) -> trace.Tracer | None:
        """The tracer of the configured provider, or None while none is configured.

        The API's own default (a proxy until the SDK's provider is set, or
        the no-op one) would make spans that record nothing, at a few
        microseconds each: without a provider, each event costs one check.
        The provider may be set after start-up (in ``wsgi.py``), so while
        none is, it is looked for again every :data:`UNSET_RECHECK_S`; once
        one is, on each event, and the tracer only when it changed.
        """
        if self._fixed is None and self._tracer is None:
            # Asking the API costs an environment look-up per call while no
            # provider is set (about 1 us, paid by every job): ask at most
            # every UNSET_RECHECK_S until one is.
            now = time.monotonic()
            if now < self._recheck_at:
                return None
            self._recheck_at = now + UNSET_RECHECK_S
        provider = self._fixed or trace.get_tracer_provider()
        if provider is not self._provider:
            self._provider = provider
            unset = isinstance(provider, trace.ProxyTracerProvider | trace.NoOpTracerProvider)
            self._tracer = None if unset else provider.get_tracer("reliable_jobs", __version__)
        return self._tracer

    def enqueue(self, queue: str, task: str, count: int) -> AbstractContextManager[str | None]:
        tracer = self._tracer_now()
        if tracer is not None:
            return self._enqueue(tracer, queue, task, count)
        if not trace.get_current_span().get_span_context().is_valid:
            return telemetry.NOTHING
        # No provider here, but a trace came in (a propagated request): pass
        # it on, so a worker that does trace links its spans to it.
        carrier: dict[str, str] = {}
        self.propagator.inject(carrier)
        return nullcontext(carrier.get("traceparent"))

    @contextmanager
    def _enqueue(self, tracer: trace.Tracer, queue: str, task: str,
                 count: int) -> Iterator[str | None]:
        attributes: dict[str, str | int] = {
            "messaging.system": SYSTEM, "messaging.operation.type": "send",
            "messaging.destination.name": queue, "reliable_jobs.task": task}
        if count != 1:
            attributes["messaging.batch.message_count"] = count
        with tracer.start_as_current_span(f"enqueue {task}", kind=SpanKind.PRODUCER,
                                               attributes=attributes):
            carrier: dict[str, str] = {}
            self.propagator.inject(carrier)
            yield carrier.get("traceparent")

    def attempt(self, job: ClaimedJob, task: str,
                trace: str | None) -> AbstractContextManager[object]:
        tracer = self._tracer_now()
        if tracer is None:
            return telemetry.NOTHING
        return self._attempt(tracer, job, task, trace)

    @contextmanager
    def _attempt(self, tracer: trace.Tracer, job: ClaimedJob, task: str,
                 traceparent: str | None) -> Iterator[None]:
        parent = (self.propagator.extract({"traceparent": traceparent})
                  if traceparent is not None else None)
        with tracer.start_as_current_span(
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
