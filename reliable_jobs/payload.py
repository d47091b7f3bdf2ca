"""The job payload: strict JSON in, strict JSON out, never pickle.

Arguments are checked before anything is written, and the error names the
offending argument (``kwargs['when']``, ``args[1][0]``). A payload read back
from Redis is decoded defensively: anything this module would not have
written (not JSON, too large, too deep, NaN, a NUL character, a lone
surrogate, a task path that is not a dotted Python path) is a
:class:`MalformedPayload`, never an exception that crashes a worker, and
never a value that the database mirror or Redis would refuse later.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .compat import InvalidTask
from .exceptions import InvalidJobArguments, MalformedPayload, PayloadTooLarge

_encoder = json.JSONEncoder(ensure_ascii=False, allow_nan=False, separators=(",", ":"))

#: Longest task path a payload may name, in characters (``Job.task_path`` holds 300).
MAX_TASK_PATH = 300
#: Deepest nesting of lists and dicts in the arguments: far beyond any real
#: call, well within Python's recursion limit (``json`` recurses, so does
#: ``normalize_json``) and PostgreSQL's ``jsonb`` input.
MAX_DEPTH = 100
#: The character PostgreSQL cannot store in text or jsonb.
_NUL = "\x00"
#: NUL, and surrogate code points (in a ``str`` they are always lone, so not
#: valid Unicode: UTF-8 cannot encode them).
_UNSTORABLE = re.compile("[\x00\ud800-\udfff]")
#: How :func:`storable_text` shows a character that cannot be stored.
_REPLACEMENT = "\ufffd"


#: A W3C Trace Context ``traceparent`` (version 00): the only shape the
#: payload's optional ``trace`` field may take. All-zero trace or span ids
#: are invalid by the specification.
TRACEPARENT_RE = re.compile(r"00-(?!0{32})[0-9a-f]{32}-(?!0{16})[0-9a-f]{16}-[0-9a-f]{2}")


@dataclass(frozen=True, slots=True)
class Payload:
    task_path: str
    args: list[Any]
    kwargs: dict[str, Any]
    #: The enqueuer's trace context (a traceparent), or None.
    trace: str | None = None


def is_traceparent(value: object) -> bool:
    """Return True for a well-formed W3C ``traceparent`` string (version 00)."""
    return isinstance(value, str) and TRACEPARENT_RE.fullmatch(value) is not None


def text_problem(text: str) -> str:
    """Say why ``text`` cannot be stored (PostgreSQL, UTF-8 to Redis), or return ""."""
    found = _UNSTORABLE.search(text)
    if found is None:
        return ""
    if found.group() == _NUL:
        return f"contains a NUL character at index {found.start()}"
    return f"contains a lone surrogate at index {found.start()} (not valid Unicode)"


#: Task paths found well-formed, so each job's payload is checked with one set
#: look-up (a project has few task paths; anyone writing to Redis could make
#: more, so the set is emptied when it grows past this).
_GOOD_PATHS: set[str] = set()
_GOOD_PATHS_MAX = 1_000


def is_task_path(value: object) -> bool:
    """Return True for a dotted Python path (``app.tasks.send_mail``) of sane length."""
    if not isinstance(value, str):
        return False
    if value in _GOOD_PATHS:
        return True
    if not (0 < len(value) <= MAX_TASK_PATH
            and all(part.isidentifier() for part in value.split("."))):
        return False
    if len(_GOOD_PATHS) >= _GOOD_PATHS_MAX:
        _GOOD_PATHS.clear()
    _GOOD_PATHS.add(value)
    return True


def check_json(value: Any, where: str) -> None:
    """Raise InvalidJobArguments unless ``value`` round-trips through JSON unchanged.

    Also refused: text the database mirror cannot store (NUL characters,
    lone surrogates) and nesting deeper than :data:`MAX_DEPTH`. The walk is
    iterative, so a deeply nested argument gets this error, not a
    RecursionError.
    """
    stack: list[tuple[Any, str, int]] = [(value, where, 0)]
    while stack:
        item, here, depth = stack.pop()
        if item is None or isinstance(item, (bool, int)):
            continue
        if isinstance(item, str):
            problem = text_problem(item)
            if problem:
                raise InvalidJobArguments(f"{here} {problem}, which the job mirror cannot "
                                          "store.")
            continue
        if isinstance(item, float):
            if not math.isfinite(item):
                raise InvalidJobArguments(f"{here} is {item!r}, which JSON cannot represent.")
            continue
        if isinstance(item, (list, tuple, dict)) and depth >= MAX_DEPTH:
            raise InvalidJobArguments(
                f"{here} is nested more than {MAX_DEPTH} levels deep; flatten the arguments.")
        if isinstance(item, (list, tuple)):
            stack += [(child, f"{here}[{index}]", depth + 1)
                      for index, child in reversed(list(enumerate(item)))]
            continue
        if isinstance(item, dict):
            children = []
            for key, child in item.items():
                if not isinstance(key, str):
                    raise InvalidJobArguments(
                        f"{here} has the key {key!r} of type {type(key).__name__}; JSON object "
                        "keys must be strings."
                    )
                problem = text_problem(key)
                if problem:
                    raise InvalidJobArguments(f"{here} has a key that {problem}, which the job "
                                              "mirror cannot store.")
                children.append((child, f"{here}[{key!r}]", depth + 1))
            stack += reversed(children)
            continue
        raise InvalidJobArguments(
            f"{here} is of type {type(item).__name__}, which is not JSON serializable; pass "
            "only None, bool, int, float, str, list, tuple and dict with str keys."
        )


def check_call(args: tuple[Any, ...] | list[Any], kwargs: dict[str, Any]) -> None:
    """Raise InvalidJobArguments unless every argument and keyword name can be stored."""
    for index, value in enumerate(args):
        check_json(value, f"Argument args[{index}]")
    for name, value in kwargs.items():
        if not isinstance(name, str) or text_problem(name):
            raise InvalidJobArguments(
                f"The keyword argument name {name!r} is not text the job mirror can store.")
        check_json(value, f"Argument kwargs[{name!r}]")


def encode(task_path: str, args: tuple[Any, ...] | list[Any], kwargs: dict[str, Any],
           *, max_bytes: int, trace: str | None = None,
           flow: Callable[[list[Any], dict[str, Any]], str] | None = None) -> str:
    """Check the task path and the arguments; return the payload text written to Redis.

    ``trace``, the enqueuer's traceparent (see tracing.py), is stored only
    when it is a well-formed one; the field is left out otherwise. One call
    of the one encoder, :class:`CallEncoder`.
    """
    return CallEncoder(task_path, max_bytes=max_bytes, trace=trace, flow=flow)(args, kwargs)[0]


def _check_size(text: str, max_bytes: int) -> None:
    # Only texts that could be over the limit are counted (4 bytes per
    # character at most in UTF-8).
    if len(text) * 4 <= max_bytes:
        return
    size = len(text.encode())
    if size > max_bytes:
        raise PayloadTooLarge(
            f"The encoded arguments take {size} bytes, over the limit of {max_bytes} bytes "
            "(OPTIONS['MAX_PAYLOAD_BYTES']); store large data elsewhere and pass its key."
        )


class CallEncoder:
    """The payload encoder: the calls of one task, as an enqueue makes them.

    The task path is checked once; each call's arguments are checked and
    encoded once, and their JSON texts are returned beside the payload (the
    payload is joined from them: the encoder writes each member as it would
    alone) so the mirror's ``args`` and ``kwargs`` columns take them as they
    are instead of encoding the arguments a second time.
    """

    def __init__(self, task_path: str, *, max_bytes: int, trace: str | None = None,
                 flow: Callable[[list[Any], dict[str, Any]], str] | None = None) -> None:
        if not is_task_path(task_path):
            raise InvalidTask(
                f"The task path {_shorten(task_path)} is not a dotted Python path of at most "
                f"{MAX_TASK_PATH} characters, so no worker could run it."
            )
        self._head = '{"task":' + _encoder.encode(task_path) + ',"args":'
        #: The trace field every payload of the batch carries, or nothing (see encode()).
        self._tail = (',"trace":' + _encoder.encode(trace)
                      if trace is not None and is_traceparent(trace) else "") + "}"
        self._max_bytes = max_bytes
        #: The call's flow limits (flow.TaskFlow.spec), written first in the
        #: payload so the claim script reads them with one anchored match.
        self._flow = flow

    def __call__(self, args: tuple[Any, ...] | list[Any],
                 kwargs: dict[str, Any]) -> tuple[str, str, str]:
        """Return (payload, args JSON, kwargs JSON), or raise like :func:`encode`."""
        if not args and not kwargs:  # a call without arguments: nothing to check
            args_json, kwargs_json = "[]", "{}"
        else:
            check_call(args, kwargs)
            args_json = _encoder.encode(args)
            kwargs_json = _encoder.encode(kwargs)
        head = self._head
        if self._flow is not None:
            spec = self._flow(list(args), dict(kwargs))
            if spec:
                head = '{"flow":' + _encoder.encode(spec) + "," + head[1:]
        text = f'{head}{args_json},"kwargs":{kwargs_json}{self._tail}'
        _check_size(text, self._max_bytes)
        return text, args_json, kwargs_json


def decode(text: object, *, max_bytes: int | None = None) -> Payload:
    """Parse a payload read from Redis, or raise MalformedPayload.

    ``max_bytes`` (the backend's MAX_PAYLOAD_BYTES) refuses a payload no
    enqueue could have written before parsing it. Error messages quote
    nothing raw (a task path or a key appears as its ``repr``, shortened
    where it could be long), so they are safe to log and to store.
    """
    if not isinstance(text, str) or not text:
        raise MalformedPayload("the job has no payload")
    if max_bytes is not None and len(text) > max_bytes // 4:
        # Only sizes that could be over the limit are counted (4 bytes per
        # character at most in UTF-8); the common small payload skips it.
        size = len(text.encode(errors="surrogatepass"))
        if size > max_bytes:
            raise MalformedPayload(
                f"the payload takes {size} bytes, over the limit of {max_bytes} bytes "
                "(OPTIONS['MAX_PAYLOAD_BYTES'])")
    data = _strict_loads(text)
    if not isinstance(data, dict):
        raise MalformedPayload("the payload is not a JSON object")
    task_path, args, kwargs = data.get("task"), data.get("args", []), data.get("kwargs", {})
    if not isinstance(task_path, str) or not isinstance(args, list) or not isinstance(kwargs, dict):
        raise MalformedPayload("the payload lacks a task path, an args list or a kwargs object")
    if not is_task_path(task_path):
        raise MalformedPayload(f"the task path {_shorten(task_path)} is not a dotted Python path")
    try:
        check_call(args, kwargs)
    except InvalidJobArguments as exc:
        message = str(exc).rstrip(".")
        raise MalformedPayload(f"in the payload: {message[0].lower()}{message[1:]}") from None
    # Tracing is best effort: a trace field that is not a traceparent (anyone
    # who can write to Redis chooses it) is dropped, never a reason to fail
    # the job, and never passed on as anything but this checked string.
    trace = data.get("trace")
    return Payload(task_path, args, kwargs, trace if is_traceparent(trace) else None)


def _strict_loads(text: str) -> Any:
    """Parse ``text`` as strict JSON (no NaN, no infinity, no key twice), or raise.

    ``json.loads`` with keyword arguments builds a new decoder per call,
    which cost as much as the parse of a small payload: one decoder serves
    every call (it keeps no state between calls).
    """
    try:
        if text.startswith("\ufeff"):  # as json.loads says it
            raise json.JSONDecodeError("Unexpected UTF-8 BOM (decode using utf-8-sig)", text, 0)
        return _strict_decoder.decode(text)
    except RecursionError:
        raise MalformedPayload("the payload is nested too deeply to parse") from None
    except ValueError as exc:
        # json's messages quote positions, never the text itself.
        raise MalformedPayload(f"the payload is not strict JSON ({exc})") from None


def storable_text(text: str) -> str:
    """``text`` with each NUL character and lone surrogate replaced by U+FFFD.

    For text a task produced (an exception message, a traceback) on its way
    to the mirror and to Redis: PostgreSQL refuses NUL, and UTF-8 (Redis,
    psycopg) refuses lone surrogates, so one such character would make the
    whole write fail, again and again.
    """
    if text.isascii() and _NUL not in text:  # the common case, without a regex pass
        return text
    return _UNSTORABLE.sub(_REPLACEMENT, text)


def storable(value: Any) -> Any:
    """A JSON value (a task's return value) that PostgreSQL's jsonb can store.

    Strings and keys go through :func:`storable_text`; NaN and the
    infinities, which JSON has no spelling for, become the strings "NaN",
    "Infinity" and "-Infinity". Anything else is returned unchanged.
    """
    if isinstance(value, str):
        return storable_text(value)
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, dict):
        return {storable_text(k) if isinstance(k, str) else k: storable(v)
                for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [storable(v) for v in value]
    return value


def _shorten(value: object, limit: int = 80) -> str:
    """``repr(value)``, cut to ``limit`` characters: safe to log (no raw newlines)."""
    shown = repr(value)
    return shown if len(shown) <= limit else f"{shown[:limit]}...'"


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text[:20]!r} is too large for a float")
    return value


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    data = dict(pairs)
    if len(data) != len(pairs):
        raise ValueError("an object has the same key twice")
    return data


_strict_decoder = json.JSONDecoder(parse_constant=_refuse_constant, parse_float=_finite_float,
                                   object_pairs_hook=_unique_keys)
