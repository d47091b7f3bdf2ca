"""Periodic jobs: cron expressions and intervals, each slot enqueued exactly once.

Declare a schedule next to its task with :func:`periodic` (or in the
backend's OPTIONS['SCHEDULE']); every ``runworker`` runs a scheduler
(``scheduler.py``) unless started with ``--no-scheduler``. Slot times come
from ``timetable.py``; the proof that a slot was enqueued is its
``ScheduleSlot`` row, inserted in the same transaction as the job's row.
"""

from __future__ import annotations

from .declared import CATCH_UP, Declaration, periodic
from .timetable import Cron, Every, TimetableError

__all__ = ["CATCH_UP", "Cron", "Declaration", "Every", "TimetableError", "periodic"]
