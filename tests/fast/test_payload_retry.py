"""The payload codec (strict JSON, errors that name the argument) and the retry policy."""

from __future__ import annotations

import datetime
import decimal
import json
import random
import uuid
from typing import Any

import pytest

from reliable_jobs import payload, retry
from reliable_jobs.compat import InvalidTask
from reliable_jobs.exceptions import (
    InvalidJobArguments,
    MalformedPayload,
    PayloadTooLarge,
    PermanentFailure,
    RetryLater,
    UnknownTask,
)

TASK = "app.tasks.send_mail"
LIMIT = 1_000_000


# -- payload.encode -------------------------------------------------------------


def test_encode_then_decode_round_trips() -> None:
    # Given arguments of every JSON type, nested, with non-ASCII text
    args = (1, 2.5, "héllo ✓", None, True, [1, [2, {"k": "v"}]], (3, 4))
    kwargs = {"to": ["a@example.com"], "options": {"retry": False, "ratio": -0.0}}

    # When they are encoded and decoded
    text = payload.encode(TASK, args, kwargs, max_bytes=LIMIT)
    decoded = payload.decode(text)

    # Then the same values come back (tuples as lists, as JSON has no tuple)
    assert decoded == payload.Payload(
        TASK, [1, 2.5, "héllo ✓", None, True, [1, [2, {"k": "v"}]], [3, 4]], kwargs)
    assert json.loads(text)["task"] == TASK


@pytest.mark.parametrize(("args", "kwargs", "where", "type_name"), [
    ((), {"when": datetime.datetime(2025, 1, 1, tzinfo=datetime.UTC)}, "kwargs['when']",
     "datetime"),
    ((1, [object()]), {}, "args[1][0]", "object"),
    (({"user": {"id": uuid.UUID(int=1)}},), {}, "args[0]['user']['id']", "UUID"),
    ((), {"amount": decimal.Decimal("1.10")}, "kwargs['amount']", "Decimal"),
    ((), {"tags": {"a", "b"}}, "kwargs['tags']", "set"),
    ((b"raw",), {}, "args[0]", "bytes"),
    ((), {"rows": [[1, 2], [3, 1j]]}, "kwargs['rows'][1][1]", "complex"),
])
def test_encode_names_the_argument_that_is_not_json(
        args: tuple[Any, ...], kwargs: dict[str, Any], where: str, type_name: str) -> None:
    # When arguments hold a value JSON cannot store
    # Then the error names its path and its type, and is Django's InvalidTask
    with pytest.raises(InvalidJobArguments) as caught:
        payload.encode(TASK, args, kwargs, max_bytes=LIMIT)
    message = str(caught.value)
    assert f"Argument {where} is of type {type_name}," in message
    assert "not JSON serializable" in message
    assert isinstance(caught.value, InvalidTask)
    assert isinstance(caught.value, TypeError)


@pytest.mark.parametrize(("value", "shown"), [
    (float("nan"), "nan"), (float("inf"), "inf"), (float("-inf"), "-inf")])
def test_encode_refuses_non_finite_floats(value: float, shown: str) -> None:
    # When a float JSON cannot represent is passed, deep inside a kwarg
    # Then the error names where it is and what it is
    with pytest.raises(InvalidJobArguments) as caught:
        payload.encode(TASK, (), {"stats": {"mean": [1.0, value]}}, max_bytes=LIMIT)
    assert str(caught.value) == (
        f"Argument kwargs['stats']['mean'][1] is {shown}, which JSON cannot represent.")


@pytest.mark.parametrize("key", [1, 2.5, None, True, ("a", "b")])
def test_encode_refuses_dict_keys_that_are_not_strings(key: object) -> None:
    # When a dict argument has a key that JSON would silently turn into a string
    # Then the error names the dict, the key and its type
    with pytest.raises(InvalidJobArguments) as caught:
        payload.encode(TASK, ({"ok": 1, key: "value"},), {}, max_bytes=LIMIT)
    message = str(caught.value)
    assert message.startswith(f"Argument args[0] has the key {key!r} of type "
                              f"{type(key).__name__};")
    assert "keys must be strings" in message


def test_encode_refuses_a_payload_over_the_limit_and_names_it() -> None:
    # Given arguments whose encoded size is known (non-ASCII counts in UTF-8 bytes)
    args = ("é" * 100,)
    size = len(payload.encode(TASK, args, {}, max_bytes=LIMIT).encode())

    # When the limit is exactly that size, it passes
    payload.encode(TASK, args, {}, max_bytes=size)

    # When the limit is one byte less
    # Then PayloadTooLarge says the size, the limit and the setting
    with pytest.raises(PayloadTooLarge) as caught:
        payload.encode(TASK, args, {}, max_bytes=size - 1)
    message = str(caught.value)
    assert f"take {size} bytes, over the limit of {size - 1} bytes" in message
    assert "MAX_PAYLOAD_BYTES" in message
    assert isinstance(caught.value, InvalidTask)
    assert isinstance(caught.value, ValueError)


# -- payload.decode -------------------------------------------------------------


@pytest.mark.parametrize("text", [
    None,
    "",
    b'{"task": "t", "args": [], "kwargs": {}}',
    "{",
    "not json",
    "[1, 2]",
    '"a string"',
    "42",
    "null",
    "{}",
    '{"args": [], "kwargs": {}}',
    '{"task": 7, "args": [], "kwargs": {}}',
    '{"task": "t", "args": {}, "kwargs": {}}',
    '{"task": "t", "args": [], "kwargs": []}',
    '{"task": "t", "args": "x", "kwargs": {}}',
])
def test_decode_turns_anything_it_did_not_write_into_malformed_payload(text: object) -> None:
    # When a payload read back from Redis is garbage
    # Then decoding raises MalformedPayload (the job is buried), never another error
    with pytest.raises(MalformedPayload) as caught:
        payload.decode(text)
    assert str(caught.value)


def test_decode_accepts_missing_args_and_kwargs() -> None:
    # When a payload names only its task
    decoded = payload.decode('{"task": "t"}')

    # Then it runs without arguments
    assert decoded == payload.Payload("t", [], {})


# -- retry ----------------------------------------------------------------------


def samples(attempt: int, *, base_ms: int, max_ms: int, n: int = 400) -> list[int]:
    rng = random.Random(attempt * 7_919 + base_ms)
    return [retry.backoff_ms(attempt, base_ms=base_ms, max_ms=max_ms, rng=rng)
            for _ in range(n)]


@pytest.mark.parametrize("attempt", [1, 2, 3, 4, 5, 6])
def test_backoff_stays_between_half_and_all_of_its_nominal_delay(attempt: int) -> None:
    # Given the nominal delay base * 2 ** (attempt - 1), under the cap
    nominal = 100 * 2 ** (attempt - 1)

    # When many delays are drawn
    delays = samples(attempt, base_ms=100, max_ms=1_000_000)

    # Then each is within [nominal / 2, nominal], and the draws cover that range
    assert all(nominal // 2 <= d <= nominal for d in delays)
    assert min(delays) < nominal * 0.6
    assert max(delays) > nominal * 0.9


def test_backoff_doubles_with_each_attempt() -> None:
    # When delays are drawn for successive attempts
    ranges = [(min(d), max(d)) for d in
              (samples(attempt, base_ms=4, max_ms=10**9, n=2_000) for attempt in range(1, 8))]

    # Then the whole range doubles each time: [2, 4], [4, 8], [8, 16] ... [128, 256]
    assert ranges == [(2 * 2 ** i, 4 * 2 ** i) for i in range(7)]


@pytest.mark.parametrize("attempt", [5, 6, 20, 1_000, 10**9])
def test_backoff_is_capped(attempt: int) -> None:
    # When the nominal delay exceeds the cap (even absurdly)
    delays = samples(attempt, base_ms=50, max_ms=400)

    # Then the cap is the nominal delay: within [cap / 2, cap]
    assert all(200 <= d <= 400 for d in delays)


@pytest.mark.parametrize("attempt", [0, -3])
def test_backoff_treats_attempts_below_one_as_the_first(attempt: int) -> None:
    # Then the delay is that of attempt one
    assert all(50 <= d <= 100 for d in samples(attempt, base_ms=100, max_ms=10_000))


class QuotaExceeded(PermanentFailure):
    """A task's own permanent failure."""


@pytest.mark.parametrize("exc", [
    PermanentFailure("no such user"), QuotaExceeded(), UnknownTask("app.gone"),
    MalformedPayload("the payload is not JSON")])
def test_next_delay_is_dead_for_errors_no_retry_can_fix(exc: BaseException) -> None:
    # When a non-retryable error ends the first of many attempts
    delay = retry.next_delay_ms(exc, attempt=1, max_attempts=10, base_ms=100, max_ms=1_000)

    # Then the job goes to dead at once
    assert delay == retry.DEAD == -1


@pytest.mark.parametrize("exc", [ValueError("flaky"), RetryLater(5_000), TimeoutError()])
@pytest.mark.parametrize("attempt", [3, 4])
def test_next_delay_is_dead_when_attempts_are_spent(exc: BaseException, attempt: int) -> None:
    # When a retryable error ends the last attempt (or one past it)
    delay = retry.next_delay_ms(exc, attempt=attempt, max_attempts=3, base_ms=100, max_ms=1_000)

    # Then the job goes to dead
    assert delay == retry.DEAD


@pytest.mark.parametrize("delay_ms", [0, 1, 1_234, 86_400_000])
def test_next_delay_honours_retry_later(delay_ms: int) -> None:
    # When a task asks to be retried after a given delay, with attempts left
    delay = retry.next_delay_ms(RetryLater(delay_ms, "rate limited"), attempt=1, max_attempts=3,
                                base_ms=100, max_ms=1_000)

    # Then that exact delay is used, outside the backoff and its cap
    assert delay == delay_ms


@pytest.mark.parametrize("attempt", [1, 2, 3])
def test_next_delay_backs_off_for_other_errors(attempt: int) -> None:
    # When an ordinary error ends an attempt with attempts left
    delays = {retry.next_delay_ms(RuntimeError("boom"), attempt=attempt, max_attempts=5,
                                  base_ms=100, max_ms=250) for _ in range(200)}

    # Then the delay is the capped backoff of that attempt
    nominal = min(250, 100 * 2 ** (attempt - 1))
    assert all(nominal // 2 <= d <= nominal for d in delays)


@pytest.mark.parametrize("bad", [-1, 1.5, "10", None])
def test_retry_later_needs_whole_non_negative_milliseconds(bad: object) -> None:
    # When a task asks for a retry with a delay that is not whole milliseconds >= 0
    # Then it is refused at once
    with pytest.raises(ValueError, match="whole number of milliseconds"):
        RetryLater(bad)  # type: ignore[arg-type]  # the wrong type is the point
