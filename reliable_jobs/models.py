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
    #: Waits for other jobs (workflows.py): a row only, nothing in Redis,
    #: until the mirror write that settles its last dependency makes it
    #: queued (or scheduled) and pushes it.
    WAITING = "waiting", _("Waiting")
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
    JobState.WAITING: TaskResultStatus.READY,
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

    #: Dependencies not settled yet (only a ``waiting`` job has any): the
    #: mirror write that settles one takes it down by one under the row's
    #: lock, and the one that reaches 0 makes the job runnable.
    waiting_for = models.PositiveIntegerField(_("waiting for"), default=0, db_default=0)
    #: The workflow the job belongs to (None for a job enqueued alone).
    workflow = models.ForeignKey("Workflow", models.SET_NULL, null=True, blank=True,
                                 related_name="jobs", verbose_name=_("workflow"),
                                 db_index=False, db_constraint=False)
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
            # Partial: plain jobs (no workflow) never enter it, so enqueue pays nothing.
            models.Index(fields=["workflow"], name="rj_job_workflow",
                         condition=models.Q(workflow__isnull=False)),
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


class Workflow(models.Model):
    """Jobs enqueued together by a builder of ``workflows.py`` (chain, group, chord).

    A header only: its jobs point to it (``Job.workflow``), their order is
    in :class:`Dependency`. Written once, in the transaction that inserts
    the jobs; never updated (progress is counted from the jobs).
    """

    id = models.UUIDField(_("id"), primary_key=True, default=uuid.uuid4, editable=False)
    name = models.CharField(_("name"), max_length=200, blank=True, default="")
    #: How many jobs it has.
    total = models.PositiveIntegerField(_("jobs"))
    created_at = models.DateTimeField(_("created"))

    class Meta:
        verbose_name = _("workflow")
        verbose_name_plural = _("workflows")
        ordering = ["-created_at"]
        # The admin's two workflow actions, each granted on its own (workflows.py).
        permissions = [
            ("retry_workflow", _("Can retry a workflow from its failed jobs")),
            ("cancel_workflow", _("Can cancel the rest of a workflow")),
        ]

    def __str__(self) -> str:
        return self.name or str(self.id)


class OnFailure(models.TextChoices):
    """What a dependent job does when a job it waits for ends dead or cancelled."""

    CANCEL = "cancel", _("Cancel the dependent job")
    RUN = "run", _("Run it anyway, the failure passed to it")
    #: A callback on failure: released by the first failed upstream, cancelled
    #: as not needed (CallbackNotNeeded) once every upstream succeeded.
    ONLY = "only", _("Run it only if one fails, as soon as one does")


class PassResult(models.IntegerChoices):
    """Whether, and how, the upstream's result reaches the dependent's first argument."""

    NO = 0, _("Not passed")
    VALUE = 1, _("As the first argument")
    LIST = 2, _("As an item of a list, the first argument")


class Dependency(models.Model):
    """One edge of a workflow: ``job`` runs only after ``upstream`` has ended.

    ``upstream_id`` is no foreign key: the edge is settled (``state`` set,
    the result copied) by the write that ends the upstream, so pruning the
    upstream's row later loses nothing the dependent still needs.
    """

    job = models.ForeignKey(Job, models.CASCADE, related_name="dependencies",
                            verbose_name=_("job"))
    upstream_id = models.UUIDField(_("upstream job"))
    #: '' while the upstream has not ended; then the state it ended in.
    state = models.CharField(_("state"), max_length=16, blank=True, default="")
    on_failure = models.CharField(_("on failure"), max_length=8, choices=OnFailure.choices,
                                  default=OnFailure.CANCEL)
    passes = models.PositiveSmallIntegerField(_("passes its result"), choices=PassResult.choices,
                                              default=PassResult.NO)
    #: The place of the upstream's result in the dependent's list (PassResult.LIST).
    position = models.PositiveIntegerField(_("position"), default=0)
    #: The upstream's return value (or its failure), copied when it ended.
    result = models.JSONField(_("result"), null=True, blank=True)

    class Meta:
        verbose_name = _("dependency")
        verbose_name_plural = _("dependencies")
        indexes = [
            # What the write that ends a job looks up: its edges not settled yet.
            models.Index(fields=["upstream_id"], name="rj_dep_pending",
                         condition=models.Q(state="")),
        ]

    def __str__(self) -> str:
        return f"{self.job_id} after {self.upstream_id}"


class QueuePause(models.Model):
    """A paused queue: the durable record of the flag its shards carry in Redis.

    Written only by ``pausing.py``, in the transaction that sets or removes
    the Redis flags; the sweep puts lost flags back from these rows (Redis
    restarted or flushed), so a pause outlives the data Redis holds. No row:
    the queue runs.
    """

    backend = models.CharField(_("backend"), max_length=100, default="default")
    queue = models.CharField(_("queue"), max_length=100)
    paused_at = models.DateTimeField(_("paused at"))
    #: Who paused it: a user name, "manage.py pausequeue" or what the caller said.
    paused_by = models.CharField(_("paused by"), max_length=150, blank=True, default="")

    class Meta:
        verbose_name = _("paused queue")
        verbose_name_plural = _("paused queues")
        ordering = ["backend", "queue"]
        constraints = [
            models.UniqueConstraint(fields=["backend", "queue"], name="rj_queue_pause_once"),
        ]
        # Pausing is its own grant (staff.py's actions have theirs); rows are
        # never added, changed or deleted by hand in the admin.
        default_permissions = ("view",)
        permissions = [("pause_queue", _("Can pause and resume queues"))]

    def __str__(self) -> str:
        return f"{self.queue} ({self.backend})"
