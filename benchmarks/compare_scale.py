"""``gym-bridge compare`` at scale: two runs of 20,000 and of 200,000 prompts (target: under a minute and under
2 GB on two cores), timed and measured as a user runs it (the CLI in a fresh interpreter), and the statistics
alone (paired bootstrap with 10,000 resamples and McNemar's exact test, per agent and overall).

The run folders are written into a temporary folder: every prompt has 4 completions with binary rewards (and,
with ``--continuous``, rewards in [0, 1] with many distinct values, the bootstrap's slow path), three agents,
row ids, and each completion a Gym result holding the prompt (what compare previews). Run B fixes about a fifth
of A's failures and breaks a tenth of its passes, so both McNemar counts are large (the case that took minutes).

    uv run python benchmarks/compare_scale.py [--sizes 20000 200000] [--continuous] [--write]

Peak memory is the compare process's maximum resident set (``getrusage`` of the child), imports included.
Prints one Markdown section; ``--write`` appends it to ``benchmarks/history/<date>-compare-at-scale.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

from results_file import git_revision, publish, verdict

from gym_bridge.eval.records import row_id

AGENTS = ("math_agent", "tool_agent", "judge_agent")
N = 4
TARGET_S = 60.0
TARGET_BYTES = 2 << 30


def write_runs(root: Path, prompts: int, *, continuous: bool, seed: int = 0) -> tuple[Path, Path]:
    """Two finished run folders over the same ``prompts`` rows: A, and B that fixes and breaks some of them."""
    rng = random.Random(seed)
    folders = (root / f"a-{prompts}", root / f"b-{prompts}")
    files = []
    for folder in folders:
        folder.mkdir(parents=True)
        meta = {"fingerprint": {"dataset_sha256": "scale", "config_paths": ["a.yaml"], "gym_overrides": {}},
                "config": {"pass_threshold": 1.0 if not continuous else 0.5}, "model": folder.name}  # fmt: skip
        (folder / "run.json").write_text(json.dumps(meta))
        files.append((folder / "results.jsonl").open("w"))
    try:
        for i in range(prompts):
            agent = AGENTS[i % len(AGENTS)]
            prompt = {"input": [{"role": "user", "content": f"Question {i}: what is {i} + {i}?"}]}
            row = {"responses_create_params": prompt, "agent_ref": {"name": agent}}
            skill = rng.random()
            a = [_reward(rng, skill, continuous) for _ in range(N)]
            shift = 0.2 if rng.random() < 0.6 else -0.1
            b = [_reward(rng, min(1.0, max(0.0, skill + shift)), continuous) for _ in range(N)]
            for f, rewards in zip(files, (a, b), strict=True):
                line = {"prompt_idx": i, "row_id": row_id(row), "line": i + 1, "agent": agent,
                        "completions": [{"reward": r, "gym_result": {"responses_create_params": prompt}}
                                        for r in rewards]}  # fmt: skip
                f.write(json.dumps(line) + "\n")
    finally:
        for f in files:
            f.close()
    return folders


def _reward(rng: random.Random, skill: float, continuous: bool) -> float:
    if continuous:
        return round(min(1.0, max(0.0, rng.gauss(skill, 0.2))), 6)
    return 1.0 if rng.random() < skill else 0.0


def run_cli(a: Path, b: Path, out: Path) -> tuple[float, int, str]:
    """Wall time, peak RSS (bytes) and stderr of ``gym-bridge compare A B`` in a fresh interpreter."""
    probe = (
        "import resource, subprocess, sys, time\n"
        "t = time.perf_counter()\n"
        "done = subprocess.run(sys.argv[1:], capture_output=True, text=True)\n"
        "wall = time.perf_counter() - t\n"
        "peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024\n"
        "print(wall, peak, done.returncode)\n"
        "sys.stderr.write(done.stderr)\n"
    )
    cmd = [sys.executable, "-m", "gym_bridge.cli", "compare", str(a), str(b), "--out", str(out)]
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    done = subprocess.run([sys.executable, "-c", probe, *cmd], capture_output=True, text=True, env=env, check=True)
    wall, peak, code = done.stdout.split()
    if code != "0":
        raise SystemExit(f"compare failed ({code}): {done.stderr[-2000:]}")
    return float(wall), int(peak), done.stderr


def stats_alone(a: Path, b: Path) -> tuple[float, float]:
    """Seconds of the statistics over the whole run: (paired bootstrap of every metric, McNemar) per agent + all."""
    import numpy as np

    from gym_bridge.eval.runs import load_run
    from gym_bridge.stats import mcnemar_exact, paired_bootstrap

    ra, rb = load_run(a), load_run(b)
    keys = [g.key for g in ra.groups]
    xa = np.array([[float(np.mean(ra.by_key[k].rewards)), float(np.mean(ra.by_key[k].rewards) >= 0.5)] for k in keys])
    xb = np.array([[float(np.mean(rb.by_key[k].rewards)), float(np.mean(rb.by_key[k].rewards) >= 0.5)] for k in keys])
    t = time.perf_counter()
    paired_bootstrap((xb - xa).T, seed=0)
    boot_s = time.perf_counter() - t
    t = time.perf_counter()
    result = mcnemar_exact((xa[:, 1] >= 0.5).tolist(), (xb[:, 1] >= 0.5).tolist())
    mcnemar_s = time.perf_counter() - t
    assert result.wrong_to_right > 1_000 or len(keys) < 20_000, result
    return boot_s, mcnemar_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[20_000, 200_000])
    parser.add_argument("--continuous", action="store_true", help="rewards in [0, 1] with many distinct values")
    parser.add_argument("--write", action="store_true", help="append the section to history/<date>-compare-at-scale.md")
    args = parser.parse_args()

    root = Path(tempfile.mkdtemp(prefix="bench-compare-scale-"))
    rows = []
    try:
        for prompts in args.sizes:
            t = time.perf_counter()
            a, b = write_runs(root, prompts, continuous=args.continuous)
            write_s = time.perf_counter() - t
            size_mb = (a / "results.jsonl").stat().st_size / 1e6
            wall, peak, _ = run_cli(a, b, root / f"out-{prompts}")
            report = json.loads((root / f"out-{prompts}" / "compare.json").read_text())
            overall = report["comparisons"][0]["agents"]["all"]["mcnemar"]
            boot_s, mcnemar_s = stats_alone(a, b)
            ok = wall < TARGET_S and peak < TARGET_BYTES
            rows.append(
                f"| {prompts:,} x {N} ({size_mb:.0f} MB each; written in {write_s:.0f} s) | {wall:.1f} s | "
                f"{peak / 2**20:,.0f} MiB | {boot_s:.2f} s | {mcnemar_s:.3f} s ({overall['fixed']:,} fixed, "
                f"{overall['broken']:,} broken) | {verdict(ok)} |"
            )
            shutil.rmtree(a)
            shutil.rmtree(b)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    rewards = "rewards in [0, 1], many distinct values" if args.continuous else "binary rewards"
    section = "\n".join(
        [
            f"\n## compare at scale ({rewards}), {date.today()} ({platform.machine()}, {os.cpu_count()} cores, "
            f"Python {platform.python_version()}, {git_revision()})\n",
            "`benchmarks/compare_scale.py`: `gym-bridge compare A B` in a fresh interpreter (read, check, statistics "
            "per agent and overall with 10,000 resamples, md + json + png); peak = the process's max RSS.",
            "",
            "| prompts per run | compare (wall) | peak memory | bootstrap alone (overall, 2 metrics) | McNemar alone | "
            "target (< 60 s, < 2 GiB) |",
            "|---|---|---|---|---|---|",
            *rows,
            "",
        ]
    )
    publish(section, topic="compare-at-scale", write=args.write)
    print(f"max RSS of this process: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")


if __name__ == "__main__":
    main()
