"""Make a process die with its parent, even when the parent is SIGKILLed.

A parent killed outright (SIGKILL, the OOM killer) runs no cleanup, so its
children must be told by the kernel: Linux's ``PR_SET_PDEATHSIG`` sends the
child a signal when its parent goes. Used for the supervisor's workers,
``chaosjobs``' workers, and the forkserver and children of isolated attempts.

Two details of ``prctl(2)`` shape this module:

* the parent may already be dead when the child asks, and the kernel would
  then never signal it: after asking, the child checks that its parent is
  still the expected process and exits at once if not;
* "parent" means the *thread* that forked the child: the signal comes when
  that thread exits, even if the rest of its process runs on. Callers must
  fork from a thread that lives as long as its process.

Off Linux there is no such call: nothing is asked and nothing fails.
"""

from __future__ import annotations

import ctypes
import os
import sys

#: prctl(2) option: the signal a process gets when its parent dies (Linux).
PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int | None, signum: int) -> None:
    """Ask for ``signum`` when the parent dies; exit now if it already has.

    ``parent_pid`` is the parent this process was started by; None skips the
    check (the caller cannot know it). Call it in the child, as early as
    possible: until then the child would outlive its parent.
    """
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signum)
    except (OSError, AttributeError):  # no usable libc: the callers' own safety nets remain
        return
    if parent_pid is not None and os.getppid() != parent_pid:  # died before prctl ran
        os._exit(1)
