"""Drop the attempt table's index on job_id alone.

The unique constraint rj_attempt_job_number (job_id, number) starts with
job_id and serves every look-up by job, the foreign key's cascade included;
the second index only cost a write per attempt (about 90 bytes of WAL per
job, measured with ``benchjobs --process``).

Only the index goes: Django's own AlterField would also drop the foreign key
and add it back, checking every attempt row under a lock. The name is the
one Django gave the index (the same on every database and installation).
"""

import django.db.models.deletion
from django.db import migrations, models

INDEX = "reliable_jobs_attempt_job_id_485a0a3f"


class Migration(migrations.Migration):

    dependencies = [
        ('reliable_jobs', '0009_priority_permission'),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            database_operations=[
                migrations.RunSQL(
                    f'DROP INDEX IF EXISTS "{INDEX}"',
                    reverse_sql=f'CREATE INDEX "{INDEX}" ON "reliable_jobs_attempt" ("job_id")',
                ),
            ],
            state_operations=[
                migrations.AlterField(
                    model_name='attempt',
                    name='job',
                    field=models.ForeignKey(
                        db_index=False, on_delete=django.db.models.deletion.CASCADE,
                        related_name='attempt_set', to='reliable_jobs.job',
                        verbose_name='job'),
                ),
            ],
        ),
    ]
