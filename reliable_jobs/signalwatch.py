"""Whether anyone can see a job's ``TaskResult``: Django's task signals, watched cheaply.

The ``django.tasks`` contract sends ``task_enqueued`` per job enqueued, and
``task_started`` and ``task_finished`` with a ``TaskResult`` per attempt.
Building that result (with ``normalize_json`` of the arguments) and sending
both signals cost about a sixth of a no-op job's worker CPU, and the Tasks
framework always connects receivers of its own to
both: ``log_task_started`` and ``log_task_finished``, which only log to its
logger. ``runworker`` silences that logger below ``-v 2`` (see
``management/base.py``), so in a stock project those sends reach a logger
that drops them, and ``Signal.has_listeners`` alone cannot tell.

:class:`SignalWatch` answers "would a send be seen?": yes when a receiver
other than the framework's own log receivers is live for the sender, or
when those log receivers would write a line (their logger enabled for
the level they log at: INFO for a start and a success, DEBUG for an
enqueue; the backport's are no higher). The backend asks about
``task_enqueued`` once per ``enqueue_many`` (a signal per job was a tenth
of a bulk enqueue's Python); a single enqueue always sends. It reads the
receivers again only when ``Signal.receivers`` changes (a connect or disconnect at
any time, even while the worker runs), so a job pays one list comparison
and one level check.

A failed attempt's ``task_finished`` is not decided here: it is sent
whenever the signal has any listener (Django logs failures at ERROR, which
a quiet logger still writes), as before.
"""

from __future__ import annotations

import logging
from typing import Any

from .compat import TASKS_LOGGER

#: The Tasks framework's own receivers, which only log (``django.tasks.signals``
#: or the backport's ``django_tasks.signals``), by module and name.
FRAMEWORK_MODULES = frozenset({"django.tasks.signals", "django_tasks.signals"})
FRAMEWORK_LOG_RECEIVERS = frozenset({"log_task_enqueued", "log_task_started",
                                     "log_task_finished"})


def is_framework_log_receiver(receiver: Any) -> bool:
    """Whether ``receiver`` is one of the framework's own log-only receivers."""
    return (getattr(receiver, "__module__", None) in FRAMEWORK_MODULES
            and getattr(receiver, "__name__", None) in FRAMEWORK_LOG_RECEIVERS)


class SignalWatch:
    """Whether a send of ``signal`` by ``sender`` would be seen by anyone."""

    def __init__(self, signal: Any, sender: type, *, level: int = logging.INFO) -> None:
        self._signal = signal
        self._sender = sender
        self._level = level
        self._logger = logging.getLogger(TASKS_LOGGER)
        #: The ``Signal.receivers`` list last read (a copy), and what it held.
        self._seen: list[Any] | None = None
        self._foreign = True
        self._logs = True

    def observed(self) -> bool:
        """Whether sending now would reach a receiver that does something visible."""
        receivers = self._signal.receivers
        if receivers != self._seen:
            self._read(receivers)
        return self._foreign or (self._logs and self._logger.isEnabledFor(self._level))

    def _read(self, receivers: list[Any]) -> None:
        seen = list(receivers)
        try:
            # Private but stable since Django 5.0 (the oldest we support):
            # (sync receivers, async receivers) live for this sender.
            sync, asynchronous = self._signal._live_receivers(self._sender)
            live = [*sync, *asynchronous]
        except Exception:  # another shape: assume someone listens, as has_listeners would
            self._foreign, self._logs, self._seen = True, True, seen
            return
        self._foreign = any(not is_framework_log_receiver(r) for r in live)
        self._logs = any(is_framework_log_receiver(r) for r in live)
        self._seen = seen
