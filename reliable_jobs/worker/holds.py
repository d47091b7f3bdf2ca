"""When a worker may try again a queue whose limits held back every job it reached.

The claim script enforces the limits (scripts/include/flow_limit.lua); a
claim that could do nothing because of them says how long until one may let
a job go (``ClaimResult.hold_ms``). The main thread then sleeps that long
(at most ``max_wait_s``, and wakes early when one of its own jobs ends)
instead of claiming in a busy loop or blocking on a list whose jobs it may
not take yet. A cap's hold is only a guess (an ack in another process frees
a slot without telling anyone), so while a queue stays held its waits double
from the script's hint up to ``BACKOFF_MAX_S``: a cap full for minutes costs
a few claim calls a second per worker, not a hundred.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from ..flow import Limits
from ..keys import logical_queue

#: Longest wait a run of futile claims on one queue backs off to, in seconds
#: (unless the script's own hint, a rate's next slot, is later).
BACKOFF_MAX_S = 0.05


class FlowHolds:
    """Each physical queue's own limits (the claim's ARGV) and its current hold."""

    def __init__(self, limits_of: Callable[[str], Limits], *, max_wait_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._limits_of = limits_of
        self._max_wait_s = max_wait_s
        self._clock = clock
        self._args: dict[str, tuple[int, int, int]] = {}
        #: Physical queue -> clock() time before which claiming from it is futile.
        self._until: dict[str, float] = {}
        #: Physical queue -> the last wait it was given, for the back-off.
        self._last_s: dict[str, float] = {}

    def claim_args(self, queue: str) -> tuple[int, int, int]:
        """The queue's limits as claim.lua takes them (ARGV[6..8])."""
        args = self._args.get(queue)
        if args is None:
            args = self._args[queue] = self._limits_of(logical_queue(queue)).claim_args()
        return args

    def record(self, queue: str, hold_ms: int, *, by_cap: bool = True) -> None:
        """What a claim on ``queue`` said: -1 (no hold) or how long its limits hold.

        Only a cap's hold (``by_cap``: a guess) backs off; a rate's is exact,
        and waiting longer would only lose rate.
        """
        if hold_ms < 0:
            self._until.pop(queue, None)
            self._last_s.pop(queue, None)
            return
        hint_s = hold_ms / 1000
        last_s = self._last_s.get(queue) if by_cap else None
        wait_s = hint_s if last_s is None else max(hint_s, min(last_s * 2, BACKOFF_MAX_S))
        self._last_s[queue] = max(wait_s, 0.001)
        self._until[queue] = self._clock() + wait_s

    def wait_s(self) -> float | None:
        """How long to sleep before the next claim round, or None when no queue is held.

        At least a millisecond (the hold ends at the server's next tick), at
        most ``max_wait_s``.
        """
        if not self._until:
            return None
        left = min(self._until.values()) - self._clock()
        return min(max(left, 0.001), self._max_wait_s)
