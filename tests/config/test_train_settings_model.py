"""``policy.model_name`` is checked with the other keys, before Ray, Gym or a model starts: a built-in name or an
existing folder passes without being built, anything else is one line naming the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from gym_bridge.config.keys import TrainingConfigError
from gym_bridge.config.overrides import load_with_overrides
from gym_bridge.config.run_settings import grpo_run_settings
from gym_bridge.models import registry

DEMO = Path(__file__).resolve().parents[2] / "examples" / "grpo_nemo_gym.yaml"


def test_a_model_name_that_is_no_model_is_a_config_error_naming_the_key(tmp_path):
    missing = tmp_path / "no-such-model"
    config = load_with_overrides(DEMO, [f"policy.model_name={missing}"])
    with pytest.raises(TrainingConfigError) as raised:
        grpo_run_settings(config)
    message = str(raised.value)
    assert message.startswith("policy.model_name: ") and str(missing) in message
    assert len(message.splitlines()) == 1


def test_a_built_in_name_or_a_folder_passes_without_building_or_loading_a_model(tmp_path, monkeypatch):
    def refuse() -> Path:
        raise AssertionError("the settings check built a model")

    monkeypatch.setitem(registry.BUILTIN_MODELS, "smollm2", refuse)
    assert grpo_run_settings(load_with_overrides(DEMO, [])).served_model_name == "smollm2"
    folder = tmp_path / "weights"
    folder.mkdir()  # an empty folder: the check looks for it, loading it is the engine's job
    assert grpo_run_settings(load_with_overrides(DEMO, [f"policy.model_name={folder}"])).policy.model == str(folder)


def test_train_with_a_missing_model_is_one_line_and_exit_2_before_ray_starts(tmp_path, capsys, monkeypatch):
    from gym_bridge import ray_utils
    from gym_bridge.cli import main

    def no_ray(**_: object) -> None:
        raise AssertionError("gym-bridge train started Ray")

    monkeypatch.setattr(ray_utils, "init_ray", no_ray)
    missing = tmp_path / "no-such-model"
    run = tmp_path / "run"
    assert main(["train", str(DEMO), f"policy.model_name={missing}", "--out", str(run)]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("gym-bridge train: policy.model_name: ") and str(missing) in line
    assert not run.exists(), "nothing started"
