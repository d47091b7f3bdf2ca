"""Masking secrets in what people read: log lines, check messages, error reports.

Django hides settings whose *name* looks secret; the Redis URL carries its
password inside the *value*, so every place that shows a URL goes through
:func:`mask_password`.
"""

from __future__ import annotations

import re
from typing import Any

from django.views import debug


def mask_password(url: str) -> str:
    """Return ``url`` with every password replaced by ``***`` (for logs and messages).

    Masks the password of the user info (``redis://user:***@host``) and the
    value of any query parameter whose name holds "password" (redis-py reads
    ``?password=`` and ``?ssl_password=`` from the URL too). Works on URLs
    ``urlsplit`` refuses (a bad port, an unclosed IPv6 bracket), since those
    are exactly the ones an error message shows. Up to the last ``@`` before
    the query is user info, so an unescaped ``/`` or ``@`` in a password is
    masked too.
    """
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    userinfo, at, host_and_rest = rest.rpartition("@")
    if at and ":" in userinfo:
        rest = f"{userinfo.split(':', 1)[0]}:***@{host_and_rest}"
    rest, question, query = rest.partition("?")
    if question:
        query = _PASSWORD_PARAM.sub(r"\1***", query)
    return f"{scheme}://{rest}{question}{query}"


#: A query parameter holding a password, up to its value's end.
_PASSWORD_PARAM = re.compile(r"((?:^|[&;])[^=&;]*password[^=&;]*=)[^&;#]*", re.IGNORECASE)


class SafeExceptionReporterFilter(debug.SafeExceptionReporterFilter):
    """Django's error-report filter, plus: passwords inside URLs are masked.

    Django hides settings whose *name* looks secret (``PASSWORD``, ``KEY``,
    ...), but ``TASKS['default']['OPTIONS']['REDIS_URL']`` carries its
    password inside the *value*, so the debug page and the error e-mails to
    ``ADMINS`` would show it. Set ``DEFAULT_EXCEPTION_REPORTER_FILTER =
    "reliable_jobs.redaction.SafeExceptionReporterFilter"`` to mask it (and any
    other URL's password).
    """

    def cleanse_setting(self, key: Any, value: Any) -> Any:
        cleansed = super().cleanse_setting(key, value)
        return mask_password(cleansed) if isinstance(cleansed, str) else cleansed
