"""Unit tests of NeMo-RL's Gym-path reward shaping (gym_bridge.rollout.reward_shaping): effort shaping,
reward-zeroing penalties, think-tag rules on the tiny tokenizer's real ids, reward components."""

from __future__ import annotations

from typing import Any

import pydantic
import pytest
import torch

from gym_bridge.failures import GymResultError, RolloutDataFailure, SettingError
from gym_bridge.rollout.reward_components import (
    build_reward_component_columns,
    extract_reward_components,
    validate_reward_components_match_scalar,
)
from gym_bridge.rollout.reward_shaping import (
    EffortLevelsConfig,
    EffortShaping,
    apply_effort_shaping,
    apply_reward_penalties,
    effort_metrics,
    get_nemo_gym_thinking_tags,
    penalty_metrics,
    resolve_reward_penalty_config,
    should_mask_flagged_samples,
)

LOW = "{reasoning effort: low}"
ZERO_COUNTS = {"duplicated_reasoning": 0, "empty_final_answer": 0, "unwanted_token": 0, "malformed_think_tag": 0}


def turn(role: str, token_ids: list[int], **extra: Any) -> dict[str, Any]:
    return {"role": role, "token_ids": torch.tensor(token_ids, dtype=torch.long), **extra}


def result(
    message_log: list[dict[str, Any]] | None = None, output: list[dict[str, Any]] | None = None, reward: float = 1.0
) -> dict[str, Any]:
    log = message_log if message_log is not None else [turn("user", [1, 2]), turn("assistant", [3, 4])]
    return {"message_log": log, "full_result": {"reward": reward, "response": {"output": output or []}}}


def message(text: Any, **extra: Any) -> dict[str, Any]:
    return {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": text}], **extra}


def reasoning(text: str) -> dict[str, Any]:
    return {"type": "reasoning", "summary": [{"type": "summary_text", "text": text}]}


def gym_row(*user_texts: str) -> dict[str, Any]:
    messages: list[dict[str, Any]] = []
    for text in user_texts:
        messages += [{"role": "user", "content": text}, {"role": "assistant", "content": "ok"}]
    return {"responses_create_params": {"input": messages[:-1]}, "agent_ref": {"name": "agent"}}


def rewards(results: list[dict[str, Any]]) -> list[float]:
    return [r["full_result"]["reward"] for r in results]


@pytest.fixture(scope="module")
def think_ids(tiny_tokenizer) -> tuple[int, int]:
    open_id, close_id = tiny_tokenizer.convert_tokens_to_ids(["<think>", "</think>"])
    assert tiny_tokenizer.encode("<think>", add_special_tokens=False) == [open_id]
    return open_id, close_id


# ---- effort shaping -------------------------------------------------------------------------------


def test_effort_levels_config_defaults_and_validation():
    config = EffortLevelsConfig()
    assert (config.low_weight, config.low_penalty, config.low_ub, config.low_string) == (0.0, 1.0, 64000, "")
    assert EffortLevelsConfig.model_validate({"low_weight": 0.1, "note": "kept"}).model_extra == {"note": "kept"}
    with pytest.raises(pydantic.ValidationError, match="low_ub"):
        EffortLevelsConfig.model_validate({"low_ub": "many"})


def test_effort_shaping_on_a_hand_computed_group():
    config = EffortLevelsConfig(low_weight=0.5, low_penalty=2.0, low_ub=100, low_string=LOW)
    results = [
        result([turn("user", [1]), turn("assistant", [7] * 20)]),  # short low: 0.5 * (1 - 0.2) = 0.4
        result([turn("user", [1]), turn("assistant", [7] * 150)]),  # long low: 0.5 * (1 - 1.5) = -0.25
        result([turn("user", [1]), turn("assistant", [7] * 30)]),  # high
        result([turn("user", [1]), turn("assistant", [7] * 99), turn("user", [1])]),  # high, ends on user: 0
    ]
    rows = [
        gym_row(f"Solve 2+2. {LOW}"),
        gym_row(f"{LOW} Solve 3+3."),
        gym_row("Solve 4+4."),
        gym_row(f"first {LOW}", "follow-up without it"),  # only the last user message counts
    ]

    shaping = apply_effort_shaping(results, rows, config)

    assert shaping.length_rewards_low == pytest.approx([0.4, -0.25])
    # 1 + 1 * 0.4 and 1 + 0 + 2 * (-0.25)
    assert shaping.rewards_low == pytest.approx([1.4, 0.5])
    assert rewards(results) == pytest.approx([1.4, 0.5, 1.0, 1.0])
    assert (shaping.low_lengths, shaping.high_lengths) == ([20, 150], [30, 0])
    assert effort_metrics(shaping) == pytest.approx(
        {
            "mean_length_reward_low": 0.075,
            "mean_reward_low": 0.95,
            "mean_length_low": 85.0,
            "median_length_low": 85.0,
            "mean_length_high": 15.0,
            "median_length_high": 15.0,
        }
    )


def test_effort_length_reward_is_capped_at_one_and_a_string_input_is_the_prompt():
    config = EffortLevelsConfig(low_weight=5.0, low_ub=100, low_string=LOW)
    results = [result([turn("user", [1]), turn("assistant", [7] * 10)], reward=0.5)]
    row = {"responses_create_params": {"input": f"hi {LOW}"}}

    shaping = apply_effort_shaping(results, [row], config)

    assert shaping.length_rewards_low == [1.0]  # 5 * 0.9 = 4.5, capped
    assert rewards(results) == [1.0]  # 0.5 + 0.5 * 1


@pytest.mark.parametrize(
    "config",
    [None, EffortLevelsConfig(low_weight=0.0, low_string=LOW), EffortLevelsConfig(low_weight=0.5, low_string="")],
)
def test_effort_shaping_off_changes_nothing(config):
    results = [result(reward=0.25)]
    shaping = apply_effort_shaping(results, [gym_row(f"x {LOW}")], config)
    assert shaping == EffortShaping()
    assert rewards(results) == [0.25]
    assert effort_metrics(shaping) == {}


def test_effort_metrics_leave_out_empty_sides():
    assert effort_metrics(EffortShaping(high_lengths=[3, 1, 2])) == {"mean_length_high": 2.0, "median_length_high": 2.0}


# ---- env config -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("env", "tags"),
    [
        ({}, ["<think>", "</think>"]),
        ({"nemo_gym": {"thinking_tags": ["<r>", "</r>"]}}, ["<r>", "</r>"]),
        ({"nemo_gym": {"thinking_tags": []}}, ["<think>", "</think>"]),
        ({"nemo_gym": None}, ["<think>", "</think>"]),
    ],
)
def test_get_nemo_gym_thinking_tags(env, tags):
    assert get_nemo_gym_thinking_tags(env) == tags


@pytest.mark.parametrize(
    ("env", "mask"),
    [
        ({}, True),
        ({"should_mask_flagged_samples": True}, True),
        ({"should_mask_flagged_samples": None}, True),
        ({"should_mask_flagged_samples": 0}, True),
        ({"should_mask_flagged_samples": False}, False),
    ],
)
def test_should_mask_flagged_samples_only_an_explicit_false_turns_it_off(env, mask):
    assert should_mask_flagged_samples(env) is mask


# ---- resolving the penalty config -----------------------------------------------------------------


class TokenIds(pydantic.BaseModel, extra="allow"):
    unwanted: list[int] | None = None
    think_open: int | None = None
    think_close: int | None = None


class Penalties(pydantic.BaseModel, extra="allow"):
    """The shape of NeMo-RL's RewardPenaltyConfig (master_config.reward_penalties)."""

    penalize_duplicated_reasoning: bool = False
    penalize_empty_final_answer: bool = False
    penalize_unwanted_tokens: bool = False
    penalize_malformed_think_tag: bool = False
    token_ids: TokenIds | None = None


def test_resolve_none_is_none(tiny_tokenizer):
    assert resolve_reward_penalty_config(None, tiny_tokenizer) is None


@pytest.mark.parametrize("token_ids", [None, {}, {"unwanted": []}, {"unwanted": None}])
def test_unwanted_penalty_without_token_ids_is_refused(tiny_tokenizer, token_ids):
    config = {"penalize_unwanted_tokens": True, "token_ids": token_ids}
    with pytest.raises(SettingError, match=r"token_ids\.unwanted must be set when .*penalize_unwanted_tokens is true"):
        resolve_reward_penalty_config(config, tiny_tokenizer)


def test_resolve_infers_single_token_think_tags_from_the_tokenizer(tiny_tokenizer, think_ids):
    config = Penalties(penalize_malformed_think_tag=True, token_ids=TokenIds(unwanted=[2]))
    resolved = resolve_reward_penalty_config(config, tiny_tokenizer)
    assert resolved == {
        "penalize_duplicated_reasoning": False,
        "penalize_empty_final_answer": False,
        "penalize_unwanted_tokens": False,
        "penalize_malformed_think_tag": True,
        "thinking_tags": ("<think>", "</think>"),
        "token_ids": {"unwanted": [2], "think_open": think_ids[0], "think_close": think_ids[1]},
    }


def test_resolve_takes_a_single_unwanted_id_as_a_list(tiny_tokenizer):
    resolved = resolve_reward_penalty_config({"token_ids": {"unwanted": 5}}, tiny_tokenizer)
    assert resolved == {"token_ids": {"unwanted": [5]}}


def test_resolve_skips_think_tags_when_the_penalty_is_off(tiny_tokenizer):
    assert resolve_reward_penalty_config({"penalize_malformed_think_tag": False}, tiny_tokenizer) == {
        "penalize_malformed_think_tag": False
    }


def test_resolve_does_not_infer_multi_token_tags(tiny_tokenizer, think_ids):
    assert len(tiny_tokenizer.encode("<reason>", add_special_tokens=False)) > 1
    config = {"penalize_malformed_think_tag": True}
    # only one of the two tags is a single token and none is configured: the token check stays off
    resolved = resolve_reward_penalty_config(config, tiny_tokenizer, thinking_tags=["<think>", "</reason>"])
    assert resolved == {"penalize_malformed_think_tag": True, "thinking_tags": ("<think>", "</reason>")}


def test_resolve_infers_the_missing_tag_next_to_a_configured_one(tiny_tokenizer, think_ids):
    config = {"penalize_malformed_think_tag": True, "token_ids": {"think_open": 77}}
    resolved = resolve_reward_penalty_config(config, tiny_tokenizer)
    assert resolved is not None
    assert resolved["token_ids"] == {"think_open": 77, "think_close": think_ids[1]}


def test_resolve_thinking_tags_argument_wins_over_the_config(tiny_tokenizer):
    config = {"penalize_malformed_think_tag": True, "thinking_tags": ["<a>", "</a>"]}
    from_config = resolve_reward_penalty_config(config, tiny_tokenizer)
    from_argument = resolve_reward_penalty_config(config, tiny_tokenizer, thinking_tags=["<b>", "</b>"])
    assert from_config is not None and from_argument is not None
    assert (from_config["thinking_tags"], from_argument["thinking_tags"]) == (("<a>", "</a>"), ("<b>", "</b>"))


def test_one_configured_tag_whose_partner_cannot_be_inferred_fails_when_applied(tiny_tokenizer):
    config = {"penalize_malformed_think_tag": True, "token_ids": {"think_open": 77}}
    resolved = resolve_reward_penalty_config(config, tiny_tokenizer, thinking_tags=["<think>", "</reason>"])
    assert resolved is not None and resolved["token_ids"] == {"think_open": 77}
    with pytest.raises(SettingError, match=r"think_open and reward_penalties\.token_ids\.think_close must both be set"):
        apply_reward_penalties([result()], resolved)


def test_a_single_thinking_tag_is_refused(tiny_tokenizer):
    resolved = resolve_reward_penalty_config({"penalize_malformed_think_tag": True}, tiny_tokenizer, ["<think>"])
    with pytest.raises(SettingError, match="thinking_tags must contain open and close tags"):
        apply_reward_penalties([result()], resolved)


# ---- applying penalties ---------------------------------------------------------------------------


@pytest.mark.parametrize("config", [None, {}, {"penalize_empty_final_answer": False}])
def test_no_enabled_penalty_changes_nothing(config):
    results = [result(output=[])]  # would be an empty final answer
    assert apply_reward_penalties(results, config) == ZERO_COUNTS
    assert rewards(results) == [1.0]
    assert penalty_metrics(config, ZERO_COUNTS, 1) == {}


def test_penalties_refuse_non_gym_roles():
    results = [result([turn("user", [1]), turn("assistant", [2]), turn("tool", [3])])]
    with pytest.raises(SettingError, match=r"only 'user' and 'assistant' roles, found.*'tool'"):
        apply_reward_penalties(results, {"penalize_empty_final_answer": True})
    assert apply_reward_penalties(results, {"penalize_empty_final_answer": False}) == ZERO_COUNTS


@pytest.mark.parametrize(
    ("output", "caught"),
    [
        ([reasoning("The answer is 4."), message(" The answer is 4.\n")], True),
        ([reasoning("4"), {"type": "message", "content": "4"}], True),  # string content
        ([message("hi"), reasoning("4"), message("4")], True),  # any reasoning item, not only the first
        ([reasoning("Add 2 and 2."), message("4")], False),
        ([reasoning("   "), message("   ")], False),  # empty text never counts as a copy
        ([reasoning("4"), {"type": "function_call", "name": "f", "arguments": "4"}], False),
        ([message("4"), message("4")], False),
    ],
)
def test_duplicated_reasoning(output, caught):
    results = [result(output=output), result(output=[reasoning("a"), message("b")])]
    counts = apply_reward_penalties(results, {"penalize_duplicated_reasoning": True})
    assert counts == {**ZERO_COUNTS, "duplicated_reasoning": int(caught)}
    assert rewards(results) == [0.0 if caught else 1.0, 1.0]


@pytest.mark.parametrize(
    ("output", "caught"),
    [
        ([reasoning("thinking"), message("  \n")], True),
        ([], True),
        ([reasoning("thinking only")], True),  # no item with content
        ([message("")], True),
        ([message("4")], False),
        ([{"type": "message", "content": "4"}], False),
        ([reasoning("call a tool"), {"type": "function_call", "name": "f", "arguments": "{}"}], False),
        # an item whose content has no text is walked past, to the earlier answer
        ([message("4"), {"type": "message", "content": []}], False),
        ([message("4"), {"type": "message", "content": [{"type": "refusal", "refusal": "no"}]}], False),
    ],
)
def test_empty_final_answer(output, caught):
    results = [result(output=output)]
    counts = apply_reward_penalties(results, {"penalize_empty_final_answer": True})
    assert counts == {**ZERO_COUNTS, "empty_final_answer": int(caught)}
    assert rewards(results) == [0.0 if caught else 1.0]


def test_unwanted_tokens_in_any_assistant_turn_including_the_last_position(tiny_tokenizer):
    eos = tiny_tokenizer.eos_token_id
    config = resolve_reward_penalty_config(
        {"penalize_unwanted_tokens": True, "token_ids": {"unwanted": [eos, 999]}}, tiny_tokenizer
    )
    results = [
        result([turn("user", [1]), turn("assistant", [5, 6, eos])]),
        result([turn("user", [1]), turn("assistant", [5]), turn("user", [1]), turn("assistant", [999, 5])]),
        result([turn("user", [1, eos, 999]), turn("assistant", [5, 6])]),  # only the prompt has them
    ]
    counts = apply_reward_penalties(results, config)
    assert counts == {**ZERO_COUNTS, "unwanted_token": 2}
    assert rewards(results) == [0.0, 0.0, 1.0]
    assert penalty_metrics(config, counts, len(results)) == {"unwanted_token_rate": pytest.approx(2 / 3)}


def test_unwanted_penalty_on_an_unresolved_config_without_ids_is_refused():
    with pytest.raises(SettingError, match=r"token_ids\.unwanted must be set"):
        apply_reward_penalties([result()], {"penalize_unwanted_tokens": True})


# (prompt's open, close count; generation's open, close count; malformed)
THINK_CASES = [
    ((0, 0), (0, 0), False),  # thinking off: nothing generated
    ((1, 1), (0, 0), False),  # thinking off, empty think block in the prompt
    ((1, 0), (0, 1), False),  # thinking on: the prompt opens, the model closes once
    ((1, 1), (0, 1), True),  # thinking off but the model closes
    ((1, 0), (0, 0), True),  # thinking on but never closed
    ((1, 0), (0, 2), True),  # closed twice
    ((1, 0), (1, 1), True),  # the model opens a think block itself
    ((0, 0), (1, 0), True),
    ((2, 0), (0, 1), True),  # a prompt that is neither pattern
    ((0, 1), (0, 0), True),
]


@pytest.mark.parametrize(("prompt", "generation", "malformed"), THINK_CASES)
def test_think_tag_token_counts(tiny_tokenizer, think_ids, prompt, generation, malformed):
    open_id, close_id = think_ids
    word = 40  # any ordinary token

    def ids(n_open: int, n_close: int) -> list[int]:
        return [word] + [open_id] * n_open + [word] + [close_id] * n_close + [word]

    config = resolve_reward_penalty_config({"penalize_malformed_think_tag": True}, tiny_tokenizer)
    results = [result([turn("user", ids(*prompt)), turn("assistant", ids(*generation))])]
    counts = apply_reward_penalties(results, config)
    assert counts == {**ZERO_COUNTS, "malformed_think_tag": int(malformed)}
    assert rewards(results) == [0.0 if malformed else 1.0]


def test_think_tag_token_counts_check_every_turn(tiny_tokenizer, think_ids):
    open_id, close_id = think_ids
    config = resolve_reward_penalty_config({"penalize_malformed_think_tag": True}, tiny_tokenizer)
    good_turn = [turn("user", [40, open_id]), turn("assistant", [41, close_id, 42])]
    results = [
        result(good_turn + good_turn),
        result([*good_turn, turn("user", [40, open_id]), turn("assistant", [41, 42])]),  # 2nd turn never closes
    ]
    assert apply_reward_penalties(results, config)["malformed_think_tag"] == 1
    assert rewards(results) == [1.0, 0.0]


@pytest.mark.parametrize(
    ("generation_strs", "malformed"),
    [
        (["<reason>x</reason> answer"], True),  # the open tag is never generated
        (["x</reason> a </reason>"], True),
        (["x</reason> answer", "plain", ""], False),
        (["answer"], False),
    ],
)
def test_think_tag_text_check(tiny_tokenizer, generation_strs, malformed):
    config = resolve_reward_penalty_config(
        {"penalize_malformed_think_tag": True}, tiny_tokenizer, thinking_tags=["<reason>", "</reason>"]
    )
    assert config is not None and "token_ids" not in config  # multi-token tags: the text check alone
    output = [message(s, generation_str=s) for s in generation_strs]
    results = [result(output=output)]
    assert apply_reward_penalties(results, config)["malformed_think_tag"] == int(malformed)
    assert rewards(results) == [0.0 if malformed else 1.0]


def test_gym_malformed_thinking_flag_counts():
    flagged = [turn("user", [1]), turn("assistant", [2], has_malformed_thinking=True)]
    clean = [turn("user", [1]), turn("assistant", [2], has_malformed_thinking=False)]
    results = [result(flagged), result(clean)]
    assert apply_reward_penalties(results, {"penalize_malformed_think_tag": True})["malformed_think_tag"] == 1
    assert rewards(results) == [0.0, 1.0]


def test_a_result_caught_twice_counts_under_each_penalty_and_metrics_cover_enabled_flags():
    config = {"penalize_duplicated_reasoning": True, "penalize_empty_final_answer": True}
    results = [
        result(output=[reasoning("4"), message("4"), message("")]),  # copied, then an empty answer
        result(output=[message("4")]),
        result(output=[message("5")]),
        result(output=[message("6")]),
    ]
    counts = apply_reward_penalties(results, config)
    assert counts == {**ZERO_COUNTS, "duplicated_reasoning": 1, "empty_final_answer": 1}
    assert rewards(results) == [0.0, 1.0, 1.0, 1.0]
    assert penalty_metrics(config, counts, 4) == {
        "reasoning_equal_to_final_answer_rate": 0.25,
        "empty_final_answer_rate": 0.25,
    }
    assert penalty_metrics(config, counts, 0) == {}


def test_penalty_metrics_names_every_enabled_penalty():
    config = {
        "penalize_duplicated_reasoning": True,
        "penalize_empty_final_answer": True,
        "penalize_unwanted_tokens": True,
        "penalize_malformed_think_tag": True,
    }
    counts = {"duplicated_reasoning": 1, "empty_final_answer": 2, "unwanted_token": 3, "malformed_think_tag": 4}
    assert penalty_metrics(config, counts, 8) == {
        "reasoning_equal_to_final_answer_rate": 0.125,
        "empty_final_answer_rate": 0.25,
        "unwanted_token_rate": 0.375,
        "malformed_think_tag_rate": 0.5,
    }


# ---- reward components ----------------------------------------------------------------------------


def test_extract_reward_components():
    assert extract_reward_components({"reward": 1.0}) is None
    assert extract_reward_components({"reward": 1.0, "reward_components": {}}) is None
    assert extract_reward_components({"reward_components": {"format": 1, 7: 0.5}}) == {"format": 1.0, "7": 0.5}


def test_reward_component_columns_take_the_union_and_fill_zeros():
    columns = build_reward_component_columns([{"format": 1.0, "answer": 0.5}, None, {"style": 0.25}])
    assert list(columns) == ["reward/answer", "reward/format", "reward/style"]
    assert {k: v.tolist() for k, v in columns.items()} == {
        "reward/answer": [0.5, 0.0, 0.0],
        "reward/format": [1.0, 0.0, 0.0],
        "reward/style": [0.0, 0.0, 0.25],
    }
    assert build_reward_component_columns([None, None]) == {}


def test_components_matching_the_scalar_pass_and_one_off_by_a_hair_more_does_not():
    matching = [
        {"reward": 0.3, "reward_components": {"a": 0.1, "b": 0.2}},  # 0.30000000000000004: within the tolerance
        {"reward": 0.0},
        {"reward": 1.0, "reward_components": {}},
    ]
    validate_reward_components_match_scalar(matching)
    off = [*matching, {"reward": 0.3, "reward_components": {"a": 0.1, "b": 0.2001}}]
    with pytest.raises(GymResultError, match=r"result 3 has reward=0\.3"):
        validate_reward_components_match_scalar(off)


def test_components_not_summing_to_the_scalar_name_the_result():
    results = [{"reward": 1.0, "reward_components": {"a": 1.0}}, {"reward": 1.0, "reward_components": {"a": 0.5}}]
    with pytest.raises(GymResultError, match=r"result 1 has reward=1\.0 but its reward_components sum to 0\.5") as e:
        validate_reward_components_match_scalar(results)
    assert isinstance(e.value, RolloutDataFailure)
