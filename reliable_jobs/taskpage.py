"""The admin's per-task page: each task's figures over the last hour or day.

A table sortable by any column (``?o=failed``, ``?o=-run_p99_ms``), each task
linking to the job list filtered on it. The figures come from
:mod:`reliable_jobs.taskstats`; this module only picks the backend, the
window and the order, and renders.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlencode

from django.core.exceptions import PermissionDenied
from django.db import DatabaseError
from django.http import Http404, HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.urls import reverse
from django.utils.translation import gettext_lazy as _

from . import changelist, taskstats
from .dashboard import human_ms

if TYPE_CHECKING:
    from .taskstats import TaskLine

#: Column headings, in taskstats.FIGURES order.
HEADINGS = {
    "task": _("task"),
    "started": _("started"),
    "succeeded": _("succeeded"),
    "failed": _("failed"),
    "dead": _("dead"),
    "retried": _("retried"),
    "failure_ratio": _("failed %"),
    "run_p50_ms": _("run p50"),
    "run_p95_ms": _("run p95"),
    "run_p99_ms": _("run p99"),
    "queue_p50_ms": _("in queue p50"),
    "queue_p99_ms": _("in queue p99"),
}
#: The order when none is asked for: the busiest tasks first.
DEFAULT_ORDER = "-started"


@dataclass(frozen=True, slots=True)
class Heading:
    name: str
    label: Any
    url: str
    #: "asc", "desc" or "" (not the sort column).
    sorted: str
    numeric: bool


def sort_lines(lines: list[TaskLine], order: str) -> list[TaskLine]:
    """``lines`` by the figure ``order`` names ("-" first for descending); no figure last."""
    name = order.removeprefix("-")
    descending = order.startswith("-")
    present = [line for line in lines if getattr(line, name) is not None]
    absent = [line for line in lines if getattr(line, name) is None]
    present.sort(key=lambda line: line.task)  # ties stay by name (sorts are stable)
    present.sort(key=lambda line: getattr(line, name), reverse=descending)
    return present + absent


@dataclass(frozen=True, slots=True)
class Cell:
    name: str
    text: str
    #: The job list filtered on what the cell counts, or "".
    url: str = ""
    #: Shown in the warning colour (failures, deaths).
    bad: bool = False


#: Cells that link to the job list, with the state they filter on ("" for any).
_LINKED = {"task": "", "succeeded": "succeeded", "dead": "dead"}


def cells(line: TaskLine, changelist_url: str) -> list[Cell]:
    """One row of the table: each figure as text, some linked to the job list."""
    found = []
    for name in taskstats.FIGURES:
        value = getattr(line, name)
        if name.endswith("_ms"):
            text = human_ms(None if value is None else round(value))
        elif name == "failure_ratio":
            text = "-" if value is None else f"{value * 100:.1f} %"
        else:
            text = str(value)
        url = ""
        if name in _LINKED:
            query = {"task": line.task}
            if _LINKED[name]:
                query["state__exact"] = _LINKED[name]
            url = f"{changelist_url}?{urlencode(query)}"
        found.append(Cell(name, text, url,
                          bad=name in ("failed", "dead", "failure_ratio") and bool(value)))
    return found


def task_stats_view(model_admin: Any, request: HttpRequest,
                    alias: str | None = None) -> HttpResponse:
    """Render one backend's per-task figures (needs the job view permission)."""
    if not model_admin.has_view_permission(request):
        raise PermissionDenied
    aliases = changelist.reliable_backends()
    alias = alias or (aliases[0] if aliases else None)
    if alias not in aliases:
        raise Http404(f"There is no reliable_jobs backend {alias!r} in TASKS.")
    backend = changelist.reliable_backend(alias)
    window = request.GET.get("window", "hour")
    if window not in taskstats.WINDOWS:
        window = "hour"
    order = request.GET.get("o", DEFAULT_ORDER)
    if order.removeprefix("-") not in taskstats.FIGURES:
        order = DEFAULT_ORDER
    opts = model_admin.opts
    changelist_url = reverse(f"{model_admin.admin_site.name}:"
                             f"{opts.app_label}_{opts.model_name}_changelist")
    problem = ""
    lines: list[TaskLine] = []
    began = time.perf_counter()
    try:
        lines = taskstats.task_stats(using=backend.config.DATABASE, backend=alias,
                                     window=taskstats.WINDOWS[window])
    except DatabaseError as exc:
        problem = f"The database did not answer ({exc}): the figures are unknown."
    took_ms = (time.perf_counter() - began) * 1000

    def link(**params: str) -> str:
        return f"?{urlencode({'window': window, 'o': order, **params})}"

    headings = []
    for name, label in HEADINGS.items():
        current = order.removeprefix("-") == name
        descending = order.startswith("-")
        # A click on the sort column flips it; on another, numbers start high.
        flipped = (name if descending else f"-{name}") if current else (
            name if name == "task" else f"-{name}")
        headings.append(Heading(name, label, link(o=flipped),
                                ("desc" if descending else "asc") if current else "",
                                name != "task"))
    rows = [(line.task, cells(line, changelist_url)) for line in sort_lines(lines, order)]
    context = {
        **model_admin.admin_site.each_context(request),
        "opts": opts,
        "title": _("Per-task figures: %(alias)s") % {"alias": alias},
        "alias": alias,
        "aliases": aliases,
        "window": window,
        "windows": [(name, link(window=name)) for name in taskstats.WINDOWS],
        "headings": headings,
        "rows": rows,
        "problem": problem,
        "took_ms": took_ms,
        "changelist_url": changelist_url,
        "dashboard_url": reverse(f"{model_admin.admin_site.name}:"
                                 f"{opts.app_label}_{opts.model_name}_dashboard", args=[alias]),
    }
    return TemplateResponse(request, "admin/reliable_jobs/job/task_stats.html", context)
