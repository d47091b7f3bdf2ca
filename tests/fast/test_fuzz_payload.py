"""Fuzz the payload codec: decode never crashes and never lets through what encode refuses.

A payload read from Redis may be anything. ``payload.decode`` must turn all
of it into either a :class:`Payload` that ``payload.encode`` itself would
have written (so no value a worker hands to a task, to the mirror or back to
Redis can be refused later: no NaN, no NUL, no lone surrogate, no absurd
nesting, a task path that is a dotted Python path), or a
:class:`MalformedPayload` whose message is safe to store and to log. Pure
Python: no server, no database; derandomized, so CI sees the same examples.
"""

from __future__ import annotations

import json
import math
import sys
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from reliable_jobs import payload, tasks
from reliable_jobs.compat import InvalidTask
from reliable_jobs.exceptions import InvalidJobArguments, MalformedPayload, PayloadTooLarge

FUZZ = settings(max_examples=400, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

#: Every code point, surrogates and NUL included.
any_text = st.text(alphabet=st.characters(exclude_categories=()), max_size=60)
#: JSON values as a hostile writer might produce them (before any check).
json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), any_text),
    lambda children: st.one_of(st.lists(children, max_size=4),
                               st.dictionaries(any_text, children, max_size=4)),
    max_leaves=20,
)
#: Arguments a producer may legitimately pass.
good_text = st.text(alphabet=st.characters(codec="utf-8", exclude_characters="\x00"),
                    max_size=40)
good_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(),
              st.floats(allow_nan=False, allow_infinity=False), good_text),
    lambda children: st.one_of(st.lists(children, max_size=4),
                               st.dictionaries(good_text, children, max_size=4)),
    max_leaves=20,
)
task_paths = st.one_of(
    st.sampled_from(["os.system", "subprocess.run", "builtins.eval", "a", "app.tasks.send",
                     "app..tasks", ".app", "app.", "app.tasks.send()", "app.tasks;rm",
                     "app/tasks", "__import__('os').system", "tâche.envoyer", "x" * 301,
                     "app.tasks.send\n", "app.\x00", "app.\udcff"]),
    any_text,
)
payload_objects = st.fixed_dictionaries(
    {}, optional={"task": st.one_of(task_paths, json_values),
                  "args": st.one_of(st.lists(json_values, max_size=4), json_values),
                  "kwargs": st.one_of(st.dictionaries(any_text, json_values, max_size=4),
                                      json_values),
                  "extra": json_values})


def to_json(value: Any) -> str:
    """Serialise as a hostile writer might: NaN allowed, non-ASCII raw or escaped."""
    return json.dumps(value, allow_nan=True, ensure_ascii=False)


def strings_in(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for k, v in value.items() for s in (k, *strings_in(v))]
    if isinstance(value, list):
        return [s for v in value for s in strings_in(v)]
    return []


def assert_safe_message(exc: BaseException) -> None:
    """The reason kept in last_error and logged: storable, one line."""
    message = str(exc)
    assert message
    assert payload.text_problem(message) == "", message
    assert "\n" not in message and "\r" not in message, message


@FUZZ
@given(st.one_of(any_text, payload_objects.map(to_json), json_values.map(to_json),
                 st.binary(max_size=40), st.integers(), st.none(), st.lists(st.integers())))
@example("[" * 100_000)
@example('{"task": "a.b", "args": ' + "[" * 5_000 + "]" * 5_000 + "}")
@example('{"task": "a.b", "args": [' + "9" * 5_000 + "]}")
@example('{"task": "a.b", "args": [1e400]}')
@example('{"task": "a.b", "args": [NaN]}')
@example('{"task": "a.b", "task": "c.d"}')
@example('{"task": "a.b", "args": ["\\u0000"]}')
@example('{"task": "a.b", "kwargs": {"\\ud800": 1}}')
@example("\x80abc")
def test_decode_returns_what_encode_would_write_or_raises_malformed(text: Any) -> None:
    # When anything at all is decoded as a payload
    try:
        decoded = payload.decode(text)
    except MalformedPayload as exc:
        # Then a refusal is a MalformedPayload with a message safe to store and log
        assert_safe_message(exc)
        return

    # Then what it accepts, encode would have written: same task, same arguments
    assert payload.is_task_path(decoded.task_path)
    again = payload.encode(decoded.task_path, decoded.args, decoded.kwargs, max_bytes=10**9)
    assert payload.decode(again) == decoded
    for text_value in strings_in([decoded.args, decoded.kwargs]):
        assert payload.text_problem(text_value) == ""


@FUZZ
@given(path=task_paths, args=st.lists(good_values, max_size=4),
       kwargs=st.dictionaries(good_text, good_values, max_size=4))
def test_encode_then_decode_round_trips_any_good_call(
    path: str, args: list[Any], kwargs: dict[str, Any]
) -> None:
    # When a producer enqueues any JSON arguments under any task path
    try:
        text = payload.encode(path, tuple(args), kwargs, max_bytes=10**9)
    except InvalidTask as exc:
        # Then only a path that is not a dotted Python path is refused, with a clear message
        assert not payload.is_task_path(path)
        assert "is not a dotted Python path" in str(exc)
        return

    # Then the worker reads back exactly that call
    assert payload.is_task_path(path)
    assert payload.decode(text) == payload.Payload(path, args, kwargs)


everything = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), any_text, st.binary(),
              st.complex_numbers(), st.sets(st.integers(), max_size=2), st.just(object()),
              st.dates()),
    lambda children: st.one_of(
        st.lists(children, max_size=3), st.tuples(children, children),
        st.dictionaries(st.one_of(any_text, st.integers(), st.none()), children, max_size=3)),
    max_leaves=12,
)


@FUZZ
@given(args=st.lists(everything, max_size=3), kwargs=st.dictionaries(any_text, everything,
                                                                       max_size=3))
@example(args=[[[[[]]]] * 2], kwargs={})
def test_encode_refuses_anything_else_with_invalid_job_arguments(
    args: list[Any], kwargs: dict[str, Any]
) -> None:
    # When a producer passes arbitrary Python values
    try:
        text = payload.encode("app.tasks.send", tuple(args), kwargs, max_bytes=10**9)
    except (InvalidJobArguments, PayloadTooLarge) as exc:
        # Then a refusal is Django's InvalidTask, in a whole sentence
        assert isinstance(exc, InvalidTask)
        assert str(exc).endswith(".")
        return

    # Then what passes decodes to the same values
    assert payload.decode(text).kwargs == json.loads(text)["kwargs"]


@pytest.mark.parametrize("depth", [payload.MAX_DEPTH, payload.MAX_DEPTH + 1, 5_000])
def test_nesting_is_bounded_at_enqueue_and_in_redis_alike(depth: int) -> None:
    # Given an argument nested ``depth`` lists deep
    nested: Any = []
    for _ in range(depth - 1):
        nested = [nested]
    text = '{"task":"app.tasks.send","args":[' + "[" * depth + "]" * depth + "]}"

    # When it is enqueued, and when the same payload is found in Redis
    if depth <= payload.MAX_DEPTH:
        # Then up to the limit both accept it
        payload.encode("app.tasks.send", (nested,), {}, max_bytes=10**9)
        assert payload.decode(text).args == [nested]
        return
    # Then beyond it enqueue says why, and decode buries the job; neither recurses away
    with pytest.raises(InvalidJobArguments, match=f"nested more than {payload.MAX_DEPTH}"):
        payload.encode("app.tasks.send", (nested,), {}, max_bytes=10**9)
    with pytest.raises(MalformedPayload, match="nested"):
        payload.decode(text)


@FUZZ
@given(size=st.integers(min_value=0, max_value=3_000), limit=st.integers(64, 2_000),
       char=st.sampled_from(["a", "é", "☃", "😀"]))
def test_the_size_limit_counts_utf8_bytes_at_enqueue_and_in_redis_alike(
    size: int, limit: int, char: str
) -> None:
    # Given arguments of a known encoded size
    args = (char * size,)
    encoded = payload.encode("app.tasks.send", args, {}, max_bytes=10**9)
    nbytes = len(encoded.encode())

    # When the limit is applied at enqueue, and to the same text found in Redis
    # Then both agree: under or at the limit passes, over it is refused naming the limit
    if nbytes <= limit:
        assert payload.encode("app.tasks.send", args, {}, max_bytes=limit) == encoded
        assert payload.decode(encoded, max_bytes=limit).args == list(args)
        return
    with pytest.raises(PayloadTooLarge, match=f"over the limit of {limit} bytes"):
        payload.encode("app.tasks.send", args, {}, max_bytes=limit)
    with pytest.raises(MalformedPayload, match=f"{nbytes} bytes, over the limit of {limit}"):
        payload.decode(encoded, max_bytes=limit)


@FUZZ
@given(json_values)
def test_storable_makes_any_return_value_storable(value: Any) -> None:
    # When a task returns anything JSON-like (NaN, NUL, lone surrogates included)
    cleaned = payload.storable(value)

    # Then the cleaned value is strict JSON with text PostgreSQL and UTF-8 accept,
    text = json.dumps(cleaned, allow_nan=False, ensure_ascii=False)
    text.encode()
    assert "\\u0000" not in json.dumps(cleaned)

    # and a value that was already storable is left exactly as it was
    assert payload.storable(cleaned) == cleaned
    if all(payload.text_problem(s) == "" for s in strings_in(value)) and not any(
            isinstance(v, float) and not math.isfinite(v) for v in _leaves(value)):
        assert cleaned == value


def _leaves(value: Any) -> list[Any]:
    if isinstance(value, dict):
        return [leaf for v in value.values() for leaf in _leaves(v)]
    if isinstance(value, list):
        return [leaf for v in value for leaf in _leaves(v)]
    return [value]


@FUZZ
@given(any_text)
def test_storable_text_keeps_length_and_every_storable_character(text: str) -> None:
    # When text a task produced is made storable
    cleaned = payload.storable_text(text)

    # Then only NUL and surrogates changed, one for one, to U+FFFD
    assert payload.text_problem(cleaned) == ""
    assert len(cleaned) == len(text)
    for before, after in zip(text, cleaned, strict=True):
        assert after == before or (after == "\ufffd" and payload.text_problem(before))


@FUZZ
@given(task_paths)
@example("os.system")
@example("subprocess.run")
@example("json.loads")
def test_lookup_of_any_path_imports_nothing_and_finds_no_task(path: str) -> None:
    # Given the modules loaded so far
    loaded = set(sys.modules)

    # When a path from a payload is looked up
    found = tasks.lookup(path)

    # Then nothing was imported, and no task answers to a path nobody registered
    assert set(sys.modules) == loaded
    assert found is None
