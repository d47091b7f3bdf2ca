"""Job ids: time-ordered UUIDs (version 7, RFC 9562), as canonical text.

A job's id is the primary key of its mirror row. Random (version 4) ids
land all over the key's B-tree, so every insert dirties a random leaf
page: on a job table of a million rows (ten minutes of retention at a few
thousand jobs a second) an insert of 200,000 rows took 3.5 s with random
ids and 1.8-2.1 s with time-ordered ones (bench/README.md, "Enqueue").
Version 7 puts the Unix time in milliseconds in the first 48 bits, so new
rows go to the key's right edge, and the worker's updates of recent jobs
find their pages in cache. The other 74 bits are random, so an id is no
easier to guess than needed for a capability (only staff and code that
enqueued the job are given it); what it tells is when the job was made.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

#: Ids made per ``os.urandom`` call by :func:`new_job_ids`.
BATCH = 1000
#: Characters of an id the admin shows (and its search takes back).
SHORT_ID_LENGTH = 8


def short_id(job_id: object) -> str:
    """The last 8 hex digits of an id, the short form people read and paste.

    Not the first 8, as for a git hash: a version 7 id starts with its time,
    which the jobs of the same minute share; its end is random.
    """
    return str(job_id)[-SHORT_ID_LENGTH:]


def new_job_id() -> str:
    """One version 7 UUID as text (``str(uuid.UUID(...))`` form)."""
    return next(new_job_ids(1))


def new_job_ids(batch: int = BATCH) -> Iterator[str]:
    """Version 7 UUIDs as text, endlessly, made ``batch`` at a time.

    One ``os.urandom`` call and one clock read per batch instead of a UUID
    object per job (a UUID object per job was one of the largest costs of a
    bulk enqueue); the ids of one batch share their millisecond, which keeps
    them together in the key's index as well as one per job would.
    """
    while True:
        stamp = (time.time_ns() // 1_000_000).to_bytes(6, "big").hex()
        stamp = f"{stamp[:8]}-{stamp[8:12]}-"
        raw = bytearray(os.urandom(10 * batch))
        raw[0::10] = bytes((b & 0x0F) | 0x70 for b in raw[0::10])  # version 7
        raw[2::10] = bytes((b & 0x3F) | 0x80 for b in raw[2::10])  # RFC 9562 variant
        hexed = raw.hex()
        for i in range(0, 20 * batch, 20):
            yield (f"{stamp}{hexed[i:i + 4]}-{hexed[i + 4:i + 8]}-{hexed[i + 8:i + 20]}")
