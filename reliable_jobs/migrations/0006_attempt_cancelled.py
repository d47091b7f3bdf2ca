from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ("reliable_jobs", "0005_job_unique_key"),
    ]

    operations = [
        migrations.AlterModelOptions(
            name="job",
            options={
                "ordering": ["-enqueued_at"],
                "permissions": [
                    ("retry_job", "Can retry dead jobs"),
                    ("cancel_job", "Can cancel unfinished jobs"),
                    ("requeue_job", "Can requeue scheduled or cancelled jobs"),
                ],
                "verbose_name": "job",
                "verbose_name_plural": "jobs",
            },
        ),
        migrations.AlterField(
            model_name="attempt",
            name="outcome",
            field=models.CharField(
                blank=True,
                choices=[
                    ("succeeded", "Succeeded"),
                    ("failed", "Failed"),
                    ("lease_expired", "Lease expired"),
                    ("released", "Released"),
                    ("timed_out", "Timed out"),
                    ("cancelled", "Cancelled"),
                ],
                default="",
                max_length=16,
                verbose_name="outcome",
            ),
        ),
    ]
