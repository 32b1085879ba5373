"""Reading an eval dataset: a JSONL file of Gym rows, every line checked before anything runs."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gym_bridge.gym.rows import InvalidGymRow, validate_row


class DatasetError(ValueError):
    """A dataset line is not a valid Gym row; the message names the file and line number."""


@dataclass(frozen=True)
class DatasetRow:
    prompt_idx: int
    """The row's position among the file's non-blank lines (0-based); stable across runs."""
    line: int
    """1-based line number in the file."""
    row: dict[str, Any]

    @property
    def agent(self) -> str:
        return self.row["agent_ref"]["name"]


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def load_dataset(path: str | Path, *, limit: int | None = None) -> list[DatasetRow]:
    """Every row of ``path`` (the first ``limit`` when given), parsed and validated.

    Raises:
        DatasetError: the file is missing or empty, a line is not JSON, or a row fails
            :func:`~gym_bridge.gym.rows.validate_row`; the message names the line.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise DatasetError(f"cannot read the dataset {path}: {exc}") from None
    rows: list[DatasetRow] = []
    for line_no, line in enumerate(text.splitlines(), start=1):
        if limit is not None and len(rows) >= limit:
            break
        if not line.strip():
            continue
        where = f"{path}:{line_no}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DatasetError(f"{where}: not valid JSON: {exc}") from None
        try:
            validate_row(row, prompt_idx=len(rows))
        except InvalidGymRow as exc:
            raise DatasetError(f"{where}: {exc}") from None
        rows.append(DatasetRow(prompt_idx=len(rows), line=line_no, row=row))
    if not rows:
        raise DatasetError(f"the dataset {path} has no rows")
    return rows
