"""The Django admin: every job's history, its attempts, staff actions, the live dashboard.

Rows are never edited here: the admin reads the mirror, and the four
actions (retry, cancel, requeue, change priority) go through
:mod:`reliable_jobs.staff`, which
acts in Redis first and mirrors what Redis did. Each action has its own model
permission and is offered on the changelist and on the job's page.

Everything a job carries (arguments, return value, errors, tracebacks) is
user data: it is rendered through ``format_html``/``escape`` only, so
``<script>`` in an argument is shown as text.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import datetime
from functools import partial
from typing import Any

from django import forms
from django.contrib import admin, messages
from django.contrib.admin.helpers import ActionForm
from django.core.exceptions import PermissionDenied
from django.db.models import QuerySet
from django.db.models.expressions import Combinable
from django.http import Http404, HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.urls import URLPattern, path, reverse
from django.utils.html import format_html
from django.utils.safestring import SafeString
from django.utils.translation import gettext_lazy as _

# schedule_admin is imported for its side effect: it registers the periodic jobs' admin.
from . import changelist, dashboard, schedule_admin, staff, taskpage  # noqa: F401
from .adminparts import ReadOnlyMixin, badge, timestamp
from .broker import REDIS_ERRORS
from .compat import admin_action
from .jobids import short_id
from .models import Attempt, Job

#: Jobs one action handles at most per click (each is a transaction and a
#: Redis call); the message says when more were selected.
ACTION_LIMIT = 1_000
#: Refusals listed one by one in the admin message before "and N more".
MESSAGES_LISTED = 10


class PriorityActionForm(ActionForm):
    """The action bar, plus the new priority the "change priority" action sets."""

    # Text, checked by the action itself: an invalid action form makes the
    # admin drop the action with "No action selected", which says nothing.
    priority = forms.CharField(
        label=_("New priority"), required=False, max_length=20,
        widget=forms.NumberInput(attrs={"min": staff.MIN_PRIORITY, "max": staff.MAX_PRIORITY}),
        help_text=_("For \u201cchange priority\u201d: -100 to 100, higher runs first."))


class PriorityFilter(admin.SimpleListFilter):
    """Raised, default or lowered priority: three fixed choices, no DISTINCT scan."""

    title = _("priority")
    parameter_name = "priority"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, Any]]:
        return [("raised", _("Above 0 (runs first)")), ("default", _("0 (the default)")),
                ("lowered", _("Below 0 (runs last)"))]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Job]) -> QuerySet[Job]:
        value = self.value()
        if value == "raised":
            return queryset.filter(priority__gt=0)
        if value == "default":
            return queryset.filter(priority=0)
        if value == "lowered":
            return queryset.filter(priority__lt=0)
        return queryset


def duration(started: datetime | None, finished: datetime | None) -> str:
    """A short human duration ("850 ms", "12.3 s", "4 min 5 s", "2 h 3 min")."""
    if not started or not finished:
        return ""
    ms = (finished - started).total_seconds() * 1000
    if ms < 1000:
        return f"{ms:.0f} ms"
    if ms < 60_000:
        return f"{ms / 1000:.1f} s"
    minutes, seconds = divmod(int(ms // 1000), 60)
    if minutes < 60:
        return f"{minutes} min {seconds} s"
    return f"{minutes // 60} h {minutes % 60} min"


def pretty_json(value: Any) -> SafeString:
    return format_html('<pre class="rj-pre">{}</pre>',
                       json.dumps(value, indent=2, ensure_ascii=False, sort_keys=True))


# django-stubs makes the admin classes generic; Django's are not subscriptable at run time.
class AttemptInline(ReadOnlyMixin, admin.TabularInline):  # type: ignore[type-arg]
    model = Attempt
    extra = 0
    fields = ("number", "worker_id", "started", "finished", "took", "result", "details")
    readonly_fields = fields
    ordering = ("number",)
    can_delete = False
    show_change_link = False

    @admin.display(description=_("started"))
    def started(self, attempt: Attempt) -> str | None:
        return timestamp(attempt.started_at)

    @admin.display(description=_("finished"))
    def finished(self, attempt: Attempt) -> str | None:
        return timestamp(attempt.finished_at)

    @admin.display(description=_("duration"))
    def took(self, attempt: Attempt) -> str:
        return duration(attempt.started_at, attempt.finished_at)

    @admin.display(description=_("outcome"))
    def result(self, attempt: Attempt) -> SafeString:
        if not attempt.outcome:
            return badge("outcome", "open", _("in progress"))
        return badge("outcome", attempt.outcome, attempt.get_outcome_display())

    @admin.display(description=_("error"))
    def details(self, attempt: Attempt) -> SafeString | str:
        if not attempt.traceback:
            return attempt.error
        return format_html('{}<details><summary>{}</summary><pre class="rj-pre">{}</pre>'
                           "</details>", attempt.error, _("traceback"), attempt.traceback)


@admin.register(Job)
class JobAdmin(ReadOnlyMixin, admin.ModelAdmin):  # type: ignore[type-arg]  # as AttemptInline
    list_display = ("short_id", "task_path", "queue", "state_badge", "priority", "attempts_of",
                    "enqueued", "started", "finished", "took", "short_error")
    list_filter = ("state", PriorityFilter, changelist.QueueFilter, changelist.TaskFilter,
                   changelist.EnqueuedFilter, changelist.DriftFilter)
    search_fields = ("=id", "task_path")
    search_help_text = _("A job id (or its first 4+ characters), or part of a task path.")
    show_facets = admin.ShowFacets.NEVER  # a count per filter choice: a scan each
    ordering = ("-enqueued_at",)
    show_full_result_count = False
    paginator = changelist.EstimatedCountPaginator
    list_per_page = 50
    inlines = [AttemptInline]
    actions = ["retry_jobs", "cancel_jobs", "requeue_jobs", "reprioritize_jobs"]
    action_form = PriorityActionForm
    fieldsets = (
        (None, {"fields": ("id", "task_path", "queue", "backend", "state_badge", "attempts_of",
                           "priority", "fair_key")}),
        (_("Timing"), {"fields": ("runs_after", "enqueued", "started", "finished", "took",
                                  "updated")}),
        (_("Arguments and result"), {"fields": ("args_json", "kwargs_json", "return_json")}),
        (_("Progress"), {"fields": ("progress", "checkpoint_json")}),
        (_("Error"), {"fields": ("last_error", "traceback")}),
    )
    readonly_fields = ("id", "task_path", "queue", "backend", "state_badge", "attempts_of",
                       "priority", "fair_key", "runs_after", "enqueued", "started", "finished",
                       "took", "updated", "args_json", "kwargs_json", "return_json", "progress",
                       "checkpoint_json", "last_error", "traceback")

    class Media:
        css = {"all": ["reliable_jobs/admin.css"]}

    # -- columns and fields ----------------------------------------------

    @admin.display(description=_("id"), ordering="pk")
    def short_id(self, job: Job) -> SafeString:
        """The last 8 characters (jobids.short_id); the whole id on hover."""
        return format_html('<span class="rj-id" title="{}">{}</span>', job.pk, short_id(job.pk))

    @admin.display(description=_("state"), ordering="state")
    def state_badge(self, job: Job) -> SafeString:
        return badge("state", job.state, job.get_state_display())

    @admin.display(description=_("attempts"))
    def attempts_of(self, job: Job) -> str:
        return f"{job.attempts}/{job.max_attempts}"

    @admin.display(description=_("run after"))
    def runs_after(self, job: Job) -> str | None:
        return timestamp(job.run_after)

    @admin.display(description=_("enqueued"), ordering="enqueued_at")
    def enqueued(self, job: Job) -> str | None:
        return timestamp(job.enqueued_at, ms=False)

    @admin.display(description=_("started"), ordering="started_at")
    def started(self, job: Job) -> str | None:
        return timestamp(job.started_at, ms=False)

    @admin.display(description=_("finished"), ordering="finished_at")
    def finished(self, job: Job) -> str | None:
        return timestamp(job.finished_at, ms=False)

    @admin.display(description=_("updated"))
    def updated(self, job: Job) -> str | None:
        return timestamp(job.updated_at)

    @admin.display(description=_("duration"))
    def took(self, job: Job) -> str:
        return duration(job.started_at, job.finished_at)

    @admin.display(description=_("last error"))
    def short_error(self, job: Job) -> str:
        return job.last_error.splitlines()[0][:120] if job.last_error else ""

    @admin.display(description=_("args"))
    def args_json(self, job: Job) -> SafeString:
        return pretty_json(job.args)

    @admin.display(description=_("kwargs"))
    def kwargs_json(self, job: Job) -> SafeString:
        return pretty_json(job.kwargs)

    @admin.display(description=_("return value"))
    def return_json(self, job: Job) -> SafeString:
        return pretty_json(job.return_value)

    @admin.display(description=_("progress"))
    def progress(self, job: Job) -> SafeString | str:
        """What the task last reported (context.progress()): done of total, as a bar."""
        if job.progress_done is None:
            return ""
        if not job.progress_total:
            return format_html("{} ({})", job.progress_done,
                               _("attempt %(n)s") % {"n": job.progress_attempt})
        share = max(0.0, min(1.0, job.progress_done / job.progress_total))
        return format_html(
            '<progress class="rj-progress" max="{}" value="{}"></progress> {} / {} ({}%, {})',
            job.progress_total, job.progress_done, job.progress_done, job.progress_total,
            f"{share * 100:.1f}", _("attempt %(n)s") % {"n": job.progress_attempt})

    @admin.display(description=_("checkpoint"))
    def checkpoint_json(self, job: Job) -> SafeString:
        """Where the next attempt resumes (context.checkpoint())."""
        return pretty_json(job.checkpoint)

    @admin.display(description=_("traceback"))
    def traceback(self, job: Job) -> SafeString | str:
        """The newest failed attempt's traceback."""
        failed = (job.attempt_set.exclude(traceback="").order_by("-number")
                  .values_list("number", "traceback").first())
        if failed is None:
            return ""
        number, text = failed
        return format_html('<p>{}</p><pre class="rj-pre">{}</pre>',
                           _("Attempt %(n)s:") % {"n": number}, text)

    def get_ordering(self, request: HttpRequest
                     ) -> list[str | Combinable] | tuple[str | Combinable, ...] | tuple[()]:
        # The drifted jobs are the rows unchanged the longest: list them that
        # way. It also keeps PostgreSQL on their primary keys, where ordering
        # by enqueued_at would walk that index through most of the table.
        if changelist.DriftFilter.parameter_name in request.GET:
            return ("updated_at", "pk")
        return super().get_ordering(request)

    def get_search_results(self, request: HttpRequest, queryset: QuerySet[Job],
                           search_term: str) -> tuple[QuerySet[Job], bool]:
        return changelist.search(queryset, search_term), False

    # -- staff actions -----------------------------------------------------

    def has_retry_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm(f"{self.opts.app_label}.retry_job")

    def has_cancel_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm(f"{self.opts.app_label}.cancel_job")

    def has_requeue_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm(f"{self.opts.app_label}.requeue_job")

    def has_reprioritize_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm(f"{self.opts.app_label}.reprioritize_job")

    @admin_action(description=_("Retry (dead jobs: queue again with a fresh attempt budget)"),
                  description_plural=_("Retry selected dead jobs"),
                  permissions=["retry"])
    def retry_jobs(self, request: HttpRequest, queryset: QuerySet[Job]) -> None:
        self._act(request, queryset, staff.retry,
                  _("%(n)s dead jobs are queued again, each with a fresh attempt budget."))

    @admin_action(description=_("Cancel (a waiting job never runs, a running one is stopped)"),
                  description_plural=_("Cancel selected unfinished jobs"),
                  permissions=["cancel"])
    def cancel_jobs(self, request: HttpRequest, queryset: QuerySet[Job]) -> None:
        self._act(request, queryset, staff.cancel,
                  _("Cancelled %(n)s jobs: those waiting will not run, those running are "
                    "being stopped."))

    @admin_action(description=_("Requeue (run a scheduled job now, or a cancelled one again)"),
                  description_plural=_("Requeue selected scheduled or cancelled jobs"),
                  permissions=["requeue"])
    def requeue_jobs(self, request: HttpRequest, queryset: QuerySet[Job]) -> None:
        self._act(request, queryset, staff.requeue, _("Requeued %(n)s jobs: they are queued now."))

    @admin_action(description=_("Change priority (queued or scheduled jobs) to the new "
                                "priority given"),
                  description_plural=_("Change the priority of selected waiting jobs"),
                  permissions=["reprioritize"])
    def reprioritize_jobs(self, request: HttpRequest, queryset: QuerySet[Job]) -> None:
        # The action bar's form on the changelist; prefixed on the job's page.
        raw = request.POST.get("priority", request.POST.get("CHANGE_FORM-priority", ""))
        field = forms.IntegerField(min_value=staff.MIN_PRIORITY, max_value=staff.MAX_PRIORITY)
        try:
            priority: int | None = field.clean(raw.strip())
        except forms.ValidationError:
            priority = None
        if priority is None:
            self.message_user(request, f"Give the new priority, a whole number from "
                              f"{staff.MIN_PRIORITY} to {staff.MAX_PRIORITY} (not {raw!r}), "
                              "next to the action: no job was changed.", messages.ERROR)
            return
        self._act(request, queryset, lambda parts, pk: staff.reprioritize(parts, pk, priority),
                  f"%(n)s jobs now have priority {priority}.")

    def _act(self, request: HttpRequest, queryset: QuerySet[Job],
             operation: Callable[[Any, Any], staff.StaffResult], summary: Any) -> None:
        """Run ``operation`` on each selected job; one message for the done, one per refusal.

        ``summary`` says what happened to ``%(n)s`` jobs when more than one was
        done (a single job gets its own sentence).
        """
        jobs = list(queryset.order_by("pk").only("pk", "backend", "task_path")[:ACTION_LIMIT + 1])
        selected = queryset.count() if len(jobs) > ACTION_LIMIT else len(jobs)
        outcomes = []
        for job in jobs[:ACTION_LIMIT]:
            outcome = self._act_on(job, operation)
            if outcome.done:
                self.log_change(request, job, outcome.message)
            outcomes.append(outcome)
        done = [o for o in outcomes if o.done]
        refused = [o for o in outcomes if not o.done]
        if len(done) == 1:
            self.message_user(request, done[0].message, messages.SUCCESS)
        elif done:
            self.message_user(request, summary % {"n": len(done)}, messages.SUCCESS)
        for outcome in refused[:MESSAGES_LISTED]:
            self.message_user(request, outcome.message, messages.WARNING)
        if len(refused) > MESSAGES_LISTED:
            self.message_user(request, f"{len(refused) - MESSAGES_LISTED} more jobs were not "
                              "changed for the same kinds of reasons.", messages.WARNING)
        if selected > ACTION_LIMIT:
            self.message_user(request, f"Only {ACTION_LIMIT} of the {selected} selected jobs "
                              "were handled; select the rest (the state filter helps) and run "
                              "the action again.", messages.WARNING)

    @staticmethod
    def _act_on(job: Job, operation: Callable[[Any, Any], staff.StaffResult]) -> staff.StaffResult:
        if job.backend not in changelist.reliable_backends():
            return staff.StaffResult(str(job.pk), False, f"Job {job.pk} belongs to backend "
                                 f"{job.backend!r}, which is not configured: it was not changed.")
        try:
            return operation(changelist.reliable_backend(job.backend).parts, job.pk)
        except REDIS_ERRORS as exc:
            return staff.StaffResult(str(job.pk), False, f"Redis did not answer ({exc}): job "
                                 f"{job.pk} was not changed.")

    # -- the dashboard -----------------------------------------------------

    def get_urls(self) -> list[URLPattern]:
        view = self.admin_site.admin_view(self.dashboard_view)
        name = f"{self.opts.app_label}_{self.opts.model_name}_dashboard"
        tasks_view = self.admin_site.admin_view(partial(taskpage.task_stats_view, self))
        tasks_name = f"{self.opts.app_label}_{self.opts.model_name}_task_stats"
        return [
            path("dashboard/", view, name=name),
            path("dashboard/<str:alias>/", view, name=name),
            path("tasks/", tasks_view, name=tasks_name),
            path("tasks/<str:alias>/", tasks_view, name=tasks_name),
            *super().get_urls(),
        ]

    def dashboard_view(self, request: HttpRequest, alias: str | None = None) -> HttpResponse:
        """Live counts, workers, throughput and drift of one backend."""
        if not self.has_view_permission(request):
            raise PermissionDenied
        aliases = changelist.reliable_backends()
        alias = alias or (aliases[0] if aliases else None)
        if alias not in aliases:
            raise Http404(f"There is no reliable_jobs backend {alias!r} in TASKS.")
        backend = changelist.reliable_backend(alias)
        snap = dashboard.snapshot(backend)
        bars, peak = dashboard.chart(snap.minutes)
        changelist_url = reverse(f"{self.admin_site.name}:"
                                 f"{self.opts.app_label}_{self.opts.model_name}_changelist")
        context = {
            **self.admin_site.each_context(request),
            "opts": self.opts,
            "title": _("Jobs dashboard: %(alias)s") % {"alias": alias},
            "alias": alias,
            "aliases": aliases,
            "snap": snap,
            "bars": bars,
            "peak": peak,
            "changelist_url": changelist_url,
            "drift_url": f"{changelist_url}?drift={alias}",
            "taskstats_url": reverse(f"{self.admin_site.name}:{self.opts.app_label}_"
                                     f"{self.opts.model_name}_task_stats", args=[alias]),
            "prefix": backend.config.PREFIX,
        }
        return TemplateResponse(request, "admin/reliable_jobs/job/dashboard.html", context)

    def changelist_view(self, request: HttpRequest,
                        extra_context: dict[str, Any] | None = None) -> HttpResponse:
        aliases = changelist.reliable_backends()
        return super().changelist_view(request, {**(extra_context or {}),
                                                 "rj_dashboards": aliases})

