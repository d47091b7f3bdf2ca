"""``python djtasks_manage.py KIND COMMAND ...``: manage.py of the django.tasks bench project.

KIND (``db``, ``redis`` or ``rq``) picks the backend, see djtasks_settings.
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":
    os.environ["BENCH_DJTASKS"] = sys.argv.pop(1)
    os.environ["DJANGO_SETTINGS_MODULE"] = "djtasks_settings"
    from django.core.management import execute_from_command_line

    execute_from_command_line(sys.argv)
