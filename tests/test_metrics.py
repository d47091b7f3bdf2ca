"""Prometheus metrics: a real worker scraped over HTTP, the view, and life without the extra."""

from __future__ import annotations

import signal
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from django.test import Client
from prometheus_client.parser import text_string_to_metric_families

from reliable_jobs import metrics, telemetry
from reliable_jobs.exceptions import InvalidJobArguments
from reliable_jobs.models import Attempt, Job, JobState
from testproject.demo import tasks as demo

from .faultinjection import free_port
from .helpers import REPO, Processes, wait_until

pytestmark = [pytest.mark.django_db(transaction=True)]

ADD = "testproject.demo.tasks.add"
FAIL_TIMES = "testproject.demo.tasks.fail_times"
ALWAYS_FAIL = "testproject.demo.tasks.always_fail"


def samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Every sample of an exposition, keyed by (name, labels)."""
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(found: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str,
          **labels: str) -> float:
    return found.get((name, frozenset(labels.items())), 0.0)


def scrape(port: int) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return samples(response.read().decode())


def scrape_when_up(port: int) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    def attempt() -> dict[tuple[str, frozenset[tuple[str, str]]], float] | None:
        try:
            return scrape(port)
        except OSError:
            return None

    return wait_until(attempt, timeout=30, message=f"a metrics server on port {port}")


@pytest.mark.slow
def test_a_real_worker_counts_its_jobs_and_serves_them_over_http(
    rj_settings: Any, processes: Processes
) -> None:
    # Given: a worker serving metrics, and jobs that succeed, retry, and die
    env = rj_settings()
    port = free_port()
    worker = processes.worker(env, "--metrics-port", str(port), "--worker-id", "scraped")
    scrape_when_up(port)
    ids = [demo.add.enqueue(i, 1).id for i in range(3)]
    ids.append(demo.fail_times.enqueue("metrics", 2).id)
    ids.append(demo.always_fail.enqueue("doomed").id)

    # When: they have all ended and the worker has counted their outcomes
    wait_until(lambda: Job.objects.filter(pk__in=ids, state__in=[
        JobState.SUCCEEDED, JobState.DEAD]).count() == len(ids), timeout=60,
        message="every job to end")
    found = wait_until(
        lambda: (s := scrape(port)) and value(
            s, "reliable_jobs_jobs_dead_total", queue="default", task=ALWAYS_FAIL) == 1 and s,
        message="the dead job to be counted")

    # Then: each counter says what happened, by queue and task
    def count(name: str, task: str) -> float:
        return value(found, f"reliable_jobs_{name}_total", queue="default", task=task)

    assert [count(n, ADD) for n in ("jobs_started", "jobs_succeeded", "jobs_failed")] == [3, 3, 0]
    assert [count(n, FAIL_TIMES) for n in ("jobs_started", "jobs_failed", "jobs_retried",
                                           "jobs_succeeded", "jobs_dead")] == [3, 2, 2, 1, 0]
    assert [count(n, ALWAYS_FAIL) for n in ("jobs_started", "jobs_failed", "jobs_retried",
                                            "jobs_dead")] == [3, 3, 2, 1]
    assert count("acks_refused", ADD) == 0
    # And: every attempt's run time is in the histogram; time in queue, once per job
    assert value(found, "reliable_jobs_job_run_seconds_count", queue="default", task=ADD) == 3
    assert value(found, "reliable_jobs_job_run_seconds_count", queue="default",
                 task=ALWAYS_FAIL) == 3
    assert value(found, "reliable_jobs_job_queue_wait_seconds_count", queue="default",
                 task=ALWAYS_FAIL) == 1
    assert value(found, "reliable_jobs_job_queue_wait_seconds_count", queue="default",
                 task=ADD) == 3
    # And: the gauges are read live: an empty queue, one worker (this one), one dead job
    assert value(found, "reliable_jobs_queue_jobs", queue="default", state="queued") == 0
    assert value(found, "reliable_jobs_queue_jobs", queue="default", state="dead") == 1
    assert value(found, "reliable_jobs_queue_oldest_age_seconds", queue="default") == 0
    assert value(found, "reliable_jobs_queue_workers", queue="default") == 1
    assert value(found, "reliable_jobs_worker_in_hand_jobs", worker="scraped") == 0
    assert value(found, "reliable_jobs_redis_up", backend="default") == 1
    assert processes.stop(worker) == 0


@pytest.mark.slow
def test_each_worker_process_serves_its_own_port(rj_settings: Any,
                                                 processes: Processes) -> None:
    # Given: two worker processes under one supervisor, metrics from port N
    env = rj_settings()
    port = free_port()
    supervisor = processes.worker(env, "--processes", "2", "--metrics-port", str(port))

    # When: jobs run
    ids = [demo.add.enqueue(i, 0).id for i in range(40)]
    wait_until(lambda: Job.objects.filter(pk__in=ids, state=JobState.SUCCEEDED).count() == 40,
               timeout=60, message="the jobs to succeed")

    # Then: ports N and N + 1 each answer, and their counts add up to every job
    def total() -> float:
        return sum(value(scrape_when_up(p), "reliable_jobs_jobs_succeeded_total",
                         queue="default", task=ADD) for p in (port, port + 1))

    wait_until(lambda: total() == 40, message="both processes' counts to add up")
    supervisor.terminate()
    assert supervisor.wait(timeout=30) == 0, processes.log(supervisor)


@pytest.mark.slow
def test_a_refused_ack_and_a_recovery_are_counted_where_they_happen(
    rj_settings: Any, processes: Processes
) -> None:
    # Given: worker A (metrics on port a) running a job of two seconds
    env = rj_settings()
    port_a, port_b = free_port(), free_port()
    a = processes.worker(env, "--metrics-port", str(port_a), "--worker-id", "a")
    scrape_when_up(port_a)
    job = demo.sleep_for.enqueue(2.0)
    wait_until(lambda: Attempt.objects.filter(job_id=job.id, number=1).exists(),
               message="attempt 1 to start")

    # When: A is frozen past its lease, worker B recovers the job and runs it again,
    # then A wakes up and reports its stale outcome
    a.send_signal(signal.SIGSTOP)
    try:
        b = processes.worker(env, "--metrics-port", str(port_b), "--worker-id", "b")
        wait_until(lambda: Attempt.objects.filter(job_id=job.id, number=2).exists(),
                   timeout=30, message="B to run attempt 2")
    finally:
        a.send_signal(signal.SIGCONT)
    wait_until(lambda: Job.objects.get(pk=job.id).state == JobState.SUCCEEDED, timeout=30,
               message="the job to succeed")

    # Then: A counts one refused ack, B one recovery of an expired lease
    sleep = "testproject.demo.tasks.sleep_for"
    wait_until(lambda: value(scrape(port_a), "reliable_jobs_acks_refused_total",
                             queue="default", task=sleep) == 1, message="A's refused ack")
    assert value(scrape(port_b), "reliable_jobs_jobs_recovered_total", queue="default",
                 kind="expired") == 1
    assert value(scrape(port_b), "reliable_jobs_jobs_succeeded_total", queue="default",
                 task=sleep) == 1
    assert processes.stop_many(a, b) == [0, 0]


def test_the_view_counts_enqueues_and_reads_the_queue(rj_settings: Any) -> None:
    # Given: the metrics view mounted by the test project, and two jobs enqueued
    rj_settings()
    client = Client()
    before = samples(client.get("/jobs/metrics").content.decode())
    demo.add.enqueue(1, 2)
    demo.add.enqueue(3, 4)
    # (an enqueue refused before anything was written is not counted)
    with pytest.raises(InvalidJobArguments):
        demo.add.enqueue(float("nan"), 2)

    # When: Prometheus scrapes the view
    response = client.get("/jobs/metrics")

    # Then: this process's counter rose by two; the gauges show the two waiting jobs
    assert response.status_code == 200
    assert response["Content-Type"].startswith("text/plain")
    after = samples(response.content.decode())
    name = "reliable_jobs_jobs_enqueued_total"
    assert value(after, name, queue="default", task=ADD) - value(
        before, name, queue="default", task=ADD) == 2
    assert value(after, "reliable_jobs_queue_jobs", queue="default", state="queued") == 2
    assert value(after, "reliable_jobs_queue_oldest_age_seconds", queue="default") >= 0
    assert value(after, "reliable_jobs_queue_workers", queue="default") == 0
    assert value(after, "reliable_jobs_redis_up", backend="default") == 1


def test_the_view_says_when_redis_is_down(rj_settings: Any) -> None:
    # Given: a backend whose Redis is a closed port
    rj_settings()
    from django.conf import settings

    settings.TASKS["default"]["OPTIONS"]["REDIS_URL"] = f"redis://127.0.0.1:{free_port()}/0"
    settings.TASKS = dict(settings.TASKS)  # a new value: the task backends are rebuilt

    # When / Then: the scrape still answers, with redis_up 0 and no stale queue numbers
    found = samples(Client().get("/jobs/metrics").content.decode())
    assert value(found, "reliable_jobs_redis_up", backend="default") == 0
    assert ("reliable_jobs_queue_jobs",
            frozenset({"queue": "default", "state": "queued"}.items())) not in found


def test_a_garbage_task_path_is_never_a_label_value() -> None:
    # Given: the installed hook, and an attempt of a task path nobody registered
    hook = telemetry.installed(metrics.PrometheusHook)
    assert isinstance(hook, metrics.PrometheusHook)
    from reliable_jobs.broker import ClaimedJob

    job = ClaimedJob("default", "x", 1, 1, "{}", 0)

    # When
    hook.finished(job, "os.system", JobState.DEAD, 0.01)

    # Then: it is counted under "?"
    text = metrics.prometheus_client.generate_latest().decode()
    assert 'task="os.system"' not in text
    assert 'reliable_jobs_jobs_dead_total{queue="default",task="?"}' in text


# -- without prometheus_client -------------------------------------------------------


def blocked(tmp_path: Path, *names: str) -> dict[str, str]:
    """An environment in which importing each of ``names`` raises ImportError."""
    for name in names:
        package = tmp_path / "blocked" / name
        package.mkdir(parents=True)
        (package / "__init__.py").write_text(
            f"raise ImportError('{name} is blocked by the test')\n")
    return {"PYTHONPATH": f"{tmp_path / 'blocked'}:{REPO}"}


@pytest.mark.slow
def test_without_the_library_the_flag_fails_and_the_check_warns(
    rj_settings: Any, processes: Processes, tmp_path: Path
) -> None:
    # Given: an environment where prometheus_client cannot be imported
    env = rj_settings()
    extra = blocked(tmp_path, "prometheus_client")

    # When: a worker is asked for metrics
    worker = processes.worker(env, "--metrics-port", str(free_port()), extra_env=extra)

    # Then: it refuses to start, saying what to install
    assert worker.wait(timeout=60) == 1
    log = processes.log(worker)
    assert "--metrics-port cannot work: prometheus_client is not installed" in log
    assert "reliable-jobs[prometheus]" in log

    # And: `manage.py check` of a project that mounts the view warns that it cannot work
    (tmp_path / "blocked" / "mounted_urls.py").write_text(
        "from django.urls import include, path\n"
        "urlpatterns = [path('jobs/', include('reliable_jobs.urls'))]\n")
    (tmp_path / "blocked" / "mounted_settings.py").write_text(
        "from testproject.settings import *  # noqa: F403\nROOT_URLCONF = 'mounted_urls'\n")
    check = processes.manage("check", env=env,
                             extra_env={**extra, "DJANGO_SETTINGS_MODULE": "mounted_settings"})
    assert check.wait(timeout=60) == 0
    assert "reliable_jobs.W020" in processes.log(check)

    # And: the test project, which mounts it only with the extra, stays quiet (a
    # newcomer's quickstart installs no prometheus_client)
    check = processes.manage("check", env=env, extra_env=extra)
    assert check.wait(timeout=60) == 0
    assert "W020" not in processes.log(check)
    readiness = subprocess.run(
        [sys.executable, "-c", "import django; django.setup(); from django.urls import reverse; "
         "print(reverse('ready'))"],
        env={**env, **extra, "DJANGO_SETTINGS_MODULE": "testproject.settings"}, cwd=REPO,
        capture_output=True, text=True, timeout=60, check=True)
    assert readiness.stdout.strip().splitlines()[-1] == "/jobs/ready"


def test_without_either_library_the_hook_is_the_no_op(rj_settings: Any, tmp_path: Path) -> None:
    # Given: neither prometheus_client nor opentelemetry importable
    env = {**rj_settings(), **blocked(tmp_path, "prometheus_client", "opentelemetry")}

    # When: Django starts (the app installs what it can)
    env["DJANGO_SETTINGS_MODULE"] = "testproject.settings"
    code = ("import django; django.setup(); from reliable_jobs import telemetry; "
            "print(type(telemetry.hook).__module__, type(telemetry.hook).__name__)")
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, check=True,
                         capture_output=True, text=True, timeout=60).stdout

    # Then: every call site calls the base class's empty methods
    assert out.strip().splitlines()[-1] == "reliable_jobs.telemetry Hook"


@pytest.mark.slow
def test_in_multiprocess_mode_the_view_sums_every_process(rj_settings: Any,
                                                          tmp_path: Path) -> None:
    # Given: the client library's multiprocess mode, as under gunicorn --workers
    shared = tmp_path / "prometheus"
    shared.mkdir()
    env = {**rj_settings(), "DJANGO_SETTINGS_MODULE": "testproject.settings",
           "PROMETHEUS_MULTIPROC_DIR": str(shared)}

    def python(code: str) -> str:
        return subprocess.run([sys.executable, "-c", "import django; django.setup()\n" + code],
                              env=env, cwd=REPO, check=True, capture_output=True, text=True,
                              timeout=60).stdout

    # When: two processes enqueue a job each, and a third serves the view
    for _ in range(2):
        python("from testproject.demo import tasks\ntasks.add.enqueue(1, 2)")
    text = python("from django.test import RequestFactory\nfrom reliable_jobs import metrics\n"
                  "print(metrics.view(RequestFactory().get('/')).content.decode())")

    # Then: it counts both processes' jobs, and reads the queue as usual
    found = samples(text)
    assert value(found, "reliable_jobs_jobs_enqueued_total", queue="default", task=ADD) == 2
    assert value(found, "reliable_jobs_queue_jobs", queue="default", state="queued") == 2


def test_a_worker_counts_only_when_something_can_read_the_counts(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Given a process counting from start-up, as every process does
    counting = telemetry.installed(metrics.PrometheusHook)
    assert counting is not None
    try:
        # When it is a worker with a metrics port, or in the client library's
        # multiprocess mode (a view sums the files), it goes on counting
        assert metrics.stop_counting_unless_served(9108)
        monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", "/nonexistent")
        assert metrics.stop_counting_unless_served(None)
        assert telemetry.installed(metrics.PrometheusHook) is not None

        # When it has neither, it stops: nothing could ever read the counters
        monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR")
        assert not metrics.stop_counting_unless_served(None)
        assert telemetry.installed(metrics.PrometheusHook) is None
    finally:
        if telemetry.installed(metrics.PrometheusHook) is None:
            telemetry.install(counting)


@pytest.mark.slow
def test_runworker_without_a_metrics_port_stops_counting_and_in_multiprocess_mode_counts(
        rj_settings: Any, processes: Processes, tmp_path: Path) -> None:
    # Given a job, and a worker with neither --metrics-port nor PROMETHEUS_MULTIPROC_DIR
    env = rj_settings()
    demo.add.enqueue(1, 2)
    worker = processes.worker(env, "--burst", "-v", "2")
    assert worker.wait(timeout=60) == 0, processes.log(worker)

    # Then it said its counters are off
    assert "Prometheus counters are off in this worker" in processes.log(worker)

    # Given a second job, and a worker in the client library's multiprocess mode
    shared = tmp_path / "prometheus"
    shared.mkdir()
    demo.add.enqueue(2, 3)
    worker = processes.worker(env, "--burst", "-v", "2",
                              extra_env={"PROMETHEUS_MULTIPROC_DIR": str(shared)})
    assert worker.wait(timeout=60) == 0, processes.log(worker)

    # Then it counted, and a view over the same directory shows its success
    assert "Prometheus counters are off" not in processes.log(worker)
    code = ("import django; django.setup()\nfrom django.test import RequestFactory\n"
            "from reliable_jobs import metrics\n"
            "print(metrics.view(RequestFactory().get('/')).content.decode())")
    text = subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, text=True,
                          env={**env, "DJANGO_SETTINGS_MODULE": "testproject.settings",
                               "PROMETHEUS_MULTIPROC_DIR": str(shared)},
                          capture_output=True, timeout=60).stdout
    assert value(samples(text), "reliable_jobs_jobs_succeeded_total", queue="default",
                 task=ADD) == 1


def test_a_snooze_is_counted_as_a_snooze_never_as_a_failure(
    rj_settings: Any, processes: Processes
) -> None:
    # Given: a worker serving its metrics, and a job that snoozes twice, then adds
    env = rj_settings()
    port = free_port()
    worker = processes.worker(env, "--metrics-port", str(port))
    scrape_when_up(port)
    job = demo.snooze_then_add.enqueue(2, 1, 1)

    # When it runs to its success
    wait_until(lambda: Job.objects.get(pk=job.id).state == JobState.SUCCEEDED, timeout=30,
               message="the job to succeed")

    # Then two snoozes and one success are counted, no failure
    task = "testproject.demo.tasks.snooze_then_add"
    found = scrape(port)
    assert value(found, "reliable_jobs_jobs_snoozed_total", queue="default", task=task) == 2
    assert value(found, "reliable_jobs_jobs_succeeded_total", queue="default", task=task) == 1
    assert value(found, "reliable_jobs_jobs_failed_total", queue="default", task=task) == 0
    assert processes.stop(worker) == 0
