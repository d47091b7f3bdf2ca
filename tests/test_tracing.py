"""OpenTelemetry: the enqueue span, the traceparent in the payload, the attempt spans."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from reliable_jobs import payload, telemetry, tracing
from reliable_jobs.compat import task_backends
from reliable_jobs.keys import QueueKeys
from testproject.demo import tasks as demo

from .helpers import REPO, drain_here

pytestmark = [pytest.mark.django_db(transaction=True)]
KEYS = QueueKeys("rj", "default")



@pytest.fixture
def exporter() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture
def provider(exporter: InMemorySpanExporter) -> Iterator[TracerProvider]:
    """An SDK provider of the test's own, which the installed hook uses meanwhile.

    Not the global provider: OpenTelemetry lets that be set once per
    process, and every later test would then make spans and trace fields.
    """
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    assert telemetry.installed(tracing.TracingHook), "the app installs the hook at start-up"
    telemetry.uninstall(tracing.TracingHook)
    telemetry.install(tracing.TracingHook(provider))
    yield provider
    telemetry.uninstall(tracing.TracingHook)
    tracing.install()
    provider.shutdown()


@pytest.fixture
def spans(provider: TracerProvider, exporter: InMemorySpanExporter) -> InMemorySpanExporter:
    """The spans finished during the test, made by the hook through ``provider``."""
    return exporter


@pytest.fixture
def tracer(provider: TracerProvider) -> trace.Tracer:
    """A tracer for the test's own spans (the request around an enqueue)."""
    return provider.get_tracer("test")


def traceparent(span: Any) -> str:
    ctx = span.context
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"


def stored_payload(client: redis.Redis, job_id: str) -> dict[str, Any]:
    return json.loads(client.hget(KEYS.job(job_id), "payload"))  # type: ignore[arg-type]


def test_a_job_span_is_a_child_of_the_request_that_enqueued_it(
    rj_settings: Any, redis_client: redis.Redis, spans: InMemorySpanExporter,
    tracer: trace.Tracer,
) -> None:
    # Given: a request span in which a job that fails once then succeeds is enqueued
    rj_settings()
    with tracer.start_as_current_span("POST /orders") as request:
        result = demo.fail_times.enqueue("traced", 1)
    request_ctx = request.get_span_context()

    # When: a worker in this process runs it to the end
    drain_here()

    # Then: the enqueue span is the request's child, and its context is in the payload
    finished = spans.get_finished_spans()
    (enqueue,) = [s for s in finished if s.name == "enqueue testproject.demo.tasks.fail_times"]
    assert enqueue.kind == SpanKind.PRODUCER
    assert enqueue.parent is not None and enqueue.parent.span_id == request_ctx.span_id
    assert enqueue.context.trace_id == request_ctx.trace_id
    # And: each attempt is a consumer span, a child of the enqueue span, in the same trace
    runs = sorted((s for s in finished if s.name == "run testproject.demo.tasks.fail_times"),
                  key=lambda s: s.attributes["reliable_jobs.attempt"])  # type: ignore[index]
    assert [s.attributes["reliable_jobs.attempt"] for s in runs] == [1, 2]  # type: ignore[index]
    for run in runs:
        assert run.kind == SpanKind.CONSUMER
        assert run.context.trace_id == request_ctx.trace_id
        assert run.parent is not None and run.parent.span_id == enqueue.context.span_id
        assert run.attributes["messaging.message.id"] == result.id  # type: ignore[index]
        assert run.attributes["messaging.destination.name"] == "default"  # type: ignore[index]
    # And: the failed attempt says so
    assert runs[0].status.status_code == StatusCode.ERROR
    assert runs[1].status.status_code != StatusCode.ERROR


def test_the_payload_carries_the_traceparent_of_the_enqueue_span(
    rj_settings: Any, redis_client: redis.Redis, spans: InMemorySpanExporter,
    tracer: trace.Tracer,
) -> None:
    # Given
    rj_settings()

    # When: a job is enqueued under a span, and another with no span around it
    with tracer.start_as_current_span("request"):
        traced = demo.add.enqueue(1, 2)
    plain_trace = stored_payload(redis_client, demo.add.enqueue(3, 4).id).get("trace")

    # Then: the first payload names the enqueue span; the second its own root enqueue span
    (enqueue,) = [s for s in spans.get_finished_spans() if s.name.startswith("enqueue")
                  and s.parent is not None]
    assert stored_payload(redis_client, traced.id)["trace"] == traceparent(enqueue)
    assert payload.is_traceparent(plain_trace)


def test_enqueue_many_makes_one_span_for_the_batch(
    rj_settings: Any, redis_client: redis.Redis, spans: InMemorySpanExporter
) -> None:
    # Given / When
    rj_settings()
    results = task_backends["default"].enqueue_many(demo.add, [((i, 0), {}) for i in range(3)])

    # Then: one span, counting three messages, whose context every payload carries
    (enqueue,) = [s for s in spans.get_finished_spans() if s.name.startswith("enqueue")]
    assert enqueue.attributes["messaging.batch.message_count"] == 3  # type: ignore[index]
    traces = {stored_payload(redis_client, r.id)["trace"] for r in results}
    assert traces == {traceparent(enqueue)}


def test_a_forged_trace_field_is_dropped_and_the_job_still_runs(
    rj_settings: Any, redis_client: redis.Redis, spans: InMemorySpanExporter
) -> None:
    # Given: a job whose payload someone rewrote in Redis with a bogus trace field
    rj_settings()
    result = demo.add.enqueue(2, 2)
    data = stored_payload(redis_client, result.id)
    data["trace"] = "00-" + "0" * 32 + "-" + "1" * 16 + "-01\nX-Injected: yes"
    redis_client.hset(KEYS.job(result.id), "payload", json.dumps(data))
    spans.clear()

    # When
    drain_here()

    # Then: it ran, in a trace of its own
    assert demo.add.get_result(result.id).return_value == 4
    (run,) = [s for s in spans.get_finished_spans() if s.name.startswith("run")]
    assert run.parent is None


@pytest.mark.parametrize("value", [
    None, 7, "", "00-" + "a" * 32 + "-" + "b" * 16 + "-01 ", "01-" + "a" * 32 + "-" + "b" * 16
    + "-01", "00-" + "0" * 32 + "-" + "b" * 16 + "-01", "00-" + "a" * 32 + "-" + "0" * 16 + "-01",
    "00-" + "A" * 32 + "-" + "b" * 16 + "-01",
])
def test_only_a_w3c_traceparent_is_kept(value: Any) -> None:
    # Given: a payload with a trace field that is not a valid traceparent
    text = json.dumps({"task": "a.b", "args": [], "kwargs": {}, "trace": value})

    # When / Then: it decodes, without the field; and encode never writes such a field
    assert payload.decode(text).trace is None
    encoded = payload.encode("a.b", (), {}, max_bytes=1000,
                             trace=value if isinstance(value, str) else None)
    assert "trace" not in json.loads(encoded)


def test_a_valid_traceparent_round_trips() -> None:
    good = "00-" + "a" * 32 + "-" + "b" * 16 + "-01"
    assert payload.decode(payload.encode("a.b", (), {}, max_bytes=1000, trace=good)).trace == good


def test_with_no_tracer_provider_only_a_propagated_trace_is_passed_on(
    rj_settings: Any, redis_client: redis.Redis
) -> None:
    # Given: a fresh process with opentelemetry-api installed but no provider configured
    env = {**rj_settings(), "DJANGO_SETTINGS_MODULE": "testproject.settings"}
    incoming = "00-" + "c" * 32 + "-" + "d" * 16 + "-01"
    code = (
        "import django; django.setup()\n"
        "from opentelemetry import context, trace\n"
        "from opentelemetry.trace.propagation.tracecontext import "
        "TraceContextTextMapPropagator\n"
        "from testproject.demo import tasks\n"
        "with trace.get_tracer('t').start_as_current_span('local'):\n"
        "    print(tasks.add.enqueue(1, 2).id)\n"
        "context.attach(TraceContextTextMapPropagator().extract("
        f"{{'traceparent': '{incoming}'}}))\n"
        "print(tasks.add.enqueue(3, 4).id)\n"
    )

    # When: it enqueues a job inside a span of its own (recording nothing), then
    # one inside a trace that came in from elsewhere (a request's traceparent header)
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, check=True,
                         capture_output=True, text=True, timeout=60).stdout
    local, propagated = out.strip().splitlines()[-2:]

    # Then: the first payload has no trace field; the second passes the incoming one on
    assert "trace" not in stored_payload(redis_client, local)
    assert stored_payload(redis_client, propagated)["trace"] == incoming
