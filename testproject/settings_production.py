"""Production settings of the test project.

Select them with ``DJANGO_SETTINGS_MODULE=testproject.settings_production``.

The base settings let a fresh checkout run with nothing set: a development
SECRET_KEY, SQLite, a local or embedded Redis. Here nothing is guessed: the
secret key, the hosts and both URLs must come from the environment (set
them before these settings load, or startup stops with
ImproperlyConfigured), DEBUG is off, and the HTTPS settings are the ones
``manage.py check --deploy`` asks for; the test suite runs that check with
``--fail-level WARNING``. Use ``rediss://`` and a Redis ACL user in
REDIS_URL (see docs/howto/security.md).
"""

from __future__ import annotations

import environ
from django.conf import global_settings
from django.core.exceptions import ImproperlyConfigured

_env = environ.Env()
# Checked before the base settings run: they would fall back to SQLite, and
# probe for a local Redis or start an embedded one.
for _name in ("SECRET_KEY", "ALLOWED_HOSTS", "DATABASE_URL", "REDIS_URL"):
    if not _env.str(_name, default=""):
        raise ImproperlyConfigured(
            f"Set the {_name} environment variable: the production settings never guess it.")

from testproject.settings import *  # noqa: E402, F403 -- the base, then what production changes

DEBUG = False
SECRET_KEY = _env.str("SECRET_KEY")
ALLOWED_HOSTS = _env.list("ALLOWED_HOSTS")
# Never the test suite's fast hasher (RJ_FAST_HASHER).
PASSWORD_HASHERS = global_settings.PASSWORD_HASHERS

# HTTPS only, for a year, subdomains included; cookies never sent in clear.
SECURE_SSL_REDIRECT = True
SECURE_HSTS_SECONDS = 31_536_000
SECURE_HSTS_INCLUDE_SUBDOMAINS = True
SECURE_HSTS_PRELOAD = True
SESSION_COOKIE_SECURE = True
CSRF_COOKIE_SECURE = True
# Behind a proxy that terminates TLS, trust its X-Forwarded-Proto header
# (only then: anyone could send it to a server reached directly).
if _env.bool("RJ_BEHIND_TLS_PROXY", default=False):
    SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
