"""``benchmarks/RESULTS.md``: every benchmark appends one dated section per run, newest last."""

from __future__ import annotations

from pathlib import Path

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
