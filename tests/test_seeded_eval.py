"""``gym-bridge eval`` with a seed, run twice in subprocesses (real Ray, real Gym, the embedded tiny model
sampling at temperature 1): the same completions, token for token, although the second run sends one
group at a time and the first four, so rows meet other rows in the engine's decode batches.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from gym_bridge.eval.store import read_jsonl

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "eval_equivalence_tools.yaml"

pytestmark = [pytest.mark.gym, pytest.mark.e2e, pytest.mark.slow]


def run_eval(folder: Path, *overrides: str) -> dict[int, list[list[str]]]:
    """Run the example on the tiny model; return each prompt's completions as their generated token lists."""
    env = {**os.environ, "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0", "RAY_USAGE_STATS_ENABLED": "0"}
    args = ["eval", str(EXAMPLE), f"output_dir={folder}", "embedded_policy=tiny", "num_generations_per_prompt=2",
            "max_new_tokens=24", "temperature=1.0", *overrides, "--no-progress"]  # fmt: skip
    done = subprocess.run([sys.executable, "-m", "gym_bridge.cli", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return {
        line["prompt_idx"]: [
            [token for turn in c["trace"] if turn["role"] == "assistant" for token in turn["tokens"]]
            for c in line["completions"]
        ]
        for line in read_jsonl(folder / "results.jsonl")
    }


@pytest.mark.timeout(1200)
def test_an_eval_run_twice_with_one_seed_gives_identical_completions(tmp_path: Path) -> None:
    first = run_eval(tmp_path / "a", "seed=11", "concurrency=4")
    second = run_eval(tmp_path / "b", "seed=11", "concurrency=1")
    assert sorted(first) == list(range(6))
    assert first == second
    differing = sum(len({tuple(t) for t in samples}) == len(samples) for samples in first.values())
    assert differing >= 5, "the samples of a group have seeds of their own and should differ"
