"""Reading an eval dataset: a JSONL file of Gym rows, every line checked before anything runs."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from gym_bridge.boundary import UntrustedInputError
from gym_bridge.boundary.files import open_regular
from gym_bridge.boundary.text import shown
from gym_bridge.failures import GymBridgeError
from gym_bridge.gym.protocol.routing import TASK_SOURCE_KEY, RowRouting, row_agent
from gym_bridge.gym.protocol.row_file import MAX_ROW_FILE_BYTES, read_row_file, read_row_text
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


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open_regular(path, MAX_ROW_FILE_BYTES) as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def load_dataset(path: str | Path, *, limit: int | None = None, routing: RowRouting | None = None) -> list[DatasetRow]:
    """Every row of ``path`` (the first ``limit`` lines when given), routed, parsed and validated.

    Lines are split on ``\n`` only (a JSON string may hold U+2028 and other line separators). ``routing``
    (Gym's ``agent_name`` / ``agent_map`` / ``fan_out``) applies to each line's row first: a ``fan_out`` row
    becomes one task per agent, each its own ``prompt_idx``. Identical rows are one task rolled out more than
    once (:func:`~gym_bridge.gym.protocol.numbering.mark_repeats`): own rollout indices, seeds and ``row_id``.

    Raises:
        DatasetError: the file is missing or empty, or lines are not JSON or fail
            :func:`~gym_bridge.gym.protocol.rows.validate_row`; the message names every such line
            (the first ``_MAX_REPORTED`` of them, and how many more).
    """
    path = Path(path)
    try:
        text = read_row_text(path)
    except OSError as exc:
        raise DatasetError(f"cannot read the dataset {shown(path)}: {exc.strerror or exc}") from None
    except UntrustedInputError as exc:
        raise DatasetError(f"cannot read the dataset: {exc}") from None
    lines, problems = read_row_file(path, text, limit=limit, routing=routing)
    rows = [DatasetRow(prompt_idx=item.prompt_idx, line=item.line, row=item.row) for item in lines]
    if problems:
        more = f"\n... and {len(problems) - _MAX_REPORTED} more" if len(problems) > _MAX_REPORTED else ""
        raise DatasetError(f"{len(problems)} bad line(s):\n" + "\n".join(problems[:_MAX_REPORTED]) + more)
    if not rows:
        raise DatasetError(f"the dataset {path} has no rows")
    return rows
