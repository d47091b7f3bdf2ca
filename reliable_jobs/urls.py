"""Views for monitoring, to mount where only your monitoring and orchestrator reach them.

``path("jobs/", include("reliable_jobs.urls"))`` gives ``jobs/metrics``
(Prometheus, needs the prometheus extra) and ``jobs/ready`` (readiness:
200 or 503 with a JSON body). Neither asks for a login.
"""

from __future__ import annotations

from django.http import HttpRequest, HttpResponse
from django.urls import path

app_name = "reliable_jobs"


# The views' modules import the models, and Django's URL checks import this
# module even when reliable_jobs is missing from INSTALLED_APPS: importing
# them on the first request lets `manage.py check` report E009 instead of a
# traceback.
def metrics_view(request: HttpRequest) -> HttpResponse:
    """Prometheus' text format (see reliable_jobs.metrics.view)."""
    from .metrics import view

    return view(request)


def ready_view(request: HttpRequest) -> HttpResponse:
    """Readiness: 200 or 503 with a JSON body (see reliable_jobs.health.ready)."""
    from .health import ready

    return ready(request)


urlpatterns = [
    path("metrics", metrics_view, name="metrics"),
    path("ready", ready_view, name="ready"),
]
