"""URLs of the test project: the admin (the job history), the demo pages and monitoring."""

from importlib import import_module

from django.contrib import admin
from django.urls import URLPattern, URLResolver, include, path
from django.views.generic import RedirectView

from reliable_jobs.urls import ready_view


def prometheus_installed() -> bool:
    """Whether the prometheus extra is importable (the metrics view needs it)."""
    try:
        import_module("prometheus_client")
    except ImportError:
        return False
    return True


# The metrics view answers 501 without the prometheus extra, and `manage.py
# check` then warns (W020) on every command: mount it only where the extra is
# installed. Readiness needs nothing, so jobs/ready is always there.
monitoring: URLPattern | URLResolver = (
    path("jobs/", include("reliable_jobs.urls")) if prometheus_installed()
    else path("jobs/ready", ready_view, name="ready")
)

urlpatterns = [
    path("", RedirectView.as_view(pattern_name="demo:index")),
    path("admin/", admin.site.urls),
    path("demo/", include("testproject.demo.urls")),
    monitoring,
]
