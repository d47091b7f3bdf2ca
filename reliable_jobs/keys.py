"""Every Redis key name reliable_jobs uses, and nothing else.

All keys of one queue carry the hash tag ``{queue}`` so that a queue lives in
one Redis Cluster slot and every Lua script touches a single slot. No other
module spells a key: they ask a :class:`QueueKeys` (or :func:`worker_key`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

#: Queue names may use letters, digits and ``._-`` (1 to 100 characters):
#: braces would break the hash tag, and ``:`` would blur key boundaries.
QUEUE_NAME_RE = re.compile(r"[A-Za-z0-9._-]{1,100}")
#: Prefixes follow the same rule, and may also not contain a hash tag.
PREFIX_RE = QUEUE_NAME_RE


#: A physical queue: a queue name, or ``name#i`` for shard i > 0 of a sharded
#: queue ('#' is not allowed in queue names, so the two never collide).
PHYSICAL_QUEUE_RE = re.compile(r"[A-Za-z0-9._-]{1,100}(#[1-9][0-9]{0,3})?")
#: Most shards one queue may be split into.
MAX_SHARDS = 1024

#: A fair group (fairness.py): 1 to 100 letters, digits or ``._:@-``. It ends
#: a key (QueueKeys.group), and the weights reach claim.lua as
#: ``group=weight,...``, hence no ',' or '='.
FAIR_GROUP_RE = re.compile(r"[A-Za-z0-9._:@-]{1,100}")
#: Largest weight of a fair group: jobs it takes per turn (claim.lua checks it too).
MAX_FAIR_WEIGHT = 1000


def is_valid_queue_name(name: object) -> bool:
    """Return True when ``name`` can be used inside a key and a hash tag."""
    return isinstance(name, str) and bool(QUEUE_NAME_RE.fullmatch(name))


def shard_queue(queue: str, index: int) -> str:
    """The physical queue of shard ``index``: shard 0 keeps the plain name.

    So an unsharded queue is its own shard 0, and splitting it (or merging
    shards back) never moves the jobs already waiting: workers drain every
    shard that was ever used (see shards_index).
    """
    return queue if index == 0 else f"{queue}#{index}"


def logical_queue(physical: str) -> str:
    """The queue name a physical queue (a shard) belongs to."""
    return physical.split("#", 1)[0]


def shard_index(physical: str) -> int:
    """The shard number of a physical queue (0 for the plain name)."""
    _, _, index = physical.partition("#")
    return int(index) if index else 0


def shards_index(prefix: str, queue: str) -> str:
    """Sorted set of the shard indexes of ``queue`` that were ever written to."""
    return f"{prefix}:shards:{queue}"


@dataclass(frozen=True, slots=True)
class QueueKeys:
    """The keys of one queue; see docs/design.md's key table."""

    prefix: str
    queue: str

    def __post_init__(self) -> None:
        if not isinstance(self.queue, str) or not PHYSICAL_QUEUE_RE.fullmatch(self.queue):
            raise ValueError(
                f"Queue name {self.queue!r} is not usable: use 1 to 100 letters, "
                "digits, '.', '_' or '-'."
            )
        if not isinstance(self.prefix, str) or not PREFIX_RE.fullmatch(self.prefix):
            raise ValueError(
                f"Key prefix {self.prefix!r} is not usable: use 1 to 100 letters, "
                "digits, '.', '_' or '-'."
            )

    @property
    def base(self) -> str:
        return f"{self.prefix}:{{{self.queue}}}"

    @property
    def queued(self) -> str:
        return f"{self.base}:queued"

    @property
    def bands(self) -> str:
        """Sorted set of the non-zero priorities that have a non-empty band list.

        Member and score are both the priority. Priority 0 lives on
        :attr:`queued` itself, so a queue that never sees another priority
        never has this key and its claims take today's path.
        """
        return f"{self.base}:bands"

    @property
    def band_prefix(self) -> str:
        """A priority band's list is ``band_prefix + priority`` (a non-zero -100..100).

        Scripts receive it as a KEYS entry, like :attr:`job_prefix`.
        """
        return f"{self.base}:band:"

    def band(self, priority: int) -> str:
        """The list of ids ready to run at ``priority`` (0: :attr:`queued`)."""
        return self.queued if priority == 0 else f"{self.band_prefix}{priority}"

    @property
    def share(self) -> str:
        """Counter of jobs claimed while several bands wait (the fair share's turn)."""
        return f"{self.base}:share"

    @property
    def fair_bands(self) -> str:
        """Sorted set of the priorities (0 included) whose jobs wait in fair groups.

        Member and score are both the priority; a priority is listed while
        its rotation (:attr:`rota_prefix`) is not empty. A queue whose jobs
        never carry a fair key never has this key, and its claims take the
        plain path.
        """
        return f"{self.base}:fairbands"

    @property
    def rota_prefix(self) -> str:
        """The rotation of priority p is ``rota_prefix + p``: a sorted set of
        the fair groups with jobs waiting at p, group -> its place in the turn
        order ('' stands for the priority's plain list while it has jobs)."""
        return f"{self.base}:rota:"

    @property
    def group_prefix(self) -> str:
        """The list of group g at priority p is ``group_prefix + p + ':' + g``."""
        return f"{self.base}:group:"

    def group(self, priority: int, group: str) -> str:
        """The list of ids of fair group ``group`` ready to run at ``priority``."""
        return f"{self.group_prefix}{priority}:{group}"

    @property
    def fair(self) -> tuple[str, str, str]:
        """What every script that pushes a job takes last: fair_bands, rota and group prefixes."""
        return (self.fair_bands, self.rota_prefix, self.group_prefix)

    @property
    def turn(self) -> str:
        """Hash: priority -> jobs its rotation's head group took in its current turn."""
        return f"{self.base}:turn"

    @property
    def strays(self) -> str:
        """Sorted set: id -> copies left behind on a band list by reprioritize.lua."""
        return f"{self.base}:strays"

    @property
    def paused(self) -> str:
        """String, set while this shard is paused (its value: since when, ms).

        claim.lua (KEYS[11]) takes nothing while it exists and start.lua
        lets no claimed job start; pause.lua sets and removes it. The
        mirror's QueuePause rows hold the same fact durably (pausing.py).
        """
        return f"{self.base}:paused"

    @property
    def flow_prefix(self) -> str:
        """A limit's keys are ``flow_prefix + kind + ':' + wire name`` (see flow.py).

        ``log:<wire>`` (sorted set, a rate limit's sliding log of claims),
        ``tat:<wire>`` (string, its pacing), ``run:<wire>`` (sorted set, a
        cap's admitted ids), ``held:<wire>`` (list, the jobs the limit holds
        back); ``log:q`` is the queue's own
        rate log. Scripts receive it as a KEYS entry, like :attr:`job_prefix`.
        """
        return f"{self.base}:flow:"

    def flow(self, kind: str, wire: str) -> str:
        """One limit's key: ``kind`` is 'log', 'tat', 'run' or 'held'."""
        return f"{self.flow_prefix}{kind}:{wire}"

    @property
    def holds(self) -> str:
        """Sorted set: wire name of a limit holding jobs back -> when it may let one go (ms)."""
        return f"{self.base}:flow-holds"

    @property
    def processing(self) -> str:
        """Legacy: the list where version 0.1 kept claimed ids.

        The in-flight index is now :attr:`leases` (an ack is a ZREM,
        O(log n), where LREM on this shared list was O(jobs in flight));
        recover.lua drains what an upgrade left here into leases.
        """
        return f"{self.base}:processing"

    @property
    def leases(self) -> str:
        """Sorted set id -> lease deadline (ms): every claimed, unacked job."""
        return f"{self.base}:leases"

    @property
    def landing(self) -> str:
        """Ids a worker moved off queued with BLMOVE and has not stamped yet."""
        return f"{self.base}:landing"

    @property
    def scheduled(self) -> str:
        return f"{self.base}:scheduled"

    @property
    def dead(self) -> str:
        return f"{self.base}:dead"

    @property
    def wake(self) -> str:
        """A list of at most one marker, pushed when work arrives (multi-queue waits)."""
        return f"{self.base}:wake"

    @property
    def job_prefix(self) -> str:
        """Job hashes are ``job_prefix + id``; scripts receive it as a KEYS entry."""
        return f"{self.base}:job:"

    def job(self, job_id: str) -> str:
        return f"{self.job_prefix}{job_id}"


def worker_key(prefix: str, worker_id: str) -> str:
    """The heartbeat key of one worker (a string with a TTL)."""
    return f"{prefix}:worker:{worker_id}"


def workers_index(prefix: str) -> str:
    """Sorted set: worker id -> last heartbeat (ms), for listing live workers."""
    return f"{prefix}:workers"


def wake_marker(prefix: str, queue: str) -> str:
    """A queue's wake marker on Redis Cluster: every queue's shares one slot.

    One ``BLPOP`` can then wait on all of a worker's queues, which a cluster
    refuses across slots (see scripts/wake.lua).
    """
    return f"{prefix}:{{wake}}:{queue}"
