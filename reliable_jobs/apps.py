from __future__ import annotations

from django.apps import AppConfig
from django.utils.translation import gettext_lazy as _


class ReliableJobsConfig(AppConfig):
    name = "reliable_jobs"
    verbose_name = _("Reliable jobs")
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from . import checks, metrics, tracing  # noqa: F401 - checks registers the checks

        # Counting and tracing start with the process (a counter begun at the
        # first scrape would miss what came before it); each is a no-op when
        # its library is not installed.
        metrics.install()
        tracing.install()
        # Jobs a workflow's dependencies release are pushed after the commit
        # that released them, in whichever process wrote it (workflows.py).
        from .canvas import ENQUEUE
        from .mirror.dependencies import jobs_released
        from .workflows import enqueue_after, enqueue_plan, push_released

        jobs_released.connect(push_released, dispatch_uid="reliable_jobs.workflows.push")
        ENQUEUE.update(plan=enqueue_plan, after=enqueue_after)
