"""What keeps the job changelist fast on a million rows: filters, search, counting.

Django's defaults scan the whole table on every page: ``AllValuesFieldListFilter``
runs ``SELECT DISTINCT`` over every row, the paginator counts every matching
row, ``date_hierarchy`` groups every row by date, and ``icontains`` search
cannot use an index. Here instead:

- queue and task choices come from a skip scan of their index (one index
  probe per distinct value, on PostgreSQL);
- the count stops at ``COUNT_CAP`` rows and above that shows the planner's
  estimate ("about N");
- time is filtered by relative windows (ranges on the ``enqueued_at`` index);
- search takes a job id or its prefix (primary-key lookups) or part of a
  task path, matched against the few distinct task paths, then looked up by
  index.
"""

from __future__ import annotations

import json
import string
import uuid
from datetime import timedelta
from functools import cached_property
from typing import Any

from django.contrib import admin
from django.core.paginator import Paginator
from django.db import connections
from django.db.models import CharField, Field, Model, Q, QuerySet
from django.db.models.functions import Cast
from django.http import HttpRequest
from django.utils import timezone
from django.utils.translation import gettext_lazy as _

from .backend import ReliableJobsBackend, find_backend
from .backend import reliable_backends as configured_backends
from .dashboard import drift
from .models import Job

#: Rows counted exactly; above this the paginator shows the planner's estimate.
COUNT_CAP = 10_000
#: Distinct values a filter lists at most.
CHOICES_CAP = 200


def distinct_values(queryset: QuerySet[Any], column: str) -> list[str]:
    """Distinct values of ``column`` (which leads an index), at most CHOICES_CAP.

    On PostgreSQL a recursive query jumps from one value to the next through
    the index (a "loose index scan"): cost grows with the number of distinct
    values, not of rows. Other databases use ``DISTINCT``.
    """
    model: type[Model] = queryset.model
    using = queryset.db
    if connections[using].vendor != "postgresql":
        return list(queryset.model._default_manager.using(using).order_by(column)
                    .values_list(column, flat=True).distinct()[:CHOICES_CAP])
    quote = connections[using].ops.quote_name
    field = model._meta.get_field(column)
    assert isinstance(field, Field), f"{column!r} is not a column of {model.__name__}"
    table, col = quote(model._meta.db_table), quote(str(field.column))
    sql = f"""
        WITH RECURSIVE walk(value, n) AS (
            (SELECT {col}, 1 FROM {table} ORDER BY {col} LIMIT 1)
            UNION ALL
            SELECT (SELECT {col} FROM {table} WHERE {col} > walk.value ORDER BY {col} LIMIT 1),
                   walk.n + 1
            FROM walk WHERE walk.value IS NOT NULL AND walk.n < %s
        )
        SELECT value FROM walk WHERE value IS NOT NULL
    """
    with connections[using].cursor() as cursor:
        cursor.execute(sql, [CHOICES_CAP])
        return [row[0] for row in cursor.fetchall()]


class ValuesFilter(admin.SimpleListFilter):
    """Choices from the values present in an indexed column, found by skip scan."""

    column = ""

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        values = distinct_values(model_admin.get_queryset(request), self.column)
        return [(value, value) for value in values]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        value = self.value()
        return queryset.filter(**{self.column: value}) if value else queryset


class QueueFilter(ValuesFilter):
    title = _("queue")
    parameter_name = "queue"
    column = "queue"


class TaskFilter(ValuesFilter):
    title = _("task")
    parameter_name = "task"
    column = "task_path"


#: Time windows of the "enqueued" filter: (parameter, label, age).
WINDOWS = (
    ("1h", _("Last hour"), timedelta(hours=1)),
    ("24h", _("Last 24 hours"), timedelta(days=1)),
    ("7d", _("Last 7 days"), timedelta(days=7)),
    ("30d", _("Last 30 days"), timedelta(days=30)),
)


class EnqueuedFilter(admin.SimpleListFilter):
    """Relative windows on ``enqueued_at``: a range scan on its index."""

    title = _("enqueued")
    parameter_name = "enqueued"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, Any]]:
        return [(key, label) for key, label, _ in WINDOWS] + [("older", _("Older than 30 days"))]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        now = timezone.now()
        if self.value() == "older":
            return queryset.filter(enqueued_at__lt=now - timedelta(days=30))
        for key, _label, age in WINDOWS:
            if self.value() == key:
                return queryset.filter(enqueued_at__gte=now - age)
        return queryset


class DriftFilter(admin.SimpleListFilter):
    """Jobs the database and Redis disagree on (see ``dashboard.drift``)."""

    title = _("Redis drift")
    parameter_name = "drift"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [(alias, str(_("Disagrees with Redis (%(alias)s)") % {"alias": alias}))
                for alias in reliable_backends()]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        alias = self.value()
        if not alias:
            return queryset
        if alias not in reliable_backends():
            return queryset.none()
        return queryset.filter(pk__in=drift(reliable_backend(alias)).ids)


def reliable_backends() -> list[str]:
    """Aliases of the configured backends that are reliable_jobs backends."""
    return [backend.alias for backend in configured_backends()]


def reliable_backend(alias: str) -> ReliableJobsBackend:
    """The backend ``alias``, which the caller found in :func:`reliable_backends`."""
    return find_backend(alias)


#: Shortest id prefix or suffix searched as one (the changelist shows 8 characters).
MIN_ID_PREFIX = 4
#: Longest id suffix searched: the last group of a UUID's text (no dash in it).
MAX_ID_SUFFIX = 12


def search(queryset: QuerySet[Job], term: str) -> QuerySet[Job]:
    """Find jobs by id, by the start or end of an id, or by part of a task path.

    A whole id is a primary-key lookup. A prefix of 4+ hex digits is a range
    on the primary key (every UUID from ``prefix000…`` to ``prefixfff…``);
    being the time an id was made (jobids.py), it finds the jobs of that
    stretch of time. 4 to 12 hex digits also match the ends of ids, so the
    short id the list shows (jobids.short_id) can be pasted back: that test
    reads the ids' text, a scan of the job table, paid only by a search of
    hex digits. Any text also matches the task paths that contain it,
    picked from the few distinct paths, then looked up on the task index.
    """
    term = term.strip()
    if not term:
        return queryset
    try:
        return queryset.filter(pk=uuid.UUID(term))
    except ValueError:
        pass
    matches = Q(task_path__in=[path for path in distinct_values(queryset, "task_path")
                               if term.lower() in path.lower()])
    digits = term.replace("-", "").lower()
    if MIN_ID_PREFIX <= len(digits) <= 32 and all(c in string.hexdigits for c in digits):
        matches |= Q(pk__gte=uuid.UUID(digits.ljust(32, "0")),
                     pk__lte=uuid.UUID(digits.ljust(32, "f")))
        if "-" not in term and len(digits) <= MAX_ID_SUFFIX:
            queryset = queryset.annotate(id_text=Cast("pk", CharField()))
            matches |= Q(id_text__endswith=digits)
    return queryset.filter(matches)


# Generic in django-stubs only: Django's Paginator is not subscriptable at run time.
class EstimatedCountPaginator(Paginator):  # type: ignore[type-arg]
    """Counts exactly up to COUNT_CAP rows, then trusts PostgreSQL's estimate.

    ``estimated`` tells the template to say "about". Deep pages of a huge
    result are rarely wanted; filters are the way in.
    """

    estimated = False

    @cached_property
    def count(self) -> int:
        queryset = self.object_list
        if not isinstance(queryset, QuerySet):
            return super().count
        exact = queryset.order_by()[:COUNT_CAP + 1].count()
        if exact <= COUNT_CAP or connections[queryset.db].vendor != "postgresql":
            return exact if exact <= COUNT_CAP else queryset.count()
        plan = json.loads(queryset.order_by().explain(format="json"))
        if isinstance(plan, list):  # the driver's raw reply, not Django's flattened one
            plan = plan[0]
        self.estimated = True
        return max(COUNT_CAP + 1, int(plan["Plan"]["Plan Rows"]))
