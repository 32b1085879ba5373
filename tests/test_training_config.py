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


def test_actor_configs_share_or_split_endpoints(tmp_path):
    from gym_bridge.gym.actor import NemoGymConfig, actor_configs

    config = NemoGymConfig(model_name="m", base_urls=[f"http://h{i}:8000/v1" for i in range(3)], log_dir=tmp_path)
    assert actor_configs(config, 1) == [config]
    shared = actor_configs(config, 2)
    assert [c.base_urls for c in shared] == [config.base_urls] * 2
    assert [c.log_dir for c in shared] == [tmp_path / "actor-0", tmp_path / "actor-1"]
    split = actor_configs(config, 2, split_base_urls=True)
    assert [c.base_urls for c in split] == [["http://h0:8000/v1", "http://h2:8000/v1"], ["http://h1:8000/v1"]]
    with pytest.raises(ValueError, match="at least one endpoint per actor: 3 base_urls for 4 actors"):
        actor_configs(config, 4, split_base_urls=True)
