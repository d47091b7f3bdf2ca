"""A read-only history of jobs and their attempts in the Django admin."""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.http import HttpRequest

from .models import Attempt, Job


class ReadOnlyMixin:
    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


class AttemptInline(ReadOnlyMixin, admin.TabularInline):
    model = Attempt
    extra = 0
    fields = ("number", "worker_id", "started_at", "finished_at", "outcome", "error")
    readonly_fields = fields
    can_delete = False
    show_change_link = False


@admin.register(Job)
class JobAdmin(ReadOnlyMixin, admin.ModelAdmin):
    list_display = ("id", "task_path", "queue", "state", "attempts", "max_attempts",
                    "enqueued_at", "started_at", "finished_at", "short_error")
    list_filter = ("state", "queue", "task_path", "enqueued_at")
    search_fields = ("=id", "task_path")
    ordering = ("-enqueued_at",)
    date_hierarchy = "enqueued_at"
    show_full_result_count = False
    inlines = [AttemptInline]
    readonly_fields = ("id", "backend", "queue", "task_path", "args", "kwargs", "priority",
                       "state", "attempts", "max_attempts", "run_after", "enqueued_at",
                       "started_at", "finished_at", "updated_at", "return_value", "last_error")

    @admin.display(description="last error")
    def short_error(self, job: Job) -> str:
        return job.last_error.splitlines()[0][:120] if job.last_error else ""
