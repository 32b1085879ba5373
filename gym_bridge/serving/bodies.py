"""Request bodies read by hand: a time and size limit, JSON, a nesting limit, clean values and the pydantic model, so
every refusal is an OpenAI-shaped 4xx (never FastAPI's 422 or a 500) and decoding runs in a worker thread, not on
the event loop.

A body is untrusted all the way down: every string in it (keys too) must be UTF-8 text (a lone surrogate such as
the escape ``"\\ud800"`` is not, and would fail the tokenizer or the answer's encoding later) and every number
finite (``NaN``, ``Infinity`` and ``1e400`` are not JSON numbers a field can hold); the refusal names the first
such value's place, e.g. ``messages[0].content``.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Iterable, Sequence

from fastapi import Request
from pydantic import BaseModel, ValidationError

from gym_bridge.serving.errors import ServingError
from gym_bridge.serving.state import ServerLimits, ServingState

#: One step of a path into parsed JSON: an object's key or an array's index.
type PathStep = str | int


async def parse_request[M: BaseModel](request: Request, model: type[M], state: ServingState) -> M:
    """The body as ``model``: not all there within ``body_timeout_s`` 408; over the size limit 413; not JSON,
    nested too deep, holding a value that is not clean text or a finite number, or invalid fields 400.

    The body is read on the event loop and decoded in a worker thread (8 MB of JSON takes a while)."""
    limits = state.limits
    try:
        async with asyncio.timeout(limits.body_timeout_s):
            raw = await _read_body(request, limits.max_body_bytes)
    except TimeoutError:
        raise ServingError(f"the request body did not arrive within {limits.body_timeout_s:g} s", 408) from None
    return await asyncio.to_thread(parse_body, bytes(raw), model, limits)


async def _read_body(request: Request, limit: int) -> bytearray:
    """The raw body, refused with 413 as soon as it (or its declared length) passes ``limit`` bytes."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ServingError(f"request body exceeds {limit} bytes", 413)
    raw = bytearray()
    async for chunk in request.stream():
        raw.extend(chunk)
        if len(raw) > limit:
            raise ServingError(f"request body exceeds {limit} bytes", 413)
    return raw


def parse_body[M: BaseModel](raw: bytes, model: type[M], limits: ServerLimits) -> M:
    """``raw`` as ``model``, refused with a 400 when it is not a JSON object, nests deeper than
    ``limits.max_json_depth`` (the parser's own recursion limit included), holds a string that is not UTF-8 text
    or a number that is not finite, or has invalid fields (the refusal's ``param`` names the field)."""
    too_deep = f"the body nests objects and arrays deeper than {limits.max_json_depth} levels"
    try:
        payload = json.loads(raw)
    except RecursionError:
        raise ServingError(too_deep) from None
    except ValueError as exc:  # not JSON, not UTF-8, or an integer of more digits than Python converts
        raise ServingError(f"the body is not valid JSON: {exc}") from exc
    if not isinstance(payload, dict):
        raise ServingError("the body must be a JSON object")
    if json_depth(payload, limits.max_json_depth) > limits.max_json_depth:
        raise ServingError(too_deep)
    unclean = unclean_value(payload)
    if unclean is not None:
        where, what = unclean
        raise ServingError(f"{where}: {what}", param=where)
    try:
        return model.model_validate(payload)
    except ValidationError as exc:
        errors = exc.errors()[:5]
        problems = "; ".join(f"{field_path(err['loc']) or 'body'}: {err['msg']}" for err in errors)
        raise ServingError(f"invalid request: {problems}", param=field_path(errors[0]["loc"]) or None) from exc


def json_depth(value: object, stop_after: int) -> int:
    """How deep objects and arrays nest in parsed JSON (a scalar: 0), walked without recursion; the walk
    ends as soon as the depth passes ``stop_after``."""
    deepest = 0
    stack: list[tuple[dict[str, object] | list[object], int]] = []
    if isinstance(value, (dict, list)):
        stack.append((value, 1))
    while stack and deepest <= stop_after:
        node, depth = stack.pop()
        deepest = max(deepest, depth)
        children = node.values() if isinstance(node, dict) else node
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return deepest


def unclean_value(payload: object) -> tuple[str, str] | None:
    """The place and the problem of a value in parsed JSON that no field may hold: a string (or key) that is not
    UTF-8 text, or a float that is not finite; None when there is none. Walked without recursion."""
    stack: list[tuple[dict[str, object] | list[object], tuple[PathStep, ...]]] = []
    if isinstance(payload, (dict, list)):
        stack.append((payload, ()))
    while stack:
        node, path = stack.pop()
        items: Iterable[tuple[PathStep, object]] = node.items() if isinstance(node, dict) else enumerate(node)
        for key, value in items:
            if isinstance(key, str) and not is_text(key):
                return field_path((*path, key)), "a key that is not UTF-8 text (a lone surrogate)"
            if isinstance(value, str):
                if not is_text(value):
                    return field_path((*path, key)), "a string that is not UTF-8 text (a lone surrogate)"
            elif isinstance(value, float):
                if not math.isfinite(value):
                    return field_path((*path, key)), f"{value} is not a finite number"
            elif isinstance(value, (dict, list)):
                stack.append((value, (*path, key)))
    return None


def is_text(value: str) -> bool:
    """Whether ``value`` encodes as UTF-8 (a lone surrogate does not)."""
    if value.isascii():
        return True
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def field_path(loc: Sequence[PathStep]) -> str:
    """A place in a request as a person writes it: ``messages[0].content``."""
    out = ""
    for step in loc:
        out += f"[{step}]" if isinstance(step, int) else (f".{step}" if out else str(step))
    return out
