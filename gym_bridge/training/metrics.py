"""Training metrics: one JSON line per step and per validation in ``metrics.jsonl`` (plots: ``training/plots.py``)."""

from __future__ import annotations

import json
from pathlib import Path

from gym_bridge.json_types import JsonMapping, JsonObject

type MetricsLine = JsonObject
"""One line of ``metrics.jsonl``: a training step's or a validation's values by name (``kind``, ``step``,
``train/*``, ``val/*``, ...), each a number, a flag, a string or a list of numbers."""


def append_metrics(path: Path, metrics: JsonMapping) -> None:
    """Append one step's metrics to ``path`` (``metrics.jsonl``) and flush."""
    with path.open("a") as f:
        f.write(json.dumps(dict(metrics), sort_keys=True) + "\n")
        f.flush()


def read_metrics(path: Path) -> list[MetricsLine]:
    """Every line of a ``metrics.jsonl``; none when the file does not exist."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
