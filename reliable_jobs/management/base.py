"""The base of every reliable_jobs management command.

Each command works on one task backend: this class adds ``--backend``,
resolves it to a :class:`~reliable_jobs.backend.ReliableJobsBackend` (or
refuses, saying why), refuses one whose OPTIONS the system checks would
reject, and maps ``-v`` onto the ``reliable_jobs`` loggers, so a command's
``handle_backend`` starts with a backend it can use. Argument checks live in
argparse ``type=`` functions (as django-tasks' ``db_worker`` does), built by
:func:`whole_number` and :func:`number`: a bad value is refused while the
command line is parsed, before any server is asked.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from typing import Any, ClassVar, Literal

from django.core.management.base import BaseCommand, CommandError, CommandParser

from reliable_jobs import logformat
from reliable_jobs.backend import BackendNotFound, ReliableJobsBackend, find_backend
from reliable_jobs.compat import (
    DEFAULT_TASK_BACKEND_ALIAS,
    TASKS_LOGGER,
)

VERBOSITY_LEVELS = {0: logging.WARNING, 1: logging.INFO, 2: logging.DEBUG, 3: logging.DEBUG}


def whole_number(minimum: int, message: str) -> Callable[[str], int]:
    """An argparse ``type=``: a whole number >= ``minimum``, else ``message``."""
    return _checked(int, lambda value: value >= minimum, message)


def number(minimum: float, message: str, *, above: bool = False) -> Callable[[str], float]:
    """An argparse ``type=``: a number >= ``minimum`` (> with ``above``), else ``message``.

    ``message`` may name the value refused as ``{value!r}``.
    """
    return _checked(float, (lambda value: value > minimum) if above
                    else (lambda value: value >= minimum), message)


def _checked[T](convert: Callable[[str], T], accept: Callable[[T], bool],
                message: str) -> Callable[[str], T]:
    """``convert`` then ``accept``, refusing with a CommandError that says ``message``.

    A CommandError, not argparse's ArgumentTypeError: argparse turns the
    latter into its own usage text and exit status 2, where these commands
    say one sentence and exit 1 (see ``ReliableJobsCommand.run_from_argv``).
    Text that is no number at all still gets argparse's own "invalid int
    value" line, which is why the function takes ``convert``'s name.
    """
    def parse(text: str) -> T:
        value = convert(text)
        if not accept(value):
            raise CommandError(message.format(value=value))
        return value

    parse.__name__ = getattr(convert, "__name__", "value")
    return parse


def configure_logging(verbosity: int, log_format: str = "text") -> None:
    """Map ``-v`` onto the reliable_jobs loggers, printing to stderr.

    Django's own ``django.tasks`` logger (``django_tasks`` with the backport)
    repeats our per-job line with less in it (and costs about 20 us a job); it
    speaks only from ``-v 2`` on. Below that it is silenced outright, not
    just held to WARNING: it logs every failed attempt at ERROR with the
    full traceback, beside our one line that already names the error (the
    traceback is kept in the job's attempt, shown in the admin).
    ``log_format`` "json" prints JSON lines (see reliable_jobs.logformat),
    through the handlers the project gave the reliable_jobs logger, if any.
    """
    logger = logging.getLogger("reliable_jobs")
    logger.setLevel(VERBOSITY_LEVELS.get(verbosity, logging.DEBUG))
    logging.getLogger(TASKS_LOGGER).setLevel(
        logging.DEBUG if verbosity >= 2 else logging.CRITICAL + 1)
    if log_format == "json":
        logformat.use_json_lines(logger)
    elif not logger.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(logformat.TEXT_FORMAT))
        logger.addHandler(handler)


def quiet_logging() -> None:
    """Silence per-job log lines for commands that measure or print a table."""
    for name in ("reliable_jobs", TASKS_LOGGER):
        logging.getLogger(name).setLevel(logging.WARNING)


def queue_list(values: list[str] | None) -> list[str]:
    """``--queue`` given repeatedly and/or comma-separated, as one list."""
    return [q.strip() for value in values or [] for q in value.split(",") if q.strip()]


def get_backend(alias: str) -> ReliableJobsBackend:
    """Return the reliable_jobs backend ``alias``, or raise a CommandError that says why."""
    try:
        return find_backend(alias)
    except BackendNotFound as exc:
        raise CommandError(str(exc)) from None


class ReliableJobsCommand(BaseCommand):
    """A command on one reliable_jobs backend; subclasses write ``handle_backend``."""

    #: ``--backend``'s help; ``%(default)r`` is the default alias.
    backend_help: ClassVar[str] = "TASKS alias to use (default: %(default)r)."
    #: What ``-v`` does to logging: "verbosity" maps it onto the loggers (for
    #: commands whose log lines are their output), "quiet" silences per-job
    #: lines (for commands that print a table), None leaves logging alone.
    logging_mode: ClassVar[Literal["verbosity", "quiet"] | None] = None
    #: Refuse a backend whose OPTIONS the system checks report as errors.
    refuse_bad_options: ClassVar[bool] = True

    def create_parser(self, prog_name: str, subcommand: str, **kwargs: Any) -> CommandParser:
        parser = super().create_parser(prog_name, subcommand, **kwargs)
        parser.add_argument("--backend", default=DEFAULT_TASK_BACKEND_ALIAS,
                            help=self.backend_help)
        return parser

    def run_from_argv(self, argv: list[str]) -> None:
        """Report a refused argument as Django reports a CommandError from ``handle``.

        Django parses the command line outside the handler that prints a
        CommandError as one line and exits with its status, so a ``type=``
        check's refusal would otherwise end in a traceback.
        """
        try:
            super().run_from_argv(argv)
        except CommandError as exc:
            if "--traceback" in argv:
                raise
            self.stderr.write(f"CommandError: {exc}")
            sys.exit(exc.returncode)

    def log_format(self, options: dict[str, Any]) -> str:
        """The log format for ``logging_mode`` "verbosity" (a subclass may offer a choice)."""
        return "text"

    def handle(self, *args: Any, **options: Any) -> None:
        if self.logging_mode == "verbosity":
            configure_logging(options["verbosity"], self.log_format(options))
        elif self.logging_mode == "quiet":
            quiet_logging()
        backend = get_backend(options["backend"])
        if self.refuse_bad_options and backend.config.problems:
            raise CommandError(" ".join(message for _, message in backend.config.problems))
        self.handle_backend(backend, options)

    def handle_backend(self, backend: ReliableJobsBackend, options: dict[str, Any]) -> None:
        """The command's work, on a backend that passed the checks above."""
        raise NotImplementedError
