from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ("reliable_jobs", "0003_job_shard"),
    ]

    operations = [
        migrations.AddField(
            model_name="job",
            name="generation",
            field=models.PositiveIntegerField(default=0, verbose_name="generation"),
        ),
    ]
