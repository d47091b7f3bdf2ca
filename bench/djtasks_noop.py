"""The no-op task of the django.tasks backends, and what their three sides share.

Each backend's module (djtasks_db, djtasks_redis, djtasks_rq) names its
KIND; Django is set up late, only in the producer process and the worker
(compare.py reads queue lengths without Django).
"""

from __future__ import annotations

import os
from pathlib import Path

BENCH = Path(__file__).resolve().parent
#: The bench project's manage script: ``djtasks_manage.py KIND COMMAND ...``.
MANAGE = BENCH / "djtasks_manage.py"


def setup(kind: str) -> None:
    """Set Django up with the bench project's settings for backend ``kind``."""
    import django

    os.environ["BENCH_DJTASKS"] = kind
    os.environ["DJANGO_SETTINGS_MODULE"] = "djtasks_settings"
    django.setup()


def enqueue(kind: str, count: int) -> None:
    """Enqueue ``count`` no-op jobs one ``.enqueue()`` each (django.tasks has no bulk call)."""
    setup(kind)
    from djtasks_tasks import noop

    for _ in range(count):
        noop.enqueue()
