"""Views for monitoring, to mount where only your monitoring and orchestrator reach them.

``path("jobs/", include("reliable_jobs.urls"))`` gives ``jobs/metrics``
(Prometheus, needs the prometheus extra) and ``jobs/ready`` (readiness:
200 or 503 with a JSON body). Neither asks for a login.
"""

from __future__ import annotations

from django.urls import path

from . import health, metrics

app_name = "reliable_jobs"

urlpatterns = [
    path("metrics", metrics.view, name="metrics"),
    path("ready", health.ready, name="ready"),
]
