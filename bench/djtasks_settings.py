"""Settings of the bench's small Django project for the ``django.tasks`` backends.

``BENCH_DJTASKS`` picks the backend (``db``: django-tasks-db, ``redis``:
django-tasks-redis, ``rq``: django-tasks-rq), each with its defaults; the
servers are compare.py's (``DATABASE_URL``, ``BENCH_REDIS_URL``). Only these
apps are installed, so each worker loads what a Django user of that backend
would, and nothing of reliable_jobs.
"""

from __future__ import annotations

import os
from urllib.parse import urlsplit

KIND = os.environ.get("BENCH_DJTASKS", "db")
REDIS_URL = os.environ["BENCH_REDIS_URL"]
_db = urlsplit(os.environ["DATABASE_URL"])

SECRET_KEY = "bench-only"
DEBUG = False
USE_TZ = True
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": _db.path.lstrip("/"),
        "USER": _db.username or "postgres",
        "PASSWORD": _db.password or "",
        "HOST": _db.hostname or "127.0.0.1",
        "PORT": str(_db.port or 5432),
    }
}
BACKENDS = {
    "db": ("django_tasks_db.DatabaseBackend", {}),
    "redis": ("django_tasks_redis.backends.RedisTaskBackend", {"REDIS_URL": REDIS_URL}),
    "rq": ("django_tasks_rq.RQBackend", {}),
}
APPS = {
    "db": ["django_tasks_db"],
    "redis": ["django_tasks_redis"],
    "rq": ["django_rq", "django_tasks_rq"],
}
_backend, _options = BACKENDS[KIND]
INSTALLED_APPS = ["django.contrib.contenttypes", "django.contrib.auth", *APPS[KIND]]
TASKS = {"default": {"BACKEND": _backend, "QUEUES": ["default"], "OPTIONS": _options}}
RQ_QUEUES = {"default": {"URL": REDIS_URL}}
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "root": {"level": "WARNING", "handlers": ["console"]},
    "handlers": {"console": {"class": "logging.StreamHandler"}},
}
