"""The admin of workflows: each one's progress, and its jobs with what each waits for.

Read-only, like the job list: a workflow is written once, with its jobs, and
its progress is counted from them. The jobs are staff-acted on from the job
list (cancelling a waiting job there cancels what waits for it).
Imported by ``admin.py``.
"""

from __future__ import annotations

from django.contrib import admin
from django.db.models import Count, Q, QuerySet
from django.http import HttpRequest
from django.urls import reverse
from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString
from django.utils.translation import gettext_lazy as _

from .adminparts import ReadOnlyMixin, badge, timestamp
from .jobids import short_id
from .models import Dependency, Job, JobState, Workflow

#: Jobs the detail page lists at most (a 10,000-member group is not drawn whole).
SHOWN_JOBS = 200


@admin.register(Workflow)
class WorkflowAdmin(ReadOnlyMixin, admin.ModelAdmin):  # type: ignore[type-arg]  # generic only in django-stubs
    list_display = ("name_or_id", "created", "total", "done", "failed", "jobs_link")
    search_fields = ("=id", "name")
    ordering = ("-created_at",)
    fields = ("id", "name", "created", "total", "done", "failed", "jobs_link", "graph")
    readonly_fields = fields

    class Media:
        css = {"all": ["reliable_jobs/admin.css"]}

    def get_queryset(self, request: HttpRequest) -> QuerySet[Workflow]:
        # One grouped count per page, through the partial index on Job.workflow.
        rows: QuerySet[Workflow] = super().get_queryset(request)
        return rows.annotate(
            n_done=Count("jobs", filter=Q(jobs__state=JobState.SUCCEEDED)),
            n_failed=Count("jobs", filter=Q(jobs__state__in=(JobState.DEAD,
                                                             JobState.CANCELLED))))

    @admin.display(description=_("workflow"), ordering="name")
    def name_or_id(self, row: Workflow) -> str:
        return row.name or short_id(str(row.pk))

    @admin.display(description=_("created"), ordering="created_at")
    def created(self, row: Workflow) -> str | None:
        return timestamp(row.created_at, ms=False)

    @admin.display(description=_("succeeded"))
    def done(self, row: Workflow) -> int:
        return getattr(row, "n_done", 0)

    @admin.display(description=_("dead or cancelled"))
    def failed(self, row: Workflow) -> int:
        return getattr(row, "n_failed", 0)

    @admin.display(description=_("jobs"))
    def jobs_link(self, row: Workflow) -> SafeString:
        url = reverse("admin:reliable_jobs_job_changelist") + f"?workflow__id__exact={row.pk}"
        return format_html('<a href="{}">{}</a>', url, _("its jobs"))

    @admin.display(description=_("jobs, and what each waits for"))
    def graph(self, row: Workflow) -> SafeString:
        jobs = list(Job.objects.filter(workflow=row).order_by("pk")
                    .values_list("pk", "task_path", "state")[:SHOWN_JOBS])
        waits: dict[str, list[str]] = {}
        for job_id, upstream in Dependency.objects.filter(
                job_id__in=[job[0] for job in jobs]).values_list("job_id", "upstream_id"):
            waits.setdefault(str(job_id), []).append(short_id(str(upstream)))
        return format_html_join(
            "", "<div>{} {} {} {}</div>",
            ((format_html('<a href="{}">{}</a>',
                          reverse("admin:reliable_jobs_job_change", args=[pk]),
                          short_id(str(pk))),
              task, badge("state", state, JobState(state).label),
              (f"after {', '.join(waits[str(pk)])}" if str(pk) in waits else ""))
             for pk, task, state in jobs))
