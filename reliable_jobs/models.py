"""The database mirror of every job and every attempt.

Redis holds what is live; these tables hold everything, for durability (the
sweep rebuilds Redis from them), history (the admin) and ``get_result()``.
Only the ``mirror`` package writes job state; the model owns the vocabulary.
"""

from __future__ import annotations

import uuid

from django.db import models
from django.utils.translation import gettext_lazy as _

from .compat import TaskResultStatus
from .keys import shard_queue


class JobState(models.TextChoices):
    SCHEDULED = "scheduled", _("Scheduled")
    QUEUED = "queued", _("Queued")
    RUNNING = "running", _("Running")
    SUCCEEDED = "succeeded", _("Succeeded")
    DEAD = "dead", _("Dead")
    CANCELLED = "cancelled", _("Cancelled")


#: States in which the job still has to run: reconcile watches these.
UNFINISHED_STATES = (JobState.SCHEDULED, JobState.QUEUED, JobState.RUNNING)

#: docs/design.md's mapping onto Django's task statuses.
TASK_STATUS = {
    JobState.SCHEDULED: TaskResultStatus.READY,
    JobState.QUEUED: TaskResultStatus.READY,
    JobState.RUNNING: TaskResultStatus.RUNNING,
    JobState.SUCCEEDED: TaskResultStatus.SUCCESSFUL,
    JobState.DEAD: TaskResultStatus.FAILED,
    JobState.CANCELLED: TaskResultStatus.FAILED,
}


class AttemptOutcome(models.TextChoices):
    SUCCEEDED = "succeeded", _("Succeeded")
    FAILED = "failed", _("Failed")
    LEASE_EXPIRED = "lease_expired", _("Lease expired")
    RELEASED = "released", _("Released")
    TIMED_OUT = "timed_out", _("Timed out")
    #: Cancelled by staff or code while it was claimed or running.
    CANCELLED = "cancelled", _("Cancelled")
    #: The task raised Snooze: the job waits again, this attempt given back.
    SNOOZED = "snoozed", _("Snoozed")


#: Outcomes that count as an error in ``TaskResult.errors``.
FAILED_OUTCOMES = (AttemptOutcome.FAILED, AttemptOutcome.LEASE_EXPIRED, AttemptOutcome.TIMED_OUT,
                   AttemptOutcome.CANCELLED)


class JobQuerySet(models.QuerySet["Job"]):
    def unfinished(self) -> JobQuerySet:
        return self.filter(state__in=UNFINISHED_STATES)


class Job(models.Model):
    id = models.UUIDField(_("id"), primary_key=True, default=uuid.uuid4, editable=False)
    backend = models.CharField(_("backend"), max_length=100, default="default")
    queue = models.CharField(_("queue"), max_length=100)
    #: Which shard of a sharded queue holds the job in Redis (0 otherwise).
    shard = models.PositiveSmallIntegerField(_("shard"), default=0)
    task_path = models.CharField(_("task"), max_length=300)
    args = models.JSONField(_("args"), default=list)
    kwargs = models.JSONField(_("kwargs"), default=dict)
    priority = models.SmallIntegerField(_("priority"), default=0)
    state = models.CharField(_("state"), max_length=16, choices=JobState.choices)
    attempts = models.PositiveIntegerField(_("attempts"), default=0)
    #: How many times the job was rebuilt in Redis from this row; with the
    #: attempt number it is the fencing token (see scripts/enqueue.lua).
    generation = models.PositiveIntegerField(_("generation"), default=0)
    max_attempts = models.PositiveIntegerField(_("max attempts"))
    run_after = models.DateTimeField(_("run after"), null=True, blank=True)
    enqueued_at = models.DateTimeField(_("enqueued"))
    started_at = models.DateTimeField(_("started"), null=True, blank=True)
    finished_at = models.DateTimeField(_("finished"), null=True, blank=True)
    #: Last time any mirror write touched the row; reconcile's grace period
    #: is measured from it.
    updated_at = models.DateTimeField(_("updated"))
    return_value = models.JSONField(_("return value"), null=True, blank=True)
    last_error = models.TextField(_("last error"), blank=True, default="")
    #: Set for a task with ``unique_for_ms``: the digest of the call (unique.py).
    #: Only unfinished jobs hold their key (the rj_job_unique_key index), so a
    #: job that ends frees it by the same write that ends it; the key stays
    #: on the row as history. NULL, not "", for a job without one: the plain
    #: INSERT and the COPY of new jobs leave the column out, and NULLs never clash.
    unique_key = models.CharField(  # noqa: DJ001 - NULL means "no key", see above
        _("unique key"), max_length=64, null=True, blank=True, editable=False)

    #: The job's fair group ('' for none): the tenant whose jobs take turns
    #: with other tenants' in its queue (fairness.py); a rebuild from the
    #: mirror puts the job back in it.
    fair_key = models.CharField(_("fair group"), max_length=100, blank=True, default="")

    # What a running task said of itself (context.progress() / checkpoint(),
    # mirror/journal.py). All NULL until it says something: the INSERT and
    # COPY of new jobs leave these columns out.
    #: Items done, of progress_total (None: unknown).
    progress_done = models.BigIntegerField(_("progress done"), null=True, blank=True)
    progress_total = models.BigIntegerField(_("progress total"), null=True, blank=True)
    #: The last checkpoint (JSON), what the next attempt resumes from.
    checkpoint = models.JSONField(_("checkpoint"), null=True, blank=True)
    #: The attempt that wrote progress or the checkpoint last: an older
    #: attempt's write (a stale worker's) never overwrites a newer one's.
    progress_attempt = models.PositiveIntegerField(_("progress attempt"), null=True, blank=True)

    objects = JobQuerySet.as_manager()

    class Meta:
        verbose_name = _("job")
        verbose_name_plural = _("jobs")
        ordering = ["-enqueued_at"]
        indexes = [
            models.Index(fields=["state", "updated_at"], name="rj_job_state_updated"),
            models.Index(fields=["queue", "state"], name="rj_job_queue_state"),
            models.Index(fields=["task_path"], name="rj_job_task"),
            models.Index(fields=["-enqueued_at"], name="rj_job_enqueued"),
        ]
        constraints = [
            # The judge of unique jobs: one unfinished job per key, checked by the
            # database in the enqueuing transaction. Partial, so plain jobs (no
            # key) and finished ones never enter it.
            models.UniqueConstraint(
                fields=["unique_key"],
                # The key test first: PostgreSQL evaluates the predicate on
                # every insert and update, and for plain rows it ends there.
                condition=(models.Q(unique_key__isnull=False)
                           & models.Q(state__in=UNFINISHED_STATES)),
                name="rj_job_unique_key",
            ),
        ]
        # Staff actions in the admin, each granted on its own (staff.py).
        permissions = [
            ("retry_job", _("Can retry dead jobs")),
            ("cancel_job", _("Can cancel unfinished jobs")),
            ("requeue_job", _("Can requeue scheduled or cancelled jobs")),
            ("reprioritize_job", _("Can change the priority of waiting jobs")),
        ]

    def __str__(self) -> str:
        return f"{self.task_path} ({self.id})"

    @property
    def physical_queue(self) -> str:
        """The Redis queue (shard) that holds the job."""
        return shard_queue(self.queue, self.shard)

    @property
    def task_status(self) -> TaskResultStatus:
        return TASK_STATUS[JobState(self.state)]


class Attempt(models.Model):
    #: No index of its own: rj_attempt_job_number (job, number) serves every
    #: look-up by job, and one index less is one write less per attempt.
    job = models.ForeignKey(Job, models.CASCADE, related_name="attempt_set", verbose_name=_("job"),
                            db_index=False)
    number = models.PositiveIntegerField(_("number"))
    worker_id = models.CharField(_("worker"), max_length=200, blank=True, default="")
    started_at = models.DateTimeField(_("started"), null=True, blank=True)
    finished_at = models.DateTimeField(_("finished"), null=True, blank=True)
    outcome = models.CharField(
        _("outcome"), max_length=16, choices=AttemptOutcome.choices, blank=True, default=""
    )
    #: ``dotted.ExceptionClass: message`` of a failed attempt.
    error = models.TextField(_("error"), blank=True, default="")
    traceback = models.TextField(_("traceback"), blank=True, default="")

    class Meta:
        verbose_name = _("attempt")
        verbose_name_plural = _("attempts")
        ordering = ["job", "number"]
        constraints = [
            models.UniqueConstraint(fields=["job", "number"], name="rj_attempt_job_number"),
        ]
        # The dashboard's throughput per minute reads the last hour of attempts;
        # the per-task figures (taskstats.py) read it and the attempts still open.
        indexes = [
            models.Index(fields=["finished_at"], name="rj_attempt_finished"),
            models.Index(fields=["started_at"], condition=models.Q(outcome=""),
                         name="rj_attempt_open"),
        ]

    def __str__(self) -> str:
        return f"attempt {self.number} of {self.job_id}"

    @property
    def exception_class_path(self) -> str:
        return self.error.split(":", 1)[0] if self.error else ""


class CatchUp(models.TextChoices):
    """What a schedule enqueues of the slots missed while no scheduler ran."""

    ALL = "all", _("Every missed slot")
    LAST = "last", _("Only the last missed slot")
    NONE = "none", _("No missed slot")


class Schedule(models.Model):
    """A periodic job as the code last declared it, and where its scheduling stands.

    Written only by ``periodic/scheduler.py`` (and the staff toggle): the
    declaration fields on each scheduler's start-up, the cursor under the
    row's lock. Rows are never deleted: a schedule removed from code keeps
    its history, marked ``in_code=False``, and stops firing.
    """

    name = models.CharField(_("name"), max_length=200, unique=True)
    backend = models.CharField(_("backend"), max_length=100, default="default")
    task_path = models.CharField(_("task"), max_length=300)
    #: A 5-field cron expression, or "" for an interval.
    expression = models.CharField(_("cron expression"), max_length=200, blank=True, default="")
    every_ms = models.PositiveBigIntegerField(_("every (ms)"), null=True, blank=True)
    tz = models.CharField(_("time zone"), max_length=64, default="UTC")
    args = models.JSONField(_("args"), default=list)
    kwargs = models.JSONField(_("kwargs"), default=dict)
    queue = models.CharField(_("queue"), max_length=100, blank=True, default="")
    catch_up = models.CharField(_("after downtime"), max_length=8, choices=CatchUp.choices,
                                default=CatchUp.LAST)
    #: Staff may pause a schedule; schedulers read it at every pass.
    enabled = models.BooleanField(_("enabled"), default=True)
    #: Whether the code of the last scheduler that started declares it.
    in_code = models.BooleanField(_("in code"), default=True)
    #: Slots at or before this instant are never fired: set when the row is
    #: created and when staff enable it again, so neither fires the past.
    fire_after = models.DateTimeField(_("fires after"))
    #: The newest slot decided (enqueued, or skipped by the downtime policy).
    cursor_at = models.DateTimeField(_("decided up to"), null=True, blank=True)
    last_slot_at = models.DateTimeField(_("last slot enqueued"), null=True, blank=True)
    last_job_id = models.UUIDField(_("last job"), null=True, blank=True)
    created_at = models.DateTimeField(_("created"), auto_now_add=True)
    updated_at = models.DateTimeField(_("updated"), auto_now=True)

    class Meta:
        verbose_name = _("schedule")
        verbose_name_plural = _("schedules")
        ordering = ["name"]
        permissions = [
            ("toggle_schedule", _("Can enable or disable schedules")),
            ("run_schedule", _("Can run a schedule now")),
        ]

    def __str__(self) -> str:
        return self.name


class ScheduleSlot(models.Model):
    """One slot of a schedule that was enqueued: the proof it happened, with its job.

    The unique key (schedule, slot time) is inserted in the transaction that
    inserts the job's row, so a slot has a job exactly when it has this row,
    whichever scheduler, crash or retry came first. ``job_id`` is not a
    foreign key: ``prunejobs`` deletes old jobs, and the slot must stay.
    Manual runs ("run now") are kept here too, outside the unique key.
    """

    schedule = models.ForeignKey(Schedule, models.CASCADE, related_name="slots",
                                 verbose_name=_("schedule"))
    slot_at = models.DateTimeField(_("slot"))
    job_id = models.UUIDField(_("job"), null=True, blank=True)
    manual = models.BooleanField(_("run by staff"), default=False)
    enqueued_at = models.DateTimeField(_("enqueued"), auto_now_add=True)

    class Meta:
        verbose_name = _("schedule slot")
        verbose_name_plural = _("schedule slots")
        ordering = ["-slot_at"]
        constraints = [
            models.UniqueConstraint(fields=["schedule", "slot_at"], name="rj_slot_once",
                                    condition=models.Q(manual=False)),
        ]
        indexes = [models.Index(fields=["schedule", "-slot_at"], name="rj_slot_newest")]

    def __str__(self) -> str:
        return f"{self.schedule_id} at {self.slot_at.isoformat()}"
