"""``manage.py benchjobs``: measure enqueue and drain rates (see verify/bench.py)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.conf import settings
from django.core.management.base import CommandError, CommandParser

from reliable_jobs.backend import ReliableJobsBackend
from reliable_jobs.management.base import ReliableJobsCommand, number, whole_number

from ... import bench_process
from ...bench import (
    Figure,
    Round,
    autovacuum_off,
    measure_ack_cost,
    measure_at_length,
    measure_latency,
    measure_many_queues,
    percentile,
    rss_bytes,
    run_once,
    sustained,
)

#: Said of a bad --jobs, --runs or --concurrency.
AT_LEAST_ONE = "--jobs, --runs and --concurrency must be at least 1."
#: Said of a bad --sustained or --retention-minutes.
NOT_NEGATIVE = "--sustained and --retention-minutes must be >= 0."


def in_flight_depths(text: str) -> list[int]:
    """``--ack-depths`` as whole numbers (empty to skip); an argparse ``type=``."""
    depths = [int(x) for x in text.split(",") if x.strip()]
    if any(depth < 1 for depth in depths):
        raise CommandError("--ack-depths must be whole numbers >= 1.")
    return depths


class Command(ReliableJobsCommand):
    help = (
        "Benchmark: enqueue N no-op jobs in bulk and M one by one (each its own transaction), "
        "then drain them with one worker in this process, mirror on; print jobs/s, the "
        "median of --runs runs, beside the single enqueue's floor, the ack cost by jobs in "
        "flight and the drain with many queues configured. --sustained N drains N jobs in "
        "rounds while pruning instead. The queue must be empty. Never run it against "
        "production."
    )
    logging_mode = "quiet"
    #: Unlike the other commands, it runs on a backend whose OPTIONS the checks
    #: reject (kept as it was; issue 15 notes it lacks the check).
    refuse_bad_options = False

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--jobs", type=whole_number(1, AT_LEAST_ONE), default=20_000,
                            help="Jobs enqueued in bulk per run (default: %(default)r).")
        parser.add_argument("--singles", type=int, default=2_000,
                            help="Jobs enqueued one call each per run; the floor is measured "
                                 "with as many (default: %(default)r).")
        parser.add_argument("--runs", type=whole_number(1, AT_LEAST_ONE), default=3,
                            help="Runs; the median is shown (default: %(default)r).")
        parser.add_argument("--concurrency", type=whole_number(1, AT_LEAST_ONE), default=1,
                            help="Worker threads (default: %(default)r).")
        parser.add_argument("--prefetch", type=int, default=None,
                            help="Jobs claimed beyond those running, so one claim fetches a "
                                 "batch (default: OPTIONS['PREFETCH']).")
        parser.add_argument("--latency-samples", type=int, default=1_000,
                            help="Jobs for the enqueue-to-start latency, one at a time "
                                 "(0 to skip; default: %(default)r).")
        parser.add_argument("--lengths", default="1000,10000,100000",
                            help="Queue lengths at which to measure the drain rate of "
                                 "2,000 jobs and Redis memory per job, comma-separated "
                                 "('' to skip; default: %(default)r).")
        parser.add_argument("--ack-depths", type=in_flight_depths, default="1000,20000",
                            help="Jobs in flight (claimed, unacked) at which to time acks, "
                                 "comma-separated; the ratio is last / first ('' to skip; "
                                 "default: %(default)r).")
        parser.add_argument("--ack-sample", type=int, default=1_000,
                            help="Acks timed at each depth (default: %(default)r).")
        parser.add_argument("--many-queues", type=int, default=500,
                            help="Queues configured for the many-queues drain, work on one "
                                 "(0 to skip; default: %(default)r).")
        parser.add_argument("--sustained", type=whole_number(0, NOT_NEGATIVE), default=0,
                            metavar="N",
                            help="Instead of the above: run N jobs through one long-lived "
                                 "worker in rounds of --jobs, pruning with "
                                 "--retention-minutes between rounds; print each round "
                                 "(default: off).")
        parser.add_argument("--retention-minutes", type=number(0, NOT_NEGATIVE), default=10.0,
                            help="--sustained: prune jobs finished this long ago "
                                 "(default: %(default)r).")
        parser.add_argument("--process", action="store_true",
                            help="Instead of the above: build a stock startproject project "
                                 "in a temporary directory and time a real `runworker "
                                 "--burst` over --jobs jobs of each --process-task, --runs "
                                 "times interleaved: jobs/s, whole-process CPU per job, exit "
                                 "delay after empty, WAL bytes per job (BENCH_PROFILE_DIR: "
                                 "write a cProfile of each worker there).")
        parser.add_argument("--process-task", action="append", dest="process_tasks",
                            choices=sorted(bench_process.TASKS), metavar="TASK",
                            help="--process: 'no-op' or 'INCR + query' (one Redis INCR and "
                                 "one ORM query); repeat for both (default: both).")
        parser.add_argument("--query-jobs", type=whole_number(1, AT_LEAST_ONE), default=None,
                            help="--process: jobs of the 'INCR + query' task per run (default: "
                                 "--jobs).")
        parser.add_argument("--queue", default=None,
                            help="Queue to use (default: the backend's first queue).")

    def handle_backend(self, backend: ReliableJobsBackend, options: dict[str, Any]) -> None:
        queue = options["queue"] or sorted(backend.queues)[0]
        if queue not in backend.queues:
            raise CommandError(f"Queue {queue!r} is not in the backend's QUEUES.")
        depths: list[int] = options["ack_depths"]
        counts = backend.broker.counts(queue)
        if counts.queued or counts.running or counts.scheduled:
            raise CommandError(
                f"Queue {queue!r} is not empty ({counts}); benchmark on an idle queue."
            )
        if settings.DEBUG:
            self.stderr.write(
                "DEBUG is on: Django keeps the SQL of the last 9,000 queries of every "
                "connection, which costs time and grows the RSS (about 70 MiB over 200,000 "
                "jobs in --sustained); measure with DEBUG off.")
        if options["sustained"]:
            self._sustained(backend, queue, options)
            return
        if options["process"]:
            self._process(backend, queue, options)
            return
        self._runs(backend, queue, options)
        if options["latency_samples"] > 0:
            latencies = measure_latency(backend, queue, samples=options["latency_samples"])
            self.stdout.write(
                f"\nenqueue-to-start latency over {len(latencies):,} jobs (idle worker): "
                f"p50 {percentile(latencies, 0.5):.2f} ms, p99 {percentile(latencies, 0.99):.2f} "
                f"ms, max {max(latencies):.2f} ms")
        lengths = [int(x) for x in options["lengths"].split(",") if x.strip()]
        if lengths:
            self.stdout.write("\nqueue length   drain of 2,000 jobs   Redis bytes per waiting job")
        for length in lengths:
            rate, per_job = measure_at_length(backend, queue, waiting=length, window=2_000,
                                              prefetch=options["prefetch"])
            self.stdout.write(f"{length:>12,}   {rate:>12,.0f} jobs/s   {per_job:>12,.0f}")
        if depths:
            self._ack_costs(backend, queue, depths, options["ack_sample"])
        if options["many_queues"] > 1:
            one, many = measure_many_queues(backend, queue, jobs=options["jobs"],
                                            queues=options["many_queues"],
                                            prefetch=options["prefetch"])
            self.stdout.write(
                f"\n{options['many_queues']} queues configured, work on one: drain "
                f"{many:,.0f} jobs/s vs {one:,.0f} jobs/s with one queue ({many / one:.0%}; "
                f"{options['jobs']:,} jobs each)")

    def _runs(self, backend: Any, queue: str, options: dict[str, Any]) -> None:
        rates: dict[str, list[float]] = {}
        for run in range(1, options["runs"] + 1):
            measured = run_once(backend, queue, jobs=options["jobs"],
                                singles=options["singles"], concurrency=options["concurrency"],
                                prefetch=options["prefetch"])
            for name, rate in measured.items():
                rates.setdefault(name, []).append(rate)
            self.stdout.write(f"run {run}/{options['runs']}: " + ", ".join(
                f"{name} {rate:,.0f}" + ("" if "µs" in name else "/s")
                for name, rate in measured.items()))
        self.stdout.write(f"\n{options['jobs']:,} bulk + {options['singles']:,} single jobs, "
                          f"{options['concurrency']} thread(s), median of {options['runs']}:")
        for name, values in rates.items():
            if "µs" in name:
                self.stdout.write(Figure(name, values, unit="µs").row())
            else:
                self.stdout.write(Figure(name, values).row())
        single = Figure("", rates["single enqueue"]).median
        floor = Figure("", rates["single enqueue floor"]).median
        if single and floor:
            self.stdout.write(
                f"single enqueue floor: raw INSERT (autocommit) + one EVALSHA from this "
                f"process, {floor:,.0f} jobs/s; enqueue takes {floor / single:.2f}x the "
                f"floor's time per job")

    def _process(self, backend: Any, queue: str, options: dict[str, Any]) -> None:
        tasks = options["process_tasks"] or list(bench_process.TASKS)
        self.stdout.write(f"runworker --burst in a stock project, {options['runs']} run(s) of "
                          f"{', '.join(tasks)}, interleaved:")

        def report(run: bench_process.ProcessRun) -> None:
            self.stdout.write(run.line())
            if run.profile is not None:
                self.stdout.write(f"  profile: {run.profile}")

        sizes = {task: options["jobs"] for task in tasks}
        if options["query_jobs"] and "INCR + query" in sizes:
            sizes["INCR + query"] = options["query_jobs"]
        runs = bench_process.measure(backend, queue, sizes=sizes, runs=options["runs"],
                                     report=report)
        self.stdout.write("")
        for line in bench_process.summary(runs):
            self.stdout.write(line)

    def _ack_costs(self, backend: Any, queue: str, depths: list[int], sample: int) -> None:
        self.stdout.write("\njobs in flight   ack µs per job   (4 workers' claims, "
                          f"{sample:,} acks timed)")
        costs = []
        for depth in depths:
            cost = measure_ack_cost(backend, queue, in_flight=depth, sample=min(sample, depth))
            costs.append(cost)
            self.stdout.write(f"{depth:>14,}   {cost:>14.1f}")
        if len(costs) > 1:
            self.stdout.write(f"ratio {depths[-1]:,} / {depths[0]:,} in flight: "
                              f"{costs[-1] / costs[0]:.2f}")

    def _sustained(self, backend: Any, queue: str, options: dict[str, Any]) -> None:
        start_rss = rss_bytes()
        self.stdout.write(
            f"sustained: {options['sustained']:,} jobs in rounds of {options['jobs']:,}, "
            f"pruning jobs finished over {options['retention_minutes']:g} min ago; worker "
            f"RSS at start {start_rss / 2**20:,.1f} MiB\n"
            + ("PostgreSQL's autovacuum is off: each round's prune comes after a VACUUM "
               "ANALYZE, timed with it (prune s)\n" if autovacuum_off(backend) else "")
            + "    jobs done   enqueue+drain jobs/s   pruned   prune s   job rows   table MiB   "
            "RSS MiB")

        def report(done: Round) -> None:
            self.stdout.write(
                f"{done.jobs_done:>13,}   {done.rate:>20,.0f}   {done.pruned:>6,}   "
                f"{done.prune_s:>7.2f}   {done.table_rows:>8,}   "
                f"{done.table_bytes / 2**20:>9,.1f}   {done.rss_bytes / 2**20:>7,.1f}")

        sustained(backend, queue, total=options["sustained"], per_round=options["jobs"],
                  retention=timedelta(minutes=options["retention_minutes"]),
                  prefetch=options["prefetch"], report=report)
        self.stdout.write(f"worker RSS at start {start_rss / 2**20:,.1f} MiB, at the end "
                          f"{rss_bytes() / 2**20:,.1f} MiB")
