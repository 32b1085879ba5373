"""A NeMo-Gym ``/run`` result -> a NeMo-RL message log (monotonic token history).

It raises :class:`~gym_bridge.failures.GymResultError` and its subclasses
(``MissingGenerationData``, ``NaNLogprobs``, ``TokenDrift``), drawn in :mod:`gym_bridge.failures`.

Only the last output item of each model call carries ``prompt_token_ids``,
``generation_token_ids`` and ``generation_log_probs`` (vllm_model with
``return_token_id_information: true``). Each such call becomes a user message
(the new prompt tokens since the history: tool outputs, later user turns,
template glue) followed by an assistant message (the generated tokens).

A materialized row's reply (Gym 0.7's episode protocol) is first made the record Gym's collection stores
(:func:`episode_record`, Gym's ``_episode_record``): a ``result`` as the environment server returned it, or a handled
``failure`` as Gym's failure row, which :func:`episode_failure` types.
"""

from __future__ import annotations

import array
from collections.abc import Sequence
from typing import Any, Literal

import torch

from gym_bridge.failures import (
    GymResultError,
    MissingGenerationData,
    NaNLogprobs,
    SettingError,
    TokenDrift,
)
from gym_bridge.gym.protocol.decode import decode_turns
from gym_bridge.gym.protocol.result import GymRowResult
from gym_bridge.gym.protocol.result_fields import gym_row_result
from gym_bridge.json_types import JsonObject
from gym_bridge.serving.chat import render_ids
from gym_bridge.types import LOGPROB_DTYPE, TOKEN_DTYPE, Tokenizer

DEFAULT_INVALID_TOOL_CALL_PATTERNS: tuple[str, ...] = (
    "<tool_call>",
    "</tool_call>",
    "<function_call>",
    "</function_call>",
)
DEFAULT_THINKING_TAGS: tuple[str, ...] = ("<think>", "</think>")

_TOKEN_KEYS = ("prompt_token_ids", "generation_token_ids", "generation_log_probs", "routed_experts")
_DRIFT_WINDOW = 4
_INT_TYPE = {int}
_ARRAY_TYPECODES = {torch.int64: "q", torch.float32: "f"}
_TOKEN_ID_LIMIT = 2**63
"""Token ids are int64 (the tensors' dtype); one the tokenizer cannot decode is refused where it decodes."""


def detect_tool_call_and_thinking_flags(
    item: JsonObject,
    invalid_tool_call_patterns: Sequence[str] = DEFAULT_INVALID_TOOL_CALL_PATTERNS,
    thinking_tags: Sequence[str] = DEFAULT_THINKING_TAGS,
) -> tuple[bool, bool]:
    """``(is_invalid_tool_call, has_malformed_thinking)`` for the last output item of a model call.

    Tool-call or thinking markup left in an output message's text means the
    server's parsers did not take it out; a reasoning summary may hold each
    thinking tag at most once. Any other item type (``function_call``) is clean.
    """
    text = _message_text(item)
    if text is not None:
        return _contains_any(text, invalid_tool_call_patterns), _contains_any(text, thinking_tags)
    if item.get("type") == "reasoning":
        summary = item.get("summary")
        if isinstance(summary, list) and summary and isinstance(summary[0], dict):
            text = summary[0].get("text")
            if isinstance(text, str):
                invalid = _contains_any(text, invalid_tool_call_patterns)
                return invalid, any(text.count(tag) > 1 for tag in thinking_tags)
    return False, False


def _message_text(item: JsonObject) -> str | None:
    content = item.get("content")
    if isinstance(content, list) and content and isinstance(content[0], dict):
        text = content[0].get("text")
        if isinstance(text, str):
            return text
    return None


def _contains_any(text: str, needles: Sequence[str]) -> bool:
    return any(needle in text for needle in needles)


def convert_gym_result(
    result: JsonObject,
    tokenizer: Tokenizer,
    *,
    row_index: int = 0,
    on_drift: Literal["raise", "truncate"] = "raise",
    invalid_tool_call_patterns: Sequence[str] = DEFAULT_INVALID_TOOL_CALL_PATTERNS,
    thinking_tags: Sequence[str] = DEFAULT_THINKING_TAGS,
) -> GymRowResult:
    """One Gym ``/run`` result as the typed row ``row_index``; mutates ``result`` (see below).

    ``message_log`` alternates user/assistant (one pair per model call), every
    ``token_ids`` is int64 (empty deltas too) and ``generation_logprobs`` float32;
    ``input_message_log`` is ``message_log[:1]`` (the same first dict);
    ``full_result`` is ``result`` with the token arrays popped from every
    converted item and ``prompt_str`` / ``generation_str`` decoded onto it.
    ``token_drift`` is None, or with ``on_drift="truncate"`` the first drift
    ``{"turn", "position", "expected", "got"}``: the log then ends at the last
    turn before it, and the items from that turn on keep their token arrays.

    The reward, flags and scalar fields are read by :func:`gym_row_result`.

    Raises:
        TokenDrift: a turn's prompt does not extend the history (``on_drift="raise"``).
        NaNLogprobs, MissingGenerationData, GymResultError: see the module docstring; also a missing,
            non-numeric or non-finite reward.
    """
    if on_drift not in ("raise", "truncate"):
        raise SettingError(f"on_drift must be 'raise' or 'truncate', got {on_drift!r}")
    output = _output_items(result)
    message_log: list[dict[str, Any]] = []
    seen: list[int] = []
    converted: list[tuple[JsonObject, list[int], list[int]]] = []
    drift: JsonObject | None = None
    turn = -1
    for item in output:
        if not isinstance(item, dict) or not item.get("generation_token_ids"):
            continue
        turn += 1
        prompt, generation, logprob_tensor = _model_call(item, turn)
        position = _first_difference(seen, prompt)
        # A prompt that extends the history only needs its new tokens checked: the rest equals checked ints.
        _int_list(prompt, "prompt_token_ids", turn, start=len(seen) if position is None else 0)
        if position is not None:
            drift = {
                "turn": turn,
                "position": position,
                "expected": seen[position : position + _DRIFT_WINDOW],
                "got": prompt[position : position + _DRIFT_WINDOW],
            }
            if on_drift == "raise":
                raise TokenDrift(_drift_message(drift, seen, prompt, tokenizer))
            break
        for key in _TOKEN_KEYS:
            item.pop(key, None)
        flags = detect_tool_call_and_thinking_flags(item, invalid_tool_call_patterns, thinking_tags)
        new_prompt = prompt[len(seen) :]
        message_log.extend(_turn_messages(new_prompt, generation, logprob_tensor, flags, turn))
        converted.append((item, new_prompt, generation))
        seen = prompt + generation

    if not converted:
        raise MissingGenerationData(_missing_message(result, output, tokenizer))
    _check_token_range(message_log, _TOKEN_ID_LIMIT)
    _decode_onto(converted, tokenizer)
    return gym_row_result(row_index, message_log, result, token_drift=drift)


def _model_call(item: JsonObject, turn: int) -> tuple[list[Any], list[int], torch.Tensor]:
    """One model call's ``(prompt_token_ids, generation_token_ids, logprob tensor)``, the generation and the
    logprobs checked (the prompt is checked against the history by the caller)."""
    prompt = item.get("prompt_token_ids")
    if not isinstance(prompt, list):
        raise GymResultError(f"model call {turn}: prompt_token_ids must be a list of ints, got {type(prompt).__name__}")
    generation = _int_list(item["generation_token_ids"], "generation_token_ids", turn)
    logprobs = item.get("generation_log_probs")
    if not isinstance(logprobs, list) or len(logprobs) != len(generation):
        raise GymResultError(
            f"model call {turn}: generation_log_probs has "
            f"{len(logprobs) if isinstance(logprobs, list) else type(logprobs).__name__} entries "
            f"for {len(generation)} generation_token_ids"
        )
    return prompt, generation, _logprob_tensor(logprobs, turn)


def _turn_messages(
    new_prompt: list[int], generation: list[int], logprobs: torch.Tensor, flags: tuple[bool, bool], turn: int
) -> list[dict[str, Any]]:
    """The user message (the prompt tokens new since the history) and the assistant message of one model call."""
    invalid, malformed = flags
    user_ids = _token_tensor(new_prompt, "prompt_token_ids", turn)
    generation_ids = _token_tensor(generation, "generation_token_ids", turn)
    return [
        {"role": "user", "content": "", "token_ids": user_ids},
        {
            "role": "assistant",
            "content": "",
            "token_ids": generation_ids,
            "generation_logprobs": logprobs,
            "is_invalid_tool_call": invalid,
            "has_malformed_thinking": malformed,
        },
    ]


def _decode_onto(converted: list[tuple[JsonObject, list[int], list[int]]], tokenizer: Tokenizer) -> None:
    """``prompt_str`` / ``generation_str`` of every converted model call, decoded in one pass, onto its item."""
    try:
        prompt_strs, generation_strs = decode_turns(
            tokenizer, [u for _, u, _ in converted], [g for _, _, g in converted]
        )
    except OverflowError:
        raise GymResultError("a model call's token ids hold one the tokenizer cannot decode (past its range)") from None
    for (item, _, _), prompt_str, generation_str in zip(converted, prompt_strs, generation_strs, strict=True):
        item["prompt_str"] = prompt_str
        item["generation_str"] = generation_str


def _output_items(result: Any) -> list[Any]:
    if not isinstance(result, dict):
        raise GymResultError(f"a NeMo-Gym result must be a dict, got {type(result).__name__}")
    response = result.get("response")
    output = response.get("output") if isinstance(response, dict) else None
    if not isinstance(output, list):
        raise GymResultError(
            f"a NeMo-Gym result needs response.output as a list; result keys: {sorted(result)}, "
            f"response: {type(response).__name__}"
        )
    return output


def _int_list(value: Any, name: str, turn: int, start: int = 0) -> list[int]:
    """``value`` if it is a list of ints from ``start`` on (``set(map(type, ...))`` runs in C)."""
    if not isinstance(value, list) or not set(map(type, value[start:] if start else value)) <= _INT_TYPE:
        raise GymResultError(f"model call {turn}: {name} must be a list of ints, got {type(value).__name__}")
    return value


def _tensor(values: list[Any], dtype: torch.dtype) -> torch.Tensor:
    """A 1-D tensor of Python numbers, built through ``array.array``: about 4x faster than ``torch.tensor``."""
    if not values:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(array.array(_ARRAY_TYPECODES[dtype], values), dtype=dtype)


def _check_token_range(message_log: list[dict[str, Any]], vocab_size: int) -> None:
    """Token ids lie in ``[0, vocab_size)`` (one vectorised pass over the row; the types were checked per list)."""
    ids = torch.cat([message["token_ids"] for message in message_log])
    if not ids.numel() or (int(ids.min()) >= 0 and int(ids.max()) < vocab_size):
        return
    turn = next(
        i
        for i, m in enumerate(message_log)
        if m["token_ids"].numel() and (int(m["token_ids"].min()) < 0 or int(m["token_ids"].max()) >= vocab_size)
    )
    field = "prompt_token_ids" if turn % 2 == 0 else "generation_token_ids"
    raise GymResultError(f"model call {turn // 2}: {field} has a token id outside [0, {vocab_size})")


def _token_tensor(token_ids: list[int], name: str, turn: int) -> torch.Tensor:
    try:
        return _tensor(token_ids, TOKEN_DTYPE)
    except OverflowError:
        raise GymResultError(f"model call {turn}: {name} has a token id outside the int64 range") from None


def _logprob_tensor(logprobs: list[Any], turn: int) -> torch.Tensor:
    """The float32 tensor of one call's logprobs; NaN or null is :class:`NaNLogprobs`."""
    try:
        tensor = _tensor(logprobs, LOGPROB_DTYPE)
    except (TypeError, OverflowError):
        if any(lp is None for lp in logprobs):
            raise NaNLogprobs(f"model call {turn}: generation logprobs contain NaN (or null)") from None
        raise GymResultError(f"model call {turn}: generation_log_probs must be a list of numbers") from None
    # A float sum is NaN when any term is (or inf meets -inf): one C loop, then the exact check.
    total = sum(logprobs)
    if total != total and bool(tensor.isnan().any()):
        raise NaNLogprobs(f"model call {turn}: generation logprobs contain NaN (or null)")
    return tensor


def _first_difference(history: list[int], prompt: list[int]) -> int | None:
    """The first index where ``prompt`` stops extending ``history``; None if it does."""
    if prompt[: len(history)] == history:
        return None
    for i, token in enumerate(history):
        if i >= len(prompt) or prompt[i] != token:
            return i
    return None


def _drift_message(drift: JsonObject, seen: list[int], prompt: list[int], tokenizer: Tokenizer) -> str:
    i = drift["position"]
    start = max(0, i - _DRIFT_WINDOW)
    return (
        f"model call {drift['turn']}: its prompt ({len(prompt)} tokens) does not extend the token history "
        f"of the earlier calls ({len(seen)} tokens); first difference at position {i}: "
        f"history {seen[start : i + _DRIFT_WINDOW]} {_decode(tokenizer, seen[start : i + _DRIFT_WINDOW])!r} vs "
        f"prompt {prompt[start : i + _DRIFT_WINDOW]} {_decode(tokenizer, prompt[start : i + _DRIFT_WINDOW])!r} "
        f"(from position {start}). Likely causes: the chat template re-renders earlier turns "
        f"(e.g. strips reasoning), retokenization merges tokens, or the agent truncated or summarized history"
    )


def _decode(tokenizer: Tokenizer, ids: list[int]) -> str:
    try:
        return str(tokenizer.decode(ids))
    except Exception as exc:  # only for a diagnostic message
        return f"<decode failed: {exc}>"


def _missing_message(result: JsonObject, output: list[Any], tokenizer: Tokenizer) -> str:
    types = [item.get("type", "?") if isinstance(item, dict) else type(item).__name__ for item in output]
    response = result.get("response") or {}
    incomplete = response.get("incomplete_details") if isinstance(response, dict) else None
    return (
        f"NeMo-Gym returned a result with no generation data: output item types {types}, "
        f"incomplete_details {incomplete}, {_first_prompt_length(result, tokenizer)}. Likely causes: the first "
        f"prompt already exceeds the model's max_model_len (Gym turns the context-length 400 into an empty "
        f"rollout), the model server does not return token ids (use vllm_model_for_training.yaml, "
        f"return_token_id_information: true), or the model produced no generation"
    )


def _first_prompt_length(result: JsonObject, tokenizer: Tokenizer) -> str:
    """The first prompt's length as the model server renders it: the input messages and the tools the request offers."""
    params = result.get("responses_create_params")
    if not isinstance(params, dict):
        params = {}
    messages = params.get("input")
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    if not isinstance(messages, list):
        return "first prompt length unknown (no input messages)"
    tools = [_chat_tool(tool) for tool in params.get("tools") or [] if isinstance(tool, dict)]
    try:
        chat: list[JsonObject] = [{"role": m["role"], "content": m["content"]} for m in messages]
        ids = render_ids(tokenizer, chat, tools or None, True, None)
    except Exception as exc:  # only for a diagnostic message
        return f"first prompt length unknown ({type(exc).__name__}: {exc})"
    with_tools = f", {len(tools)} tools included" if tools else ""
    return f"first prompt ~{len(ids)} tokens by the chat template{with_tools}"


def _chat_tool(tool: JsonObject) -> JsonObject:
    """A Responses API function tool (``name`` at the top) in the chat shape the chat template renders."""
    if "function" not in tool and "name" in tool:
        return {"type": "function", "function": {k: v for k, v in tool.items() if k not in ("type", "strict")}}
    return tool
