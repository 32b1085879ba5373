"""Training metrics: one JSON line per step and per validation in ``metrics.jsonl`` (plots: ``training/plots.py``).

Written as strict JSON (:func:`~gym_bridge.boundary.json_io.dumps`: a loss that is NaN or infinite is ``null``,
so every reader accepts the file), appended through a descriptor that refuses a planted link
(:func:`~gym_bridge.boundary.files.open_nofollow`).

Read back (:func:`iter_jsonl`, for ``metrics.jsonl`` and ``val_results.jsonl``) by the loop that also reads an eval
run folder's JSONL files (:mod:`gym_bridge.boundary.jsonl`), under the same caps (:data:`MAX_JSONL_BYTES`, raised
by ``$GYM_BRIDGE_RUN_MAX_BYTES``, and :data:`MAX_LINE_BYTES`), with the same one-line errors naming ``file:line``;
``tests/eval/test_hostile_reports.py`` holds the two readers to the same caps and the same error lines.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from pathlib import Path

from gym_bridge.boundary.errors import UntrustedInputError
from gym_bridge.boundary.files import open_nofollow
from gym_bridge.boundary.json_io import dumps, loads_object
from gym_bridge.boundary.jsonl import iter_lines
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
    """(line number, object) of each line of the JSONL file ``path``, streamed by the boundary's one JSONL reader
    (:mod:`gym_bridge.boundary.jsonl`), as the eval run-folder reader streams its files (none when it does not
    exist; blank lines and a torn last line skipped: a run killed mid-write).

    Raises:
        UntrustedInputError: not a regular file, over the cap (``$GYM_BRIDGE_RUN_MAX_BYTES``), a line over
            :data:`MAX_LINE_BYTES` or holding a NUL byte, or a line that is not a JSON object or nests too deeply
            (``file:line``).
    """
    where = shown(path)
    hint = f"; set {MAX_BYTES_ENV} to read a larger one"
    for number, _, raw, complete in iter_lines(path, max_bytes=max_jsonl_bytes(), max_line=MAX_LINE_BYTES, hint=hint):
        if not complete:
            return  # a torn last line
        if raw.strip():
            yield number, loads_object(raw, f"{where}:{number}")


def read_metrics(path: Path) -> list[MetricsLine]:
    """Every line of a ``metrics.jsonl`` (none when the file does not exist; a torn last line skipped).

    Raises:
        UntrustedInputError: see :func:`iter_jsonl`.
    """
    return [record for _, record in iter_jsonl(path)]
