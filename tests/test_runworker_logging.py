"""What ``runworker`` prints about a failing job: our one line per attempt.

Django's ``django.tasks`` logger logs every failed attempt at ERROR with the
whole traceback; at the default verbosity that buried our one-line summary
under three tracebacks for one job. A real worker runs a real failing task.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from testproject.demo.tasks import always_fail

from .helpers import Processes

Configure = Callable[..., dict[str, str]]

#: Seconds a burst worker may take for three attempts (retry delays are ~100 ms).
BURST_TIMEOUT_S = 60


def run_failing_job(rj_settings: Configure, processes: Processes, verbosity: str) -> str:
    """Enqueue always_fail (3 attempts), run a burst worker to the end; return its output."""
    env = rj_settings()
    always_fail.enqueue("boom")
    worker = processes.manage("runworker", "--burst", "-v", verbosity, env=env)
    assert worker.wait(timeout=BURST_TIMEOUT_S) == 0, processes.log(worker)
    return processes.log(worker)


@pytest.mark.django_db(transaction=True)
@pytest.mark.slow
def test_default_verbosity_prints_our_line_per_attempt_and_no_django_traceback(
    rj_settings: Configure, processes: Processes
) -> None:
    # Given a job that fails on each of its 3 attempts
    # When a burst worker runs it at -v 1 (the default)
    output = run_failing_job(rj_settings, processes, "1")

    # Then each attempt has our one line, naming the error
    for attempt in (1, 2, 3):
        assert f"attempt {attempt}/3 failed" in output, output
    assert output.count("builtins.RuntimeError: boom") == 3, output
    # And Django's per-attempt lines and tracebacks are not printed
    assert output.count("Traceback") <= 1, output
    assert "state=FAILED" not in output, output


@pytest.mark.django_db(transaction=True)
@pytest.mark.slow
def test_verbosity_2_adds_djangos_lines(rj_settings: Configure, processes: Processes) -> None:
    # Given the same failing job
    # When a burst worker runs it at -v 2
    output = run_failing_job(rj_settings, processes, "2")

    # Then Django's own lines, with their tracebacks, are printed as well
    assert output.count("state=FAILED") == 3, output
    assert output.count("Traceback") == 3, output
