"""Reading a NeMo-RL-style training config into the NeMo-Gym rollout layer's settings."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from gym_bridge.rollout.training_config import TrainingConfigError, nemo_gym_config_from, should_use_nemo_gym

EXAMPLE = Path(__file__).parents[1] / "examples" / "nemo_gym_grpo.yaml"


def example() -> dict:
    return yaml.safe_load(EXAMPLE.read_text())


def test_the_example_config_asks_for_nemo_gym():
    config = example()
    assert should_use_nemo_gym(config)
    assert should_use_nemo_gym({"env": {"should_use_nemo_gym": True}})
    assert not should_use_nemo_gym({"env": {}})


def test_env_nemo_gym_splits_into_actor_fields_and_gym_overrides():
    config = example()
    config["env"]["nemo_gym"].update(
        {"request_timeout_s": 30, "on_drift": "truncate", "policy_api_key": "x", "overrides": {"a": 1}}
    )
    gym = nemo_gym_config_from(config, base_urls=["http://127.0.0.1:9/v1"])
    assert gym.model_name == "tiny" and gym.base_urls == ["http://127.0.0.1:9/v1"]
    assert gym.config_paths == example()["env"]["nemo_gym"]["config_paths"]
    assert gym.request_timeout_s == 30 and gym.on_drift == "truncate"
    assert gym.overrides == {"a": 1, "policy_api_key": "x"}  # unknown keys go to Gym's global config
    assert "rollout_timeout_s" not in gym.overrides and "max_row_attempts" not in gym.overrides


@pytest.mark.parametrize(
    ("edit", "needle"),
    [
        (lambda c: c["env"]["nemo_gym"].pop("config_paths"), "env.nemo_gym.config_paths"),
        (lambda c: c["env"].pop("nemo_gym"), "env.nemo_gym"),
        (lambda c: c["policy"].pop("model_name"), "model name"),
    ],
)
def test_missing_keys_are_named(edit, needle):
    config = example()
    edit(config)
    with pytest.raises(TrainingConfigError, match=needle):
        nemo_gym_config_from(config, base_urls=["http://127.0.0.1:9/v1"])


def test_no_endpoint_is_an_error():
    with pytest.raises(TrainingConfigError, match="base_urls"):
        nemo_gym_config_from(example())
