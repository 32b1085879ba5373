"""Writing the files a command derives from run folders (``report``'s, ``compare``'s, the trace viewer's): every
name checked before anything is written, then each file replaced atomically, so a planted link or FIFO is never
followed and a refusal leaves no half-written set."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from gym_bridge.boundary.files import file_kind, write_atomic
from gym_bridge.boundary.text import shown
from gym_bridge.eval.runs import RunReadError


def write_files(files: dict[Path, bytes | str]) -> None:
    """Write each of ``files`` (path -> content) through :func:`~gym_bridge.boundary.files.write_atomic` (a link
    or a FIFO planted at a name is replaced, never followed or opened), once no name is a folder: a folder
    planted at one is refused before anything is written.

    Raises:
        RunReadError: a name is a folder (named).
        OSError: the folder cannot be written.
    """
    for path in files:
        try:
            info = os.lstat(path)
        except FileNotFoundError:
            continue
        if stat.S_ISDIR(info.st_mode):
            raise RunReadError(f"{shown(path)}: {file_kind(info.st_mode)} where gym-bridge writes a file; remove it")
    for path, data in files.items():
        write_atomic(path, data)
