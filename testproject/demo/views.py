"""Demo pages: enqueue a job inside a transaction (optionally rolled back) and read it back."""

from __future__ import annotations

from typing import Any

from django.db import transaction
from django.http import Http404, HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import render
from django.urls import reverse
from django.views.decorators.http import require_GET, require_POST

from reliable_jobs.compat import (
    TaskResult,
    TaskResultDoesNotExist,
    TaskResultMismatch,
    TaskResultStatus,
)
from testproject.demo.tasks import add


class _RollBack(Exception):
    """Raised inside the atomic block to undo it on request."""


@require_GET
def index(request: HttpRequest) -> HttpResponse:
    """Show the enqueue form."""
    return render(request, "demo/index.html")


@require_POST
def enqueue(request: HttpRequest) -> JsonResponse:
    """Enqueue ``add(2, 3)`` in a transaction, rolled back when the form asks.

    A rolled-back enqueue shows whether the job left with the transaction or
    escaped it (it must not run).
    """
    rollback = bool(request.POST.get("rollback"))
    try:
        with transaction.atomic():
            job = add.enqueue(2, 3)
            if rollback:
                raise _RollBack
    except _RollBack:
        pass
    return JsonResponse(
        {
            "id": job.id,
            "status": str(job.status),
            "rolled_back": rollback,
            "result_url": reverse("demo:result", args=[job.id]),
        }
    )


@require_GET
def result(request: HttpRequest, result_id: str) -> JsonResponse:
    """Return the state of one ``add`` result as JSON."""
    try:
        job = add.get_result(result_id)
    except (TaskResultDoesNotExist, TaskResultMismatch) as exc:
        raise Http404(f"No add() result with id {result_id!r}.") from exc
    return JsonResponse(describe(job))


def describe(job: TaskResult[Any, Any]) -> dict[str, Any]:
    """Return the JSON-able fields of a result (the return value only once successful)."""
    return {
        "id": job.id,
        "task": job.task.module_path,
        "status": str(job.status),
        "attempts": job.attempts,
        "return_value": job.return_value if job.status == TaskResultStatus.SUCCESSFUL else None,
        "errors": [error.exception_class_path for error in job.errors],
        "enqueued_at": job.enqueued_at,
        "started_at": job.started_at,
        "finished_at": job.finished_at,
    }
