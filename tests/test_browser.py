"""The admin in a real browser: Debian's Chromium, driven by Playwright, against a live
server, real Redis, real PostgreSQL and a real ``runworker`` process.

Screenshots of the dashboard and of job pages are saved under ``test-artifacts/``
(git-ignored) for the closing note. Chromium comes from apt (``scripts/test``
installs it); ``playwright install`` is never needed.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import redis
from django.contrib.auth.models import Permission
from django.utils import timezone
from playwright.sync_api import Browser, Page, expect, sync_playwright

from reliable_jobs.jobids import short_id
from reliable_jobs.keys import QueueKeys
from reliable_jobs.models import Attempt, Job, JobState
from testproject.demo import tasks as demo

from .helpers import REPO, Processes, wait_until

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]

CHROMIUM = "/usr/bin/chromium"
#: docs/CONTRIBUTING.md: what Debian's Chromium needs to start quickly and quietly here.
CHROMIUM_ARGS = ["--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
ARTIFACTS = REPO / "test-artifacts"
#: Playwright's own waits, in ms: generous, and bounded.
UI_TIMEOUT_MS = 15_000
KEYS = QueueKeys("rj", "default")
CHANGELIST = "/admin/reliable_jobs/job/"


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    """Headless Chromium for this module.

    Playwright's sync API runs an event loop in this thread while it is open,
    and Django refuses ORM calls from a thread with a running loop unless
    DJANGO_ALLOW_ASYNC_UNSAFE is set (docs/CONTRIBUTING.md). Module scope keeps both
    the loop and the variable away from every other test module.
    """
    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} is missing: apt-get install -y chromium "
                    "(scripts/test does it when it can).")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
        with sync_playwright() as playwright:
            launched = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS,
                                                  headless=True)
            yield launched
            launched.close()


@pytest.fixture
def site(live_server: Any, settings: Any, browser: Browser) -> Iterator[Callable[..., Page]]:
    """Open a browser page logged in as a new staff user holding ``perms``."""
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
    contexts = []

    def login(username: str, *perms: str, superuser: bool = False) -> Page:
        from django.contrib.auth import get_user_model

        user = get_user_model().objects.create_user(username, password="secret-pw",
                                                    is_staff=True, is_superuser=superuser)
        user.user_permissions.set(Permission.objects.filter(
            content_type__app_label="reliable_jobs", codename__in=perms))
        context = browser.new_context(base_url=live_server.url,
                                      viewport={"width": 1920, "height": 1080})
        context.set_default_timeout(UI_TIMEOUT_MS)
        contexts.append(context)
        page = context.new_page()
        page.goto("/admin/login/?next=/admin/")
        page.fill("#id_username", username)
        page.fill("#id_password", "secret-pw")
        page.click("input[type=submit]")
        expect(page.locator("#site-name")).to_be_visible()
        expect(page.locator("#user-tools")).to_contain_text(re.compile(username, re.I))
        return page

    yield login
    for context in contexts:
        context.close()


def shoot(page: Page, name: str) -> Path:
    ARTIFACTS.mkdir(exist_ok=True)
    path = ARTIFACTS / name
    page.screenshot(path=str(path), full_page=True)
    return path


def state_of(job_id: str) -> str:
    return Job.objects.values_list("state", flat=True).get(pk=job_id)


def test_staff_watch_filter_inspect_and_retry_in_a_browser(
    rj_settings: Callable[..., dict[str, str]], processes: Processes,
    site: Callable[..., Page], redis_client: redis.Redis,
) -> None:
    # Given: a worker serving "default" only; on it a job that fails twice then
    # succeeds (3 attempts) and one that fails all its 5 attempts; on "emails",
    # which no worker serves, three queued jobs and one scheduled for later
    env = rj_settings(queues=["default", "emails"])
    worker = processes.worker(env, "--queue", "default", "--worker-id", "browser-worker")
    three = demo.fail_times.enqueue("three attempts", 2)
    phoenix = demo.fail_times.enqueue("phoenix", 5)
    emails = demo.add.using(queue_name="emails")
    for i in range(3):
        emails.enqueue(i, i)
    emails.using(run_after=timezone.now() + timedelta(hours=1)).enqueue(9, 9)
    wait_until(lambda: state_of(three.id) == JobState.SUCCEEDED
               and state_of(phoenix.id) == JobState.DEAD, timeout=60,
               message="the worker to finish the first two jobs")
    assert Attempt.objects.filter(job_id=three.id).count() == 3

    # When staff log in and open the dashboard
    page = site("ops", superuser=True)
    page.get_by_role("link", name="Jobs", exact=True).click()
    page.click("a.rj-dashboard-link")

    # Then they see the live counts per queue, the worker and the chart
    emails_row = page.locator("tr[data-queue=emails]")
    expect(emails_row.locator("td.rj-queued")).to_have_text("3")
    expect(emails_row.locator("td.rj-scheduled")).to_have_text("1")
    default_row = page.locator("tr[data-queue=default]")
    expect(default_row.locator("td.rj-dead")).to_have_text("1")
    expect(default_row.locator("td.rj-queued")).to_have_text("0")
    expect(page.locator("#rj-workers")).to_contain_text("browser-worker")
    expect(page.locator("#rj-workers")).to_contain_text(str(worker.pid))
    expect(page.locator("#rj-chart rect.rj-ok")).to_have_count(60)
    expect(page.locator("#rj-drift")).to_contain_text("None.")
    shoot(page, "dashboard.png")

    # When they filter the changelist on dead jobs, then on the emails queue
    page.goto(CHANGELIST)
    page.locator("#changelist-filter").get_by_role("link", name="Dead", exact=True).click()

    # Then only the dead job is listed
    rows = page.locator("#result_list tbody tr")
    expect(rows).to_have_count(1)
    expect(rows.first.locator(".rj-id")).to_have_attribute("title", phoenix.id)
    expect(rows.first.locator(".rj-badge")).to_have_text("Dead")
    expect(rows.first).to_contain_text("5/5")
    page.goto(CHANGELIST)
    page.locator("#changelist-filter").get_by_role("link", name="emails", exact=True).click()
    expect(rows).to_have_count(4)
    page.goto(CHANGELIST)
    shoot(page, "changelist.png")

    # When they open the job that took three attempts
    page.goto(CHANGELIST)
    page.locator(f"#result_list a[href*='/{three.id}/change/']").click()

    # Then all three attempts are there, with their workers and outcomes
    attempts = page.locator("#attempt_set-group tbody tr.has_original")
    expect(attempts).to_have_count(3)
    expect(attempts.locator(".field-worker_id")).to_have_text(["browser-worker"] * 3)
    expect(attempts.locator(".field-result")).to_have_text(["Failed", "Failed", "Succeeded"])
    expect(page.locator(".field-return_json pre")).to_have_text('"three attempts"')
    expect(page.locator(".field-traceback pre")).to_contain_text(
        "RuntimeError: three attempts: planned failure on attempt 2 of 2")
    shoot(page, "job-three-attempts.png")

    # When they keep the dashboard open in a second tab and retry the dead job
    dashboard = page.context.new_page()
    dashboard.goto("/admin/reliable_jobs/job/dashboard/")
    expect(dashboard.locator("tr[data-queue=default] td.rj-dead")).to_have_text("1")
    page.goto(f"{CHANGELIST}?state__exact=dead")
    page.check(f"input[name=_selected_action][value='{phoenix.id}']")
    page.select_option("select[name=action]", "retry_jobs")
    page.click("button[name=index]")

    # Then the admin says what it did, and the worker runs the job: attempt 6 succeeds
    expect(page.locator("ul.messagelist")).to_contain_text(
        f"Job {phoenix.id} is queued again with 5 more attempts (attempts 6 to 10).")
    wait_until(lambda: state_of(phoenix.id) == JobState.SUCCEEDED, timeout=30,
               message="the retried job to run")
    page.goto(f"{CHANGELIST}{phoenix.id}/change/")
    expect(page.locator(".field-state_badge .rj-badge")).to_have_text("Succeeded")
    expect(page.locator(".field-attempts_of .readonly")).to_have_text("6/10")
    expect(page.locator("#attempt_set-group tbody tr.has_original")).to_have_count(6)
    expect(page.locator("#attempt_set-group tbody tr.has_original .field-result")).to_have_text(
        ["Failed"] * 5 + ["Succeeded"])
    shoot(page, "job-retried.png")
    # And the dashboard tab updated itself (no reload): nothing dead any more
    expect(dashboard.locator("tr[data-queue=default] td.rj-dead")).to_have_text("0")
    assert redis_client.zcard(KEYS.dead) == 0


def test_staff_without_the_permissions_cannot_run_the_actions(
    rj_settings: Callable[..., dict[str, str]], processes: Processes,
    site: Callable[..., Page], redis_client: redis.Redis,
) -> None:
    # Given: a dead job, and staff who may only view jobs
    env = rj_settings()
    doomed = demo.always_fail.enqueue("doomed")
    worker = processes.worker(env, "--burst")
    assert worker.wait(timeout=60) == 0, processes.log(worker)
    assert state_of(doomed.id) == JobState.DEAD
    page = site("viewer", "view_job")

    # When they open the list and the job
    page.goto(f"{CHANGELIST}?state__exact=dead")
    expect(page.locator("#result_list")).to_contain_text(short_id(doomed.id))

    # Then no action is offered on either page
    expect(page.locator("select[name=action]")).to_have_count(0)
    page.goto(f"{CHANGELIST}{doomed.id}/change/")
    expect(page.locator(".field-state_badge .rj-badge")).to_have_text("Dead")
    expect(page.locator("select[name=CHANGE_FORM-action]")).to_have_count(0)

    # When they forge the retry form anyway (same session, valid CSRF token)
    page.evaluate("""([jobId]) => {
        const token = document.cookie.split('; ').find(c => c.startsWith('csrftoken='))
            .split('=')[1];
        const form = document.createElement('form');
        form.method = 'post';
        form.action = '/admin/reliable_jobs/job/';
        for (const [name, value] of [['csrfmiddlewaretoken', token], ['action', 'retry_jobs'],
                                     ['index', '0'], ['_selected_action', jobId]]) {
            const input = document.createElement('input');
            input.name = name;
            input.value = value;
            form.appendChild(input);
        }
        document.body.appendChild(form);
        form.submit();
    }""", [doomed.id])
    page.wait_for_url(f"**{CHANGELIST}")

    # Then the job stays dead, in the database and in Redis
    expect(page.locator("#result_list")).to_be_visible()
    assert state_of(doomed.id) == JobState.DEAD
    assert redis_client.hget(KEYS.job(doomed.id), "state") == "dead"
    assert redis_client.zrange(KEYS.dead, 0, -1) == [doomed.id]
