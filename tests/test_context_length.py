"""One context length: ``policy.max_total_sequence_length`` and NeMo-RL's engine copies of it
(``policy.generation.{vllm_cfg,trtllm_cfg,mcore_generation_config}.max_model_len``) have one reader,
``gym_bridge.config.training.context_length``. Its value is the engine's and the server's ``max_model_len`` and the
manager's ``max_seq_len``; keys that agree give it, one key alone gives it, keys that disagree are refused in one
line naming both keys and both values."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from gym_bridge.config.keys import TrainingConfigError
from gym_bridge.config.loading import load_training_config
from gym_bridge.config.overrides import load_with_overrides
from gym_bridge.config.run_settings import grpo_run_settings
from gym_bridge.config.training import ENGINE_CONTEXT_KEYS, context_length, nemo_gym_rollout_settings

DEMO = Path(__file__).resolve().parents[1] / "examples" / "grpo_nemo_gym.yaml"
NEMO_RL_YAML = Path(__file__).parent / "data" / "nemo_rl_grpo_nemo_gym.yaml"
URLS = ["http://127.0.0.1:9/v1"]
VLLM_KEY = "policy.generation.vllm_cfg.max_model_len"


def demo(**keys: Any) -> dict[str, Any]:
    """The train demo's config (``max_total_sequence_length: 256``) with dotted keys set (None: removed)."""
    config = copy.deepcopy(dict(load_with_overrides(DEMO, [])))
    for dotted, value in keys.items():
        *parents, last = dotted.replace("__", ".").split(".")
        node = config
        for part in parents:
            node = node.setdefault(part, {})
        if value is None:
            node.pop(last, None)
        else:
            node[last] = value
    return config


def everywhere(config: dict[str, Any]) -> set[int]:
    """The context lengths a GRPO run would start with: engine, server and manager (and the Gym path's reader)."""
    settings = grpo_run_settings(config)
    rollout = nemo_gym_rollout_settings(config, base_urls=URLS)
    return {settings.engine.max_model_len, settings.max_model_len, settings.rollout.launch.max_seq_len,
            rollout.launch.max_seq_len, context_length(config)}  # fmt: skip


def test_keys_that_agree_are_the_one_value_of_the_engine_the_server_and_the_manager():
    config = demo(**{"policy.generation.vllm_cfg.max_model_len": 256,
                     "policy.generation.mcore_generation_config.max_model_len": 256})  # fmt: skip
    assert everywhere(config) == {256}
    # NeMo-RL's own recipe writes vllm_cfg.max_model_len: ${policy.max_total_sequence_length}
    nemo_rl = load_training_config(NEMO_RL_YAML)
    assert nemo_rl["policy"]["generation"]["vllm_cfg"]["max_model_len"] == 1024
    assert nemo_gym_rollout_settings(nemo_rl, base_urls=URLS).launch.max_seq_len == 1024


@pytest.mark.parametrize("engine_key", ENGINE_CONTEXT_KEYS)
def test_keys_that_disagree_are_refused_in_one_line_naming_both_keys_and_values(engine_key):
    config = demo(**{engine_key: 384})
    for read in (grpo_run_settings, lambda c: nemo_gym_rollout_settings(c, base_urls=URLS), context_length):
        with pytest.raises(TrainingConfigError) as raised:
            read(config)
        message = str(raised.value)
        assert len(message.splitlines()) == 1
        assert message.startswith(f"policy.max_total_sequence_length (256) and {engine_key} (384) disagree")
    # two engine keys that disagree with each other, the trainer's key absent
    two = demo(**{"policy.max_total_sequence_length": None, VLLM_KEY: 512,
                  "policy.generation.trtllm_cfg.max_model_len": 640})  # fmt: skip
    with pytest.raises(TrainingConfigError, match=rf"^{VLLM_KEY} \(512\) and policy.generation.trtllm_cfg.max_model_len \(640\) disagree"):  # fmt: skip
        context_length(two)


def test_a_disagreement_stops_gym_bridge_train_before_ray_starts(tmp_path, capsys, monkeypatch):
    from gym_bridge import ray_utils
    from gym_bridge.cli import main

    def no_ray(**_: object) -> None:
        raise AssertionError("gym-bridge train started Ray")

    monkeypatch.setattr(ray_utils, "init_ray", no_ray)
    run = tmp_path / "run"
    assert main(["train", str(DEMO), f"+{VLLM_KEY}=512", "--out", str(run)]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"gym-bridge train: policy.max_total_sequence_length (256) and {VLLM_KEY} (512) disagree")
    assert not run.exists()


def test_one_key_set_alone_is_used_everywhere():
    assert everywhere(demo()) == {256}  # only policy.max_total_sequence_length
    assert everywhere(demo(**{"policy.max_total_sequence_length": None, VLLM_KEY: 320})) == {320}
    mcore = demo(**{"policy.max_total_sequence_length": None, "policy.generation.mcore_generation_config.max_model_len": 192})  # fmt: skip
    assert context_length(mcore) == 192


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        ({"policy.max_total_sequence_length": None}, r"^the training config has no 'policy.max_total_sequence_length'"),
        ({"policy.max_total_sequence_length": 0}, r"^policy.max_total_sequence_length must be a positive integer, got 0$"),
        ({VLLM_KEY: "256"}, rf"^{VLLM_KEY} must be a positive integer, got '256'$"),
        ({VLLM_KEY: True}, rf"^{VLLM_KEY} must be a positive integer, got True$"),
    ],
)
def test_a_missing_or_bad_context_length_is_named(keys, message):
    with pytest.raises(TrainingConfigError, match=message):
        grpo_run_settings(demo(**keys))


def test_a_training_config_naming_a_running_gym_is_refused_in_one_line():
    """Attaching to a running Gym is eval's (``gym_head``); a training run's Gym must call the run's own server."""
    from gym_bridge.config.training import nemo_gym_rollout_settings

    config = {
        "env": {"should_use_nemo_gym": True, "nemo_gym": {"gym_head": "http://127.0.0.1:11000"}},
        "policy": {"model_name": "m", "max_total_sequence_length": 256, "generation": {"max_new_tokens": 8}},
        "grpo": {"num_generations_per_prompt": 2},
    }
    with pytest.raises(TrainingConfigError, match=r"^env\.nemo_gym\.gym_head: a training run starts its own Gym"):
        nemo_gym_rollout_settings(config, base_urls=["http://127.0.0.1:9/v1"])
