"""Runs beside each other on one machine: two ``gym-bridge eval`` commands and a two-step ``gym-bridge train``
started at the same moment, each with its own Gym set, Ray and logs. Every one finishes; none waits on another's
port (each Gym set holds a port window of its own, and its launcher binds the head's port itself) or files.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
EVAL = REPO / "examples" / "eval_equivalence_tools.yaml"
TRAIN = REPO / "examples" / "grpo_nemo_gym.yaml"

pytestmark = [pytest.mark.gym, pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(1200)]


def _start(args: list[str], cwd: Path) -> subprocess.Popen[str]:
    env = {**os.environ, "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0", "RAY_USAGE_STATS_ENABLED": "0"}
    return subprocess.Popen(
        [sys.executable, "-m", "gym_bridge.cli", *args],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_two_evals_and_a_training_run_started_together_all_finish(tmp_path: Path) -> None:
    commands = {
        f"eval-{i}": (
            ["eval", str(EVAL), f"output_dir={tmp_path / f'eval-{i}'}", "num_generations_per_prompt=2"],
            tmp_path / f"cwd-eval-{i}",
        )
        for i in (1, 2)
    }
    train = [
        "train", str(TRAIN),
        "policy.model_name=tiny", "grpo.max_num_steps=2", "grpo.num_prompts_per_step=1",
        "grpo.num_generations_per_prompt=4", "grpo.use_dynamic_sampling=false", "grpo.val_at_start=false",
        "grpo.val_at_end=false", "grpo.val_period=0", "policy.train_micro_batch_size=4",
        "policy.logprob_batch_size=4", "--out", str(tmp_path / "train"),
    ]  # fmt: skip
    commands["train"] = (train, tmp_path / "cwd-train")
    started = time.monotonic()
    procs = {}
    for name, (args, cwd) in commands.items():
        cwd.mkdir()
        (cwd / "examples").symlink_to(REPO / "examples")  # the configs' relative data paths
        procs[name] = _start(args, cwd)
    outputs = {name: proc.communicate(timeout=1100) for name, proc in procs.items()}
    elapsed = time.monotonic() - started
    print(f"three runs side by side: {elapsed:.0f} s")
    for name, proc in procs.items():
        assert proc.returncode == 0, f"{name}: exit {proc.returncode}\n{outputs[name][1][-3000:]}"
    for i in (1, 2):
        lines = (tmp_path / f"eval-{i}" / "results.jsonl").read_text().splitlines()
        assert lines and all(len(json.loads(line)["completions"]) == 2 for line in lines)
    steps = [json.loads(line) for line in (tmp_path / "train" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in steps if m["kind"] == "train"] == [0, 1]
    # Each run wrote its own Gym logs in its run folder, none in its working directory, and no set had to start
    # again for a taken port.
    logs = {name: tmp_path / name for name in ("eval-1", "eval-2", "train")}
    for name, folder in logs.items():
        assert list((folder / "gym-logs").glob("**/_launcher.log")), f"{name}: no Gym logs of its own in {folder}"
        assert "starting again on other ports" not in outputs[name][1], name
    assert not (tmp_path / "cwd-train" / "gym-logs").exists(), "training's Gym logs are in its run folder"
