# Staff may change the priority of a waiting job (admin action, through the
# broker's reprioritize.lua): a permission of its own, like retry, cancel and
# requeue. It depends on 0008, the last migration before it, so the chain
# has one leaf.

from django.db import migrations


class Migration(migrations.Migration):

    dependencies = [
        ('reliable_jobs', '0008_task_stats_indexes'),
    ]

    operations = [
        migrations.AlterModelOptions(
            name='job',
            options={'ordering': ['-enqueued_at'], 'permissions': [('retry_job', 'Can retry dead jobs'), ('cancel_job', 'Can cancel unfinished jobs'), ('requeue_job', 'Can requeue scheduled or cancelled jobs'), ('reprioritize_job', 'Can change the priority of waiting jobs')], 'verbose_name': 'job', 'verbose_name_plural': 'jobs'},
        ),
    ]
