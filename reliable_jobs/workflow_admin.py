"""The admin of workflows: each one's progress, its graph drawn with each job's state, and
two actions on the whole workflow.

Rows are never edited here: a workflow is written once, with its jobs, and
its progress is counted from them. The two actions, "retry from failed"
and "cancel the rest", each behind its own permission
(``reliable_jobs.retry_workflow``, ``cancel_workflow``), go through
``workflows.retry_failed`` and ``cancel_rest``, which act on each job
through the staff actions (``staff.py``). The page reads a bounded number
of queries whatever the workflow's size (``workflow_svg`` says what it
draws). Imported by ``admin.py``.
"""

from __future__ import annotations

from typing import Any

from django.contrib import admin, messages
from django.db.models import Case, CharField, Count, F, Q, QuerySet, Value, When
from django.http import HttpRequest
from django.urls import reverse
from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString
from django.utils.translation import gettext_lazy as _

from . import changelist, workflow_svg, workflows
from .adminparts import ReadOnlyMixin, timestamp
from .broker import REDIS_ERRORS
from .compat import admin_action
from .jobids import short_id
from .mirror.dependencies import NOT_NEEDED, UPSTREAM_FAILED
from .models import Dependency, Job, JobState, Workflow

#: Workflows one action handles at most per click (each may be thousands of jobs).
ACTION_LIMIT = 20

#: A job's state as the graph shows it: a cancel the workflow made itself
#: (a failed upstream, a callback on failure not needed) apart from a staff cancel.
SHOWN_STATE = Case(
    When(state=JobState.CANCELLED, last_error__startswith=UPSTREAM_FAILED,
         then=Value("upstream_failed")),
    When(state=JobState.CANCELLED, last_error__startswith=NOT_NEEDED, then=Value("not_needed")),
    default=F("state"), output_field=CharField())


@admin.register(Workflow)
class WorkflowAdmin(ReadOnlyMixin, admin.ModelAdmin):  # type: ignore[type-arg]  # generic only in django-stubs
    list_display = ("name_or_id", "created", "total", "done", "failed", "jobs_link")
    search_fields = ("=id", "name")
    ordering = ("-created_at",)
    fields = ("id", "name", "created", "total", "progress", "jobs_link", "graph")
    readonly_fields = fields
    actions = ["retry_from_failed", "cancel_the_rest"]

    class Media:
        css = {"all": ["reliable_jobs/admin.css"]}

    def get_queryset(self, request: HttpRequest) -> QuerySet[Workflow]:
        # One grouped count per page, through the partial index on Job.workflow.
        rows: QuerySet[Workflow] = super().get_queryset(request)
        return rows.annotate(
            n_done=Count("jobs", filter=Q(jobs__state=JobState.SUCCEEDED)),
            n_failed=Count("jobs", filter=Q(jobs__state__in=(JobState.DEAD, JobState.CANCELLED))
                           & ~Q(jobs__last_error__startswith=NOT_NEEDED)))

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

    @admin.display(description=_("progress"))
    def progress(self, row: Workflow) -> SafeString:
        """workflows.progress(): a bar, done / failed / skipped of total, and each state."""
        counts = workflows.progress(row.pk)
        total = counts["total"]
        ended = counts["done"] + counts["failed"] + counts["skipped"]
        states = format_html_join(
            ", ", "{} {}", ((counts[state], workflow_svg.label(state))
                            for state in JobState.values if counts.get(state)))
        return format_html(
            '<progress class="rj-progress" max="{}" value="{}"></progress> '
            '<span class="rj-wf-progress">{} succeeded, {} failed, {} skipped of {}</span>'
            '<div class="rj-muted">{}</div>',
            max(total, 1), ended, counts["done"], counts["failed"], counts["skipped"], total,
            states)

    @admin.display(description=_("graph"))
    def graph(self, row: Workflow) -> SafeString:
        """The drawing, or per-layer counts above DRAW_LIMIT jobs, or counts by state above
        LAYER_LIMIT: two queries at most (jobs, edges), whatever the size."""
        jobs = Job.objects.filter(workflow=row).order_by().annotate(shown=SHOWN_STATE)
        edges_of = Dependency.objects.filter(job__workflow=row).order_by()
        if row.total <= workflow_svg.DRAW_LIMIT:
            nodes = [(str(pk), task, state) for pk, task, state in
                     jobs.values_list("pk", "task_path", "shown")[:workflow_svg.DRAW_LIMIT + 1]]
            if len(nodes) <= workflow_svg.DRAW_LIMIT:
                edges = [(str(j), str(u)) for j, u in edges_of.values_list("job_id",
                                                                           "upstream_id")]
                return format_html("<div>{}</div>{}", workflow_svg.legend(), workflow_svg.draw(
                    nodes, edges, lambda pk: reverse("admin:reliable_jobs_job_change",
                                                     args=[pk])))
        if row.total <= workflow_svg.LAYER_LIMIT:
            pairs = [(str(pk), state) for pk, state in jobs.values_list("pk", "shown")]
            edges = [(str(j), str(u)) for j, u in edges_of.values_list("job_id", "upstream_id")]
            return workflow_svg.layer_table(pairs, edges)
        counts = dict(jobs.values_list("shown").annotate(n=Count("pk")).values_list("shown", "n"))
        return workflow_svg.state_table(counts, sum(counts.values()))

    # -- actions on the whole workflow ------------------------------------

    def has_retry_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm(f"{self.opts.app_label}.retry_workflow")

    def has_cancel_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm(f"{self.opts.app_label}.cancel_workflow")

    @admin_action(description=_("Retry from failed (run the dead jobs again, and what they "
                                "cancelled)"),
                  description_plural=_("Retry selected workflows from their failed jobs"),
                  permissions=["retry"])
    def retry_from_failed(self, request: HttpRequest, queryset: QuerySet[Workflow]) -> None:
        self._act(request, queryset, workflows.retry_failed)

    @admin_action(description=_("Cancel the rest (every job not finished yet)"),
                  description_plural=_("Cancel the rest of selected workflows"),
                  permissions=["cancel"])
    def cancel_the_rest(self, request: HttpRequest, queryset: QuerySet[Workflow]) -> None:
        self._act(request, queryset, workflows.cancel_rest)

    def _act(self, request: HttpRequest, queryset: QuerySet[Workflow], operation: Any) -> None:
        """Run ``operation`` on each selected workflow (ACTION_LIMIT at most); a message each."""
        rows = list(queryset.order_by("-created_at")[:ACTION_LIMIT + 1])
        aliases = changelist.reliable_backends()
        for row in rows[:ACTION_LIMIT]:
            alias = (Job.objects.filter(workflow=row).values_list("backend", flat=True)
                     .first())
            if alias is None or alias not in aliases:
                self.message_user(request, f"Workflow {row.pk} has no job of a configured "
                                  "reliable_jobs backend: it was not changed.", messages.WARNING)
                continue
            try:
                outcome = operation(row.pk, backend=alias)
            except REDIS_ERRORS as exc:
                self.message_user(request, f"Redis did not answer ({exc}): workflow {row.pk} "
                                  "may be partly changed; run the action again.", messages.ERROR)
                continue
            self.log_change(request, row, outcome.message)
            self.message_user(request, outcome.message,
                              messages.WARNING if outcome.refused else messages.SUCCESS)
        if len(rows) > ACTION_LIMIT:
            self.message_user(request, f"Only {ACTION_LIMIT} workflows were handled; select "
                              "the rest and run the action again.", messages.WARNING)
