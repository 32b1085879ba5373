"""The table ``gym-bridge train --smoke`` prints: each key changed (recipe value -> smoke value, and why) and each
GPU-only key a CPU run leaves as it is, with the markers for a key a config lacks or a rewrite removes."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass


class _Absent:
    """A key the config does not have (shown as ``(absent)``), or one the rewrite removes (``(removed)``)."""

    def __init__(self, shown: str) -> None:
        self.shown = shown

    def __repr__(self) -> str:
        return self.shown


ABSENT = _Absent("(absent)")
REMOVED = _Absent("(removed)")


@dataclass(frozen=True)
class KeyChange:
    """One key the smoke rewrite changed."""

    key: str
    recipe: object
    """The recipe's value (:data:`ABSENT` when it had none)."""
    smoke: object
    """The smoke run's value (:data:`REMOVED` when the key is taken out)."""
    why: str


@dataclass(frozen=True)
class IgnoredKey:
    """A GPU-only key a CPU run leaves as it is: nothing here reads it."""

    key: str
    value: object
    why: str


def shown_value(value: object, limit: int = 48) -> str:
    """A config value on one short line (JSON for containers), cut in the middle to ``limit`` characters (a path
    keeps its file name)."""
    if isinstance(value, _Absent):
        return value.shown
    if isinstance(value, list) and value and all(isinstance(v, str) and "/" in v for v in value):
        value = ", ".join(v.rsplit("/", 1)[-1].rsplit(".", 1)[0] for v in value)  # config paths: their file names
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    text = " ".join(text.split())
    if len(text) <= limit:
        return text
    tail = (limit - 3) * 2 // 3
    return text[: limit - 3 - tail] + "..." + text[-tail:]


def format_table(title: str, header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """``rows`` under ``header`` in aligned columns (the last column as it is), with ``title`` above."""
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header) - 1)]

    def line(cells: Sequence[str]) -> str:
        return "  ".join([*(str(c).ljust(w) for c, w in zip(cells, widths, strict=False)), str(cells[-1])]).rstrip()

    rule = "  ".join("-" * w for w in widths) + "  ---"
    return "\n".join([title, line(header), rule, *(line(row) for row in rows)])
