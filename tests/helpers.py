"""Helpers shared by test modules (fixtures live in conftest.py)."""

from __future__ import annotations

from datetime import timedelta

from django.utils import timezone

from reliable_jobs.models import Job


def backdate(*job_ids: str) -> None:
    """Make rows old enough for reconcile (their grace period long past)."""
    Job.objects.filter(pk__in=job_ids).update(updated_at=timezone.now() - timedelta(hours=1))
