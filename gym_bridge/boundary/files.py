"""Files from outside: read only when regular, under a size cap, without blocking; written into a folder through a
temporary file and ``os.replace``; appended to or repaired only through a descriptor that refused a link.

A FIFO, a device, a socket or a folder where a file is expected is refused before anything blocks or reads, and a
link planted in a run folder never redirects a write to a file outside it.
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from gym_bridge.boundary.errors import UntrustedInputError
from gym_bridge.boundary.text import shown

_KINDS = (
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISDIR, "a folder"),
)


def file_kind(mode: int) -> str:
    """What a file that is not regular is, in words."""
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def check_regular(path: Path, info: os.stat_result, max_bytes: int, hint: str = "") -> None:
    """Refuse anything but a regular file, and a file over ``max_bytes`` (``hint`` says how to raise the cap).

    Raises:
        UntrustedInputError: naming ``path`` and what it is, or its size and the cap.
    """
    if not stat.S_ISREG(info.st_mode):
        raise UntrustedInputError(
            f"{shown(path)}: not a regular file ({file_kind(info.st_mode)}); only regular files are read"
        )
    if info.st_size > max_bytes:
        raise too_large(path, info.st_size, max_bytes, hint)


def too_large(path: Path, size: int, max_bytes: int, hint: str = "") -> UntrustedInputError:
    return UntrustedInputError(f"{shown(path)}: {size:,} bytes or more, over the limit of {max_bytes:,} bytes{hint}")


@contextlib.contextmanager
def open_regular(path: str | Path, max_bytes: int, *, hint: str = "") -> Iterator[BinaryIO]:
    """``path`` open for reading in binary, once it is known to be a regular file of at most ``max_bytes`` (links
    followed; checked on the open descriptor too, so a file swapped for a FIFO in between never blocks).

    Raises:
        FileNotFoundError: ``path`` does not exist (the caller decides whether that is an error).
        UntrustedInputError: not a regular file, over ``max_bytes``, or unreadable.
    """
    path = Path(path)
    try:
        check_regular(path, os.stat(path), max_bytes, hint)
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise UntrustedInputError(f"{shown(path)}: cannot be read ({exc.strerror or exc})") from None
    with os.fdopen(fd, "rb") as f:
        try:
            check_regular(path, os.fstat(fd), max_bytes, hint)
        except OSError as exc:
            raise UntrustedInputError(f"{shown(path)}: cannot be read ({exc.strerror or exc})") from None
        yield f


def read_bytes(path: str | Path, max_bytes: int, *, hint: str = "") -> bytes:
    """The bytes of the regular file ``path``, at most ``max_bytes`` of them.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        UntrustedInputError: not a regular file, over ``max_bytes`` (also when it grew while read), or unreadable.
    """
    with open_regular(path, max_bytes, hint=hint) as f:
        try:
            data = f.read(max_bytes + 1)
        except OSError as exc:
            raise UntrustedInputError(f"{shown(path)}: cannot be read ({exc.strerror or exc})") from None
    if len(data) > max_bytes:
        raise too_large(Path(path), len(data), max_bytes, hint)
    return data


def read_text(path: str | Path, max_bytes: int, *, hint: str = "") -> str:
    """:func:`read_bytes` decoded as UTF-8.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        UntrustedInputError: as :func:`read_bytes`, or not UTF-8 (the byte offset named).
    """
    data = read_bytes(path, max_bytes, hint=hint)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UntrustedInputError(f"{shown(path)}: not UTF-8 text (byte {exc.start})") from None


def write_atomic(path: str | Path, data: bytes | str) -> None:
    """Write ``data`` to ``path`` through a temporary file in the same folder (fsynced) and ``os.replace``: a link
    planted at ``path`` is replaced, never followed, and a reader never sees half a file."""
    path = Path(path)
    raw = data.encode("utf-8") if isinstance(data, str) else data
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(raw)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def open_nofollow(path: str | Path, flags: int, mode: int = 0o644) -> int:
    """A descriptor on ``path`` opened with ``flags`` plus ``O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC``, checked to be a
    regular file: the way to append to or repair a file in a folder someone else may have filled.

    Raises:
        UntrustedInputError: ``path`` is a link, or not a regular file, or cannot be opened (named).
    """
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode)
    except OSError as exc:
        if os.path.islink(path):
            raise UntrustedInputError(
                f"{shown(path)}: a link; gym-bridge writes only to regular files in a run folder"
            ) from None
        raise UntrustedInputError(f"{shown(path)}: cannot be opened ({exc.strerror or exc})") from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise UntrustedInputError(
            f"{shown(path)}: not a regular file ({file_kind(info.st_mode)}); gym-bridge writes only to regular files"
        )
    return fd
