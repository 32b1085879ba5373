"""NeMo-RL HEAD's config and actor-config surface: its keys read and honoured, or refused with one line."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from omegaconf import OmegaConf
from pydantic import ValidationError

from gym_bridge import NemoGymConfig, setup_nemo_gym_config, should_use_nemo_gym
from gym_bridge.config.grpo import loop_config_from
from gym_bridge.config.keys import TrainingConfigError
from gym_bridge.config.loading import load_training_config
from gym_bridge.config.nemo_rl_gym import nemo_rl_gym_config
from gym_bridge.config.training import nemo_gym_rollout_settings, unused_training_keys

DATA = Path(__file__).parents[1] / "data" / "nemo_rl_keys"
URLS = ["http://127.0.0.1:9/v1"]
NEMO_RL_PREFIXES = ("env.", "async_rl.", "grpo.async_grpo.")


def generation(backend: str = "vllm", **engine: bool) -> dict:
    key = {"vllm": "vllm_cfg", "dynamo": "vllm_cfg", "megatron": "mcore_generation_config"}.get(backend, "x")
    return {"backend": backend, key: engine}


def master(generation_config: dict, use: bool = True) -> SimpleNamespace:
    """NeMo-RL's master config shape: attribute access to sections that are mappings."""
    return SimpleNamespace(env={"should_use_nemo_gym": use}, policy={"generation": generation_config})


def test_should_use_nemo_gym_takes_attribute_style_configs_with_nemo_rl_checks():
    assert should_use_nemo_gym(master(generation(async_engine=True, expose_http_server=True)))
    assert not should_use_nemo_gym(master(generation(), use=False))
    with pytest.raises(TrainingConfigError, match=r"set policy.generation.vllm_cfg.async_engine: true"):
        should_use_nemo_gym(master(generation(expose_http_server=True)))
    with pytest.raises(TrainingConfigError, match=r"policy.generation.vllm_cfg.expose_http_server: true"):
        should_use_nemo_gym(master(generation(async_engine=True)))
    with pytest.raises(TrainingConfigError, match=r"mcore_generation_config.expose_http_server"):
        should_use_nemo_gym(master(generation("megatron")))
    dict_config = OmegaConf.create(
        {"env": {"should_use_nemo_gym": True}, "policy": {"generation": generation("dynamo", expose_http_server=True)}}
    )
    assert should_use_nemo_gym(dict_config)
    assert should_use_nemo_gym({"use_nemo_gym": True})  # ours: no NeMo-RL engine named, nothing to check


def test_setup_nemo_gym_config_prepares_the_engine_as_nemo_rl_does():
    config = master({"backend": "vllm", "stop_strings": ["\n"], "stop_token_ids": [2], "vllm_cfg": {}})
    config.policy.update(is_vlm=True, tokenizer={"name": "some/vlm"})
    setup_nemo_gym_config(config, tokenizer=None)
    gen = config.policy["generation"]
    assert gen["vllm_cfg"] == {"async_engine": True, "expose_http_server": True}
    assert gen["stop_strings"] is None and gen["stop_token_ids"] is None
    assert config.env["nemo_gym"]["tokenizer_config"] == {"name": "some/vlm"}
    assert should_use_nemo_gym(config)


@pytest.fixture
def every_key(monkeypatch) -> dict:
    monkeypatch.setenv("GYM_TEST_CACHE", "/cache")
    return load_training_config(DATA / "every_gym_key.yaml")


def test_resolvers_defaults_and_override_sections_load_as_nemo_rl_loads_them(every_key):
    assert every_key["policy"]["generation"]["max_new_tokens"] == 256  # ${div:1024,4}, from the parent
    assert every_key["grpo"]["num_generations_per_prompt"] == 16  # ${mul:2,8}
    assert every_key["grpo"]["num_prompts_per_step"] == 8  # merged from the parent
    assert every_key["env"]["nemo_gym"]["uv_venv_dir"] == "/cache/gym_venvs"
    assert "math" not in every_key["env"] and "_override_" not in every_key["env"]  # replaced, not merged


def test_every_nemo_rl_gym_key_is_read_and_honoured(every_key):
    settings = nemo_gym_rollout_settings(every_key, base_urls=URLS)
    assert not [key for key in unused_training_keys(every_key) if key.startswith(NEMO_RL_PREFIXES)]

    policy, timeouts = settings.launch.retry_policy, settings.launch.timeouts
    assert (timeouts.rollout_s, policy.max_gym_row_attempts) == (900.0, 5)
    assert (policy.max_infra_attempts, policy.max_data_attempts, policy.max_skipped_prompts) == (4, 2, 1)
    assert policy.max_consecutive_dropped_prompts == 3  # grpo.async_grpo.max_generation_failures, async on
    assert settings.launch.mask_env_flagged_samples is False
    assert settings.log_full_result_tables and settings.log_nemo_gym_responses
    assert settings.is_trajectory_collection is False
    assert settings.effort_levels == {"low_string": "/low", "low_weight": 0.5}
    assert settings.reward_penalties == {"penalize_empty_final_answer": True}
    assert settings.async_grpo.max_trajectory_age_steps == 2 and settings.async_grpo.in_flight_weight_updates
    gym = settings.launch.gym
    assert (gym.port_range_low, gym.port_range_high) == (15000, 15999)
    assert gym.servers_config().overrides["port_range_low"] == 15000
    assert gym.invalid_tool_call_patterns == ("<tool_call>",)
    assert gym.overrides["global_aiohttp_connector_limit"] == 2048 and gym.overrides["num_gpu_nodes"] == 0
    for ours in ("is_trajectory_collection", "effort_levels", "port_range_low", "thinking_tags"):
        assert ours not in gym.overrides  # NeMo-RL's knobs never reach Gym's global config

    corrected = {"loss_fn": {"use_importance_sampling_correction": True}}
    loop = loop_config_from({"grpo": {"num_prompts_per_step": 8}, **corrected}, settings)
    assert loop.async_rollouts and loop.max_trajectory_age_steps == 2 and loop.in_flight_weight_updates
    assert (loop.stall_timeout_s, loop.stall_action, loop.min_step_batch_fraction) == (1200.0, "abort", 0.75)
    assert loop_config_from({"grpo": {"use_dynamic_sampling": False, "overlong_filtering": False}, **corrected},
                            settings)
    # NeMo-RL's async_grpo_train asserts the correction, and applies no dynamic sampling: both refused in one line.
    with pytest.raises(TrainingConfigError, match=r"need loss_fn.use_importance_sampling_correction: true"):
        loop_config_from({"grpo": {"num_prompts_per_step": 8}}, settings)
    with pytest.raises(TrainingConfigError, match=r"grpo.use_dynamic_sampling: true with async rollouts"):
        loop_config_from({"grpo": {"use_dynamic_sampling": True}, **corrected}, settings)


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"async_rl": {"rollout_failure": {"on_dropped_prompt": "replace"}}}, "on_dropped_prompt: replace is not"),
        ({"async_rl": {"rollout_failure": {"max_attempts_per_prompt": 3}}}, "max_attempts_per_prompt -> .*max_infra"),
        ({"grpo": {"async_grpo": {"max_trajectory_age_step": 2}}}, "grpo.async_grpo.max_trajectory_age_step"),
        (
            {
                "async_rl": {"rollout_failure": {"nemo_gym": {"max_row_attempts": 5}}},
                "env": {"nemo_gym": {"max_row_attempts": 2}},
            },
            "env.nemo_gym.max_row_attempts and async_rl.rollout_failure.nemo_gym.max_row_attempts both set",
        ),
    ],
)
def test_what_cannot_be_honoured_is_refused_in_one_line(every_key, section, message):
    config = OmegaConf.to_container(OmegaConf.merge(every_key, section))
    with pytest.raises(TrainingConfigError, match=message):
        nemo_gym_rollout_settings(config, base_urls=URLS)


def test_nemo_rl_gym_config_takes_env_configs_as_nemo_rl_spins_them_up():
    env = {
        "nemo_gym": {
            "config_paths": ["a.yaml"],
            "thinking_tags": None,
            "invalid_tool_call_patterns": ["<bad>"],
            "port_range_low": 16000,
            "port_range_high": 16999,
            "some_agent": {"x": 1},
        }
    }
    config = nemo_rl_gym_config(
        env, URLS, "policy", enable_router_replay=False, routed_experts_dtype="int8", use_fastokens=False
    )
    assert config.config_paths == ["a.yaml"] and config.overrides == {"some_agent": {"x": 1}}
    assert config.thinking_tags == ("<think>", "</think>") and config.invalid_tool_call_patterns == ("<bad>",)
    assert (config.model_name, config.base_urls, config.port_range_low) == ("policy", URLS, 16000)
    assert env["nemo_gym"]["thinking_tags"] is None  # the caller's section is not changed
    with pytest.raises(ValidationError, match="require_routed_experts is not supported: router replay"):
        nemo_rl_gym_config(env, URLS, "p", enable_router_replay=True, routed_experts_dtype="int16", use_fastokens=False)
    with pytest.raises(ValidationError, match="use_fastokens is not supported"):
        nemo_rl_gym_config(env, URLS, "p", enable_router_replay=False, routed_experts_dtype="int16", use_fastokens=True)


def test_nemo_gym_config_accepts_nemo_rls_typed_dict_shape():
    config = NemoGymConfig.model_validate(
        {
            "model_name": "m",
            "base_urls": URLS,
            "initial_global_config_dict": {"config_paths": ["b.yaml"], "policy_model_reasoning_off": {"x": 2}},
            "require_routed_experts": False,
            "routed_experts_dtype": "int32",
            "use_fastokens": False,
            "tokenizer_config": None,
            "pad_dynamic_image_shapes": False,
        }
    )
    assert config.config_paths == ["b.yaml"] and config.overrides == {"policy_model_reasoning_off": {"x": 2}}
    for bad, message in (
        ({"tokenizer_config": {"name": "vlm"}}, "tokenizer_config is not supported"),
        ({"pad_dynamic_image_shapes": True}, "pad_dynamic_image_shapes is not supported"),
        ({"routed_experts_dtype": "int4"}, "routed_experts_dtype must be one of int8, int16, int32"),
        ({"port_range_low": 5000}, "set port_range_low and port_range_high together"),
    ):
        with pytest.raises(ValidationError, match=message):
            NemoGymConfig(model_name="m", base_urls=URLS, **bad)
