"""What the jobs admin and the periodic jobs admin both show: read-only pages, badges, times.

A module of its own so that both admins import it and neither imports the other.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from django.http import HttpRequest
from django.utils import timezone
from django.utils.html import format_html
from django.utils.safestring import SafeString


class ReadOnlyMixin:
    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


def badge(kind: str, value: str, label: Any) -> SafeString:
    """A coloured label; ``value`` picks the colour class (admin.css)."""
    return format_html('<span class="rj-badge rj-{}-{}">{}</span>', kind, value, label)


def timestamp(moment: datetime | None, *, ms: bool = True) -> str | None:
    """A sortable local time to the second (or millisecond): job timings need it.

    None for no time, so the admin shows its empty-value dash.
    """
    if moment is None:
        return None
    local = timezone.localtime(moment)
    text = f"{local:%Y-%m-%d %H:%M:%S}"
    return f"{text}.{local.microsecond // 1000:03d}" if ms else text
