"""Reading an eval dataset: a JSONL file of Gym rows, every line checked before anything runs."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from gym_bridge.failures import GymBridgeError, InvalidGymRow
from gym_bridge.gym.rows import validate_row
from gym_bridge.json_types import JsonObject

_MAX_REPORTED = 20


class DatasetError(GymBridgeError, ValueError):
    """A dataset line is not a valid Gym row; the message names the file and line number."""


@dataclass(frozen=True)
class DatasetRow:
    prompt_idx: int
    """The row's position among the file's non-blank lines (0-based); stable across runs."""
    line: int
    """1-based line number in the file."""
    row: JsonObject
    """The Gym row as the file gives it."""

    @property
    def agent(self) -> str:
        return str(self.row["agent_ref"]["name"])


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def load_dataset(path: str | Path, *, limit: int | None = None) -> list[DatasetRow]:
    """Every row of ``path`` (the first ``limit`` when given), parsed and validated.

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
    rows: list[DatasetRow] = []
    problems: list[str] = []
    for line_no, line in enumerate(text.splitlines(), start=1):
        if limit is not None and len(rows) + len(problems) >= limit:
            break
        if not line.strip():
            continue
        where, prompt_idx = f"{path}:{line_no}", len(rows) + len(problems)
        try:
            row = validate_row(json.loads(line), prompt_idx=prompt_idx)
        except json.JSONDecodeError as exc:
            problems.append(f"{where}: not valid JSON: {exc}")
        except InvalidGymRow as exc:
            problems.append(f"{where}: {exc}")
        else:
            rows.append(DatasetRow(prompt_idx=prompt_idx, line=line_no, row=row))
    if problems:
        more = f"\n... and {len(problems) - _MAX_REPORTED} more" if len(problems) > _MAX_REPORTED else ""
        raise DatasetError(f"{len(problems)} bad line(s):\n" + "\n".join(problems[:_MAX_REPORTED]) + more)
    if not rows:
        raise DatasetError(f"the dataset {path} has no rows")
    return rows
