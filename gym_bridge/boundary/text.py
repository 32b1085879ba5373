"""Text from untrusted places, made safe to print or to put in markdown."""

from __future__ import annotations


def shown(value: object) -> str:
    """``value`` as text on one line: what is not printable (ESC, NUL, newlines, bidi overrides, zero-width marks,
    U+2028, lone surrogates) escaped as ``\\x1b`` or ``\\u202e``, so a stored string cannot split a line, drive a
    terminal or reorder what a reader sees."""
    text = str(value)
    if text.isprintable():
        return text
    return "".join(
        c if c.isprintable() else c.encode("unicode_escape", "backslashreplace").decode("ascii") for c in text
    )


def markdown_cell(value: object) -> str:
    """``value`` for a markdown table cell or inline text: :func:`shown`, with backslash, pipe, backtick and angle
    brackets escaped so it cannot end a cell, open code or inject HTML."""
    text = shown(value)
    for char in "\\|`<>*_[]":
        text = text.replace(char, "\\" + char)
    return text
