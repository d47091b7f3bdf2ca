"""Check reliable_jobs on your own servers: the chaos run and the benchmark.

Add ``"reliable_jobs.contrib.verify"`` to ``INSTALLED_APPS`` (after
``"reliable_jobs"``) to get ``manage.py chaosjobs`` (SIGKILL real workers
under load, count every job) and ``manage.py benchjobs`` (enqueue and drain
rates). Both start real workers on the backend's Redis and database, so
point them at an idle queue, never at production.
"""
