"""Reading an eval dataset: a JSONL file of Gym rows, every line checked before anything runs."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gym_bridge.failures import GymBridgeError, InvalidGymRow
from gym_bridge.gym.routing import TASK_SOURCE_KEY, RowRouting, row_agent
from gym_bridge.gym.rows import mark_repeats, validate_row
from gym_bridge.json_types import JsonObject

_MAX_REPORTED = 20


class DatasetError(GymBridgeError, ValueError):
    """A dataset line is not a valid Gym row; the message names the file and line number."""


@dataclass(frozen=True)
class DatasetRow:
    prompt_idx: int
    """The task's position in the dataset (0-based): the non-blank line's, unless ``fan_out`` made one line
    several tasks; stable across runs of one dataset and config."""
    line: int
    """1-based line number in the file."""
    row: JsonObject
    """The Gym row as the file gives it."""

    @property
    def agent(self) -> str:
        """The row's agent: ``agent_ref.name`` (a ``task_source`` row gains it once Gym's config resolves it)."""
        return row_agent(self.row) or f"task_source:{self.row.get(TASK_SOURCE_KEY)}"


@dataclass(frozen=True)
class _NotJSON:
    """A line that did not parse: it keeps its ``prompt_idx`` so the rows after it keep theirs."""

    error: str


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def load_dataset(path: str | Path, *, limit: int | None = None, routing: RowRouting | None = None) -> list[DatasetRow]:
    """Every row of ``path`` (the first ``limit`` lines when given), routed, parsed and validated.

    Lines are split on ``\n`` only (a JSON string may hold U+2028 and other line separators). ``routing``
    (Gym's ``agent_name`` / ``agent_map`` / ``fan_out``) applies to each line's row first: a ``fan_out`` row
    becomes one task per agent, each its own ``prompt_idx``. Identical rows are one task rolled out more than
    once (:func:`~gym_bridge.gym.rows.mark_repeats`): own rollout indices, seeds and ``row_id``.

    Raises:
        DatasetError: the file is missing or empty, or lines are not JSON or fail
            :func:`~gym_bridge.gym.rows.validate_row`; the message names every such line
            (the first ``_MAX_REPORTED`` of them, and how many more).
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise DatasetError(f"cannot read the dataset {path}: {exc}") from None
    routing = routing or RowRouting()
    parsed: list[tuple[int, Any]] = []
    problems: list[str] = []
    lines = 0
    for line_no, line in enumerate(text.split("\n"), start=1):
        if limit is not None and lines >= limit:
            break
        if not line.strip():
            continue
        lines += 1
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            parsed.append((line_no, _NotJSON(str(exc))))
            continue
        parsed += [(line_no, routed) for routed in routing.apply(row)]
    marked = mark_repeats([row for _, row in parsed], list(range(len(parsed))))
    rows: list[DatasetRow] = []
    for prompt_idx, ((line_no, _), row) in enumerate(zip(parsed, marked, strict=True)):
        if isinstance(row, _NotJSON):
            problems.append(f"{path}:{line_no}: not valid JSON: {row.error}")
            continue
        try:
            rows.append(DatasetRow(prompt_idx=prompt_idx, line=line_no, row=validate_row(row, prompt_idx=prompt_idx)))
        except InvalidGymRow as exc:
            problems.append(f"{path}:{line_no}: {exc}")
    if problems:
        more = f"\n... and {len(problems) - _MAX_REPORTED} more" if len(problems) > _MAX_REPORTED else ""
        raise DatasetError(f"{len(problems)} bad line(s):\n" + "\n".join(problems[:_MAX_REPORTED]) + more)
    if not rows:
        raise DatasetError(f"the dataset {path} has no rows")
    return rows
