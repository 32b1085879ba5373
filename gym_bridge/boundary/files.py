"""Files from outside: read only when regular, under a size cap, without blocking; written into a folder through a
temporary file and ``os.replace``; appended to or repaired only through a descriptor that refused a link.

A FIFO, a device, a socket or a folder where a file is expected is refused before anything blocks or reads, and a
link planted in a run folder never redirects a write to a file outside it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import sys
from collections.abc import Callable, Iterator
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


def write_atomic(
    path: str | Path,
    data: bytes | str | Callable[[BinaryIO], object],
    *,
    root: str | Path | None = None,
    mode: int = 0o644,
) -> None:
    """Write ``data`` to ``path`` through a temporary file in the same folder (fsynced) and ``os.replace``: a link
    planted at ``path`` is replaced, never followed, and a reader never sees half a file. With ``root`` (a folder
    above ``path``), no folder between ``root`` and ``path`` is followed as a link (:func:`folder_under`). The file
    is created with ``mode`` (0o600 for a file holding a secret). ``data`` may be a function that writes into the
    open file, so a large file (an optimizer state) streams to disk instead of being built in memory first.

    Raises:
        UntrustedInputError: ``path``'s folder is a link, a file or cannot be written (named).
    """
    path = Path(path)
    raw = data.encode("utf-8") if isinstance(data, str) else data
    write: Callable[[BinaryIO], object] = raw if callable(raw) else (lambda f: f.write(raw))
    with folder_under(root, path.parent) as dir_fd:
        tmp = f".{path.name}.{os.urandom(6).hex()}.tmp"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=dir_fd)
        except OSError as exc:
            raise _unwritable(path, exc) from None
        try:
            with os.fdopen(fd, "wb") as f:
                write(f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path.name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except BaseException as exc:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=dir_fd)
            if isinstance(exc, OSError):
                raise _unwritable(path, exc) from None
            raise


def open_nofollow(path: str | Path, flags: int, mode: int = 0o644, *, root: str | Path | None = None) -> int:
    """A descriptor on ``path`` opened with ``flags`` plus ``O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC``, checked to be a
    regular file with one name: the way to append to or repair a file in a folder someone else may have filled. A
    second hard link (a ``cp -al`` snapshot, a name planted outside the folder) is refused, so an append or a
    truncation never reaches a file through another name. With ``root``, no folder between ``root`` and ``path``
    is followed as a link either.

    Raises:
        UntrustedInputError: ``path`` is a link, has another hard link, is not a regular file, or cannot be opened.
    """
    path = Path(path)
    with folder_under(root, path.parent) as dir_fd:
        try:
            fd = os.open(path.name, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode, dir_fd=dir_fd)
        except OSError as exc:
            if exc.errno == errno.ELOOP or os.path.islink(path):
                raise UntrustedInputError(
                    f"{shown(path)}: a link; gym-bridge writes only to regular files in a run folder"
                ) from None
            raise UntrustedInputError(f"{shown(path)}: cannot be opened ({exc.strerror or exc})") from None
    info = os.fstat(fd)
    problem = (
        f"not a regular file ({file_kind(info.st_mode)})"
        if not stat.S_ISREG(info.st_mode)
        else f"has {info.st_nlink} hard links (another name reaches the same file)"
        if info.st_nlink > 1
        else ""
    )
    if problem:
        os.close(fd)
        raise UntrustedInputError(f"{shown(path)}: {problem}; gym-bridge writes only to regular files with one name")
    return fd


def open_append(path: str | Path, *, root: str | Path | None = None) -> BinaryIO:
    """``path`` open for appending in binary (created if missing), through :func:`open_nofollow`: a log or a JSONL
    file in a folder someone else may have filled.

    Raises:
        UntrustedInputError: as :func:`open_nofollow`.
    """
    return os.fdopen(open_nofollow(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, root=root), "ab")


def make_dir(path: str | Path, *, root: str | Path | None = None, mode: int = 0o755) -> Path:
    """``path`` made a folder (with its parents) if it is not one, and returned. Without ``root``, ``path`` is a
    user's path: links are followed as the user typed them. With ``root``, every folder from ``root`` down is made
    or opened without following a link. Folders it makes get ``mode`` (0o700 for a private one).

    Raises:
        UntrustedInputError: ``path`` (or a folder above it) is a file, a link under ``root``, or cannot be made
            (one line naming it and why).
    """
    path = Path(path)
    if root is not None:
        with folder_under(root, path, create=True, mode=mode):
            return path
    try:
        path.mkdir(mode=mode, parents=True, exist_ok=True)
    except FileExistsError:
        raise UntrustedInputError(f"{shown(path)}: exists and is not a folder") from None
    except NotADirectoryError:
        blocker = next((p for p in path.parents if p.exists() and not p.is_dir()), path)
        raise UntrustedInputError(f"{shown(path)}: cannot be made, {shown(blocker)} is a file") from None
    except OSError as exc:
        raise UntrustedInputError(f"{shown(path)}: cannot be made ({exc.strerror or exc})") from None
    if not path.is_dir():
        raise UntrustedInputError(f"{shown(path)}: exists and is not a folder")
    return path


@contextlib.contextmanager
def folder_under(
    root: str | Path | None, folder: str | Path, *, create: bool = False, mode: int = 0o755
) -> Iterator[int]:
    """A descriptor on ``folder``, closed on exit. With ``root`` (``folder`` at or under it), each component below
    ``root`` is opened from its parent's descriptor with ``O_NOFOLLOW | O_DIRECTORY`` (made first when ``create``),
    so a link planted anywhere inside the folder never leads a write outside it; ``root`` itself is the user's and
    may be a link.

    Raises:
        UntrustedInputError: a component is a link, not a folder, or cannot be opened or made (named).
    """
    folder = Path(folder)
    parts: tuple[str, ...] = ()
    if root is None:
        base = folder
    else:
        base = Path(root)
        try:
            parts = folder.relative_to(base).parts
        except ValueError:
            raise UntrustedInputError(f"{shown(folder)}: not inside {shown(base)}") from None
        if ".." in parts:
            raise UntrustedInputError(f"{shown(folder)}: leaves {shown(base)} through '..'")
    try:
        fd = os.open(base, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise _unwritable(base, exc) from None
    try:
        here = base
        for part in parts:
            here = here / part
            if create:
                try:
                    os.mkdir(part, mode, dir_fd=fd)
                except FileExistsError:
                    pass
                except OSError as exc:
                    raise _unwritable(here, exc) from None
            try:
                child = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            except OSError as exc:
                raise _not_a_folder(here, exc, fd, part) from None
            os.close(fd)
            fd = child
        yield fd
    finally:
        os.close(fd)


def check_no_links(folder: str | Path, *, root: str | Path) -> None:
    """Refuse ``folder`` (under ``root``, opened as :func:`folder_under` opens it) when it or an entry in it is a
    link: a received run folder's checkpoint is read only where it lies.

    Raises:
        UntrustedInputError: ``folder``, a folder above it below ``root``, or an entry in it is a link (named).
    """
    with folder_under(root, folder) as fd:
        for name in sorted(os.listdir(fd)):
            if stat.S_ISLNK(os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode):
                raise UntrustedInputError(
                    f"{shown(Path(folder) / name)}: a link inside the run folder; gym-bridge follows no link there"
                )


def _not_a_folder(path: Path, exc: OSError, dir_fd: int, name: str) -> UntrustedInputError:
    """Why the folder component ``name`` (``path``) could not be opened without following a link."""
    try:
        info = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except OSError:
        return _unwritable(path, exc)
    if stat.S_ISLNK(info.st_mode):
        return UntrustedInputError(f"{shown(path)}: a link inside the run folder; gym-bridge follows no link there")
    if not stat.S_ISDIR(info.st_mode):
        return UntrustedInputError(f"{shown(path)}: {file_kind(info.st_mode)} where a folder is expected")
    return _unwritable(path, exc)


def _unwritable(path: Path, exc: OSError) -> UntrustedInputError:
    return UntrustedInputError(f"{shown(path)}: cannot be written ({exc.strerror or exc})")


def stdin_from_devnull() -> None:
    """This process's file descriptor 0 open on ``/dev/null`` and ``sys.stdin`` reading it, as under a shell's
    ``stdin=DEVNULL``. Multiprocessing closes fd 0 in its children, and a server that starts workers (uvicorn's
    ``workers > 1``, Gym's ``num_workers``) hands ``sys.stdin.fileno()`` to each, which fails to reopen it and dies
    at start, over and over."""
    devnull = os.open(os.devnull, os.O_RDONLY)
    if devnull != 0:
        os.dup2(devnull, 0)
        os.close(devnull)
    sys.stdin = open(0, closefd=False)  # noqa: SIM115 - the process's own stdin, open as long as it runs
