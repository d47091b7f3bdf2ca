"""The per-task figures (taskstats.py) find the attempts still open in a window.

A partial index: it holds only attempts with no outcome yet (a few per
worker thread), so it costs the hot path almost nothing.
"""

from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ("reliable_jobs", "0007_schedules"),
    ]

    operations = [
        migrations.AddIndex(
            model_name="attempt",
            index=models.Index(condition=models.Q(("outcome", "")), fields=["started_at"],
                               name="rj_attempt_open"),
        ),
    ]
