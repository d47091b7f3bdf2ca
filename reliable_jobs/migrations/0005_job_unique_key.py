from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ("reliable_jobs", "0004_job_generation"),
    ]

    operations = [
        migrations.AddField(
            model_name="job",
            name="unique_key",
            field=models.CharField(blank=True, editable=False, max_length=64, null=True, verbose_name="unique key"),
        ),
        migrations.AddConstraint(
            model_name="job",
            constraint=models.UniqueConstraint(condition=models.Q(("unique_key__isnull", False), ("state__in", ("scheduled", "queued", "running"))), fields=("unique_key",), name="rj_job_unique_key"),
        ),
    ]
