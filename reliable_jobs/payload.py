"""The job payload: strict JSON in, strict JSON out, never pickle.

Arguments are checked before anything is written, and the error names the
offending argument (``kwargs['when']``, ``args[1][0]``). A payload read back
from Redis is decoded defensively: anything this module did not write is a
:class:`MalformedPayload`, never an exception that crashes a worker.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from .exceptions import InvalidJobArguments, MalformedPayload, PayloadTooLarge

_encoder = json.JSONEncoder(ensure_ascii=False, allow_nan=False, separators=(",", ":"))


@dataclass(frozen=True, slots=True)
class Payload:
    task_path: str
    args: list[Any]
    kwargs: dict[str, Any]


def check_json(value: Any, where: str) -> None:
    """Raise InvalidJobArguments unless ``value`` round-trips through JSON unchanged."""
    if value is None or isinstance(value, (bool, str, int)):
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise InvalidJobArguments(f"{where} is {value!r}, which JSON cannot represent.")
        return
    if isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            check_json(item, f"{where}[{index}]")
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise InvalidJobArguments(
                    f"{where} has the key {key!r} of type {type(key).__name__}; JSON object "
                    "keys must be strings."
                )
            check_json(item, f"{where}[{key!r}]")
        return
    raise InvalidJobArguments(
        f"{where} is of type {type(value).__name__}, which is not JSON serializable; pass "
        "only None, bool, int, float, str, list, tuple and dict with str keys."
    )


def encode(task_path: str, args: tuple[Any, ...] | list[Any], kwargs: dict[str, Any],
           *, max_bytes: int) -> str:
    """Check the arguments and return the payload text written to Redis."""
    for index, value in enumerate(args):
        check_json(value, f"Argument args[{index}]")
    for name, value in kwargs.items():
        check_json(value, f"Argument kwargs[{name!r}]")
    text = _encoder.encode({"task": task_path, "args": list(args), "kwargs": kwargs})
    size = len(text.encode())
    if size > max_bytes:
        raise PayloadTooLarge(
            f"The encoded arguments take {size} bytes, over the limit of {max_bytes} bytes "
            "(OPTIONS['MAX_PAYLOAD_BYTES']); store large data elsewhere and pass its key."
        )
    return text


def decode(text: object) -> Payload:
    """Parse a payload read from Redis, or raise MalformedPayload."""
    if not isinstance(text, str) or not text:
        raise MalformedPayload("the job has no payload")
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise MalformedPayload(f"the payload is not JSON ({exc})") from None
    if not isinstance(data, dict):
        raise MalformedPayload("the payload is not a JSON object")
    task_path, args, kwargs = data.get("task"), data.get("args", []), data.get("kwargs", {})
    if not isinstance(task_path, str) or not isinstance(args, list) or not isinstance(kwargs, dict):
        raise MalformedPayload("the payload lacks a task path, an args list or a kwargs object")
    return Payload(task_path, args, kwargs)
