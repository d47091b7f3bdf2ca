"""Write less per job: one index less on attempts, room on the job table's pages.

- The attempt table's index on job_id alone goes: the unique constraint
  rj_attempt_job_number (job_id, number) starts with job_id and serves every
  look-up by job, the foreign key's cascade included. Only the index goes:
  Django's own AlterField would also drop the foreign key and add it back,
  checking every attempt row under a lock. The name is the one Django gave
  the index (the same on every database and installation).
- The job table's pages are filled to FILLFACTOR percent by new rows
  (PostgreSQL): the worker's UPDATE of a finished job then writes the new row
  version on the same page, so PostgreSQL logs only the bytes that changed
  and no extra lock record, instead of the whole row on another page. Pages
  written before this migration keep their fill.

Measured with ``benchjobs --process`` (docs/explanation/benchmarks.md).
"""

from typing import Any

import django.db.models.deletion
from django.db import migrations, models

INDEX = "reliable_jobs_attempt_job_id_485a0a3f"
#: Percent of each job-table page new rows fill: a page's rows are usually
#: finished by one batch, so each needs room for a second version of itself.
FILLFACTOR = 50


def fill_job_pages(apps: Any, schema_editor: Any) -> None:
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute(
            f'ALTER TABLE "reliable_jobs_job" SET (fillfactor = {FILLFACTOR})')


def fill_job_pages_fully(apps: Any, schema_editor: Any) -> None:
    if schema_editor.connection.vendor == "postgresql":
        schema_editor.execute('ALTER TABLE "reliable_jobs_job" RESET (fillfactor)')


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
        migrations.RunPython(fill_job_pages, fill_job_pages_fully),
    ]
