"""NeMo-RL's Gym-path reward shaping, as pure functions over one group of results.

Three things, applied in NeMo-RL's order by the caller: effort (length) shaping of low-effort prompts,
reward-zeroing penalties, then multi-reward components (``reward/<name>`` columns, checked against the
scalar). Config keys, defaults, metric names and config errors follow NeMo-RL HEAD
(``nemo_rl/experience/rollouts.py``, ``nemo_rl/environments/nemo_gym.py``).

``results`` are NeMo-RL-shaped dicts (``message_log`` of user/assistant turns with ``token_ids`` tensors,
``full_result`` the Gym ``/run`` result); rewards are changed in place, in ``full_result["reward"]``.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict

from gym_bridge.failures import SettingError
from gym_bridge.gym.protocol.convert import DEFAULT_THINKING_TAGS
from gym_bridge.json_types import JsonMapping, JsonObject
from gym_bridge.types import TokenIds, Tokenizer

#: Penalty count key -> (config flag that enables it, rollout metric it is reported under).
PENALTY_FLAGS: dict[str, tuple[str, str]] = {
    "duplicated_reasoning": ("penalize_duplicated_reasoning", "reasoning_equal_to_final_answer_rate"),
    "empty_final_answer": ("penalize_empty_final_answer", "empty_final_answer_rate"),
    "unwanted_token": ("penalize_unwanted_tokens", "unwanted_token_rate"),
    "malformed_think_tag": ("penalize_malformed_think_tag", "malformed_think_tag_rate"),
}
_GYM_ROLES = frozenset({"user", "assistant"})

# ---- effort shaping -----------------------------------------------------------------------------


class EffortLevelsConfig(BaseModel):
    """``env.nemo_gym.effort_levels``: length shaping for prompts that contain ``low_string``.

    ``length_reward = min(1, low_weight * (1 - len / low_ub))``; the new reward is
    ``reward + reward * max(length_reward, 0) + low_penalty * min(length_reward, 0)``.
    """

    # NeMo-RL accepts unknown keys here too; only these four are read.
    model_config = ConfigDict(extra="allow")

    low_weight: float = 0.0
    low_penalty: float = 1.0
    low_ub: int = 64000
    low_string: str = ""

    @property
    def enabled(self) -> bool:
        """Shaping runs only with a positive weight and a non-empty trigger string."""
        return self.low_weight > 0 and bool(self.low_string)


@dataclass
class EffortShaping:
    """Per-sample values effort shaping saw: low-effort samples' length rewards, new rewards and lengths,
    other samples' lengths. All empty when shaping is off."""

    length_rewards_low: list[float] = field(default_factory=list)
    rewards_low: list[float] = field(default_factory=list)
    low_lengths: list[int] = field(default_factory=list)
    high_lengths: list[int] = field(default_factory=list)


def _last_turn_length(result: JsonMapping) -> int:
    """Token count of the final message when the model wrote it, else 0 (NeMo-RL's response length)."""
    last = result["message_log"][-1]
    return len(last["token_ids"]) if last["role"] == "assistant" else 0


def _last_user_prompt(row: JsonMapping) -> str | list[object]:
    """Content of the row's last user message with content ("" if none); a string ``input`` is that message."""
    prompt = row["responses_create_params"]["input"]
    if isinstance(prompt, str):
        return prompt
    for message in reversed(prompt):
        if isinstance(message, Mapping) and message.get("role") == "user" and "content" in message:
            content: str | list[object] = message["content"]  # the Responses API: text, or a list of parts
            return content
    return ""


def _length_reward(config: EffortLevelsConfig, length: int) -> float:
    """The length term, capped at 1: positive below ``low_ub * (1 - 1/low_weight)`` tokens, negative past ``low_ub``."""
    return min(1.0, config.low_weight * (1.0 - length / config.low_ub))


def apply_effort_shaping(
    results: Sequence[JsonObject], rows: Sequence[JsonMapping], effort_config: EffortLevelsConfig | None
) -> EffortShaping:
    """Reshape the reward of each result whose row's last user prompt contains ``low_string``; return what it saw."""
    shaping = EffortShaping()
    if effort_config is None or not effort_config.enabled:
        return shaping
    for result, row in zip(results, rows, strict=True):
        length = _last_turn_length(result)
        # `in`, as NeMo-RL: a substring test for text content, list membership for content parts
        if effort_config.low_string not in _last_user_prompt(row):
            shaping.high_lengths.append(length)
            continue
        reward = result["full_result"]["reward"]
        length_reward = _length_reward(effort_config, length)
        new_reward = reward + reward * max(length_reward, 0.0) + effort_config.low_penalty * min(length_reward, 0.0)
        result["full_result"]["reward"] = new_reward
        shaping.length_rewards_low.append(length_reward)
        shaping.rewards_low.append(new_reward)
        shaping.low_lengths.append(length)
    return shaping


def effort_metrics(shaping: EffortShaping) -> dict[str, float]:
    """NeMo-RL's effort rollout metrics; a metric whose list is empty is left out."""
    metrics: dict[str, float] = {}
    if shaping.length_rewards_low:
        metrics["mean_length_reward_low"] = sum(shaping.length_rewards_low) / len(shaping.length_rewards_low)
    if shaping.rewards_low:
        metrics["mean_reward_low"] = sum(shaping.rewards_low) / len(shaping.rewards_low)
    for name, lengths in (("low", shaping.low_lengths), ("high", shaping.high_lengths)):
        if lengths:
            metrics[f"mean_length_{name}"] = sum(lengths) / len(lengths)
            metrics[f"median_length_{name}"] = float(statistics.median(lengths))
    return metrics


# ---- env config -----------------------------------------------------------------------------------


def get_nemo_gym_thinking_tags(env_config: JsonMapping) -> list[str]:
    """``env.nemo_gym.thinking_tags`` when set and non-empty, else the default ``<think>`` pair."""
    nemo_gym = env_config.get("nemo_gym")
    if isinstance(nemo_gym, Mapping) and nemo_gym.get("thinking_tags"):
        return list(nemo_gym["thinking_tags"])
    return list(DEFAULT_THINKING_TAGS)


def should_mask_flagged_samples(env_config: JsonMapping) -> bool:
    """``env.should_mask_flagged_samples``: only an explicit ``False`` turns masking of env-flagged samples off."""
    return env_config.get("should_mask_flagged_samples") is not False


# ---- reward penalties -----------------------------------------------------------------------------

type PenaltyConfig = JsonMapping | BaseModel


def _value(config: object, key: str) -> Any:
    """``key`` of a dict-like or attribute config (a pydantic model), None when absent.

    The value is whatever NeMo-RL's YAML holds there, so it stays untyped; each caller converts it
    (``int``, ``tuple``)."""
    if config is None:
        return None
    if isinstance(config, Mapping):
        return config.get(key)
    return getattr(config, key, None)


def _token_id(config: object, key: str) -> int | None:
    """``token_ids.<key>`` as one int, or None."""
    value = _value(_value(config, "token_ids"), key)
    return None if value is None else int(value)


def _token_id_list(config: object, key: str) -> list[int] | None:
    """``token_ids.<key>`` as a list of ints (a single int is a list of one), or None."""
    value = _value(_value(config, "token_ids"), key)
    if value is None:
        return None
    return [int(value)] if isinstance(value, int) else [int(v) for v in value]


def _single_token_id(tokenizer: Tokenizer, text: str) -> int | None:
    """The id ``text`` encodes to when it is exactly one token, else None."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    return int(ids[0]) if len(ids) == 1 else None


def _think_token_ids(tags: Sequence[str], explicit: dict[str, int], tokenizer: Tokenizer) -> dict[str, int]:
    """Think-tag ids to add to the configured ones: inferred per missing tag, and only if one tag is configured
    or both tags infer to single tokens."""
    inferred: dict[str, int] = {}
    for key, tag in (("think_open", tags[0]), ("think_close", tags[1])):
        if key not in explicit and (token := _single_token_id(tokenizer, tag)) is not None:
            inferred[key] = token
    if explicit or len(inferred) == 2:
        return inferred
    return {}


def resolve_reward_penalty_config(
    config: PenaltyConfig | None, tokenizer: Tokenizer, thinking_tags: Sequence[str] | None = None
) -> JsonObject | None:
    """The penalty config as a plain dict, with think-tag ids inferred from the tokenizer where each tag is one token.

    Raises :class:`SettingError` (a ``ValueError``) when ``penalize_unwanted_tokens`` is on without
    ``token_ids.unwanted``.
    """
    if config is None:
        return None
    resolved: JsonObject = {}
    for flag, _ in PENALTY_FLAGS.values():
        if (value := _value(config, flag)) is not None:
            resolved[flag] = value

    token_ids: dict[str, int | list[int]] = {}
    if (unwanted := _token_id_list(config, "unwanted")) is not None:
        token_ids["unwanted"] = unwanted
    for key in ("think_open", "think_close"):
        if (token := _token_id(config, key)) is not None:
            token_ids[key] = token
    if resolved.get("penalize_unwanted_tokens") and not token_ids.get("unwanted"):
        raise SettingError(
            "reward_penalties.token_ids.unwanted must be set when reward_penalties.penalize_unwanted_tokens is true"
        )

    if resolved.get("penalize_malformed_think_tag"):
        tags = tuple(thinking_tags or _value(config, "thinking_tags") or DEFAULT_THINKING_TAGS)
        resolved["thinking_tags"] = tags
        if len(tags) >= 2:
            explicit = {k: v for k, v in token_ids.items() if k in ("think_open", "think_close") and isinstance(v, int)}
            token_ids.update(_think_token_ids(tags, explicit, tokenizer))
    if token_ids:
        resolved["token_ids"] = token_ids
    return resolved


def _text_of(content: object) -> str | None:
    """Stripped text of an output item's ``content`` (a string, or the first part's ``text``), None if it has none."""
    if isinstance(content, str):
        return content.strip()
    if isinstance(content, list) and content and isinstance(content[0], Mapping):
        text = content[0].get("text")
        return text.strip() if isinstance(text, str) else None
    return None


def _output_items(result: JsonMapping) -> list[JsonObject]:
    """The Gym response's output items."""
    return list(result["full_result"].get("response", {}).get("output", []))


def _duplicates_reasoning(result: JsonMapping) -> bool:
    """A reasoning item's summary text equals the next item's content text (both non-empty)."""
    items = _output_items(result)
    for reasoning, following in pairwise(items):
        if reasoning.get("type") != "reasoning":
            continue
        summary = reasoning.get("summary", [])
        if not summary or "text" not in summary[0]:
            continue
        thought = summary[0]["text"].strip()
        answer = _text_of(following.get("content", ""))
        if thought and answer and thought == answer:
            return True
    return False


def _has_empty_final_answer(result: JsonMapping) -> bool:
    """The last item with text content is empty, or there is none; never when the output ends in a function call."""
    items = _output_items(result)
    if items and items[-1].get("type") == "function_call":
        return False
    for item in reversed(items):
        if "content" in item and (text := _text_of(item["content"])) is not None:
            return text == ""
    return True


def _has_unwanted_token(result: JsonMapping, unwanted: Sequence[int]) -> bool:
    """Any assistant turn contains any of the ``unwanted`` ids (its last token included)."""
    return any(
        token in message["token_ids"]
        for message in result["message_log"]
        if message["role"] == "assistant"
        for token in unwanted
    )


def _count(token_ids: TokenIds, token: int) -> int:
    """How often ``token`` occurs in a turn's ids."""
    return int((torch.as_tensor(token_ids) == token).sum().item())


def _think_tokens_malformed(message_log: Sequence[JsonMapping], open_id: int, close_id: int) -> bool:
    """Per (user, assistant) pair: a balanced prompt expects no tags generated, a prompt with one open ``<think>``
    expects exactly one ``</think>``; any other prompt counts, or a mismatch, is malformed."""
    for prompt, reply in pairwise(message_log):
        if prompt["role"] != "user" or reply["role"] != "assistant":
            continue
        prompt_open, prompt_close = _count(prompt["token_ids"], open_id), _count(prompt["token_ids"], close_id)
        if prompt_open == prompt_close:
            expected = (0, 0)
        elif prompt_open == prompt_close + 1:
            expected = (0, 1)
        else:
            return True
        if (_count(reply["token_ids"], open_id), _count(reply["token_ids"], close_id)) != expected:
            return True
    return False


def _think_text_malformed(result: JsonMapping, open_tag: str, close_tag: str) -> bool:
    """A model call's decoded text (``generation_str``) holds an open tag, or more than one close tag."""
    for item in _output_items(result):
        text = item.get("generation_str", "")
        if text and (open_tag in text or text.count(close_tag) > 1):
            return True
    return False


def _think_tag_settings(config: PenaltyConfig) -> tuple[tuple[int, int] | None, tuple[str, str]]:
    """The (open, close) think token ids, or None to skip the token check, and the (open, close) tag strings."""
    open_id, close_id = _token_id(config, "think_open"), _token_id(config, "think_close")
    if (open_id is None) != (close_id is None):
        raise SettingError(
            "reward_penalties.token_ids.think_open and reward_penalties.token_ids.think_close must both be set"
        )
    tags = _value(config, "thinking_tags") or DEFAULT_THINKING_TAGS
    if len(tags) < 2:
        raise SettingError("reward_penalties.thinking_tags must contain open and close tags")
    ids = None if open_id is None or close_id is None else (open_id, close_id)
    return ids, (tags[0], tags[1])


def _malformed_think_tag(result: JsonMapping, ids: tuple[int, int] | None, tags: tuple[str, str]) -> bool:
    """Gym flagged an assistant turn, or the think-tag token counts or the decoded text are off."""
    message_log = result["message_log"]
    if any(m.get("role") == "assistant" and m.get("has_malformed_thinking", False) for m in message_log):
        return True
    if ids is not None and _think_tokens_malformed(message_log, *ids):
        return True
    return _think_text_malformed(result, *tags)


def _check_gym_roles(results: Sequence[JsonMapping]) -> None:
    """Penalties read Gym-path message logs, whose roles alternate user/assistant; refuse any other."""
    for result in results:
        roles = {message.get("role") for message in result["message_log"]}
        if not roles <= _GYM_ROLES:
            raise SettingError(
                f"reward penalties need a Gym-path message_log with only 'user' and 'assistant' roles, "
                f"found {sorted(map(str, roles))}; they are not supported for non-Gym rollouts"
            )


def apply_reward_penalties(results: Sequence[JsonObject], config: PenaltyConfig | None) -> dict[str, int]:
    """Set ``full_result["reward"]`` to 0.0 for each result an enabled penalty catches; return counts per penalty.

    A result caught by several penalties is counted under each.
    """
    counts = dict.fromkeys(PENALTY_FLAGS, 0)
    if not config or not results:
        return counts
    enabled = {key for key, (flag, _) in PENALTY_FLAGS.items() if _value(config, flag)}
    if not enabled:
        return counts
    _check_gym_roles(results)

    checks: dict[str, Callable[[JsonMapping], bool]] = {}
    if "duplicated_reasoning" in enabled:
        checks["duplicated_reasoning"] = _duplicates_reasoning
    if "empty_final_answer" in enabled:
        checks["empty_final_answer"] = _has_empty_final_answer
    if "unwanted_token" in enabled:
        unwanted = _token_id_list(config, "unwanted")
        if not unwanted:
            raise SettingError("reward_penalties.token_ids.unwanted must be set")
        checks["unwanted_token"] = lambda r: _has_unwanted_token(r, unwanted)
    if "malformed_think_tag" in enabled:
        ids, tags = _think_tag_settings(config)
        checks["malformed_think_tag"] = lambda r: _malformed_think_tag(r, ids, tags)

    for key, caught in checks.items():
        for result in results:
            if caught(result):
                result["full_result"]["reward"] = 0.0
                counts[key] += 1
    return counts


def penalty_metrics(config: PenaltyConfig | None, counts: Mapping[str, int], n: int) -> dict[str, float]:
    """NeMo-RL's rate of each enabled penalty over ``n`` results; empty when no config or no results."""
    if not config or n == 0:
        return {}
    return {metric: counts[key] / n for key, (flag, metric) in PENALTY_FLAGS.items() if _value(config, flag)}
