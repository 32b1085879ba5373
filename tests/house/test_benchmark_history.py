"""``benchmarks/results_file.publish``: a benchmark's run goes to ``history/<date>-<topic>.md`` (one section per
run, appended in order) and never to ``RESULTS.md``, the table of current answers."""

from __future__ import annotations

import ast
import importlib.util
import re
from datetime import date
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"


@pytest.fixture(scope="module")
def results_file() -> ModuleType:
    spec = importlib.util.spec_from_file_location("results_file", BENCHMARKS / "results_file.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_publish_appends_each_run_to_the_dated_topic_file_and_leaves_results_alone(results_file, tmp_path, capsys):
    history = tmp_path / "history"
    results = tmp_path / "RESULTS.md"
    results.write_text("# Benchmark results\n\n| question | current answer |\n")
    day = date(2026, 11, 27)
    first = results_file.publish("\n## Bridge throughput, run 1\n", topic="bridge-throughput", day=day, folder=history)
    second = results_file.publish("\n## Bridge throughput, run 2\n", topic="bridge-throughput", day=day, folder=history)
    assert first == second == history / "2026-11-27-bridge-throughput.md"
    text = first.read_text()
    assert text.startswith("# Bridge throughput, 2026-11-27\n") and "](../RESULTS.md)" in text
    assert text.index("run 1") < text.index("run 2") and text.count("## Bridge throughput") == 2
    assert "run 1" in capsys.readouterr().out, "the section is printed too"
    other = results_file.publish("\n## Two nodes\n", topic="two-node-cluster", day=date(2026, 11, 28), folder=history)
    assert other == history / "2026-11-28-two-node-cluster.md" and "run 1" not in other.read_text()
    assert results.read_text() == "# Benchmark results\n\n| question | current answer |\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["RESULTS.md", "history"]


def test_publish_without_write_prints_only_and_a_topic_is_a_slug(results_file, tmp_path):
    assert results_file.publish("\n## x\n", topic="x", write=False, folder=tmp_path / "history") is None
    assert not (tmp_path / "history").exists()
    for bad in ("../RESULTS", "Bridge throughput", ""):
        with pytest.raises(ValueError, match="slug"):
            results_file.publish("\n## x\n", topic=bad, folder=tmp_path / "history")


def test_every_benchmark_names_its_topic():
    """Each caller passes a topic (a call without one fails only when the benchmark finishes, hours in)."""
    callers = []
    for path in sorted(BENCHMARKS.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "publish":
                callers.append(path.name)
                assert any(k.arg == "topic" for k in node.keywords), f"{path.name}:{node.lineno} names no topic"
    assert len(callers) >= 9


WORK_COUNTER = re.compile(r"\bsessions?[ _-]?\d+|\bround \d+|\bissue #?\d+|\bs\d{1,2}[-_]", re.IGNORECASE)
"""An internal work counter ("session 17", "session-16", "round 3", "issue 43", "s17-..."): a newcomer cannot look it
up, so history and docs cite the commit and date instead. Other projects' issues stay (``NeMo-RL#3201``)."""


def test_history_and_docs_cite_commits_and_dates_not_work_counters():
    names = [p.name for p in (BENCHMARKS / "history").glob("*.md")]
    assert names and all(re.fullmatch(r"\d{4}-\d{2}-\d{2}-[a-z0-9.]+(-[a-z0-9.]+)*\.md", n) for n in names), names
    named_by_counter = [n for n in names if WORK_COUNTER.search(n) or WORK_COUNTER.search(n.replace("-", " "))]
    assert not named_by_counter, f"history files named by a work counter: {named_by_counter}"
    pages = [ROOT / "README.md", *BENCHMARKS.glob("*.md"), *(BENCHMARKS / "history").glob("*.md")]
    pages += (ROOT / "docs").rglob("*.md")
    found = [
        f"{page.relative_to(ROOT)}:{n}: {m.group(0)!r}"
        for page in pages
        for n, line in enumerate(page.read_text().splitlines(), 1)
        for m in WORK_COUNTER.finditer(line)
    ]
    assert not found, "cite the commit and date instead of:\n" + "\n".join(found)
