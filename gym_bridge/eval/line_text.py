"""What a run-folder reader shows of a line in words: the first problem pydantic found in a refused field
(:func:`field_problem`, with a short preview of the value) and the preview of a row's prompt a reader keeps
instead of the line (:func:`prompt_preview`). Both escape what they show (:func:`~gym_bridge.boundary.text.shown`)
or cut it short: the text is model output or another person's file."""

from __future__ import annotations

import reprlib

from pydantic import ValidationError

from gym_bridge.boundary.json_io import dumps
from gym_bridge.boundary.text import shown
from gym_bridge.json_types import JsonObject

_PREVIEW = reprlib.Repr(maxlevel=2, maxdict=3, maxlist=3, maxstring=40, maxother=40)
"""How much of a refused value an error line shows."""


def field_problem(exc: ValidationError, prefix: str = "") -> str:
    """The first problem pydantic found, in words: ``field 'a.b[0]' is missing`` or ``field 'x' should be ...``."""
    error = exc.errors(include_url=False)[0]
    name = prefix + "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in error["loc"])
    name = name.lstrip(".")
    if error["type"] == "missing":
        return f"field {shown(name)!r} is missing"
    message = error["msg"].removeprefix("Value error, ").removeprefix("Input ")
    return f"field {shown(name)!r}: {message} (got {shown(_PREVIEW.repr(error['input']))})"


def prompt_preview(record: JsonObject, limit: int = 160) -> str:
    """The last user message of the row's prompt, on one line (from the first completion's Gym result); text that
    is not a string is shown as JSON; cut to ``limit`` characters."""
    try:
        items = record["completions"][0]["gym_result"]["responses_create_params"]["input"]
    except (KeyError, IndexError, TypeError):
        return ""
    if isinstance(items, str):
        text = items
    elif isinstance(items, list):
        users = [i.get("content") for i in items if isinstance(i, dict) and i.get("role") == "user"]
        last = users[-1] if users else ""
        text = last if isinstance(last, str) else dumps(last)[: 4 * limit].decode("utf-8", "replace")
    else:
        return ""
    text = " ".join(text[: 8 * limit].split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
