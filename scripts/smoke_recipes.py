"""``gym-bridge train RECIPE --smoke`` over every Gym recipe of a NeMo-RL checkout, one line of result each.

    make smoke-recipes NEMO_RL_SRC=/path/to/NeMo-RL
    uv run python scripts/smoke_recipes.py --nemo-rl-src /path/to/NeMo-RL [--only grpo_nanov3] [--timeout 1500]

Each ``examples/nemo_gym/**/*.yaml`` of the checkout (the subfolders' recipes too) runs as a user would run it: ``gym-bridge train RECIPE --smoke``
with no other override, in a temporary working directory (nothing is written into the checkout), one recipe after
another. A recipe whose training file is missing here gets the example rows the installed nemo-gym ships for its
first agent (the smoke table says so). The result is "ran a step" (the run's first training line was written), or
the one-line reason the command gave (an environment nemo-gym does not ship, a trainer feature gym-bridge refuses,
a file that is not a training recipe, an external service). The table is printed as markdown and written to
``--report`` (docs/training.md holds the last one). Exit status: 0 when the script ran, whatever the recipes did.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

PREFIX = "gym-bridge train: "


@dataclass
class Result:
    recipe: str
    outcome: str
    seconds: float
    changed: str = ""
    """What ``--smoke`` changed: its table's title counts (``19 key(s) changed, 4 GPU-only key(s) ignored``)."""


def smoke_counts(stdout: str) -> str:
    """The counts of the smoke table the command printed, or "" when it printed none."""
    title = next((line for line in stdout.splitlines() if line.startswith("--smoke: ")), "")
    return title.removeprefix("--smoke: ").split(";", 1)[0]


def reason(stdout: str, stderr: str, returncode: int) -> str:
    """The command's one-line reason: its error line (``gym-bridge train: ...``), else the last line of a traceback."""
    errors = [line.removeprefix(PREFIX) for line in stderr.splitlines() if line.startswith(PREFIX)]
    raised = [line.strip() for line in errors if re.match(r"\s*[\w.]+(Error|Exception): ", line)]
    if errors and raised:  # a server's traceback quoted from its log: its first line and the exception it ends in
        return f"{errors[0]} ... {raised[-1]}"
    if errors:
        return " / ".join(errors[:3])
    lines = [line for line in (stderr or stdout).splitlines() if line.strip()]
    return lines[-1].strip() if lines else f"exit status {returncode}, no output"


def run_recipe(recipe: Path, name: str, timeout: float, keep: Path | None) -> Result:
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="smoke-recipe-") as work:
        run_dir = Path(work) / "run"
        command = [sys.executable, "-m", "gym_bridge.cli", "train", str(recipe), "--smoke", "--out", str(run_dir)]
        try:
            done = subprocess.run(
                [*command, "--no-progress"], cwd=work, capture_output=True, text=True, timeout=timeout, check=False
            )
        except subprocess.TimeoutExpired:
            return Result(name, f"did not finish in {timeout:.0f} s", time.monotonic() - started)
        seconds = time.monotonic() - started
        if keep is not None:
            keep.mkdir(parents=True, exist_ok=True)
            (keep / f"{name.replace('/', '--').removesuffix('.yaml')}.log").write_text(
                done.stdout + "\n--- stderr ---\n" + done.stderr
            )
        changed = smoke_counts(done.stdout)
        metrics = run_dir / "metrics.jsonl"
        lines = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
        trained = [line for line in lines if line.get("kind") == "train"]
        if done.returncode == 0 and trained:
            first = trained[0]
            update = (
                "no update: every reward equal"
                if first.get("train/skipped_zero_advantage")
                else f"loss {first.get('train/loss', float('nan')):.3g}"
            )
            return Result(
                name,
                f"ran a step ({first.get('train/samples', '?')} samples, reward "
                f"{first.get('train/mean_reward', 0.0):.3f}, {update})",
                seconds,
                changed,
            )
        return Result(name, reason(done.stdout, done.stderr, done.returncode), seconds, changed)


REPO = Path(__file__).resolve().parents[1]


def table(results: list[Result], source: str) -> str:
    """The results as a markdown table (paths inside this checkout, such as the venv's Gym rows, made relative)."""
    rows = [
        f"| `{r.recipe}` | {r.outcome.replace(f'{REPO}/', '').replace('|', '/')} | {r.changed} | {r.seconds:.0f} |"
        for r in results
    ]
    header = ["| recipe | result | --smoke changed | s |", "|---|---|---|---|"]
    return "\n".join([f"`gym-bridge train RECIPE --smoke` over {source}:", "", *header, *rows])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nemo-rl-src", required=True, type=Path, help="a NeMo-RL checkout")
    parser.add_argument(
        "--only",
        default="",
        help="comma-separated recipe stems or paths under examples/nemo_gym without .yaml (default: every one)",
    )
    parser.add_argument("--timeout", type=float, default=1500.0, help="seconds for each recipe")
    parser.add_argument("--report", type=Path, default=None, help="also write the markdown table here")
    parser.add_argument("--logs", type=Path, default=None, help="keep each run's output in this folder")
    args = parser.parse_args(argv)
    folder = args.nemo_rl_src / "examples" / "nemo_gym"
    recipes = sorted(folder.rglob("*.yaml"), key=lambda r: (len(r.relative_to(folder).parts), str(r)))
    if args.only:
        wanted = set(args.only.split(","))
        recipes = [r for r in recipes if r.stem in wanted or str(r.relative_to(folder).with_suffix("")) in wanted]
    if not recipes:
        print(f"smoke-recipes: no recipes in {folder}", file=sys.stderr)
        return 2
    os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    results = []
    for recipe in recipes:
        name = str(recipe.relative_to(folder))
        print(f"{name} ...", file=sys.stderr, flush=True)
        result = run_recipe(recipe.resolve(), name, args.timeout, args.logs)
        print(f"  {result.outcome} ({result.seconds:.0f} s)", file=sys.stderr, flush=True)
        results.append(result)
    commit = subprocess.run(
        ["git", "-C", str(args.nemo_rl_src), "rev-parse", "--short", "HEAD"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    text = table(results, f"NeMo-RL {commit or args.nemo_rl_src} `examples/nemo_gym/**/*.yaml`")
    print(text)
    if args.report is not None:
        args.report.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
