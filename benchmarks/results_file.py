"""What every benchmark shares: where a run's section goes (``benchmarks/history/<date>-<topic>.md``, runs in the
order they were made; ``benchmarks/RESULTS.md`` is the table of current answers, edited by hand), the revision and
verdict each section names, and a bounded Ray wait."""

from __future__ import annotations

import asyncio
import re
import subprocess
from datetime import date
from pathlib import Path
from typing import Any

HISTORY = Path(__file__).with_name("history")
"""One file per date and topic, each holding that day's runs of one benchmark."""
_TOPIC = re.compile(r"[a-z0-9]+(-[a-z0-9]+)*")


def history_file(topic: str, day: date, folder: Path = HISTORY) -> Path:
    """The history file of ``topic`` (a lowercase slug such as ``bridge-throughput``) for ``day``."""
    if not _TOPIC.fullmatch(topic):
        raise ValueError(f"a benchmark topic is a lowercase slug like 'bridge-throughput', got {topic!r}")
    return folder / f"{day.isoformat()}-{topic}.md"


def publish(
    text: str, *, topic: str, write: bool = True, day: date | None = None, folder: Path = HISTORY
) -> Path | None:
    """Print ``text`` (one section) and, unless ``write`` is False (``--no-write``), append it to the history file
    of ``topic`` for ``day`` (today), creating the file with its header the first time; the file written, if any.
    RESULTS.md is not touched: its answers change by hand when a run measures them."""
    print(text)
    if not write:
        return None
    day = day or date.today()
    path = history_file(topic, day, folder)
    if not path.exists():
        folder.mkdir(parents=True, exist_ok=True)
        path.write_text(
            f"# {topic.replace('-', ' ').capitalize()}, {day.isoformat()}\n\nEach section is one run, in the order "
            "the runs were made; the current answers are in [benchmarks/RESULTS.md](../RESULTS.md).\n"
        )
    with path.open("a") as f:
        f.write(text if text.startswith("\n") else "\n" + text)
    return path


def verdict(ok: bool) -> str:
    """A target's verdict as the tables write it."""
    return "met" if ok else "MISSED"


def git_revision() -> str:
    """The checkout's short revision, and whether it has uncommitted changes (each results section names it)."""
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return rev.stdout.strip() + (" + uncommitted changes" if dirty.stdout.strip() else "")


async def ray_get(ref: Any, timeout_s: float = 60.0) -> Any:
    """Await a Ray object reference, bounded."""
    return await asyncio.wait_for(ref, timeout_s)
