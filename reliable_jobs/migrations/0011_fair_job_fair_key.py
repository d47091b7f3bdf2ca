# Each job keeps its fair group (fairness.py) so a rebuild from the mirror puts it back
# in its group.

from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ("reliable_jobs", "0010_speed_mirror_writes"),
    ]

    operations = [
        migrations.AddField(
            model_name="job",
            name="fair_key",
            field=models.CharField(blank=True, default="", max_length=100,
                                   verbose_name="fair group"),
        ),
    ]
