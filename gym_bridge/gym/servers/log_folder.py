"""A run folder's Gym log folder, ``gym-logs``: where a run's Gym servers write (an eval's and a training run's
alike), one log per server, appended to by every session of the run; checked before a resume starts anything."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from gym_bridge.boundary import UntrustedInputError
from gym_bridge.boundary.files import file_kind, folder_under
from gym_bridge.boundary.text import shown

GYM_LOGS = "gym-logs"
"""The run folder's Gym log folder."""


def gym_log_dir(run_dir: Path) -> Path:
    """Where a run in ``run_dir`` has its Gym servers write: the user's folder resolved, never a link inside it."""
    return run_dir.resolve() / GYM_LOGS


def check_gym_logs(run_dir: Path) -> None:
    """Refuse a run folder whose ``gym-logs`` Gym would write through to somewhere else: ``gym-logs`` or anything
    inside it a link, a file with a second hard link (a ``cp -al`` snapshot), or a FIFO, device or socket. Checked on
    resume before anything starts, the folders walked by descriptor without following a link, so a received folder
    never leads a log append outside it.

    Raises:
        UntrustedInputError: one line naming the first such entry and what it is.
    """
    logs = run_dir / GYM_LOGS
    if not os.path.lexists(logs):
        return
    with folder_under(run_dir, logs) as fd:
        for top, dirs, files, top_fd in os.fwalk(".", dir_fd=fd):
            for name in sorted(dirs + files):
                problem = _log_entry_problem(os.stat(name, dir_fd=top_fd, follow_symlinks=False))
                if problem:
                    raise UntrustedInputError(
                        f"{shown(logs / top / name)}: {problem}; a resume appends Gym's logs only to regular files "
                        "with one name inside the run folder"
                    )


def _log_entry_problem(info: os.stat_result) -> str:
    """What makes an entry of a Gym log folder unsafe to append through, in words ("" when nothing)."""
    if stat.S_ISLNK(info.st_mode):
        return "a link inside the run folder"
    if stat.S_ISDIR(info.st_mode):
        return ""
    if not stat.S_ISREG(info.st_mode):
        return f"not a regular file ({file_kind(info.st_mode)})"
    if info.st_nlink > 1:
        return f"has {info.st_nlink} hard links (another name reaches the same file)"
    return ""
