"""Imported once by the forkserver (see isolation.py): set Django up, load tasks.

Every child forked from the server starts with Django ready and the task
allow-list filled, so an isolated attempt costs a fork, not a Django start.
"""

import django

django.setup()

from reliable_jobs.tasks import discover  # noqa: E402 - needs django.setup() first

discover()
