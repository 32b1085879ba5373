"""Untrusted JSON in, strict JSON out.

In: orjson's decoder (no ``NaN`` or ``Infinity``, no number past a double's range, so no 5,000-digit integer; no lone
surrogate; its own nesting limit of 1,024) plus a depth limit of the caller's (:data:`MAX_DEPTH` by default), each
refusal one line naming where. Out: JSON with every non-finite number written as ``null`` (orjson's rule), so a
file gym-bridge writes is JSON that any reader accepts.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

import orjson

from gym_bridge.boundary.errors import UntrustedInputError

MAX_DEPTH = 128
"""How deeply untrusted JSON may nest by default, the one limit of the row path: a run file holds a dataset's rows a
few levels down (:data:`ROW_DEPTH`), so a row the eval accepts is a run file every reader accepts. Readers and
copies that recurse (``copy.deepcopy``, pydantic) recurse once per level."""
RUN_RECORD_NESTING = 8
"""How many levels a run file's record adds above a row it holds (``completions[i].gym_result`` is 3), with room."""
ROW_DEPTH = MAX_DEPTH - RUN_RECORD_NESTING
"""How deeply a dataset row may nest (tool schemas inside ``responses_create_params`` nest a few dozen levels)."""


def loads(data: bytes | str, where: str, *, max_depth: int = MAX_DEPTH) -> Any:
    """The JSON value in ``data``, its nesting counted on the bytes (:func:`raw_depth`: ~0.08 ms for a 29 KB line,
    where walking the decoded value costs ~0.9 ms).

    Raises:
        UntrustedInputError: ``where: not valid JSON (...)`` or ``where: nested deeper than N levels``.
    """
    try:
        value = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        if str(exc).startswith("depth limit exceeded"):  # orjson's own limit (1,024) is past every caller's
            raise UntrustedInputError(f"{where}: nested deeper than {max_depth} levels") from None
        raise UntrustedInputError(f"{where}: not valid JSON ({exc})") from None
    if _deeper_than(data.encode("utf-8") if isinstance(data, str) else data, max_depth):
        raise UntrustedInputError(f"{where}: nested deeper than {max_depth} levels")
    return value


_ESCAPE = re.compile(rb"\\.", re.S)
"""A backslash escape inside a JSON string (the only place valid JSON has a backslash)."""
_NOT_STRUCTURE = bytes(range(256)).translate(None, b'"[]{}')
"""Every byte but quotes and brackets (no byte of a multi-byte UTF-8 character is one of these)."""


def raw_depth(raw: bytes) -> int:
    """How deeply the valid JSON text ``raw`` nests lists and objects: as
    :func:`depth` of its value, measured on the bytes (escapes dropped, then
    everything but quotes and brackets, then what lies inside strings; the brackets left are counted)."""
    structure = _ESCAPE.sub(b"", raw) if b"\\" in raw else raw
    brackets = b"".join(structure.translate(None, _NOT_STRUCTURE).split(b'"')[::2])
    level = deepest = 0
    for byte in brackets:
        if byte == 0x5B or byte == 0x7B:  # [ {
            level += 1
            if level > deepest:
                deepest = level
        else:
            level -= 1
    return deepest


def _deeper_than(raw: bytes, limit: int) -> bool:
    """Whether the valid JSON text ``raw`` nests deeper than ``limit`` (a short line with no more opening brackets
    than ``limit`` cannot: then nothing is measured)."""
    if len(raw) <= 4096 and raw.count(b"[") + raw.count(b"{") <= limit:
        return False
    return raw_depth(raw) > limit


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
