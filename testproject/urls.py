"""URLs of the test project: the admin (the job history) and the demo pages."""

from django.contrib import admin
from django.urls import include, path
from django.views.generic import RedirectView

urlpatterns = [
    path("", RedirectView.as_view(pattern_name="demo:index")),
    path("admin/", admin.site.urls),
    path("demo/", include("testproject.demo.urls")),
    path("jobs/", include("reliable_jobs.urls")),
]
