"""Every key NeMo-RL's Gym recipes set is applied, refused by name, or listed as having no effect.

``tests/data/nemo_rl_gym_recipe_keys.yaml`` lists the keys of every NeMo-RL 7ea279a YAML that sets
``env.should_use_nemo_gym: true`` (defaults merged), with the values the recipes give them; regenerate it with
``scripts/nemo_rl_gym_recipe_keys.py``. Each key is set, one at a time, on a small Gym config of ours, to each
of those values (and, when none differs from the base, to a changed one); the GRPO recipe's settings are
built. A key is applied when some value changes them, refused when a value raises ``TrainingConfigError``
naming it; otherwise it must be in ``gym_bridge.config.no_effect.NO_EFFECT_KEYS``.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from gym_bridge.config.chat_template import chat_template_kwargs
from gym_bridge.config.grpo import (
    engine_batch_size,
    loop_config_from,
    loss_config_from,
    policy_config,
    validation_options,
)
from gym_bridge.config.keys import TrainingConfigError
from gym_bridge.config.logger import logger_settings
from gym_bridge.config.no_effect import NO_EFFECT_KEYS, no_effect_reason
from gym_bridge.config.run_data import run_data
from gym_bridge.config.training import nemo_gym_rollout_settings

FIXTURE = Path(__file__).parents[1] / "data" / "nemo_rl_gym_recipe_keys.yaml"
BASE: dict[str, Any] = {
    "grpo": {"num_prompts_per_step": 4, "num_generations_per_prompt": 4, "max_num_steps": 10, "seed": 0},
    "loss_fn": {"reference_policy_kl_penalty": 0.0, "use_importance_sampling_correction": True},
    "policy": {
        "model_name": "tiny",
        "max_total_sequence_length": 256,
        "train_micro_batch_size": 4,
        "optimizer": {"kwargs": {"lr": 1e-5}},
        "generation": {
            "backend": "vllm",
            "vllm_cfg": {"async_engine": True, "expose_http_server": True},
            "max_new_tokens": 32,
            "temperature": 1.0,
            "top_p": 1.0,
        },
    },
    "checkpointing": {"enabled": True, "save_period": 10},
    "data": {"train": {"data_path": "train.jsonl"}, "validation": {"data_path": "val.jsonl"}},
    "env": {"should_use_nemo_gym": True, "nemo_gym": {"config_paths": ["a.yaml"]}},
}


def recipe_keys() -> dict[str, list[Any]]:
    return yaml.safe_load(FIXTURE.read_text())["keys"]


def with_key(config: dict[str, Any], key: str, value: Any) -> dict[str, Any]:
    out = copy.deepcopy(config)
    node = out
    *parents, last = key.split(".")
    for part in parents:
        if not isinstance(node.get(part), dict):
            node[part] = {}
        node = node[part]
    node[last] = copy.deepcopy(value)
    return out


def built(config: dict[str, Any]) -> str:
    """Everything the GRPO recipe reads from a config before it starts anything, as one comparable string."""
    settings = nemo_gym_rollout_settings(config, base_urls=["http://127.0.0.1:1/v1"])
    loop = loop_config_from(config, settings)
    data = (run_data(config), config.get("data", {}).get("validation"), validation_options(config))
    policy = policy_config(config, "weights", loop)
    logging = logger_settings(config)
    template = chat_template_kwargs(config)
    return repr((settings, loop, loss_config_from(config), policy, engine_batch_size(config), data, logging, template))


def changed(value: Any) -> Any:
    """Another value of the same kind (None: a number), to show a key is read when every recipe value is ours."""
    if isinstance(value, bool):
        return not value
    if value is None or isinstance(value, (int, float)):
        return (value or 0) + 2
    if isinstance(value, str):
        return value + "_changed"
    if isinstance(value, list):
        return value[::-1] if len(set(map(repr, value))) > 1 else [*value, "changed"]
    return {**value, "changed": 2}


def lookup(config: dict[str, Any], key: str) -> Any:
    node: Any = config
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return KeyError
        node = node[part]
    return node


def names(message: str, key: str) -> bool:
    """The message names the dotted key, or its section and its own name."""
    section, _, name = key.rpartition(".")
    return key in message or (
        section.split(".")[0] in message and re.search(rf"\b{re.escape(name)}\b", message) is not None
    )


def verdict(key: str, values: list[Any], base: str) -> str:
    """``applied``, ``refused: <message>`` or ``neither``."""
    tries = [v for v in values if v != lookup(BASE, key)]
    tries.append(changed(values[0]))
    refusal = None
    for value in tries:
        try:
            if built(with_key(BASE, key, value)) != base:
                return "applied"
        except TrainingConfigError as exc:
            if names(str(exc), key):
                refusal = f"refused: {exc}"
    return refusal or "neither"


def test_the_fixture_counts_nemo_rls_gym_recipes():
    fixture = yaml.safe_load(FIXTURE.read_text())
    recipes = fixture["recipes"]
    assert fixture["nemo_rl_commit"] == "7ea279a"
    assert len(recipes) == 46 and sum(r.startswith("examples/configs/recipes/") for r in recipes) == 17
    assert len(fixture["keys"]) > 900


def test_every_recipe_key_is_applied_refused_or_listed_without_effect():
    base = built(BASE)
    verdicts = {key: verdict(key, values, base) for key, values in recipe_keys().items()}
    loose = sorted(key for key, v in verdicts.items() if v == "neither" and no_effect_reason(key) is None)
    assert not loose, f"{len(loose)} keys neither applied, refused nor listed without effect:\n" + "\n".join(loose)
    wrong = sorted(key for key, v in verdicts.items() if key in NO_EFFECT_KEYS and v != "neither")
    assert not wrong, f"listed without effect, yet applied or refused: {wrong}"
    stale = sorted(
        entry for entry in NO_EFFECT_KEYS if not any(k == entry or k.startswith(f"{entry}.") for k in verdicts)
    )
    assert not stale, f"NO_EFFECT_KEYS entries that no recipe key falls under: {stale}"


@pytest.mark.parametrize(
    ("key", "expected"),
    [
        ("grpo.invalid_tool_call_advantage", "applied"),
        ("grpo.malformed_thinking_advantage", "applied"),
        ("grpo.advantage_clip_low", "applied"),
        ("grpo.advantage_clip_high", "applied"),
        ("grpo.overlong_filtering", "applied"),
        ("grpo.seq_logprob_error_threshold", "applied"),
        ("grpo.max_num_epochs", "applied"),
        ("reward_penalties.penalize_empty_final_answer", "applied"),
        ("env.nemo_gym.effort_levels.low_weight", "applied"),
        ("loss_fn.kl_input_clamp_value", "applied"),
        ("grpo.adv_estimator.name", "applied"),
        ("policy.router_replay.enabled", "refused"),
        ("policy.megatron_cfg.enabled", "refused"),
        ("policy.train_global_batch_size", "refused"),
        ("policy.scheduler", "applied"),
        ("policy.optimizer.kwargs.weight_decay", "applied"),
        ("loss_fn.reference_policy_kl_penalty", "applied"),
        ("loss_fn.use_importance_sampling_correction", "applied"),
        ("loss_fn.force_on_policy_ratio", "applied"),
        ("policy.generation.vllm_kwargs.max_num_seqs", "applied"),
        ("grpo.use_dynamic_sampling", "applied"),
        ("grpo.dynamic_sampling_max_gen_batches", "applied"),
        ("grpo.batch_multiplier", "refused"),
    ],
)
def test_the_trainer_keys_are_applied_or_refused(key, expected):
    assert verdict(key, recipe_keys()[key], built(BASE)).startswith(expected)
