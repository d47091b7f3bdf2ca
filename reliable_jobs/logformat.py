"""JSON lines for the worker's log: one object per record, for log shippers.

``runworker --log-format json`` (or ``RELIABLE_JOBS_LOG_FORMAT = "json"``)
puts this formatter on the ``reliable_jobs`` logger's handlers (or on one
it adds on stderr). Other processes (a web server, ``recoverjobs``) get it
from ``LOGGING``::

    LOGGING = {
        "version": 1,
        "formatters": {"json": {"()": "reliable_jobs.logformat.JsonLinesFormatter"}},
        "handlers": {"stderr": {"class": "logging.StreamHandler", "formatter": "json"}},
        "loggers": {"reliable_jobs": {"handlers": ["stderr"], "level": "INFO"}},
    }

Every line has ``ts`` (UTC, ISO 8601 with milliseconds), ``level``,
``logger`` and ``message``; a line about an attempt adds the fields the
worker attached (``event: "attempt"``, ``job``, ``task``, ``queue``,
``shard``, ``attempt``, ``max_attempts``, ``outcome``, ``duration_ms``,
``queued_ms``, and for a failure ``error``, ``next``, ``retry_in_ms``). An
exception's traceback, when a record carries one, is one JSON string
(``exc``), so a record is always exactly one line.
"""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from .keys import logical_queue, shard_index
from .models import AttemptOutcome

if TYPE_CHECKING:
    from .broker import ClaimedJob

#: The values of RELIABLE_JOBS_LOG_FORMAT and ``runworker --log-format``.
LOG_FORMATS = ("text", "json")
#: The attribute of a log record that carries an attempt's fields.
FIELDS_ATTRIBUTE = "rj"
#: The text format (``runworker``'s historical one).
TEXT_FORMAT = "%(asctime)s %(levelname)s %(message)s"
#: The logger of the worker's lines (reliable_jobs.worker, as the worker's own).
worker_logger = logging.getLogger("reliable_jobs.worker")


def printable(job_id: str) -> str:
    """A job id read from Redis, fit for a log line: anyone who can write to
    Redis chooses it, and a newline in it would forge a line of its own."""
    return job_id if job_id.isprintable() and len(job_id) <= 100 else repr(job_id[:100])


class JsonLinesFormatter(logging.Formatter):
    """Format each record as one JSON object on one line."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, tz=UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        fields = getattr(record, FIELDS_ATTRIBUTE, None)
        if isinstance(fields, dict):
            line.update(fields)
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        elif record.exc_text:
            line["exc"] = record.exc_text
        return json.dumps(line, ensure_ascii=False, default=str)


def use_json_lines(logger: logging.Logger) -> None:
    """Make ``logger`` (``reliable_jobs``) print JSON lines, whatever LOGGING set up.

    Its own handlers get the JSON formatter; a logger without handlers gets
    one on stderr and stops propagating, so no line is printed twice (once
    as JSON, once by a root handler as text). Other loggers are left alone.
    """
    if not logger.handlers:
        logger.addHandler(logging.StreamHandler(sys.stderr))
        logger.propagate = False
    for handler in logger.handlers:
        handler.setFormatter(JsonLinesFormatter())


def log_attempt(level: int, job: ClaimedJob, task_path: str, outcome: str, duration_ms: float,
                *, error: str = "", retry_in_ms: int | None = None) -> None:
    """The one line per attempt: a sentence, with its fields attached for JSON lines.

    The fields ride on the record as ``rj`` (:class:`JsonLinesFormatter`
    prints them); the sentence says the same for people. Successes are
    logged only from -v 2 (the caller checks first: at thousands of jobs a
    second the line cost a quarter of the drain rate).
    """

    queue = logical_queue(job.queue)
    waited = f"{job.waited_ms} ms in queue" if job.waited_ms >= 0 else "time in queue unknown"
    where = queue if queue == job.queue else f"{queue}, shard {shard_index(job.queue)}"
    fields: dict[str, Any] = {
        "event": "attempt", "job": printable(job.id), "task": task_path, "queue": queue,
        "shard": shard_index(job.queue), "attempt": job.attempt,
        "max_attempts": job.max_attempts, "outcome": outcome,
        "duration_ms": round(duration_ms, 1),
        "queued_ms": job.waited_ms if job.waited_ms >= 0 else None,
    }
    if outcome == AttemptOutcome.SUCCEEDED:
        worker_logger.log(level, "Job %s %s attempt %d/%d succeeded in %.1f ms (queue %s, %s).",
                   fields["job"], task_path, job.attempt, job.max_attempts, duration_ms, where,
                   waited, extra={"rj": fields})
        return
    fields["error"] = error
    if outcome == AttemptOutcome.CANCELLED:
        fields["next"], fields["retry_in_ms"] = "cancelled", None
        worker_logger.log(level, "Job %s %s attempt %d/%d was cancelled after %.1f ms (queue %s, "
                          "%s): %s.", fields["job"], task_path, job.attempt, job.max_attempts,
                          duration_ms, where, waited, error, extra={"rj": fields})
        return
    fields["next"] = "dead" if retry_in_ms is None else "retry"
    fields["retry_in_ms"] = retry_in_ms
    verb = "timed out" if outcome == AttemptOutcome.TIMED_OUT else "failed"
    worker_logger.log(level, "Job %s %s attempt %d/%d %s in %.1f ms (queue %s, %s): %s; %s.",
               fields["job"], task_path, job.attempt, job.max_attempts, verb, duration_ms,
               where, waited, error,
               "dead" if retry_in_ms is None else f"retry in {retry_in_ms} ms",
               extra={"rj": fields})
