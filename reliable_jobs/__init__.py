"""reliable_jobs: a Django Tasks backend on Redis lists that never loses a job."""

__version__ = "0.2.0"

from .exceptions import PermanentFailure, RetryLater, Snooze

__all__ = ["PermanentFailure", "RetryLater", "Snooze", "__version__"]
