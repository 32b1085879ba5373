"""``benchmarks/RESULTS.md``: every benchmark appends one dated section per run, newest last."""

from __future__ import annotations

from pathlib import Path

RESULTS = Path(__file__).with_name("RESULTS.md")


def append_results(text: str) -> None:
    """Append ``text`` (one section) to RESULTS.md, creating it with its header the first time."""
    if not RESULTS.exists():
        RESULTS.write_text("# Benchmark results\n\nEach section is one run, newest last.\n")
    with RESULTS.open("a") as f:
        f.write(text)
