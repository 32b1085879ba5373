"""``--smoke``'s data files without the rows past the smoke context: each line whose first prompt renders to more
tokens than the context leaves room for is left out of a copy of its file in the run folder, and counted.

A recipe's rows are sized for its model's context (the SWE pivot rows of 12,840 tokens for a 131,072-token Qwen3);
the smoke model's is smaller (SmolLM2: 8,192). Only lines that could be long are rendered: a line whose prompt text
is shorter than the context in characters has fewer tokens than that. A line that does not parse or render is kept,
for the run's reader to name.
"""

from __future__ import annotations

import contextlib
import re
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gym_bridge.boundary import UntrustedInputError
from gym_bridge.boundary.files import make_dir, write_atomic
from gym_bridge.boundary.json_io import ROW_DEPTH, loads
from gym_bridge.gym.protocol.row_file import read_row_text
from gym_bridge.json_types import JsonMapping
from gym_bridge.recipes.prompt_length import first_prompt_tokens, prompt_chars

SMOKE_DATA = "smoke-data"
"""The run folder's subfolder for the fitted copies."""
SMOKE_GYM = "smoke-gym"
"""The run folder's subfolder for Gym config files copied without their vLLM servers
(:mod:`~gym_bridge.recipes.smoke_servers`)."""
SMOKE_ENV = "smoke-env"
"""The run folder's subfolder of scratch folders for a launcher's unset variables
(:mod:`~gym_bridge.recipes.smoke_env`)."""
_TEMPLATE_ALLOWANCE = 256
"""Tokens a chat template adds around a prompt's text at most (roles, tool preamble): a line shorter than the
context by this many characters is not rendered."""


@dataclass(frozen=True)
class FittedRows:
    """One data file's lines that fit, and how many did not."""

    key: str
    source: Path
    lines: tuple[str, ...]
    left_out: int
    context: int

    @property
    def total(self) -> int:
        return len(self.lines) + self.left_out


def fitted_rows(
    key: str, path: str | Path, tokenizer: Any, context: int, template_kwargs: JsonMapping | None = None
) -> FittedRows | None:
    """``path``'s lines whose first prompt leaves at least one token of ``context``; None when every line fits or
    the file cannot be read (the run's reader names it)."""
    try:
        text = read_row_text(Path(path))
    except (OSError, UntrustedInputError):
        return None
    kept, left_out = [], 0
    for line in text.split("\n"):
        if not line.strip():
            continue
        if _past(line, tokenizer, context, template_kwargs):
            left_out += 1
        else:
            kept.append(line)
    if not left_out:
        return None
    return FittedRows(key, Path(path), tuple(kept), left_out, context)


def _past(line: str, tokenizer: Any, context: int, template_kwargs: JsonMapping | None) -> bool:
    try:
        row = loads(line, "", max_depth=ROW_DEPTH)
    except UntrustedInputError:
        return False
    if prompt_chars(row) + _TEMPLATE_ALLOWANCE < context:
        return False
    tokens = first_prompt_tokens(row, tokenizer, template_kwargs)
    return tokens is not None and context - tokens < 1


def write_fitted(fitted: FittedRows, run_dir: Path) -> Path:
    """The fitted lines as ``<run_dir>/smoke-data/<key>.jsonl`` (written atomically inside the run folder)."""
    folder = make_dir(Path(run_dir) / SMOKE_DATA)
    path = folder / (re.sub(r"[^A-Za-z0-9._-]", "_", fitted.key) + ".jsonl")
    write_atomic(path, "".join(line + "\n" for line in fitted.lines), root=run_dir)
    return path


def fitted_paths(fits: Mapping[str, FittedRows], run_dir: Path) -> dict[str, tuple[str, int, int, int]]:
    """Each fitted file written; key -> (its copy's path, lines left out, lines in all, the context)."""
    return {key: (str(write_fitted(fit, run_dir)), fit.left_out, fit.total, fit.context) for key, fit in fits.items()}


def remove_unstarted_copies(run_dir: Path) -> None:
    """The fitted copies, the Gym config copies (``smoke-gym``) and the scratch folders (``smoke-env``) of a smoke
    run that did not start (no ``metrics.jsonl``) removed, and ``run_dir`` with them when nothing else is in it: a
    smoke run refused before it starts leaves no run folder. A folder that held none of them is left as it is (an
    empty ``--out`` made beforehand stays)."""
    if (run_dir / "metrics.jsonl").exists():
        return
    ours = [run_dir / name for name in (SMOKE_DATA, SMOKE_GYM, SMOKE_ENV)]
    ours = [folder for folder in ours if folder.is_dir() and not folder.is_symlink()]
    if not ours:
        return
    for folder in ours:
        shutil.rmtree(folder, ignore_errors=True)
    with contextlib.suppress(OSError):
        run_dir.rmdir()  # only an empty folder
