"""When a worker may try again a queue whose limits held back every job it reached.

The claim script enforces the limits (scripts/include/flow_limit.lua); a
claim that could do nothing because of them says how long until one may let
a job go (``ClaimResult.hold_ms``). The main thread then sleeps that long
(at most ``max_wait_s``, and wakes early when one of its own jobs ends)
instead of claiming in a busy loop or blocking on a list whose jobs it may
not take yet.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from ..flow import Limits
from ..keys import logical_queue


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

    def claim_args(self, queue: str) -> tuple[int, int, int]:
        """The queue's limits as claim.lua takes them (ARGV[6..8])."""
        args = self._args.get(queue)
        if args is None:
            args = self._args[queue] = self._limits_of(logical_queue(queue)).claim_args()
        return args

    def record(self, queue: str, hold_ms: int) -> None:
        """What a claim on ``queue`` said: -1 (no hold) or how long its limits hold."""
        if hold_ms < 0:
            self._until.pop(queue, None)
        else:
            self._until[queue] = self._clock() + hold_ms / 1000

    def wait_s(self) -> float | None:
        """How long to sleep before the next claim round, or None when no queue is held.

        At least a millisecond (the hold ends at the server's next tick), at
        most ``max_wait_s``.
        """
        if not self._until:
            return None
        left = min(self._until.values()) - self._clock()
        return min(max(left, 0.001), self._max_wait_s)
