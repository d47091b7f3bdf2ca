"""Settings for the test project: the demo site and the test suite's Django.

Everything secret or machine-specific comes from the environment (django-environ).
With nothing set it runs from a fresh checkout: SQLite under ``.run/`` and
whichever Redis ``testproject.embedded`` finds or starts.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import environ

from testproject.embedded import choose_redis_url, demo_prefix

env = environ.Env()

BASE_DIR = Path(__file__).resolve().parent.parent
#: Local state (SQLite database, embedded Valkey, worker logs); git-ignored.
RUN_DIR = BASE_DIR / ".run"
RUN_DIR.mkdir(exist_ok=True)

DEBUG = env.bool("DEBUG", default=True)
# A known key is only acceptable for local development: without DEBUG it must be set.
SECRET_KEY = (
    env.str("SECRET_KEY", default="django-insecure-testproject-dev-only-never-deploy")
    if DEBUG
    else env.str("SECRET_KEY")
)
ALLOWED_HOSTS = env.list("ALLOWED_HOSTS", default=[])

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "reliable_jobs",
    "testproject.demo",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "testproject.urls"
WSGI_APPLICATION = "testproject.wsgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

DEFAULT_SQLITE_PATH = RUN_DIR / "db.sqlite3"
DATABASES = {"default": env.db_url("DATABASE_URL", default=f"sqlite:///{DEFAULT_SQLITE_PATH}")}
if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":
    # The worker and the web/demo process write concurrently: WAL lets readers
    # through, IMMEDIATE takes the write lock up front (no mid-transaction
    # "database is locked"), and the timeout waits out the other writer.
    sqlite_options = DATABASES["default"].setdefault("OPTIONS", {})
    sqlite_options.setdefault("transaction_mode", "IMMEDIATE")
    sqlite_options.setdefault("timeout", 20)
    sqlite_options.setdefault("init_command", "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;")
    # The test database is a file, not Django's default in-memory one: the
    # suite's `manage.py runworker` subprocesses must open the same database
    # (tests/conftest.py subprocess_env passes them its path). One file per
    # test run (the pid), so concurrent runs on one checkout never share it;
    # Django replaces a leftover file at the start and deletes it at the end.
    DATABASES["default"].setdefault("TEST", {}).setdefault(
        "NAME", str(RUN_DIR / f"test-{os.getpid()}.sqlite3"))

# Lower case: not a setting, so no error report or `diffsettings` lists the URL
# (with its password) a second time.
redis_url, redis_description = choose_redis_url(
    env.str("REDIS_URL", default=None), RUN_DIR,
    force_embedded=env.bool("RJ_EMBEDDED", default=False))
# A server picked for the user may hold other projects' or checkouts' keys: the
# demo's go under this checkout's own prefix. A REDIS_URL the user set keeps "rj".
redis_prefix = env.str(
    "RJ_PREFIX", default="rj" if redis_description == "REDIS_URL" else demo_prefix(BASE_DIR))

TASKS = {
    "default": {
        "BACKEND": "reliable_jobs.backend.ReliableJobsBackend",
        "QUEUES": env.list("RJ_QUEUES", default=["default"]),
        "OPTIONS": {
            "REDIS_URL": redis_url,
            "PREFIX": redis_prefix,
            # RJ_OPTIONS is a JSON object merged over these OPTIONS. The test
            # suite sets it for the `manage.py runworker` subprocesses it starts
            # (short leases, fast retries) since those cannot see
            # override_settings.
            **json.loads(env.str("RJ_OPTIONS", default="{}")),
        },
    },
}

if not env.str("REDIS_URL", default="") or not env.str("DATABASE_URL", default=""):
    # Say what was picked when it was picked for the user, never the URLs they gave
    # (those may hold passwords).
    redis_said = (
        "REDIS_URL set"
        if redis_description == "REDIS_URL"
        else f"REDIS_URL not set, using {redis_description}"
    )
    database_said = (
        "DATABASE_URL set"
        if env.str("DATABASE_URL", default="")
        else f"DATABASE_URL not set, using SQLite at {DEFAULT_SQLITE_PATH}"
    )
    print(f"testproject: {redis_said}, key prefix {redis_prefix!r}; {database_said}",
          file=sys.stderr)

# Django's error reports hide settings whose names look secret; this filter
# also masks the password inside TASKS' REDIS_URL (and any other URL).
DEFAULT_EXCEPTION_REPORTER_FILTER = "reliable_jobs.redaction.SafeExceptionReporterFilter"

if env.bool("RJ_FAST_HASHER", default=False):
    # Tests log users in often; the default hasher costs ~0.3 s per login.
    PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {
        "plain": {"format": "%(asctime)s %(levelname)s %(name)s %(process)d: %(message)s"},
    },
    "handlers": {
        "console": {"class": "logging.StreamHandler", "formatter": "plain"},
    },
    "loggers": {
        "reliable_jobs": {
            "handlers": ["console"],
            "level": env.str("RJ_LOG_LEVEL", default="INFO"),
            "propagate": False,
        },
    },
}
