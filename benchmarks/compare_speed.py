"""How long ``gym-bridge compare`` takes on two 1,000-prompt runs (target: under 5 s on 2 cores), and how long the
trace viewer takes to open a 10,000-completion run in headless Chromium (target: under 5 s).

The runs are synthetic run folders shaped like ``gym-bridge eval``'s (``tests/viewer_support.py``: row ids, 4
completions per prompt, token traces with logprobs, tool calls, Gym results), so the files are as large as a
real run's. Compare is timed three ways: reading and checking both runs, the whole in-process call (statistics
with 10,000 paired bootstrap resamples, McNemar, the three output files), and the CLI as a user runs it (a
fresh interpreter: imports included). The viewer is timed from navigation start to the page's table being drawn
(``window.gymBridgeViewer.ready``), and as the WebDriver navigation call's wall time (load event included).

    uv run python benchmarks/compare_speed.py [--prompts 1000] [--viewer-completions 10000] [--no-browser]

Prints one Markdown section; ``--write`` appends it to ``benchmarks/history/<date>-compare-speed.md``.
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

from results_file import git_revision, publish, verdict

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from viewer_support import Chromium, synthetic_run  # noqa: E402

from gym_bridge.eval.compare import compare_runs  # noqa: E402
from gym_bridge.eval.runs import load_run  # noqa: E402
from gym_bridge.eval.viewer import build_viewer  # noqa: E402


def best_of(runs: int, fn) -> float:
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=1000)
    parser.add_argument("--n", type=int, default=4, help="completions per prompt")
    parser.add_argument("--viewer-completions", type=int, default=10_000)
    parser.add_argument("--no-browser", action="store_true")
    parser.add_argument("--write", action="store_true", help="append the section to history/<date>-compare-speed.md")
    args = parser.parse_args()

    root = Path(tempfile.mkdtemp(prefix="bench-compare-"))
    a = synthetic_run(root / "a", args.prompts, args.n, skill=0.5, seed=1)
    b = synthetic_run(root / "b", args.prompts, args.n, skill=0.6, seed=1)
    size_mb = (a / "results.jsonl").stat().st_size / 1e6
    read_s = best_of(3, lambda: (load_run(a), load_run(b)))
    inproc_s = best_of(3, lambda: compare_runs([a, b], root / "out"))
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    cli = [sys.executable, "-m", "gym_bridge.cli", "compare", str(a), str(b), "--out", str(root / "cli")]
    cli_s = best_of(2, lambda: subprocess.run(cli, check=True, capture_output=True, env=env))
    import_s = best_of(2, lambda: subprocess.run([sys.executable, "-c", "import gym_bridge.eval.compare"], check=True))

    rows = [
        f"| read and check both runs ({args.prompts} prompts x {args.n}, {size_mb:.1f} MB each) | {read_s:.2f} s | |",
        f"| `compare_runs` in process (10,000 resamples, md + json + png) | {inproc_s:.2f} s | "
        f"{verdict(inproc_s < 5)} (< 5 s) |",
        f"| `gym-bridge compare` CLI, fresh interpreter | {cli_s:.2f} s | {verdict(cli_s < 5)} (< 5 s) |",
        f"| of which `import gym_bridge.eval.compare` | {import_s:.2f} s | |",
    ]
    if not args.no_browser:
        prompts = args.viewer_completions // args.n
        big = synthetic_run(root / "big", prompts, args.n, skill=0.5, seed=2)
        t0 = time.perf_counter()
        page = build_viewer(big)
        build_s = time.perf_counter() - t0
        browser = Chromium()
        try:
            ready, nav = [], []
            for _ in range(3):
                t0 = time.perf_counter()
                browser.open(page.as_uri())
                nav.append(time.perf_counter() - t0)
                state = browser.run("return window.gymBridgeViewer")
                assert state["completions"] == prompts * args.n, state
                ready.append(state["ready"] / 1000)
            errors = [e for e in browser.console() if e.get("level") == "SEVERE"]
            assert not errors, errors
        finally:
            browser.close()
        page_mb = page.stat().st_size / 1e6
        rows += [
            f"| write report.html ({prompts * args.n} completions, {page_mb:.1f} MB) | {build_s:.2f} s | |",
            f"| viewer open: navigation start to table drawn (best of 3) | {min(ready):.2f} s | "
            f"{verdict(min(ready) < 5)} (< 5 s) |",
            f"| viewer open: WebDriver navigation wall time (best of 3) | {min(nav):.2f} s | |",
        ]
    section = "\n".join(
        [
            f"\n## compare and trace viewer speed, {date.today()} ({platform.machine()}, {os.cpu_count()} cores, "
            f"Python {platform.python_version()}, {git_revision()})\n",
            "| what | time | target |",
            "|---|---|---|",
            *rows,
            "",
        ]
    )
    publish(section, topic="compare-speed", write=args.write)


if __name__ == "__main__":
    main()
