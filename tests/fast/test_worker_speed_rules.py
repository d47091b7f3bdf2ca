"""The worker's speed cuts as pure rules: queue skipping, start-mark groups, payload decode.

Their effect on a real Redis and database is in tests/test_worker_speed.py.
"""

from __future__ import annotations

import pytest

from reliable_jobs import payload
from reliable_jobs.exceptions import MalformedPayload
from reliable_jobs.worker.executor import MARK_AHEAD, MARK_AHEAD_MAX, mark_group
from reliable_jobs.worker.skip import QueueSkipper


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_an_empty_queue_is_skipped_until_its_marker_or_the_full_recheck() -> None:
    # Given: three queues, of which b and c were found empty
    clock = Clock()
    skipper = QueueSkipper(poll_s=0.05, full_s=5.0, clock=clock)
    asked: list[list[str]] = []

    def woken(queues: list[str]) -> list[str]:
        asked.append(queues)
        return ["c"] if "c" in queues else []

    assert sorted(skipper.round(["a", "b", "c"], woken)) == ["a", "b", "c"]
    skipper.found("b", False)
    skipper.found("c", False)

    # When: the next round comes before the marker poll is due... then after
    first = skipper.round(["a", "b", "c"], woken)
    clock.now += 0.06
    second = skipper.round(["a", "b", "c"], woken)

    # Then: the first poll is immediate (never polled yet), c's marker brings it back
    assert asked[0] == ["b", "c"] and sorted(first) == ["a", "c"]
    assert len(asked) == 2 and asked[1] == ["b"] and sorted(second) == ["a", "c"]
    assert not skipper.last_full

    # And: after full_s every queue is tried again, markers or not
    clock.now += 5.0
    assert sorted(skipper.round(["a", "b", "c"], lambda qs: [])) == ["a", "b", "c"]
    assert skipper.last_full


def test_rounds_rotate_so_no_queue_is_always_first() -> None:
    skipper = QueueSkipper(clock=Clock())
    firsts = {skipper.round(["a", "b", "c"], lambda qs: [])[0] for _ in range(3)}
    assert firsts == {"a", "b", "c"}


def test_start_marks_group_more_jobs_only_when_they_are_very_short() -> None:
    assert mark_group(None) == MARK_AHEAD  # no job timed yet
    assert mark_group(50.0) == MARK_AHEAD
    assert mark_group(0.2) == MARK_AHEAD
    assert mark_group(0.05) == 40
    assert mark_group(0.0) == MARK_AHEAD_MAX


@pytest.mark.parametrize("text", [
    '\ufeff{"task":"a.b","args":[],"kwargs":{}}',
    '{"task":"a.b","args":[NaN],"kwargs":{}}',
    '{"task":"a.b","task":"a.c","args":[],"kwargs":{}}',
    '{"task":"a.b","args":[1e999],"kwargs":{}}',
])
def test_the_shared_decoder_refuses_what_json_loads_with_hooks_refused(text: str) -> None:
    with pytest.raises(MalformedPayload, match="not strict JSON"):
        payload.decode(text)


def test_the_shared_decoder_reads_a_payload_as_before() -> None:
    text = payload.encode("a.b", (1, 2.5, "x"), {"k": [None, {"n": True}]}, max_bytes=1 << 20)
    assert payload.decode(text) == payload.Payload("a.b", [1, 2.5, "x"],
                                                   {"k": [None, {"n": True}]})

