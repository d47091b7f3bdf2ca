"""Job ids are version 7 UUIDs: canonical text, time-ordered, random where it counts."""

from __future__ import annotations

import itertools
import time
import uuid

from reliable_jobs.jobids import new_job_id, new_job_ids


def test_ids_are_canonical_version_7_uuids_carrying_the_time_they_were_made() -> None:
    # Given: the clock before and after 3,000 ids are made (three batches)
    before_ms = time.time_ns() // 1_000_000
    ids = [*itertools.islice(new_job_ids(), 3_000), new_job_id()]
    after_ms = time.time_ns() // 1_000_000

    # Then: each is a canonical version 7, RFC 9562 variant UUID whose first
    # 48 bits are the Unix time in milliseconds when it was made
    for text in ids:
        parsed = uuid.UUID(text)
        assert str(parsed) == text
        assert (parsed.version, parsed.variant) == (7, uuid.RFC_4122)
        assert before_ms <= parsed.int >> 80 <= after_ms
    # and they are all different
    assert len(set(ids)) == len(ids)


def test_later_batches_sort_after_earlier_ones() -> None:
    # Given: a batch of ids, then, a few milliseconds later, another
    first = list(itertools.islice(new_job_ids(500), 500))
    time.sleep(0.005)
    second = list(itertools.islice(new_job_ids(500), 500))

    # Then: every id of the later batch sorts after every id of the first, as
    # text and as the UUIDs PostgreSQL's index compares (so new rows go to
    # the right edge of the primary key)
    assert max(first) < min(second)
    assert max(map(uuid.UUID, first)) < min(map(uuid.UUID, second))


def test_the_random_part_varies_in_every_position() -> None:
    # Given: 2,000 ids made in the same millisecond batch
    ids = [uuid.UUID(text).int for text in itertools.islice(new_job_ids(2_000), 2_000)]

    # Then: each of the 74 random bits (12 after the version, 62 after the
    # variant) is set in some id and clear in another
    random_bits = [*range(64, 76), *range(0, 62)]
    for bit in random_bits:
        values = {(value >> bit) & 1 for value in ids}
        assert values == {0, 1}, f"bit {bit} never changes"
