"""Text from run folders made inert for the files gym-bridge writes from them: strict JSON with every character that
is not printable escaped (:func:`json_out`), Markdown text that no viewer reads as markup (:func:`markdown_text`)
and matplotlib labels that mathtext never parses (:func:`plot_label`). Agent names, model names, prompts and error
messages in a run folder are model output or other people's files; ``report`` and ``compare`` show them only
through these."""

from __future__ import annotations

import html
import re

from gym_bridge.boundary.json_io import dumps
from gym_bridge.boundary.text import shown

_NON_ASCII = re.compile(r"[^\x00-\x7f]")


def json_out(value: object) -> bytes:
    """``value`` as the strict, indented JSON of a file gym-bridge writes (:func:`~gym_bridge.boundary.json_io.dumps`:
    a number that is not finite is null), with every character that is not printable (a bidi override, U+2028)
    written as its ``\\u`` escape, so ``cat metrics.json`` shows what a run folder holds without obeying it (JSON
    escapes ESC and NUL itself)."""
    data = dumps(value, indent=True) + b"\n"
    if data.isascii():
        return data
    return _NON_ASCII.sub(_escaped, data.decode("utf-8")).encode("utf-8")


def _escaped(match: re.Match[str]) -> str:
    char = match.group()
    if char.isprintable():
        return char
    code = ord(char)
    if code > 0xFFFF:  # a surrogate pair, as JSON writes one
        code -= 0x10000
        return f"\\u{0xD800 + (code >> 10):04x}\\u{0xDC00 + (code & 0x3FF):04x}"
    return f"\\u{code:04x}"


_MARKDOWN_ACTIVE = re.compile(r"([\\`*_\[\]()#!|~$])")
"""ASCII punctuation that CommonMark or GFM may read as markup (links, emphasis, tables, code); escaped by a
backslash, which CommonMark allows before any ASCII punctuation."""


def markdown_text(value: object, limit: int = 400) -> str:
    """``value`` as inert Markdown text on one line: HTML escaped, markup characters escaped, cut to ``limit``.

    Why: agent names, model names and error messages come from run folders (model output, other people's
    files); a ``|`` or newline must not break a table, ``<img onerror>`` or ``[x](javascript:)`` must not
    become markup in a Markdown viewer, and ESC, NUL or a bidi override must not reach a terminal that shows the
    file (escaped as ``\\x1b``, ``\\x00``, ``\\u202e``: :func:`~gym_bridge.boundary.text.shown`).
    """
    text = shown(" ".join(str(value).split()))
    if len(text) > limit:
        text = text[: limit - 3] + "..."
    return html.escape(_MARKDOWN_ACTIVE.sub(r"\\\1", text), quote=True)


def plot_label(value: object, limit: int = 60) -> str:
    """``value`` as a matplotlib label: one line, short, control characters escaped, ``$`` escaped (mathtext would
    parse it, and may fail)."""
    text = shown(" ".join(str(value).split()))
    text = text if len(text) <= limit else text[: limit - 3] + "..."
    return text.replace("$", "\\$").lstrip("_") or "(no name)"
