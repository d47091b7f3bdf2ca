from __future__ import annotations

from django.apps import AppConfig
from django.utils.translation import gettext_lazy as _


class ReliableJobsConfig(AppConfig):
    name = "reliable_jobs"
    verbose_name = _("Reliable jobs")
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from . import checks  # noqa: F401 - registers the deployment checks
