"""Reading a NeMo-RL-style training config into the NeMo-Gym rollout layer's settings."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import yaml

from gym_bridge.config.keys import TrainingConfigError
from gym_bridge.config.nemo_rl_gym import should_use_nemo_gym
from gym_bridge.config.training import nemo_gym_config_from

EXAMPLE = Path(__file__).parents[2] / "examples" / "nemo_gym_grpo.yaml"


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
    from gym_bridge.gym.transport.actor_config import NemoGymConfig, actor_configs

    config = NemoGymConfig(model_name="m", base_urls=[f"http://h{i}:8000/v1" for i in range(3)], log_dir=tmp_path)
    assert actor_configs(config, 1) == [config]
    shared = actor_configs(config, 2)
    assert [c.base_urls for c in shared] == [config.base_urls] * 2
    assert [c.log_dir for c in shared] == [tmp_path / "actor-0", tmp_path / "actor-1"]
    split = actor_configs(config, 2, split_base_urls=True)
    assert [c.base_urls for c in split] == [["http://h0:8000/v1", "http://h2:8000/v1"], ["http://h1:8000/v1"]]
    with pytest.raises(ValueError, match="at least one endpoint per actor: 3 base_urls for 4 actors"):
        actor_configs(config, 4, split_base_urls=True)


NEMO_RL_YAML = Path(__file__).parents[1] / "data" / "nemo_rl_grpo_nemo_gym.yaml"
NEMO_RL_CHILD = Path(__file__).parents[1] / "data" / "nemo_rl_grpo_nemo_gym_child.yaml"
URLS = ["http://127.0.0.1:9/v1"]


def test_a_nemo_rl_grpo_yaml_with_stop_strings_loads_unchanged(caplog):
    import logging

    from gym_bridge.config.loading import load_training_config
    from gym_bridge.config.training import nemo_gym_rollout_settings
    from gym_bridge.rollout.nemo_gym import AsyncNemoGymRolloutImpl

    config = load_training_config(NEMO_RL_YAML)
    assert config["policy"]["generation"]["stop_strings"] == ["</answer>"]  # set, as a user wrote it
    with pytest.raises(ValueError, match="stop_strings, stop_token_ids"):  # what the backend alone would say
        AsyncNemoGymRolloutImpl(None, {"nemo_gym": object()}, 4, 1024, generation_config=config["policy"]["generation"])

    with caplog.at_level(logging.DEBUG, logger="gym_bridge.config.training"):
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

    generation = settings.launch.generation_config
    assert generation["stop_strings"] is None and generation["stop_token_ids"] is None
    assert generation["max_new_tokens"] == 1024  # ${policy.max_total_sequence_length} resolved
    assert settings.launch.num_generations_per_prompt == 4 and settings.launch.max_seq_len == 1024
    assert settings.launch.retry_policy.max_gym_row_attempts == 3 and settings.launch.num_actors == 1 and settings.launch.timeouts.rollout_s is None
    gym = settings.launch.gym
    assert gym.model_name == "tiny" and gym.base_urls == URLS and gym.thinking_tags == ("<think>", "</think>")
    assert gym.config_paths[1] == "resources_servers/equivalence_rule/configs/lc.yaml"
    assert gym.overrides == {
        "equivalence_rule_simple_agent": {"responses_api_agents": {"simple_agent": {"max_steps": 4}}}
    }  # NeMo-RL-only keys (is_trajectory_collection) never reach Gym
    backend = AsyncNemoGymRolloutImpl(None, {"nemo_gym": object()}, 4, 1024, generation_config=generation)
    assert backend.max_new_tokens == 1024


def test_an_unresolved_yaml_and_defaults_inheritance():
    from gym_bridge.config.loading import load_training_config
    from gym_bridge.config.training import nemo_gym_rollout_settings

    raw = yaml.safe_load(NEMO_RL_YAML.read_text())  # "${...}" left as strings
    assert raw["policy"]["generation"]["max_new_tokens"] == "${policy.max_total_sequence_length}"
    settings = nemo_gym_rollout_settings(raw, base_urls=URLS)
    assert settings.launch.generation_config["max_new_tokens"] == 1024
    child = load_training_config(NEMO_RL_CHILD)
    assert child["policy"]["train_global_batch_size"] == 4 * 8  # ${mul:...} after the child's override
    settings = nemo_gym_rollout_settings(child, base_urls=URLS)
    assert settings.launch.num_generations_per_prompt == 8 and settings.launch.max_seq_len == 2048
    assert settings.launch.generation_config["max_new_tokens"] == 2048


def test_a_config_that_does_not_ask_for_gym_is_refused():
    from gym_bridge.config.training import nemo_gym_rollout_settings

    config = example()
    config.pop("use_nemo_gym")
    with pytest.raises(TrainingConfigError, match="use_nemo_gym"):
        nemo_gym_rollout_settings(config, base_urls=URLS)


# ---- NeMo-RL HEAD's async_rl / grpo.async_grpo / master-config shapes ------------------------------------------


def gym_config(**sections: dict) -> dict:
    """The example config with NeMo-RL sections merged in (one level deep)."""
    config = example()
    config["env"]["nemo_gym"].pop("rollout_timeout_s")
    config["env"]["nemo_gym"].pop("max_row_attempts")
    for name, section in sections.items():
        config[name] = {**config.get(name, {}), **section}
    return config


def settings_of(config: dict):
    from gym_bridge.config.training import nemo_gym_rollout_settings

    return nemo_gym_rollout_settings(config, base_urls=URLS)


def test_async_rl_rollout_failure_becomes_nemo_rl_s_retry_policy_and_timeouts():
    from gym_bridge.failures import RolloutRetryPolicy, RolloutTimeouts

    failure = {
        "max_infra_attempts_per_prompt": 4,
        "backoff_base_s": 2.0,
        "nemo_gym": {"rollout_timeout_s": 900, "max_row_attempts": 5},
    }
    settings = settings_of(gym_config(async_rl={"rollout_failure": failure}))
    assert settings.launch.timeouts == RolloutTimeouts(rollout_s=900.0)
    assert settings.launch.retry_policy == RolloutRetryPolicy(
        max_infra_attempts=4, max_data_attempts=2, max_gym_row_attempts=5, backoff_base_s=2.0, max_backoff_s=30.0
    )  # NeMo-RL's RolloutFailureConfig defaults for the rest
    assert (settings.launch.timeouts.rollout_s, settings.launch.retry_policy.max_gym_row_attempts, settings.min_step_batch_fraction) == (900.0, 5, 0.9)
    assert settings_of(gym_config()).min_step_batch_fraction == 0.0  # no section: no floor


def test_the_dropped_prompt_budget_comes_from_either_section_but_not_two_different_values():
    failure = {"rollout_failure": {"max_consecutive_dropped_prompts": 2}}
    on = {"async_grpo": {"enabled": True}}
    assert settings_of(gym_config(async_rl=failure, grpo=on)).launch.retry_policy.max_consecutive_dropped_prompts == 2
    on_with_budget = {"async_grpo": {"enabled": True, "max_generation_failures": 4}}
    assert settings_of(gym_config(grpo=on_with_budget)).launch.retry_policy.max_consecutive_dropped_prompts == 4
    with pytest.raises(TrainingConfigError, match=r"max_generation_failures \(4\) and .*dropped_prompts \(2\)"):
        settings_of(gym_config(async_rl=failure, grpo=on_with_budget))


@pytest.mark.parametrize(
    ("async_rl", "message"),
    [
        ({"watchdog": {"stall_timeout_s": 60}}, r"async_rl\.watchdog -> async_rl\.stall_watchdog"),
        ({"rollout_timeout_s": 60}, r"async_rl\.rollout_timeout_s -> async_rl\.rollout_failure\.nemo_gym"),
        ({"rollout_failure": {"on_data_exhausted": "skip"}}, r"on_data_exhausted -> .*max_skipped_prompts"),
        ({"generation_router": {"enabled": True}}, r"generation_router\.enabled: true is not supported: gym-bridge"),
        ({"generation_fleet_health": {"enabled": True}}, r"generation_fleet_health\.enabled: true is not supported"),
        ({"diagnostics": True}, r"diagnostics: true is not supported"),
        ({"stall_watchdog": {"gym_subprocess_check": False}}, r"gym_subprocess_check: false is not supported"),
        ({"stall_watchdog": {"stall_timeout_s": 20, "interval_s": 30}}, r"must be > interval_s \(30.0\)"),
        (
            {"stall_watchdog": {"stall_timeout_s": 600}, "rollout_failure": {"nemo_gym": {"rollout_timeout_s": 900}}},
            r"stall_timeout_s \(600.0\) must be > async_rl\.rollout_failure\.nemo_gym\.rollout_timeout_s \(900.0\)",
        ),
        ({"rollout_failure": {"native": {"env_timeout_s": 5}}}, r"native\.env_timeout_s=5: this run uses the nemo_gym"),
        ({"samplr": {}}, r"async_rl\.samplr: Extra inputs are not permitted"),
    ],
)
def test_async_rl_settings_that_cannot_be_honoured_are_refused_in_one_line(async_rl, message):
    with pytest.raises(TrainingConfigError, match=message) as raised:
        settings_of(gym_config(async_rl=async_rl))
    assert "\n" not in str(raised.value)


def test_async_rl_stall_watchdog_and_the_single_controller_pump_keys(caplog):
    import logging

    from gym_bridge.config.async_settings import StallWatchdogSettings

    assert settings_of(gym_config()).async_rl.stall_watchdog == StallWatchdogSettings.off()
    pump = {
        "sampler": {"name": "in_order"},
        "max_inflight_prompts": 32,
        "recompute_kv_cache_after_weight_updates": True,
    }
    with caplog.at_level(logging.WARNING, logger="gym_bridge.config.training"):
        settings = settings_of(gym_config(async_rl={"stall_watchdog": {"stall_action": "abort"}, **pump}))
    assert (settings.async_rl.stall_watchdog.stall_timeout_s, settings.async_rl.stall_watchdog.interval_s) == (600.0, 30.0)  # NeMo-RL's
    assert settings.async_rl.stall_watchdog.stall_action == "abort" and settings.async_rl.recompute_kv_cache_after_weight_updates
    [warning] = [r.getMessage() for r in caplog.records]
    assert "async_rl.sampler, async_rl.max_inflight_prompts" in warning and "no effect" in warning


def test_attribute_style_master_configs_are_read_as_nemo_rl_passes_them():
    from omegaconf import OmegaConf
    from pydantic import BaseModel, ConfigDict

    from gym_bridge.config.nemo_rl_gym import setup_nemo_gym_config

    class MasterConfig(BaseModel):  # NeMo-RL's: a pydantic model whose sections are dicts
        model_config = ConfigDict(extra="allow")
        env: dict
        policy: dict

    config = example()
    config.pop("use_nemo_gym")
    config["env"]["should_use_nemo_gym"] = True
    master = MasterConfig(**config)
    assert should_use_nemo_gym(master)
    assert settings_of(master).launch.gym.config_paths == config["env"]["nemo_gym"]["config_paths"]

    node = OmegaConf.create({"env": {}, "policy": {"is_vlm": True, "tokenizer": {"name": "vlm"}, "generation": {}}})
    setup_nemo_gym_config(node, tokenizer=None)  # an OmegaConf node copies what it is given: set in place anyway
    assert OmegaConf.to_container(node.policy.generation) == {
        "vllm_cfg": {"async_engine": True, "expose_http_server": True},
        "stop_strings": None,
        "stop_token_ids": None,
    }
    assert node.env.nemo_gym.tokenizer_config == {"name": "vlm"}


@pytest.mark.parametrize(
    ("generation", "message"),
    [
        ({"backend": "trtllm", "trtllm_cfg": {"expose_http_server": True}}, r"trtllm_cfg\.async_engine: true"),
        ({"backend": "trtllm", "trtllm_cfg": {"async_engine": True}}, r"trtllm_cfg\.expose_http_server: true"),
        ({"backend": "sglang", "use_async_rollouts": True}, r"backend: sglang does not offer"),
    ],
)
def test_nemo_rl_s_engine_checks_name_the_key_to_set(generation, message):
    with pytest.raises(TrainingConfigError, match=message):
        should_use_nemo_gym({"env": {"should_use_nemo_gym": True}, "policy": {"generation": generation}})


def test_nemo_gym_config_follows_nemo_rl_for_defaults_global_config_and_ports():
    from gym_bridge.failures import GymPortInUse
    from gym_bridge.gym.servers._launcher import claim_head_port
    from gym_bridge.gym.transport.actor_config import NemoGymConfig

    config = NemoGymConfig(
        model_name="m",
        base_urls=URLS,
        thinking_tags=[],
        invalid_tool_call_patterns=None,
        initial_global_config_dict={"config_paths": ["a.yaml"], "effort_levels": {"low_weight": 0.1}, "x": 1},
    )
    assert config.thinking_tags == ("<think>", "</think>") and "<tool_call>" in config.invalid_tool_call_patterns
    assert config.config_paths == ["a.yaml"] and config.overrides == {"x": 1}  # NeMo-RL drops effort_levels too
    with pytest.raises(ValueError, match="pad_dynamic_image_shapes is not supported"):
        NemoGymConfig(model_name="m", base_urls=URLS, initial_global_config_dict={"pad_dynamic_image_shapes": True})

    held, taken = _port_with_a_free_neighbour()
    with held:
        ranged = NemoGymConfig(model_name="m", base_urls=URLS, port_range_low=taken, port_range_high=taken + 1)
        overrides = ranged.servers_config().overrides
        assert (overrides["port_range_low"], overrides["port_range_high"]) == (taken, taken + 1)
        # The launcher binds the head server's port in the range, skipping the busy one, before Gym reads the config.
        claimed = claim_head_port(overrides)
        with claimed:
            assert claimed.getsockname()[1] == taken + 1 and overrides["head_server"] == {"port": taken + 1}
        with pytest.raises(GymPortInUse, match=f"cannot bind 127.0.0.1:{taken}"):
            claim_head_port({"head_server": {"port": taken}})


def _port_with_a_free_neighbour() -> tuple[socket.socket, int]:
    """A bound socket on port P, where P + 1 was free a moment ago (tries again when P + 1 is taken)."""
    for _ in range(50):
        held = socket.socket()
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", taken + 1))
            except OSError:
                held.close()
                continue
        return held, taken
    raise AssertionError("no free port with a free neighbour in 50 tries")


def test_a_training_config_s_launch_spec_carries_the_caller_s_options_over_the_config_s():
    from gym_bridge.config.training import nemo_gym_launch_spec
    from gym_bridge.rollout.backend import BackendOptionsError

    spec = nemo_gym_launch_spec(gym_config(grpo={"seed": 7}), base_urls=URLS, uses_tools=True, full_results_path="r.jsonl")
    assert (spec.uses_tools, spec.preflight, spec.gym.base_urls) == (True, True, URLS)
    assert (spec.manager_options.seed, str(spec.manager_options.full_results_path)) == (7, "r.jsonl")
    assert spec.manager_options.model_fields_set >= {"seed", "full_results_path"}
    assert spec.with_manager_options() is spec
    with pytest.raises(BackendOptionsError, match="rollout backend 'nemo_gym': unknown option 'temprature'"):
        spec.with_manager_options(temprature=0.5)
    with pytest.raises(BackendOptionsError, match="option 'seed'"):
        nemo_gym_launch_spec(gym_config(), base_urls=URLS, seed="seven")
