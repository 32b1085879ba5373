"""Streaming a run folder's lines in bounded memory and time: where a line is (:class:`LineRef`), so a reader keeps
that instead of the line and reads it again when asked, and the cyclic garbage collector paused while lines stream
by (:func:`collector_paused`). A line read again is checked to be the line read first."""

from __future__ import annotations

import contextlib
import gc
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from gym_bridge.boundary.errors import UntrustedInputError
from gym_bridge.boundary.files import open_regular
from gym_bridge.boundary.json_io import loads_object
from gym_bridge.boundary.text import shown
from gym_bridge.json_types import JsonObject


@dataclass(frozen=True, slots=True)
class LineRef:
    """Where one line of a JSONL file is, to read it again: its number, byte offset, size and CRC-32."""

    path: Path
    number: int
    offset: int
    size: int
    crc: int

    def read(self, max_bytes: int, hint: str = "") -> JsonObject:
        """The line again, decoded as it was the first time, from a file of at most ``max_bytes``.

        Raises:
            UntrustedInputError: the file is no longer a regular file under ``max_bytes``, or the line changed
                since it was read (named).
        """
        where = f"{shown(self.path)}:{self.number}"
        with open_regular(self.path, max_bytes, hint=hint) as f:
            try:
                f.seek(self.offset)
                raw = f.read(self.size)
            except OSError as exc:
                raise UntrustedInputError(f"{where}: cannot be read ({exc.strerror or exc})") from None
        if len(raw) != self.size or zlib.crc32(raw) != self.crc:
            raise UntrustedInputError(f"{where}: changed since it was read; read the run folder again")
        return loads_object(raw, where)


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """The cyclic garbage collector off while lines stream by: decoded JSON holds no cycles, and a collection
    that walks every object kept so far, once per few hundred lines, cost more than the decoding itself."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
