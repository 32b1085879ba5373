"""RolloutRetryPolicy is the one definition of every retry setting and its default; each door reads it.

The doors: the manager and the hand-built Gym backend (no policy: ``single_attempt()``), NeMo-RL's
``async_rl.rollout_failure`` (NeMo-RL's key names, NeMo-RL's defaults where it sets them), and the eval
config's ``retry:`` section (the policy itself, over the eval's preset).
"""

from __future__ import annotations

import pickle
from dataclasses import asdict, fields

import pytest

from gym_bridge.config.async_settings import RolloutFailureSettings
from gym_bridge.eval.config import EVAL_RETRY, EvalConfigError, build_config
from gym_bridge.failures import GymBridgeError, RolloutRetryPolicy, SettingError

EVAL_BASE = {"dataset": "rows.jsonl", "config_paths": ["a.yaml"], "output_dir": "out"}


def test_the_attempt_budgets_are_named_or_single_attempt_the_rest_have_one_default():
    with pytest.raises(TypeError, match="max_infra_attempts"):
        RolloutRetryPolicy()  # type: ignore[call-arg]
    policy = RolloutRetryPolicy.single_attempt()
    assert (policy.max_infra_attempts, policy.max_data_attempts, policy.max_gym_row_attempts) == (1, 1, 1)
    assert policy == RolloutRetryPolicy(max_infra_attempts=1, max_data_attempts=1, max_gym_row_attempts=1)
    assert (policy.backoff_base_s, policy.max_backoff_s, policy.max_skipped_prompts) == (1.0, 30.0, 0)
    assert (policy.max_consecutive_dropped_prompts, policy.stop_after_config_failures) == (0, 2)
    assert RolloutRetryPolicy.single_attempt(max_gym_row_attempts=2).max_gym_row_attempts == 2


def test_the_constructor_keeps_its_keywords_and_positions_and_pickles():
    policy = RolloutRetryPolicy(5, 2, 3, backoff_base_s=0.5, max_skipped_prompts=1)
    assert (policy.max_infra_attempts, policy.max_data_attempts, policy.max_gym_row_attempts) == (5, 2, 3)
    assert pickle.loads(pickle.dumps(policy)) == policy


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"max_infra_attempts": 0}, "max_infra_attempts must be >= 1, got 0"),
        ({"max_gym_row_attempts": True}, "max_gym_row_attempts must be an int >= 1, got True"),
        ({"max_skipped_prompts": -1}, "max_skipped_prompts must be >= 0, got -1"),
        ({"max_data_attempts": 1.5}, "max_data_attempts must be an int >= 1, got 1.5"),
        ({"backoff_base_s": -1.0}, "backoff times must be >= 0, got backoff_base_s=-1.0"),
        ({"max_backoff_s": "30"}, "max_backoff_s must be a number of seconds >= 0, got '30'"),
    ],
)
def test_an_invalid_setting_is_a_typed_error_naming_it(changes, message):
    with pytest.raises(SettingError, match=message) as caught:
        RolloutRetryPolicy.single_attempt(**changes)
    assert isinstance(caught.value, GymBridgeError) and isinstance(caught.value, ValueError)
    assert str(pickle.loads(pickle.dumps(caught.value))) == str(caught.value)


def test_nemo_rl_s_keys_map_onto_the_policy_with_nemo_rl_s_defaults_where_it_sets_them():
    policy = RolloutFailureSettings().retry_policy()
    defaults = RolloutRetryPolicy.single_attempt()
    assert (policy.max_infra_attempts, policy.max_data_attempts, policy.max_gym_row_attempts) == (5, 2, 3)
    same = ("backoff_base_s", "max_backoff_s", "max_skipped_prompts", "max_consecutive_dropped_prompts")
    assert {name: getattr(policy, name) for name in same} == {name: getattr(defaults, name) for name in same}
    assert policy.stop_after_config_failures == defaults.stop_after_config_failures
    named = RolloutFailureSettings.model_validate(
        {"max_infra_attempts_per_prompt": 4, "max_data_attempts_per_prompt": 3, "nemo_gym": {"max_row_attempts": 6}}
    ).retry_policy(max_consecutive_dropped_prompts=7)
    assert (named.max_infra_attempts, named.max_data_attempts, named.max_gym_row_attempts) == (4, 3, 6)
    assert named.max_consecutive_dropped_prompts == 7


def test_the_eval_retry_section_is_the_policy_over_the_eval_preset():
    assert build_config(EVAL_BASE).retry_policy() == EVAL_RETRY
    config = build_config({**EVAL_BASE, "retry": {"max_data_attempts": 2}}, ["retry.max_gym_row_attempts=5"])
    assert config.retry == RolloutRetryPolicy(
        **{**asdict(EVAL_RETRY), "max_data_attempts": 2, "max_gym_row_attempts": 5}
    )
    assert {f.name for f in fields(RolloutRetryPolicy)} == set(config.model_dump(mode="json")["retry"])


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"retry": {"max_infra_attempts": 0}}, "retry: max_infra_attempts must be >= 1, got 0"),
        ({"retry": {"max_row_attempts": 2}}, "retry.max_row_attempts: unknown key; known keys: max_infra_attempts"),
        ({"retry": {"max_data_attempts": "x"}}, "retry.max_data_attempts: Input should be a valid integer"),
        ({"max_row_attempts": 2}, "max_row_attempts: a retry setting: give it as retry.max_gym_row_attempts"),
        ({"retry_backoff_s": 2}, "retry_backoff_s: a retry setting: give it as retry.backoff_base_s"),
    ],
)
def test_an_invalid_eval_retry_section_names_the_key(data, message):
    with pytest.raises(EvalConfigError, match=message):
        build_config({**EVAL_BASE, **data})
