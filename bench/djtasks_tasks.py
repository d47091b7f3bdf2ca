"""The django.tasks no-op task (imported once Django is set up: defining it validates
it against the configured backend)."""

from __future__ import annotations

from django.tasks import task


@task
def noop() -> None:
    """Do nothing: what is left is the queue's own cost."""
