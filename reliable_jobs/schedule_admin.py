"""The admin of periodic jobs: each schedule, when it fires next, what it last enqueued.

Rows are declared in code, so nothing here edits them; staff may pause and
enable a schedule (``toggle_schedule``) and run one now (``run_schedule``),
each permission granted on its own. A pause takes effect at the schedulers'
next pass (they read ``enabled`` under the row's lock), with no restart.
Imported by ``admin.py``.
"""

from __future__ import annotations

from typing import Any

from django.contrib import admin, messages
from django.db.models import QuerySet
from django.http import HttpRequest
from django.urls import reverse
from django.utils import timezone
from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString
from django.utils.translation import gettext_lazy as _

from .adminparts import ReadOnlyMixin, badge, timestamp
from .changelist import reliable_backend, reliable_backends
from .compat import admin_action
from .jobids import short_id
from .models import Schedule, ScheduleSlot
from .periodic.scheduler import next_slot, run_now, set_enabled, timetable_of


@admin.register(Schedule)
class ScheduleAdmin(ReadOnlyMixin, admin.ModelAdmin):  # type: ignore[type-arg]  # generic only in django-stubs
    list_display = ("name", "task_path", "when", "catch_up", "next_run", "last_slot",
                    "last_job", "state", "in_code")
    list_filter = ("enabled", "in_code", "backend")
    search_fields = ("name", "task_path")
    actions = ["disable_schedules", "enable_schedules", "run_schedules_now"]
    fields = ("name", "backend", "task_path", "when", "queue", "args", "kwargs", "catch_up",
              "state", "in_code", "next_run", "last_slot", "last_job", "recent_slots",
              "created_at", "updated_at")
    readonly_fields = fields

    class Media:
        css = {"all": ["reliable_jobs/admin.css"]}

    @admin.display(description=_("when"))
    def when(self, row: Schedule) -> str:
        timetable = timetable_of(row)
        return str(timetable) if timetable is not None else row.expression

    @admin.display(description=_("next slot"))
    def next_run(self, row: Schedule) -> str | None:
        if not row.enabled or not row.in_code:
            return "-"
        return timestamp(next_slot(row, timezone.now()), ms=False)

    @admin.display(description=_("last slot enqueued"), ordering="last_slot_at")
    def last_slot(self, row: Schedule) -> str | None:
        return timestamp(row.last_slot_at, ms=False)

    @admin.display(description=_("last job"))
    def last_job(self, row: Schedule) -> SafeString | str:
        return job_link(row.last_job_id) if row.last_job_id else "-"

    @admin.display(description=_("enabled"), ordering="enabled")
    def state(self, row: Schedule) -> SafeString:
        return badge("schedule", "enabled" if row.enabled else "paused",
                     _("enabled") if row.enabled else _("paused"))

    @admin.display(description=_("recent slots"))
    def recent_slots(self, row: Schedule) -> SafeString | str:
        slots = ScheduleSlot.objects.filter(schedule=row).order_by("-enqueued_at")[:20]
        items = [(timestamp(s.slot_at, ms=False), _("(run now)") if s.manual else "",
                  job_link(s.job_id) if s.job_id else "-") for s in slots]
        if not items:
            return "-"
        return format_html("<ul>{}</ul>", format_html_join("", "<li>{} {} {}</li>", items))

    # -- staff actions ------------------------------------------------------------

    def has_toggle_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm(f"{self.opts.app_label}.toggle_schedule")

    def has_run_permission(self, request: HttpRequest) -> bool:
        return request.user.has_perm(f"{self.opts.app_label}.run_schedule")

    @admin_action(description=_("Pause (no slot fires until enabled again)"),
                  description_plural=_("Pause selected schedules"), permissions=["toggle"])
    def disable_schedules(self, request: HttpRequest, queryset: QuerySet[Schedule]) -> None:
        self._toggle(request, queryset, enabled=False)

    @admin_action(description=_("Enable (fire from the next slot on; the paused ones are "
                                "not caught up)"),
                  description_plural=_("Enable selected schedules"), permissions=["toggle"])
    def enable_schedules(self, request: HttpRequest, queryset: QuerySet[Schedule]) -> None:
        self._toggle(request, queryset, enabled=True)

    def _toggle(self, request: HttpRequest, queryset: QuerySet[Schedule], *,
                enabled: bool) -> None:
        by_database: dict[str, list[str]] = {}
        for row in queryset:
            database = (reliable_backend(row.backend).config.DATABASE
                        if row.backend in reliable_backends() else "default")
            by_database.setdefault(database, []).append(row.name)
        changed = sum(set_enabled(database, names, enabled)
                      for database, names in by_database.items())
        verb = "enabled" if enabled else "paused"
        for row in queryset:
            self.log_change(request, row, f"Schedule {verb}.")
        self.message_user(request, f"{changed} schedule(s) {verb}; the schedulers see it at "
                          "their next pass.", messages.SUCCESS)

    @admin_action(description=_("Run now (one job with the schedule's arguments)"),
                  description_plural=_("Run selected schedules now"), permissions=["run"])
    def run_schedules_now(self, request: HttpRequest, queryset: QuerySet[Schedule]) -> None:
        for row in queryset:
            if row.backend not in reliable_backends():
                self.message_user(request, f"Schedule {row.name!r} belongs to backend "
                                  f"{row.backend!r}, which is not configured: nothing was run.",
                                  messages.WARNING)
                continue
            job_id = run_now(reliable_backend(row.backend), row.name)
            if job_id is None:
                self.message_user(request, f"Schedule {row.name!r} names {row.task_path!r}, "
                                  "which is not a task here: nothing was run.", messages.WARNING)
                continue
            self.log_change(request, row, f"Run now: job {job_id}.")
            self.message_user(request, format_html("Schedule {} enqueued job {}.", row.name,
                                                   job_link(job_id)), messages.SUCCESS)


def job_link(job_id: Any) -> SafeString:
    url = reverse("admin:reliable_jobs_job_change", args=[job_id])
    return format_html('<a class="rj-job-link" href="{}">{}</a>', url, short_id(job_id))
