# A snoozed attempt's outcome, and what a running task says of itself: progress and
# its checkpoint (mirror/journal.py).

from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ("reliable_jobs", "0011_fair_job_fair_key"),
    ]

    operations = [
        migrations.AlterField(
            model_name="attempt",
            name="outcome",
            field=models.CharField(
                blank=True,
                choices=[("succeeded", "Succeeded"), ("failed", "Failed"),
                         ("lease_expired", "Lease expired"), ("released", "Released"),
                         ("timed_out", "Timed out"), ("cancelled", "Cancelled"),
                         ("snoozed", "Snoozed")],
                default="", max_length=16, verbose_name="outcome"),
        ),
        migrations.AddField(
            model_name="job",
            name="progress_done",
            field=models.BigIntegerField(blank=True, null=True, verbose_name="progress done"),
        ),
        migrations.AddField(
            model_name="job",
            name="progress_total",
            field=models.BigIntegerField(blank=True, null=True, verbose_name="progress total"),
        ),
        migrations.AddField(
            model_name="job",
            name="checkpoint",
            field=models.JSONField(blank=True, null=True, verbose_name="checkpoint"),
        ),
        migrations.AddField(
            model_name="job",
            name="progress_attempt",
            field=models.PositiveIntegerField(blank=True, null=True,
                                              verbose_name="progress attempt"),
        ),
    ]
