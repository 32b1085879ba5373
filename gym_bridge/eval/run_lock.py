"""A run folder's ``run.lock``: the store holds it while it writes the folder, and a reader asks whether anyone does
(a run still being written is not read as finished). The lock file is opened without blocking or following a link,
so a FIFO or a device planted as ``run.lock`` never hangs either side."""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path

from gym_bridge.boundary.errors import UntrustedInputError
from gym_bridge.boundary.files import open_nofollow

LOCK_FILE = "run.lock"


def open_lock(path: Path, *, create: bool) -> int:
    """A descriptor on the lock file ``path``, opened without blocking or following a link (a FIFO or a device
    planted as ``run.lock`` never hangs the reader).

    Raises:
        OSError: ``path`` cannot be opened, or is a link, not a regular file or hard-linked (``EINVAL``).
    """
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT if create else os.O_RDONLY
    try:
        return open_nofollow(path, flags)
    except UntrustedInputError as exc:
        raise OSError(errno.EINVAL, str(exc), str(path)) from None


def writer_active(run_dir: str | Path) -> bool:
    """Whether a process holds ``run_dir``'s store open right now (a run still being written)."""
    try:
        fd = open_lock(Path(run_dir) / LOCK_FILE, create=False)
    except OSError:
        return False  # no lock file, or not one a writer made
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)
    return False
