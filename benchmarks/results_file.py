"""What every benchmark shares: ``benchmarks/RESULTS.md`` (one dated section per run, newest last), the
revision and verdict each section names, and a bounded Ray wait."""

from __future__ import annotations

import asyncio
import subprocess
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).with_name("RESULTS.md")


def publish(text: str, *, write: bool = True) -> None:
    """Print ``text`` (one section) and, unless ``write`` is False (``--no-write``), append it to RESULTS.md,
    creating the file with its header the first time."""
    print(text)
    if not write:
        return
    if not RESULTS.exists():
        RESULTS.write_text("# Benchmark results\n\nEach section is one run, newest last.\n")
    with RESULTS.open("a") as f:
        f.write(text)


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
