"""Imported once by the forkserver (see isolation.py): set Django up, load tasks.

Every child forked from the server starts with Django ready and the task
allow-list filled, so an isolated attempt costs a fork, not a Django start.

First of all, the forkserver binds its life to the worker's: a forkserver
left behind by a SIGKILLed worker would keep its running children alive.
"""

from __future__ import annotations

import os
import signal

from reliable_jobs.lifetime import die_with_parent

#: This forkserver's pid: each child checks that it is still its parent.
FORKSERVER_PID = os.getpid()

# isolation.FORKSERVER_PARENT_ENV, spelled out: importing isolation here would
# import Django before this process is bound to its worker.
_worker_pid = os.environ.pop("RELIABLE_JOBS_FORKSERVER_PARENT", None)
die_with_parent(int(_worker_pid) if _worker_pid else None, signal.SIGKILL)

import django  # noqa: E402 - after the forkserver is bound to its worker

django.setup()

from reliable_jobs.tasks import discover  # noqa: E402 - needs django.setup() first

discover()
