"""A JSONL file of Gym rows read the one way every entrance reads it (eval datasets, training and validation data).

Lines are split on ``\\n`` only (a JSON string may hold U+2028 and other line separators); each line's row is
routed by the run's :class:`~gym_bridge.gym.routing.RowRouting` (a ``fan_out`` row becomes several tasks),
identical rows become repeats of one task (:func:`~gym_bridge.gym.rows.mark_repeats`), and every row is checked
by :func:`~gym_bridge.gym.rows.validate_row`. Problems are collected, not raised, so the caller names them all
in its own error type.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gym_bridge.boundary import UntrustedInputError
from gym_bridge.boundary.files import read_text
from gym_bridge.boundary.json_io import loads
from gym_bridge.boundary.text import shown
from gym_bridge.failures import InvalidGymRow
from gym_bridge.gym.routing import RowRouting
from gym_bridge.gym.rows import ValidGymRow, mark_repeats, validate_row

MAX_ROW_FILE_BYTES = 4 << 30
"""The largest row file read (a dataset, training or validation data)."""
MAX_ROW_DEPTH = 128
"""How deeply a row may nest (tool schemas inside ``responses_create_params`` nest a few dozen levels at most)."""


def read_row_text(path: Path) -> str:
    """The text of the row file ``path``: a regular file (a FIFO or ``/dev/zero`` is refused before anything blocks
    or is read) of at most :data:`MAX_ROW_FILE_BYTES`, in UTF-8.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        UntrustedInputError: not a regular file, too large or not UTF-8 (one line naming the file).
    """
    return read_text(path, MAX_ROW_FILE_BYTES)


@dataclass(frozen=True)
class RowLine:
    """One task of a row file."""

    prompt_idx: int
    """The task's position (0-based): the non-blank line's, unless ``fan_out`` made one line several tasks."""
    line: int
    """1-based line number in the file."""
    row: ValidGymRow


@dataclass(frozen=True)
class _NotJSON:
    """A line that did not parse: it keeps its ``prompt_idx`` so the rows after it keep theirs."""

    error: str


def read_row_file(
    path: Path, text: str, *, limit: int | None = None, routing: RowRouting | None = None
) -> tuple[list[RowLine], list[str]]:
    """The tasks of ``text`` (the content of ``path``; the first ``limit`` non-blank lines) and every problem found,
    each problem ``"<path>:<line>: <what>"``."""
    routing = routing or RowRouting()
    parsed: list[tuple[int, Any]] = []
    lines = 0
    for line_no, line in enumerate(text.split("\n"), start=1):
        if limit is not None and lines >= limit:
            break
        if not line.strip():
            continue
        lines += 1
        try:
            row = loads(line, "", max_depth=MAX_ROW_DEPTH)
        except UntrustedInputError as exc:
            parsed.append((line_no, _NotJSON(str(exc).removeprefix(": "))))
            continue
        parsed += [(line_no, routed) for routed in routing.apply(row)]
    marked = mark_repeats([row for _, row in parsed], list(range(len(parsed))))
    rows: list[RowLine] = []
    problems: list[str] = []
    for prompt_idx, ((line_no, _), row) in enumerate(zip(parsed, marked, strict=True)):
        if isinstance(row, _NotJSON):
            problems.append(f"{shown(path)}:{line_no}: {row.error}")
            continue
        try:
            rows.append(RowLine(prompt_idx, line_no, validate_row(row, prompt_idx=prompt_idx)))
        except InvalidGymRow as exc:
            problems.append(f"{shown(path)}:{line_no}: {shown(exc)}")
    return rows, problems
