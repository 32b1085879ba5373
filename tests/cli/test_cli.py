"""The `gym-bridge` command, run as a user runs it."""

from __future__ import annotations

import subprocess
import sys

import pytest


def test_backends_lists_the_registry():
    out = subprocess.run(
        [sys.executable, "-m", "gym_bridge.cli", "backends"], capture_output=True, text=True, timeout=60, check=True
    ).stdout
    assert "native" in out and "gym_bridge.rollout.native:AsyncRolloutImpl" in out
    assert "nemo_gym" in out and "(gym-bridge " in out


def test_overrides_after_an_option_reach_the_command(tmp_path, capsys):
    """``eval CONFIG --resume key=value``: argparse before Python 3.13 leaves a key=value after an option
    unparsed; main() hands it to the command's overrides, and a stray option is still refused."""
    from gym_bridge.cli import main

    missing = tmp_path / "missing.yaml"
    assert main(["eval", str(missing), "--resume", "limit=2"]) == 2
    assert "missing.yaml" in capsys.readouterr().err  # the config was read: the override parsed
    assert main(["eval", str(missing), "--resume", "--bogus"]) == 2
    assert "unrecognized arguments: --bogus" in capsys.readouterr().err


def test_train_reads_nemo_rl_overrides_before_anything_starts(tmp_path, capsys):
    """``gym-bridge train``: NeMo-RL's override grammar over a config with ``defaults:`` and ``${...}``; a missing
    key, an unknown override and an unreadable file are each one line and exit 2, before Ray or a model starts."""
    from gym_bridge.cli import main
    from gym_bridge.config.overrides import load_with_overrides

    parent = tmp_path / "parent.yaml"
    parent.write_text("policy:\n  model_name: tiny\n  max_total_sequence_length: 64\n  max_new: ${policy.max_total_sequence_length}\n"
                      "grpo:\n  max_num_steps: 3\n  drop: 1\n")  # fmt: skip
    child = tmp_path / "child.yaml"
    child.write_text("defaults: parent.yaml\ngrpo:\n  max_num_steps: 1\n")
    config = load_with_overrides(child, ["policy.max_total_sequence_length=128", "+grpo.extra=[1,2]", "~grpo.drop"])
    assert config["policy"]["max_new"] == 128, "the interpolation sees the overridden value, as in NeMo-RL"
    assert config["grpo"] == {"max_num_steps": 1, "extra": [1, 2]}

    assert main(["train", str(child), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["gym-bridge train: the training config has no 'grpo.num_prompts_per_step' (NeMo-RL's GRPO recipes set it)"]
    assert main(["train", str(child), "grpo.max_num_stepz=2"]) == 2
    assert "+grpo.max_num_stepz" in capsys.readouterr().err
    assert main(["train", str(tmp_path / "missing.yaml")]) == 2
    assert "missing.yaml" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_metrics_lines_take_nemo_rl_names():
    from gym_bridge.training.loggers import nemo_rl_scalars

    step, scalars = nemo_rl_scalars({"kind": "train", "step": 0, "train/mean_reward": 0.5, "time/step_s": 2.0,
                                     "train/rollout_sha256": "ab", "train/refit": True, "loss/clip_fraction": 0.1})  # fmt: skip
    assert step == 1 and scalars == {"train/mean_reward": 0.5, "train/reward": 0.5, "timing/train/total_step_time": 2.0,
                                     "train/refit": 1.0, "loss/clip_fraction": 0.1}  # fmt: skip
    step, scalars = nemo_rl_scalars({"kind": "val", "step": 4, "val/accuracy": 0.25, "val/set2/accuracy": 0.5, "time/val_s": 3.0})
    assert step == 4 and scalars == {"validation/accuracy": 0.25, "validation/set2/accuracy": 0.5,
                                     "timing/validation/total_validation_time": 3.0}  # fmt: skip


def test_the_logger_section_refuses_what_would_leave_the_machine():
    from gym_bridge.config.keys import TrainingConfigError
    from gym_bridge.config.logger import logger_settings

    remote = {"logger": {"mlflow_enabled": True, "mlflow": {"tracking_uri": "https://mlflow.example.com"}}}
    with pytest.raises(TrainingConfigError, match="logger.mlflow.tracking_uri"):
        logger_settings(remote)
    with pytest.raises(TrainingConfigError, match="logger.swanlab_enabled"):
        logger_settings({"logger": {"swanlab_enabled": True}})
    local = logger_settings({"logger": {"mlflow_enabled": True, "mlflow": {"tracking_uri": "http://127.0.0.1:5000"},
                                        "tensorboard": {"log_dir": "ignored"}, "monitor_gpus": True}})  # fmt: skip
    assert local.mlflow.tracking_uri == "http://127.0.0.1:5000"
