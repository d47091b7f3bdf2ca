"""A runnable Django project using reliable_jobs: the demo site and the tests' settings."""
