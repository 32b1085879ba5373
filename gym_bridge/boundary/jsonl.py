"""JSONL files from outside, streamed: each line read under a per-line cap and the file under its own, a NUL byte
refused at its line (a sparse file or a file of zeros is refused after one read), and each line decoded as
:func:`~gym_bridge.boundary.json_io.loads_object` decodes it, its nesting measured on the bytes (walking a decoded
29 KB line costs ~0.9 ms; counting its brackets ~0.08 ms). The one loop every run-folder reader uses, eval and
training folders alike."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson

from gym_bridge.boundary.errors import UntrustedInputError
from gym_bridge.boundary.files import open_regular, too_large
from gym_bridge.boundary.json_io import MAX_DEPTH, loads_object
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


_ESCAPE = re.compile(rb"\\.", re.S)
"""A backslash escape inside a JSON string (the only place valid JSON has a backslash)."""
_NOT_STRUCTURE = bytes(range(256)).translate(None, b'"[]{}')
"""Every byte but quotes and brackets (no byte of a multi-byte UTF-8 character is one of these)."""


def raw_depth(raw: bytes) -> int:
    """How deeply the valid JSON text ``raw`` nests lists and objects: as
    :func:`~gym_bridge.boundary.json_io.depth` of its value, measured on the bytes (escapes dropped, then
    everything but quotes and brackets, then what lies inside strings; the brackets left are counted)."""
    structure = _ESCAPE.sub(b"", raw) if b"\\" in raw else raw
    brackets = b"".join(structure.translate(None, _NOT_STRUCTURE).split(b'"')[::2])
    level = deepest = 0
    for byte in brackets:
        if byte == 0x5B or byte == 0x7B:  # [ {
            level += 1
            if level > deepest:
                deepest = level
        else:
            level -= 1
    return deepest


def _deeper_than(raw: bytes, limit: int) -> bool:
    """Whether the valid JSON text ``raw`` nests deeper than ``limit`` (a short line with no more opening brackets
    than ``limit`` cannot: then nothing is measured)."""
    if len(raw) <= 4096 and raw.count(b"[") + raw.count(b"{") <= limit:
        return False
    return raw_depth(raw) > limit


def decode_line(raw: bytes, where: str, *, max_depth: int = MAX_DEPTH) -> dict[str, Any]:
    """One JSONL line (or ``run.json``) as a JSON object, decoded as
    :func:`~gym_bridge.boundary.json_io.loads_object` decodes it (the same decoder, the same refusals in its
    words), its nesting measured on the bytes (:func:`raw_depth`).

    Raises:
        UntrustedInputError: not valid JSON, not an object, or nested deeper than ``max_depth`` (``where``).
    """
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError:
        value = None
    if isinstance(value, dict) and not _deeper_than(raw, max_depth):
        return value
    loads_object(raw, where, max_depth=max_depth)  # refuses it, in its own words
    raise UntrustedInputError(f"{where}: nested deeper than {max_depth} levels")  # pragma: no cover (refused above)
