from __future__ import annotations

from django.apps import AppConfig
from django.utils.translation import gettext_lazy as _


class VerifyConfig(AppConfig):
    """The chaos run and the benchmark, for a project that lists this app on purpose."""

    name = "reliable_jobs.contrib.verify"
    #: Not "verify": a project may well have an app of that name.
    label = "reliable_jobs_verify"
    verbose_name = _("Reliable jobs verification")
