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


NEMO_RL_YAML = Path(__file__).parent / "data" / "nemo_rl_grpo_nemo_gym.yaml"
NEMO_RL_CHILD = Path(__file__).parent / "data" / "nemo_rl_grpo_nemo_gym_child.yaml"
URLS = ["http://127.0.0.1:9/v1"]


def test_a_nemo_rl_grpo_yaml_with_stop_strings_loads_unchanged(caplog):
    import logging

    from gym_bridge.rollout.nemo_gym import AsyncNemoGymRolloutImpl
    from gym_bridge.rollout.training_config import load_training_config, nemo_gym_rollout_settings

    config = load_training_config(NEMO_RL_YAML)
    assert config["policy"]["generation"]["stop_strings"] == ["</answer>"]  # set, as a user wrote it
    with pytest.raises(ValueError, match="stop_strings, stop_token_ids"):  # what the backend alone would say
        AsyncNemoGymRolloutImpl(None, {"nemo_gym": object()}, 4, 1024, generation_config=config["policy"]["generation"])

    with caplog.at_level(logging.DEBUG, logger="gym_bridge.rollout.training_config"):
        settings = nemo_gym_rollout_settings(config, base_urls=URLS)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "stop_strings=['</answer>']" in warnings[0].getMessage() and "stop_token_ids=[2]" in warnings[0].getMessage()
    unused = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG and "does not use" in r.getMessage()]
    assert len(unused) == 1
    for key in ("loss_fn.ratio_clip_min", "checkpointing.keep_top_k", "policy.dtensor_cfg.enabled",
                "policy.generation.vllm_cfg.async_engine", "grpo.max_rollout_turns", "cluster.num_nodes"):
        assert key in unused[0]
    for key in ("env.should_log_nemo_gym_responses", "env.nemo_gym.is_trajectory_collection"):
        assert key not in unused[0]  # read into the settings
    assert "grpo.num_generations_per_prompt" not in unused[0] and "env.nemo_gym.config_paths" not in unused[0]

    generation = settings.generation_config
    assert generation["stop_strings"] is None and generation["stop_token_ids"] is None
    assert generation["max_new_tokens"] == 1024  # ${policy.max_total_sequence_length} resolved
    assert settings.num_generations_per_prompt == 4 and settings.max_seq_len == 1024
    assert settings.max_row_attempts == 3 and settings.num_actors == 1 and settings.rollout_timeout_s is None
    gym = settings.gym
    assert gym.model_name == "tiny" and gym.base_urls == URLS and gym.thinking_tags == ("<think>", "</think>")
    assert gym.config_paths[1] == "resources_servers/equivalence_rule/configs/lc.yaml"
    assert gym.overrides == {
        "equivalence_rule_simple_agent": {"responses_api_agents": {"simple_agent": {"max_steps": 4}}}
    }  # NeMo-RL-only keys (is_trajectory_collection) never reach Gym
    backend = AsyncNemoGymRolloutImpl(None, {"nemo_gym": object()}, 4, 1024, generation_config=generation)
    assert backend.max_new_tokens == 1024


def test_an_unresolved_yaml_and_defaults_inheritance():
    from gym_bridge.rollout.training_config import load_training_config, nemo_gym_rollout_settings

    raw = yaml.safe_load(NEMO_RL_YAML.read_text())  # "${...}" left as strings
    assert raw["policy"]["generation"]["max_new_tokens"] == "${policy.max_total_sequence_length}"
    settings = nemo_gym_rollout_settings(raw, base_urls=URLS)
    assert settings.generation_config["max_new_tokens"] == 1024
    child = load_training_config(NEMO_RL_CHILD)
    assert child["policy"]["train_global_batch_size"] == 4 * 8  # ${mul:...} after the child's override
    settings = nemo_gym_rollout_settings(child, base_urls=URLS)
    assert settings.num_generations_per_prompt == 8 and settings.max_seq_len == 2048
    assert settings.generation_config["max_new_tokens"] == 2048


def test_a_config_that_does_not_ask_for_gym_is_refused():
    from gym_bridge.rollout.training_config import nemo_gym_rollout_settings

    config = example()
    config.pop("use_nemo_gym")
    with pytest.raises(TrainingConfigError, match="use_nemo_gym"):
        nemo_gym_rollout_settings(config, base_urls=URLS)
