"""``manage.py benchjobs``: measure enqueue and drain rates (see reliable_jobs.bench)."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from reliable_jobs.bench import Figure, measure_at_length, measure_latency, percentile, run_once
from reliable_jobs.management.commands.runworker import (
    add_queue_and_backend_arguments,
    get_backend,
    quiet_logging,
)


class Command(BaseCommand):
    help = (
        "Benchmark: enqueue N no-op jobs in bulk and M one by one (each its own transaction), "
        "then drain them with one worker in this process, mirror on; print jobs/s, the "
        "median of --runs runs. The queue must be empty. Never run it against production."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--jobs", type=int, default=20_000,
                            help="Jobs enqueued in bulk per run (default: %(default)r).")
        parser.add_argument("--singles", type=int, default=2_000,
                            help="Jobs enqueued one call each per run (default: %(default)r).")
        parser.add_argument("--runs", type=int, default=3,
                            help="Runs; the median is shown (default: %(default)r).")
        parser.add_argument("--concurrency", type=int, default=1,
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
        add_queue_and_backend_arguments(parser)

    def handle(self, *args: Any, **options: Any) -> None:
        quiet_logging()
        backend = get_backend(options["backend"])
        queue = options["queue"] or sorted(backend.queues)[0]
        if queue not in backend.queues:
            raise CommandError(f"Queue {queue!r} is not in the backend's QUEUES.")
        if min(options["jobs"], options["runs"], options["concurrency"]) < 1:
            raise CommandError("--jobs, --runs and --concurrency must be at least 1.")
        counts = backend.broker.counts(queue)
        if counts.queued or counts.running or counts.scheduled:
            raise CommandError(
                f"Queue {queue!r} is not empty ({counts}); benchmark on an idle queue."
            )
        rates: dict[str, list[float]] = {}
        for run in range(1, options["runs"] + 1):
            measured = run_once(backend, queue, jobs=options["jobs"],
                                singles=options["singles"], concurrency=options["concurrency"],
                                prefetch=options["prefetch"])
            for name, rate in measured.items():
                rates.setdefault(name, []).append(rate)
            self.stdout.write(f"run {run}/{options['runs']}: " + ", ".join(
                f"{name} {rate:,.0f}/s" for name, rate in measured.items()))
        self.stdout.write(f"\n{options['jobs']:,} bulk + {options['singles']:,} single jobs, "
                          f"{options['concurrency']} thread(s), median of {options['runs']}:")
        for name, values in rates.items():
            self.stdout.write(Figure(name, values).row())
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
