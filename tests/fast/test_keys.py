"""Key names: exactly docs/design.md's table, and only from names that fit in a hash tag."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from redis.crc import key_slot

from reliable_jobs.keys import QueueKeys, is_valid_queue_name, worker_key, workers_index

#: docs/design.md's "Redis keys" table for a queue Q under the default prefix.
DESIGN_TABLE = {
    "queued": "rj:{Q}:queued",
    "processing": "rj:{Q}:processing",
    "landing": "rj:{Q}:landing",
    "leases": "rj:{Q}:leases",
    "scheduled": "rj:{Q}:scheduled",
    "dead": "rj:{Q}:dead",
}

#: Names that would break a key or its hash tag, and why.
INVALID_NAMES = {
    "open brace": "a{b",
    "close brace": "a}b",
    "colon": "a:b",
    "space": "a b",
    "unicode": "café",
    "empty": "",
    "101 characters": "q" * 101,
    "trailing newline": "queue\n",
    "tab": "a\tb",
}


def test_queue_keys_match_the_design_table() -> None:
    # Given the keys of queue "Q" under the default prefix
    keys = QueueKeys("rj", "Q")

    # Then each key is spelled exactly as docs/design.md's table says
    assert {name: getattr(keys, name) for name in DESIGN_TABLE} == DESIGN_TABLE
    assert keys.job("0b6c3f8e-1a2b") == "rj:{Q}:job:0b6c3f8e-1a2b"
    assert keys.job_prefix == "rj:{Q}:job:"
    assert keys.wake == "rj:{Q}:wake"


def test_every_key_of_a_queue_lives_in_one_cluster_slot() -> None:
    # Given two queues whose names hash to different slots
    assert key_slot(b"emails") != key_slot(b"reports")

    for queue in ("emails", "reports"):
        keys = QueueKeys("myapp", queue)

        # When every key of the queue is listed
        names = [keys.queued, keys.processing, keys.landing, keys.leases,
                 keys.scheduled, keys.dead, keys.wake, keys.job("some-id"), keys.job_prefix]

        # Then each carries the {queue} tag, so all share the queue's slot
        assert all(f"{{{queue}}}" in name for name in names)
        assert {key_slot(name.encode()) for name in names} == {key_slot(queue.encode())}


def test_the_prefix_is_configurable() -> None:
    # Given a prefix other than the default
    keys = QueueKeys("shop.v2", "mail-out_1")

    # Then every key starts with it
    assert keys.queued == "shop.v2:{mail-out_1}:queued"
    assert keys.job("x") == "shop.v2:{mail-out_1}:job:x"


def test_worker_keys_use_the_prefix() -> None:
    # Then the heartbeat keys are spelled under the prefix
    assert worker_key("rj", "host-1.42") == "rj:worker:host-1.42"
    assert workers_index("rj") == "rj:workers"


@pytest.mark.parametrize("name", ["a", "Q", "q" * 100, "emails.high_priority-2", "0", "-._"])
def test_valid_names_are_accepted_as_queue_and_prefix(name: str) -> None:
    # When a name of allowed characters, 1 to 100 long, is used
    keys = QueueKeys(name, name)

    # Then it is used verbatim
    assert is_valid_queue_name(name)
    assert keys.queued == f"{name}:{{{name}}}:queued"


@pytest.mark.parametrize("why", sorted(INVALID_NAMES))
def test_an_invalid_queue_name_is_refused_with_a_clear_message(why: str) -> None:
    # Given a queue name that cannot live inside a key and a hash tag
    name = INVALID_NAMES[why]

    # When keys are asked for it
    # Then a ValueError names the queue and says what is allowed
    with pytest.raises(ValueError, match=r"Queue name .* is not usable") as caught:
        QueueKeys("rj", name)
    message = str(caught.value)
    assert repr(name) in message
    assert "1 to 100 letters, digits, '.', '_' or '-'" in message
    assert not is_valid_queue_name(name)


@pytest.mark.parametrize("why", sorted(INVALID_NAMES))
def test_an_invalid_prefix_is_refused_with_a_clear_message(why: str) -> None:
    # Given a prefix that cannot start a key (a brace would even add a second hash tag)
    prefix = INVALID_NAMES[why]

    # When keys are asked for under it
    # Then a ValueError names the prefix and says what is allowed
    with pytest.raises(ValueError, match=r"Key prefix .* is not usable") as caught:
        QueueKeys(prefix, "default")
    message = str(caught.value)
    assert repr(prefix) in message
    assert "1 to 100 letters, digits, '.', '_' or '-'" in message


@pytest.mark.parametrize("value", [None, 7, b"default", ["default"]])
def test_a_queue_name_that_is_not_a_string_is_refused(value: object) -> None:
    # When keys are asked for a queue "name" of another type
    # Then it is a ValueError like any other unusable name
    assert not is_valid_queue_name(value)
    with pytest.raises(ValueError, match="is not usable"):
        QueueKeys("rj", value)  # type: ignore[arg-type]  # the wrong type is the point


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(queue=st.from_regex(r"[A-Za-z0-9._-]{1,100}", fullmatch=True),
       other=st.from_regex(r"[A-Za-z0-9._-]{1,100}", fullmatch=True),
       prefix=st.from_regex(r"[A-Za-z0-9._-]{1,100}", fullmatch=True),
       job_id=st.text(), worker_id=st.text())
def test_ids_stay_inside_their_namespace(
    queue: str, other: str, prefix: str, job_id: str, worker_id: str
) -> None:
    # Given the keys of a queue, and any id at all (ids come from Redis lists and flags)
    keys = QueueKeys(prefix, queue)
    job_key = keys.job(job_id)
    named = [keys.queued, keys.processing, keys.leases, keys.scheduled, keys.dead, keys.wake]

    # Then a job key stays in its queue's namespace and cluster slot, whatever the id
    assert job_key.startswith(keys.job_prefix)
    assert key_slot(job_key.encode(errors="surrogatepass")) == key_slot(queue.encode())
    assert job_key not in named

    # And: no key of another queue, and no heartbeat key, can equal one of this queue's
    if other != queue:
        theirs = QueueKeys(prefix, other)
        assert not {theirs.queued, theirs.processing, theirs.leases, theirs.scheduled,
                    theirs.dead, theirs.wake, theirs.job(job_id)} & {*named, job_key}
    beat = worker_key(prefix, worker_id)
    assert beat not in {*named, job_key, workers_index(prefix)}
    assert not beat.startswith(f"{prefix}:{{")

