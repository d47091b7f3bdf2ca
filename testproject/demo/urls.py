from django.urls import path

from testproject.demo import views

app_name = "demo"
urlpatterns = [
    path("", views.index, name="index"),
    path("enqueue/", views.enqueue, name="enqueue"),
    path("result/<str:result_id>/", views.result, name="result"),
]
