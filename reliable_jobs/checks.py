"""System checks for ``ReliableJobsBackend`` settings, with stable ids.

``manage.py check`` reports every problem at once, instead of the first
enqueue failing in production. Every id is listed here. The checks of one
backend's settings (``backend.check()``) live in :mod:`reliable_jobs.backendchecks`,
a layer down, where :data:`~reliable_jobs.backendchecks.PROBLEM_IDS` names the
id of each kind of problem (:class:`~reliable_jobs.conf.ProblemKind`) that
``conf.parse`` and ``ReliableJobsBackend.problems()`` report; this module
registers the app-wide ones. Ids:

- E001 unknown OPTIONS key (a typo), E002 bad REDIS_URL, E003 bad value,
  E004 MAX_ATTEMPTS < 1, E005 unusable PREFIX or queue name, E006 lease not
  longer than its renewal interval, E007 reconcile grace shorter than a
  lease, E008 DATABASE alias unknown, E009 app not in INSTALLED_APPS.
- E010 a bad OPTIONS['SHARDS'] entry (not 1 to 1024 shards, or a queue not
  in QUEUES).
- E011 a bad OPTIONS['SCHEDULE'] entry (cron expression, interval, time
  zone, policy, arguments); E012 a schedule naming a task no worker runs,
  or a queue the backend does not serve; E013 a schedule name declared twice
  differently.
- E015 a unique task (``unique_for_ms``) whose backend's database has no
  partial unique indexes (MySQL, MariaDB, Oracle): equal calls would not be
  deduplicated.
- E016 the job mirror on SQLite without ``transaction_mode`` "IMMEDIATE"
  (or "EXCLUSIVE"): row locks do nothing there, so the mirror's writers
  must take the database's write lock when their transaction begins.
- E017 a bad OPTIONS['QUEUE_LIMITS'] or OPTIONS['TASK_OPTIONS'] entry (a rate
  that is not count/period, a cap that is not 1 to 10,000, an unknown key);
  E018 a limit naming a queue not in QUEUES or a task no installed app
  defines; E019 a limit on a sharded queue (each shard would enforce it alone).
- E027 a bad OPTIONS['FAIR_WEIGHTS'] entry (a group that is not a fair
  group name, or a weight not from 1 to 1000).
- W001 Redis does not answer (a warning: it may start after the web app).
- W003 Redis may evict keys (maxmemory-policy is not noeviction); a
  deployment check (``check --deploy``).
- W002 REDIS_URL not set (absent, None or empty: usually an environment
  variable that is missing), so the default URL is used.
- E014 settings.RELIABLE_JOBS_LOG_FORMAT is neither "text" nor "json".
- W020 the metrics view is mounted but prometheus_client is not installed.
- W029 a debounced task (``debounce_ms``) shorter than SWEEP_INTERVAL_MS:
  its runs may start later than its quiet period.

Nothing here runs at import: a missing or unreachable Redis is reported by
``manage.py check``, never raised while settings or apps load.
"""

from __future__ import annotations

from typing import Any

from django.core import checks

from .backendchecks import PING_TIMEOUT_S
from .broker import REDIS_ERRORS, connect
from .redaction import mask_password


@checks.register(checks.Tags.compatibility, deploy=True)
def check_redis_eviction(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    """W003 (``check --deploy``) unless Redis is known never to evict keys.

    An evicting Redis drops job hashes, leases or whole lists under memory
    pressure: jobs then wait for reconcile, and an evicted tombstone lets a
    late push run a job again. A deployment check only: it needs CONFIG GET,
    which the minimal ACL does not grant (workers run the ordinary checks,
    and a refused command would fill the ACL log); a user without CONFIG
    rights is not warned, the policy cannot be read.
    """
    from .backend import reliable_backends

    messages: list[checks.CheckMessage] = []
    for backend in reliable_backends():
        if not backend.problems():
            where = f"TASKS[{backend.alias!r}]"
            messages += _check_eviction(where, backend.config.REDIS_URL)
    return messages


def _check_eviction(where: str, url: str) -> list[checks.CheckMessage]:
    client = connect(url, socket_timeout=PING_TIMEOUT_S)
    try:
        policies = client.config_get("maxmemory-policy")
    except (*REDIS_ERRORS, OSError):  # type: ignore[misc]  # mypy cannot unpack a tuple[type, ...]
        return []
    finally:
        client.close()
    found = {str(v) for v in (policies.values() if isinstance(policies, dict) else [])}
    if not found or found == {"noeviction"}:
        return []
    return [checks.Warning(
        f"{where}: Redis at {mask_password(url)} has maxmemory-policy "
        f"{', '.join(sorted(found))}: it may evict job data under memory pressure.",
        hint="Set maxmemory-policy noeviction (CONFIG SET maxmemory-policy noeviction, and in "
             "redis.conf): a full Redis should refuse writes, never drop jobs.",
        id="reliable_jobs.W003",
    )]


@checks.register(checks.Tags.compatibility)
def check_log_format(app_configs: Any = None, **kwargs: Any) -> list[checks.CheckMessage]:
    """E014 unless RELIABLE_JOBS_LOG_FORMAT (runworker's default --log-format) is known."""
    from django.conf import settings

    from .logformat import LOG_FORMATS

    value = getattr(settings, "RELIABLE_JOBS_LOG_FORMAT", "text")
    if value in LOG_FORMATS:
        return []
    return [checks.Error(
        f"settings.RELIABLE_JOBS_LOG_FORMAT is {value!r}; runworker prints 'text' or 'json' "
        "lines.",
        hint="Set it to 'json' for one JSON object per line, or remove it.",
        id="reliable_jobs.E014",
    )]


@checks.register(checks.Tags.urls)
def check_metrics_view(**kwargs: Any) -> list[checks.CheckMessage]:
    """W020: the metrics view is mounted but prometheus_client is not installed."""
    from . import metrics

    if metrics.available():
        return []
    from django.urls import get_resolver

    try:
        mounted = metrics.mounted(list(get_resolver().url_patterns))
    except Exception:  # a broken URLconf is Django's own check to report
        return []
    if not mounted:
        return []
    return [checks.Warning(
        "The reliable_jobs metrics view is mounted, but " + metrics.MISSING,
        hint="Install the extra, or remove the view from your URLconf.",
        id="reliable_jobs.W020",
    )]
