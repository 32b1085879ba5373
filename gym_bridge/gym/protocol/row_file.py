"""A JSONL file of Gym rows read the one way every entrance reads it (eval datasets, training and validation data).

Lines are split on ``\\n`` only (a JSON string may hold U+2028 and other line separators); each line's row is
routed by the run's :class:`~gym_bridge.gym.protocol.routing.RowRouting` (a ``fan_out`` row becomes one prompt group per
agent), numbered as Gym 0.7's ``preprocess_examples`` numbers it
(:func:`~gym_bridge.gym.protocol.numbering.number_tasks`:
every row gets its ``_ng_task_index``, dense over distinct rows, and its ``_ng_rollout_index`` among its task's repeats
and fan-out agents), and every row is checked by :func:`~gym_bridge.gym.protocol.rows.validate_row`. Problems are
collected, not raised, so the caller names them all in its own error type.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gym_bridge.boundary import UntrustedInputError
from gym_bridge.boundary.files import read_text
from gym_bridge.boundary.json_io import ROW_DEPTH, loads
from gym_bridge.boundary.text import shown
from gym_bridge.failures import InvalidGymRow
from gym_bridge.gym.protocol.numbering import number_tasks
from gym_bridge.gym.protocol.routing import RowRouting
from gym_bridge.gym.protocol.rows import ValidGymRow, validate_row

MAX_ROW_FILE_BYTES = 4 << 30
"""The largest row file read (a dataset, training or validation data)."""
MAX_ROW_DEPTH = ROW_DEPTH
"""How deeply a row may nest: the boundary's :data:`~gym_bridge.boundary.json_io.ROW_DEPTH`, below what a run file
may hold, so a run folder written from rows is one that ``report``, ``compare`` and ``--resume`` read."""


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
    """One prompt group of a row file: a line's row, or one ``fan_out`` agent's copy of it."""

    prompt_idx: int
    """The prompt group's position (0-based): the non-blank line's, unless ``fan_out`` made one line several groups.
    Not Gym's task index: that is the row's ``_ng_task_index``."""
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
    """The prompt groups of ``text`` (the content of ``path``; the first ``limit`` non-blank lines), each row numbered
    by Gym's rules, and every problem found, each problem ``"<path>:<line>: <what>"``."""
    routing = routing or RowRouting()
    parsed: list[tuple[int, Any, Any]] = []
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
            error = _NotJSON(str(exc).removeprefix(": "))
            parsed.append((line_no, error, error))
            continue
        parsed += [(line_no, row, routed) for routed in routing.apply(row)]
    numbered = number_tasks([(source, routed) for _, source, routed in parsed])
    rows: list[RowLine] = []
    problems: list[str] = []
    for prompt_idx, ((line_no, _, _), row) in enumerate(zip(parsed, numbered, strict=True)):
        if isinstance(row, _NotJSON):
            problems.append(f"{shown(path)}:{line_no}: {row.error}")
            continue
        try:
            rows.append(RowLine(prompt_idx, line_no, validate_row(row, prompt_idx=prompt_idx)))
        except InvalidGymRow as exc:
            problems.append(f"{shown(path)}:{line_no}: {shown(exc)}")
    return rows, problems
