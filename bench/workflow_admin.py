"""The workflow admin and actions, measured: the page by size, retry from failed, cancel the rest.

    python bench/workflow_admin.py page [--sizes 10,500,5000,60000] [--runs 5]
    python bench/workflow_admin.py actions [--members 2000] [--dead 500]

- page: per size N, a chord of N-1 ``demo.noop`` members and a callback;
  a superuser's GET of the workflow's admin page, ``--runs`` times (after
  one warm-up). Printed: the median milliseconds, the queries of one GET
  and what the page shows (a drawing up to 500 jobs, counts per layer up to
  50,000, counts by state above).
- actions: a chord of ``--members`` members whose first ``--dead`` are
  ``demo.give_up`` (dead on their first attempt, the callback cancelled),
  run by a burst worker in this process; then ``retry_failed`` is timed
  (each dead member through ``staff.retry``, then the put-back of the
  callback). Then a chord of ``--members`` queued members and three
  callbacks (``batch``), never run: ``cancel_rest`` is timed (the
  callbacks in one transaction, each member through ``staff.cancel``).

Uses ``REDIS_URL`` (a database it FLUSHES: give it one nobody else uses) and
``DATABASE_URL`` (its job tables are TRUNCATED: a database of its own,
migrated).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent


def setup() -> None:
    sys.path.insert(0, str(HERE))
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "testproject.settings")
    import django

    django.setup()


def reset() -> None:
    from django.apps import apps
    from django.db import connection

    from reliable_jobs.compat import task_backends

    tables = [m._meta.db_table for m in apps.get_app_config("reliable_jobs").get_models()]
    with connection.cursor() as cursor:
        cursor.execute("TRUNCATE " + ", ".join(connection.ops.quote_name(t) for t in tables))
    task_backends["default"].broker.client.flushdb()


def page(sizes: list[int], runs: int) -> None:
    from django.contrib.auth import get_user_model
    from django.db import connection
    from django.test import Client
    from django.test.utils import CaptureQueriesContext, setup_test_environment

    from reliable_jobs.canvas import chord, group
    from testproject.demo import tasks as demo

    setup_test_environment()
    user_model = get_user_model()
    user_model.objects.filter(username="bench-admin").delete()
    admin = user_model.objects.create_superuser("bench-admin", password="pw")
    client = Client()
    client.force_login(admin)
    try:
        for size in sizes:
            reset()
            flow = chord(group(*(demo.noop.s() for _ in range(size - 1))), demo.noop.s()
                         ).enqueue()
            url = f"/admin/reliable_jobs/workflow/{flow.id}/change/"
            text = client.get(url).content.decode()
            shown = ("drawing" if 'class="rj-graph"' in text
                     else "per layer" if "the graph is not drawn" in text else "by state")
            took = []
            for _ in range(runs):
                with CaptureQueriesContext(connection) as queries:
                    start = time.perf_counter()
                    assert client.get(url).status_code == 200
                    took.append((time.perf_counter() - start) * 1000)
            print(f"{size:>7} jobs: {statistics.median(took):8.1f} ms median, "
                  f"{len(queries)} queries, {shown}", flush=True)
    finally:
        admin.delete()


def actions(members: int, dead: int) -> None:
    from reliable_jobs.canvas import batch, chord, group
    from reliable_jobs.compat import task_backends
    from reliable_jobs.models import Job
    from reliable_jobs.worker import Worker
    from reliable_jobs.workflows import cancel_rest, retry_failed
    from testproject.demo import tasks as demo

    reset()
    calls = [demo.give_up.s("bench") for _ in range(dead)]
    calls += [demo.noop.s() for _ in range(members - dead)]
    flow = chord(group(*calls), demo.noop.s()).enqueue()
    Worker(task_backends["default"], queues=["default"], burst=True).run()
    assert Job.objects.filter(workflow_id=flow.id, state="dead").count() == dead
    start = time.perf_counter()
    outcome = retry_failed(flow.id)
    took = time.perf_counter() - start
    print(f"retry_failed: {len(outcome.done)} dead of {members} retried, "
          f"{len(outcome.waiting)} put back: {took:.2f} s "
          f"({took / max(dead, 1) * 1000:.2f} ms a dead job)", flush=True)

    reset()
    flow = batch([demo.noop.s() for _ in range(members)], on_success=demo.noop.s(),
                 on_complete=demo.noop.s(), on_death=demo.noop.s()).enqueue()
    start = time.perf_counter()
    outcome = cancel_rest(flow.id)
    took = time.perf_counter() - start
    print(f"cancel_rest: {len(outcome.waiting)} waiting and {len(outcome.done)} queued "
          f"cancelled, {len(outcome.refused)} refused: {took:.2f} s "
          f"({took / members * 1000:.2f} ms a queued job)", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    pages = sub.add_parser("page")
    pages.add_argument("--sizes", default="10,500,5000,60000")
    pages.add_argument("--runs", type=int, default=5)
    acts = sub.add_parser("actions")
    acts.add_argument("--members", type=int, default=2000)
    acts.add_argument("--dead", type=int, default=500)
    args = parser.parse_args()
    setup()
    if args.command == "page":
        page([int(size) for size in args.sizes.split(",")], args.runs)
    else:
        actions(args.members, args.dead)


if __name__ == "__main__":
    main()
