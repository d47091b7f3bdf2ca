"""reliable_jobs: a Django Tasks backend on Redis lists that never loses a job.

What task code uses is importable from here: the exceptions that steer a
job (``Snooze``, ``RetryLater``, ``PermanentFailure``) and the context a
``takes_context`` task receives (``JobContext``: cancellation, progress,
checkpoints).
"""

from .cancellation import JobContext
from .exceptions import PermanentFailure, RetryLater, Snooze

__version__ = "0.2.0"

__all__ = ["JobContext", "PermanentFailure", "RetryLater", "Snooze", "__version__"]
