"""Training metrics: one JSON line per step and per validation in ``metrics.jsonl`` (plots: ``training/plots.py``).

Written as strict JSON (:func:`~gym_bridge.boundary.json_io.dumps`: a loss that is NaN or infinite is ``null``,
so every reader accepts the file), appended through a descriptor that refuses a planted link
(:func:`~gym_bridge.boundary.files.open_nofollow`).

Read back (:func:`iter_jsonl`, for ``metrics.jsonl`` and ``val_results.jsonl``) the way the run-folder reader of
:mod:`gym_bridge.eval.runs` reads an eval run folder's JSONL files: through the boundary
(:func:`~gym_bridge.boundary.files.open_regular`, :func:`~gym_bridge.boundary.json_io.loads_object`), streamed
line by line, under the same caps (:data:`MAX_JSONL_BYTES`, raised by ``$GYM_BRIDGE_RUN_MAX_BYTES``, and
:data:`MAX_LINE_BYTES`), with the same one-line errors naming ``file:line``. The layer table keeps this module
from importing ``eval/`` (a tool), so the loop is this module's own; ``tests/test_hostile_reports.py`` holds the
two readers to the same caps and the same error lines.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from gym_bridge.boundary.errors import UntrustedInputError
from gym_bridge.boundary.files import open_nofollow, open_regular
from gym_bridge.boundary.json_io import MAX_DEPTH, dumps, loads_object
from gym_bridge.boundary.text import shown
from gym_bridge.json_types import JsonMapping, JsonObject

type MetricsLine = JsonObject
"""One line of ``metrics.jsonl``: a training step's or a validation's values by name (``kind``, ``step``,
``train/*``, ``val/*``, ...), each a number, a flag, a string or a list of numbers."""

MAX_BYTES_ENV = "GYM_BRIDGE_RUN_MAX_BYTES"
"""The environment variable that raises (or lowers) :data:`MAX_JSONL_BYTES` (as for an eval run folder)."""
MAX_JSONL_BYTES = 2 << 30
"""The largest JSONL file of a run folder read (``eval.runs.ReadLimits.max_jsonl_bytes``)."""
MAX_LINE_BYTES = 128 << 20
"""The longest line read (``eval.runs.ReadLimits.max_line_bytes``)."""
_PIECE = 1 << 20


def _plain(value: object) -> object:
    """``value`` with numpy's scalars as Python numbers (a float subclass is a float; a non-finite one None)."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, float):
        return float(value) if math.isfinite(value) else None
    if isinstance(value, int):
        return int(value)
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    item = getattr(value, "item", None)  # a numpy scalar that is not a Python number (float32, int64)
    return _plain(item()) if callable(item) else value


def append_metrics(path: Path, metrics: JsonMapping) -> None:
    """Append one step's metrics to ``path`` (``metrics.jsonl``) as one strict JSON line (keys sorted), through a
    descriptor that refuses a link planted at the name.

    Raises:
        UntrustedInputError: ``path`` is a link or not a regular file.
    """
    line = dumps(_plain(dict(metrics))) + b"\n"
    fd = open_nofollow(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


def max_jsonl_bytes() -> int:
    """:data:`MAX_JSONL_BYTES`, or ``$GYM_BRIDGE_RUN_MAX_BYTES`` when it is set.

    Raises:
        UntrustedInputError: the variable is not a positive integer.
    """
    raw = os.environ.get(MAX_BYTES_ENV, "").strip()
    if not raw:
        return MAX_JSONL_BYTES
    if not raw.isdigit() or int(raw) == 0:
        raise UntrustedInputError(f"{MAX_BYTES_ENV}={shown(raw)} is not a positive number of bytes")
    return int(raw)


def iter_jsonl(path: Path) -> Iterator[tuple[int, JsonObject]]:
    """(line number, object) of each line of the JSONL file ``path``, streamed (none when it does not exist;
    blank lines and a torn last line skipped: a run killed mid-write).

    Raises:
        UntrustedInputError: not a regular file, over the cap (``$GYM_BRIDGE_RUN_MAX_BYTES``), a line over
            :data:`MAX_LINE_BYTES` or holding a NUL byte, or a line that is not a JSON object or nests too deeply
            (``file:line``).
    """
    where = shown(path)
    limit = max_jsonl_bytes()
    hint = f"; set {MAX_BYTES_ENV} to read a larger one"
    with contextlib.ExitStack() as stack:
        try:
            f = stack.enter_context(open_regular(path, limit, hint=hint))
        except FileNotFoundError:
            return
        offset = number = 0
        while True:
            line = _line(f, where, number + 1)
            if not line:
                return
            number += 1
            offset += len(line)
            if offset > limit:
                raise UntrustedInputError(f"{where}: {offset:,} bytes or more, over the limit of {limit:,} bytes{hint}")
            if not line.endswith(b"\n"):
                return  # a torn last line
            if line.strip():
                yield number, loads_object(line, f"{where}:{number}", max_depth=MAX_DEPTH)


def _line(f: BinaryIO, where: str, number: int) -> bytes:
    """The next line of ``f`` with its newline (without one: the file's end), under :data:`MAX_LINE_BYTES`."""
    parts: list[bytes] = []
    size = 0
    while True:
        try:
            piece = f.readline(_PIECE)
        except OSError as exc:
            raise UntrustedInputError(f"{where}: cannot be read ({exc.strerror or exc})") from None
        if not piece:
            break
        at = piece.find(b"\x00")
        if at >= 0:
            byte = size + at
            raise UntrustedInputError(f"{where}:{number}: not valid JSON (a NUL byte at byte {byte:,} of the line)")
        parts.append(piece)
        size += len(piece)
        if size > MAX_LINE_BYTES:
            raise UntrustedInputError(
                f"{where}:{number}: a line of more than {MAX_LINE_BYTES:,} bytes, over the limit of a line"
            )
        if piece.endswith(b"\n"):
            break
    return b"".join(parts)


def read_metrics(path: Path) -> list[MetricsLine]:
    """Every line of a ``metrics.jsonl`` (none when the file does not exist; a torn last line skipped).

    Raises:
        UntrustedInputError: see :func:`iter_jsonl`.
    """
    return [record for _, record in iter_jsonl(path)]
