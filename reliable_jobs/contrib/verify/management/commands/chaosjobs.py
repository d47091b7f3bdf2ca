"""``manage.py chaosjobs``: SIGKILL workers under load, count every job (see verify/chaos.py)."""

from __future__ import annotations

from typing import Any

from django.core.management.base import CommandError, CommandParser

from reliable_jobs.backend import ReliableJobsBackend
from reliable_jobs.management.base import ReliableJobsCommand

from ...chaos import DEFAULT_TASK, ChaosConfig, ChaosError, ChaosRun, Interrupted


class Command(ReliableJobsCommand):
    help = (
        "Chaos run: start --workers `runworker` processes and a `recoverjobs --interval 0.5` "
        "sweep, enqueue --jobs jobs, SIGKILL a random worker every --kill-every seconds for "
        "--duration seconds (starting a replacement each time), optionally SIGTERM one every "
        "--sigterm-every seconds as a rolling deploy does, optionally empty Redis "
        "(--flush-redis-at) and cut PostgreSQL off (--cut-postgres-at), wait for the queue to "
        "drain, stop every process it started, and print a table: enqueued, succeeded, dead, "
        "lost (must be 0), run more than once, worst crash-to-rerun time, and what the "
        "execution ledger (every run of the task, written by the task itself) shows: runs "
        "of one job at the same time, re-runs no crash explains, final states the last run "
        "contradicts (each must be 0). Exits 1 if any of these is not 0, a job was lost or "
        "the drain timed out. The children use this process's environment and "
        "settings. The lease decides recovery: a killed worker's jobs come back after "
        "OPTIONS['LEASE_MS'] (default 30 s), so use short leases for the run, e.g. "
        "OPTIONS {\"LEASE_MS\": 2000, \"SWEEP_INTERVAL_MS\": 250, \"RECONCILE_GRACE_MS\": "
        "5000} (reliable_jobs' own test project reads them from RJ_OPTIONS). The default "
        "--task is this app's and belongs to the default reliable_jobs backend. Needs an "
        "idle queue; never run it against production."
    )
    logging_mode = "quiet"

    def add_arguments(self, parser: CommandParser) -> None:
        defaults = ChaosConfig()
        parser.add_argument("--jobs", type=int, default=defaults.jobs,
                            help="Jobs to enqueue (default: %(default)r).")
        parser.add_argument("--workers", type=int, default=defaults.workers,
                            help="Worker processes kept running (default: %(default)r).")
        parser.add_argument("--concurrency", type=int, default=defaults.concurrency,
                            help="Threads per worker (default: %(default)r).")
        parser.add_argument("--kill-every", type=float, default=defaults.kill_every_s,
                            help="Seconds between two SIGKILLs (default: %(default)r).")
        parser.add_argument("--duration", type=float, default=defaults.duration_s,
                            help="Seconds of killing; it stops earlier if the queue drains "
                                 "(default: %(default)r).")
        parser.add_argument("--drain-timeout", type=float, default=defaults.drain_timeout_s,
                            help="Seconds to wait for the queue to drain after the kills "
                                 "(default: %(default)r).")
        parser.add_argument("--task-ms", type=int, default=defaults.task_ms,
                            help="Milliseconds each job sleeps, so jobs are running when their "
                                 "worker dies (default: %(default)r).")
        parser.add_argument("--task", default=DEFAULT_TASK,
                            help="Registered task to enqueue; it is called with one argument, "
                                 "the seconds to sleep, plus fail_attempts=1 or give_up=True "
                                 "for planned failures. The default writes the execution "
                                 "ledger; a task that does not is not checked by it "
                                 "(default: %(default)r).")
        parser.add_argument("--fail-percent", type=float, default=defaults.fail_percent,
                            help="Percent of jobs planned to fail their first attempt, then "
                                 "succeed on a retry (default: %(default)r).")
        parser.add_argument("--give-up-percent", type=float, default=defaults.give_up_percent,
                            help="Percent of jobs planned to raise PermanentFailure: they must "
                                 "end dead with that reason (default: %(default)r).")
        parser.add_argument("--flush-redis-at", type=float, default=None, metavar="SECONDS",
                            help="Seconds into the chaos to empty the backend's Redis database "
                                 "with FLUSHDB, as a restart without persistence would: every "
                                 "key of that database index goes, not only the queue's "
                                 "(default: never).")
        parser.add_argument("--cut-postgres-at", type=float, default=None, metavar="SECONDS",
                            help="Seconds into the chaos to cut every child off PostgreSQL "
                                 "through a TCP proxy (needs DATABASE_URL; default: never).")
        parser.add_argument("--cut-postgres-for", type=float,
                            default=defaults.cut_postgres_for_s, metavar="SECONDS",
                            help="How long PostgreSQL stays cut off (default: %(default)r).")
        parser.add_argument("--sigterm-every", type=float, default=None, metavar="SECONDS",
                            help="Rolling deploy: every this many seconds SIGTERM a random "
                                 "worker and start its replacement at once; the ledger then "
                                 "also checks that a job whose run ended within its worker's "
                                 "grace period never runs again (default: never).")
        parser.add_argument("--second-sigterm-every", type=int,
                            default=defaults.second_sigterm_every, metavar="N",
                            help="With --sigterm-every: every N-th stop gets a second SIGTERM "
                                 "a second later, a hard stop (0: never; default: %(default)r).")
        parser.add_argument("--grace", type=float, default=defaults.grace_s,
                            help="Each worker's --grace, in seconds (default: %(default)r).")
        parser.add_argument("--long-percent", type=float, default=defaults.long_percent,
                            help="Percent of jobs that sleep --long-ms instead of --task-ms, "
                                 "so a stop finds them running past --grace "
                                 "(default: %(default)r).")
        parser.add_argument("--long-ms", type=int, default=defaults.long_ms,
                            help="Milliseconds a long job sleeps (default: %(default)r).")
        parser.add_argument("--seed", type=int, default=None,
                            help="Seed of the choice of victims (default: random, printed).")
        parser.add_argument("--queue", default=None,
                            help="Queue to use (default: the backend's first queue).")

    def handle_backend(self, backend: ReliableJobsBackend, options: dict[str, Any]) -> None:
        config = ChaosConfig(
            jobs=options["jobs"], workers=options["workers"],
            concurrency=options["concurrency"], kill_every_s=options["kill_every"],
            duration_s=options["duration"], drain_timeout_s=options["drain_timeout"],
            task_ms=options["task_ms"], seed=options["seed"], queue=options["queue"],
            task_path=options["task"], child_verbosity=max(0, options["verbosity"] - 1),
            fail_percent=options["fail_percent"], give_up_percent=options["give_up_percent"],
            flush_redis_at_s=options["flush_redis_at"],
            cut_postgres_at_s=options["cut_postgres_at"],
            cut_postgres_for_s=options["cut_postgres_for"],
            sigterm_every_s=options["sigterm_every"],
            second_sigterm_every=options["second_sigterm_every"], grace_s=options["grace"],
            long_percent=options["long_percent"], long_ms=options["long_ms"],
        )
        run = ChaosRun(backend, config, out=self.stdout.write)
        try:
            report = run.run()
        except ChaosError as exc:
            raise CommandError(str(exc)) from None
        except Interrupted as exc:
            raise CommandError(f"Interrupted by {exc}; every process the run started was "
                               "stopped.") from None
        self.stdout.write("\n" + report.table())
        if report.evidence:
            self.stdout.write("\nExecution ledger findings (times UTC):\n"
                              + "\n".join(report.evidence))
        if not report.ok:
            ledger = report.ledger
            raise CommandError(
                ("The queue did not drain within --drain-timeout. " if report.drain_s is None
                 else "") + f"{report.lost} job(s) lost. "
                + (f"{report.dead_without_error} dead job(s) without an error. "
                   if report.dead_without_error else "")
                + (f"The execution ledger found {len(ledger.overlaps)} concurrent run pair(s), "
                   f"{len(ledger.wrong_final)} wrong final state(s), {ledger.rerun_jobs} "
                   "re-run(s) without a crash (see above and ledger-findings.txt). "
                   if ledger is not None and not ledger.clean else "")
                + (f"{report.unclean_stops} SIGTERMed worker(s) exited non-zero or had to "
                   "be SIGKILLed. " if report.unclean_stops else "")
                + f"{report.leftovers} Logs: {report.log_dir}"
            )
