"""Untrusted JSON in, strict JSON out.

In: orjson's decoder (no ``NaN`` or ``Infinity``, no number past a double's range, so no 5,000-digit integer; no lone
surrogate; its own nesting limit of 1,024) plus a depth limit of the caller's (:data:`MAX_DEPTH` by default), each
refusal one line naming where. Out: JSON with every non-finite number written as ``null`` (orjson's rule), so a
file gym-bridge writes is JSON that any reader accepts.
"""

from __future__ import annotations

import json
import math
from typing import Any

import orjson

from gym_bridge.boundary.errors import UntrustedInputError

MAX_DEPTH = 64
"""How deeply untrusted JSON may nest by default: a Gym row, a run file or an endpoint answer nests a few levels;
readers and copies that recurse (``copy.deepcopy``, pydantic) recurse once per level."""


def loads(data: bytes | str, where: str, *, max_depth: int = MAX_DEPTH) -> Any:
    """The JSON value in ``data``.

    Raises:
        UntrustedInputError: ``where: not valid JSON (...)`` or ``where: nested deeper than N levels``.
    """
    try:
        value = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise UntrustedInputError(f"{where}: not valid JSON ({exc})") from None
    if depth(value, stop_after=max_depth) > max_depth:
        raise UntrustedInputError(f"{where}: nested deeper than {max_depth} levels")
    return value


def loads_object(data: bytes | str, where: str, *, max_depth: int = MAX_DEPTH) -> dict[str, Any]:
    """:func:`loads`, and the value must be a JSON object.

    Raises:
        UntrustedInputError: as :func:`loads`, or ``where: not a JSON object``.
    """
    value = loads(data, where, max_depth=max_depth)
    if not isinstance(value, dict):
        raise UntrustedInputError(f"{where}: not a JSON object")
    return value


def jsonl_lines(data: bytes) -> tuple[list[bytes], bytes]:
    """A JSONL file's complete lines, split on ``\\n`` only, and what follows the last newline (b"" or a torn
    write). U+2028, U+2029 and U+0085 inside a row are text, not line ends."""
    lines = data.split(b"\n")
    tail = lines.pop()
    return lines, tail


def depth(value: object, stop_after: int | None = None) -> int:
    """How deeply ``value`` nests lists and objects (iterative, so no recursion limit; stops counting once past
    ``stop_after``)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, list | tuple):
            children = item
        else:
            continue
        deepest = max(deepest, level)
        if stop_after is not None and deepest > stop_after:
            return deepest
        stack.extend((child, level + 1) for child in children)
    return deepest


def dumps(value: object, *, indent: bool = False) -> bytes:
    """``value`` as strict JSON: non-finite numbers as ``null``, keys that are not strings as strings, anything else
    JSON has no form for (an object) as its ``str``; an integer past 64 bits as itself (past ~4,000 digits: a
    string that says so)."""
    option = orjson.OPT_NON_STR_KEYS | (orjson.OPT_INDENT_2 if indent else 0)
    try:
        return orjson.dumps(value, option=option, default=str)
    except TypeError:  # an integer orjson cannot write
        text = json.dumps(_plain(value), allow_nan=False, default=str, ensure_ascii=False, indent=2 if indent else None)
        return text.encode("utf-8")


def _plain(value: object) -> object:
    """``value`` with non-finite floats as None and huge integers as strings, for the standard library's encoder."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 13_000:
        return f"<an integer of {value.bit_length():,} bits>"
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value
