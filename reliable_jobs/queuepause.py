"""The admin's pause and resume buttons: one POST view on the jobs dashboard.

Gated by its own permission (``reliable_jobs.pause_queue``, "Can pause and
resume queues"), checked again here whatever the page showed; the work goes
through the backend (pausing.py), never a raw write. The result is one
admin message, a whole sentence, and the browser goes back to the dashboard.
"""

from __future__ import annotations

from typing import Any

from django.contrib import messages
from django.core.exceptions import PermissionDenied
from django.db import DatabaseError
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseNotAllowed
from django.shortcuts import redirect

from . import changelist, pausing
from .broker import REDIS_ERRORS
from .pausing import UnknownQueue

#: The permission the buttons need (models.QueuePause.Meta.permissions).
PAUSE_PERMISSION = "reliable_jobs.pause_queue"


def url_name(opts: Any) -> str:
    """The URL name of the view, under the job admin's names."""
    return f"{opts.app_label}_{opts.model_name}_pause"


def may_pause(request: HttpRequest) -> bool:
    return bool(request.user.has_perm(PAUSE_PERMISSION))


def pause_view(model_admin: Any, request: HttpRequest, alias: str) -> HttpResponse:
    """Pause (``action=pause``) or resume (``action=resume``) the queue ``queue`` of ``alias``."""
    if request.method != "POST":
        return HttpResponseNotAllowed(["POST"])
    if not may_pause(request):
        raise PermissionDenied
    if alias not in changelist.reliable_backends():
        raise Http404(f"There is no reliable_jobs backend {alias!r} in TASKS.")
    backend = changelist.reliable_backend(alias)
    queue, action = request.POST.get("queue", ""), request.POST.get("action", "")
    back = redirect(f"{model_admin.admin_site.name}:{dashboard_name(model_admin)}", alias)
    try:
        if action == "pause":
            done = pausing.pause(backend.parts, queue, by=request.user.get_username())
            messages.success(request, f"Paused queue {queue!r}: no job of it starts from now "
                             "on; jobs already running finish." if done
                             else f"Queue {queue!r} was already paused.")
        elif action == "resume":
            done = pausing.resume(backend.parts, queue)
            messages.success(request, f"Resumed queue {queue!r}." if done
                             else f"Queue {queue!r} was not paused.")
        else:
            messages.error(request, f"Unknown action {action!r}: use pause or resume.")
    except UnknownQueue as exc:
        messages.error(request, str(exc))
    except (*REDIS_ERRORS, DatabaseError) as exc:  # type: ignore[misc]  # mypy cannot unpack a tuple[type, ...]
        messages.error(request, f"Queue {queue!r} was not changed: a server did not answer "
                       f"({exc}). Try again: pausing and resuming are safe to repeat.")
    return back


def dashboard_name(model_admin: Any) -> str:
    return f"{model_admin.opts.app_label}_{model_admin.opts.model_name}_dashboard"
