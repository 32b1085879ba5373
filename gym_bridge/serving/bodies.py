"""Request bodies read by hand: a size limit, JSON, a nesting limit and the pydantic model, so every refusal is an
OpenAI-shaped 4xx (never FastAPI's 422 or a 500) and decoding runs in a worker thread, not on the event loop."""

from __future__ import annotations

import asyncio
import json

from fastapi import Request
from pydantic import BaseModel, ValidationError

from gym_bridge.serving.errors import ServingError
from gym_bridge.serving.state import ServerLimits, ServingState


async def parse_request[M: BaseModel](request: Request, model: type[M], state: ServingState) -> M:
    """The body as ``model``: over the size limit 413; not JSON, nested too deep or invalid fields 400.

    The body is read on the event loop and decoded in a worker thread (8 MB of JSON takes a while)."""
    raw = await _read_body(request, state.limits.max_body_bytes)
    return await asyncio.to_thread(parse_body, bytes(raw), model, state.limits)


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
    ``limits.max_json_depth`` (the parser's own recursion limit included) or has invalid fields."""
    too_deep = f"the body nests objects and arrays deeper than {limits.max_json_depth} levels"
    try:
        payload = json.loads(raw)
    except RecursionError:
        raise ServingError(too_deep) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ServingError(f"the body is not valid JSON: {exc}") from exc
    if not isinstance(payload, dict):
        raise ServingError("the body must be a JSON object")
    if json_depth(payload, limits.max_json_depth) > limits.max_json_depth:
        raise ServingError(too_deep)
    try:
        return model.model_validate(payload)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or 'body'}: {err['msg']}" for err in exc.errors()[:5]
        )
        raise ServingError(f"invalid request: {problems}") from exc


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
