"""JSONL files from outside, streamed: each line read under a per-line cap and the file under its own, a NUL byte
refused at its line (a sparse file or a file of zeros is refused after one read). Each line is then decoded with
:func:`~gym_bridge.boundary.json_io.loads_object`. The one loop every run-folder reader uses, eval and training
folders alike."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from gym_bridge.boundary.errors import UntrustedInputError
from gym_bridge.boundary.files import open_regular, too_large
from gym_bridge.boundary.text import shown

_PIECE = 1 << 20
"""How much of a file is read at once: a longer line is read piece by piece up to its cap."""


def iter_lines(path: Path, *, max_bytes: int, max_line: int, hint: str = "") -> Iterator[tuple[int, int, bytes, bool]]:
    """Each line of the JSONL file ``path`` as it is read: (line number, byte offset, bytes without the newline,
    whether a newline ended it). Only the last can lack its newline (a torn write, or a file not ending in one).
    Nothing when ``path`` does not exist. Memory: a read of :data:`_PIECE` bytes and the line it ends, under
    ``max_line``; ``hint`` (how to raise ``max_bytes``) ends a refusal for size.

    Raises:
        UntrustedInputError: not a regular file, over ``max_bytes`` (also when it grows while read), a line over
            ``max_line``, or a NUL byte in a line (``file:line``; JSON
            has no NUL byte: a sparse file or a file of zeros is refused at its first line, after one read).
    """
    where = shown(path)
    with contextlib.ExitStack() as stack:
        try:
            f = stack.enter_context(open_regular(path, max_bytes, hint=hint))
        except FileNotFoundError:
            return
        buf, start, base, number, total = b"", 0, 0, 0, 0  # base: the file offset of buf[0]
        while True:
            end = buf.find(b"\n", start)
            if end < 0:
                if len(buf) - start > max_line:
                    raise _line_too_long(where, number + 1, max_line)
                try:
                    piece = f.read(_PIECE)
                except OSError as exc:
                    raise UntrustedInputError(f"{where}: cannot be read ({exc.strerror or exc})") from None
                if not piece:
                    if start < len(buf):
                        yield number + 1, base + start, buf[start:], False
                    return
                total += len(piece)
                if total > max_bytes:
                    raise too_large(path, total, max_bytes, hint)
                base, buf, start = base + start, buf[start:] + piece, 0
                nul = buf.find(b"\x00", len(buf) - len(piece))
                if nul >= 0:
                    line_start = buf.rfind(b"\n", 0, nul) + 1
                    line = number + 1 + buf.count(b"\n", 0, line_start)
                    byte = nul - line_start
                    raise UntrustedInputError(
                        f"{where}:{line}: not valid JSON (a NUL byte at byte {byte:,} of the line)"
                    )
                continue
            number += 1
            if end - start >= max_line:
                raise _line_too_long(where, number, max_line)
            yield number, base + start, buf[start:end], True
            start = end + 1


def _line_too_long(where: str, number: int, max_line: int) -> UntrustedInputError:
    return UntrustedInputError(f"{where}:{number}: a line of more than {max_line:,} bytes, over the limit of a line")
