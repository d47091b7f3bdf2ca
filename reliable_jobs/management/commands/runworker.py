"""``manage.py runworker``: run a worker process (see reliable_jobs.worker)."""

from __future__ import annotations

import atexit
import logging
import os
import sys
from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.management.base import CommandError, CommandParser

from reliable_jobs import logformat, metrics
from reliable_jobs.backend import ReliableJobsBackend
from reliable_jobs.health import HeartbeatFile
from reliable_jobs.management.base import ReliableJobsCommand, number, queue_list, whole_number
from reliable_jobs.supervisor import Supervisor, runworker_command_line
from reliable_jobs.worker import Worker, default_worker_id

logger = logging.getLogger("reliable_jobs.worker")


class Command(ReliableJobsCommand):
    help = (
        "Run a reliable_jobs worker: claim jobs from Redis, run them, mirror the outcome. "
        "Stop it with SIGTERM or Ctrl-C (a second one stops at once)."
    )
    backend_help = "TASKS alias to serve (default: %(default)r)."
    logging_mode = "verbosity"
    #: Set when run from the command line (not call_command()): see _exit_promptly.
    _from_command_line = False

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--queue", "-q", action="append", dest="queues", metavar="NAME",
                            help="Queue to serve; repeat or separate with commas "
                                 "(default: every queue of the backend).")
        parser.add_argument("--concurrency", "-c",
                            type=whole_number(1, "--concurrency must be at least 1."), default=1,
                            help="Threads running tasks (default: %(default)r).")
        parser.add_argument("--prefetch",
                            type=whole_number(0, "--prefetch must be at least 0."), default=None,
                            help="Jobs claimed beyond those running, so one claim fetches a "
                                 "batch (default: OPTIONS['PREFETCH']).")
        parser.add_argument("--burst", action="store_true",
                            help="Exit when nothing is queued, running or scheduled.")
        parser.add_argument("--burst-give-up",
                            type=number(0, "--burst-give-up must be more than 0 seconds.",
                                        above=True),
                            default=60.0, metavar="SECONDS",
                            help="With --burst: exit with an error when Redis has not answered "
                                 "for this long (default: %(default)r).")
        parser.add_argument("--max-jobs",
                            type=whole_number(1, "--max-jobs must be at least 1."), default=None,
                            help="Exit after claiming this many jobs (default: no limit).")
        parser.add_argument("--worker-id", default=None,
                            help="Name shown in attempts and heartbeats "
                                 "(default: host:pid:random).")
        parser.add_argument("--grace", type=float, default=30.0,
                            help="Seconds running jobs get to finish after the first "
                                 "SIGTERM (default: %(default)r).")
        parser.add_argument("--no-scheduler", action="store_false", dest="scheduler",
                            help="Do not fire periodic jobs from this worker (by default every "
                                 "worker runs a scheduler; each slot is enqueued once however "
                                 "many do).")
        parser.add_argument("--processes",
                            type=whole_number(1, "--processes must be at least 1."), default=1,
                            help="Worker processes, each running --concurrency threads. Above "
                                 "1 this process supervises them: it restarts one that fails "
                                 "or is killed, forwards SIGTERM/SIGINT, and exits once all "
                                 "have exited. Their ids are <--worker-id>-<n> "
                                 "(default: %(default)r).")
        parser.add_argument("--metrics-port", type=int, default=None, metavar="PORT",
                            help="Serve Prometheus metrics over HTTP on this port (needs the "
                                 "prometheus extra). With --processes P, process i of P "
                                 "listens on PORT + i (default: no metrics server).")
        parser.add_argument("--metrics-addr", default="0.0.0.0", metavar="ADDRESS",
                            help="Address the metrics server listens on "
                                 "(default: %(default)r).")
        parser.add_argument("--heartbeat-file", default=None, metavar="PATH",
                            help="Touch PATH every few seconds while the claim loop runs, for "
                                 "a liveness probe on its age; with --processes every process "
                                 "touches it (default: none).")
        parser.add_argument("--log-format", choices=logformat.LOG_FORMATS, default=None,
                            help="'text' lines, or 'json' lines (one object per line, with "
                                 "each attempt's fields) for log shippers (default: "
                                 "settings.RELIABLE_JOBS_LOG_FORMAT, or 'text').")

    def log_format(self, options: dict[str, Any]) -> str:
        log_format: str = (options["log_format"]
                           or getattr(settings, "RELIABLE_JOBS_LOG_FORMAT", "text"))
        if log_format not in logformat.LOG_FORMATS:
            raise CommandError(f"RELIABLE_JOBS_LOG_FORMAT must be 'text' or 'json', not "
                               f"{log_format!r}.")
        return log_format

    def handle_backend(self, backend: ReliableJobsBackend, options: dict[str, Any]) -> None:
        queues = queue_list(options["queues"]) or sorted(backend.queues)
        unknown = sorted(set(queues) - backend.queues)
        if unknown:
            raise CommandError(
                f"Queue(s) {', '.join(unknown)} are not in TASKS[{backend.alias!r}]['QUEUES'] "
                f"({', '.join(sorted(backend.queues))})."
            )
        port = options["metrics_port"]
        if port is not None:
            if not metrics.available():
                raise CommandError(f"--metrics-port cannot work: {metrics.MISSING}")
            if not 0 < port <= 65535 - options["processes"] + 1:
                raise CommandError("--metrics-port must leave room for one port per process "
                                   "below 65536.")
        if options["processes"] > 1:
            if options["heartbeat_file"]:
                # Here too: children failing on it would only be restarted, again and again.
                self._check_writable(options["heartbeat_file"])
            supervisor = Supervisor(runworker_command_line(), processes=options["processes"],
                                    base_id=options["worker_id"] or default_worker_id(),
                                    metrics_port=port)
            if supervisor.run():
                raise CommandError("A worker process did not stop cleanly (logged above).")
            return
        if not metrics.stop_counting_unless_served(port) and metrics.available():
            logger.debug("Prometheus counters are off in this worker: no --metrics-port and "
                         "no PROMETHEUS_MULTIPROC_DIR, so nothing could read them.")
        progress = self.stdout.write if options["burst"] and options["verbosity"] >= 1 else None
        worker = Worker(
            backend, queues=queues, concurrency=options["concurrency"],
            worker_id=options["worker_id"], burst=options["burst"],
            max_jobs=options["max_jobs"], grace_s=options["grace"],
            prefetch=options["prefetch"], progress=progress,
            give_up_s=options["burst_give_up"] if options["burst"] else None,
            scheduler=options["scheduler"],
        )
        worker.install_signal_handlers()
        if port is not None:
            try:
                metrics.serve(port, worker, addr=options["metrics_addr"])
            except OSError as exc:
                raise CommandError(f"Cannot serve metrics on {options['metrics_addr']}:{port} "
                                   f"({exc.strerror or exc}).") from None
        heartbeat = None
        if options["heartbeat_file"]:
            self._check_writable(options["heartbeat_file"])
            heartbeat = HeartbeatFile(options["heartbeat_file"], worker)
            heartbeat.start()
        try:
            worker.run()
        finally:
            # Stopped: what is left is the interpreter's exit, during which
            # Python puts back the default action of the signals it handled. A
            # second SIGTERM arriving then would turn a clean stop into a
            # death by signal (exit -15, which a supervisor reports).
            worker.ignore_signals()
            if heartbeat is not None:
                heartbeat.stop()
        error = None
        if worker.crashed:
            error = ("A worker thread died of an unexpected error (logged above); its jobs "
                     "were handed back.")
        elif worker.gave_up:
            error = (f"Redis did not answer for {options['burst_give_up']:g} s; the burst run "
                     "gave up (its jobs stay queued). Check REDIS_URL and that Redis is running.")
        if worker.left_running:
            self._end_now(worker.left_running, error)
        if error is not None:
            raise CommandError(error)
        if self._from_command_line:
            self._exit_promptly()

    def run_from_argv(self, argv: list[str]) -> None:
        self._from_command_line = True
        super().run_from_argv(argv)

    @staticmethod
    def _exit_promptly() -> None:
        """End a cleanly stopped worker process now, without the interpreter's teardown.

        Everything the worker owns is settled by then: every outcome
        mirrored and applied, the rest handed back, its heartbeat gone. What
        is left is Python freeing every module and object one by one (a few
        hundred milliseconds after a long run on a busy machine, during
        which a deploy waits for the old worker), and waiting for any
        non-daemon thread a task's library left running. Exit handlers
        registered with ``atexit`` (an OpenTelemetry SDK's flush, logging's
        own) still run first; only the teardown after them is skipped.
        Never under ``call_command()``, whose caller's process goes on.
        """
        atexit._run_exitfuncs()
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)

    def _end_now(self, running: int, error: str | None) -> None:
        """End the process at once: tasks still run in its threads.

        Their jobs are left to their leases, renewed one last time as the
        worker stopped, and another worker may run them once a lease
        expires. An interpreter teardown (atexit, finalizers) can take
        seconds on a busy machine, and a thread could run on meanwhile;
        ``os._exit`` ends every thread now, well within the lease. (Hence
        runworker is started from the command line, not call_command().)
        """
        logger.warning("Exiting now: %d task(s) still running in threads end with the process.",
                       running)
        if error is not None:
            self.stderr.write(f"CommandError: {error}")
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1 if error is not None else 0)

    @staticmethod
    def _check_writable(path: str) -> None:
        try:
            Path(path).touch()
        except OSError as exc:
            raise CommandError(f"Cannot write the heartbeat file {path!r} "
                               f"({exc.strerror or exc}).") from None
