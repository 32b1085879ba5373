"""The answers of the completion routes: the OpenAI envelope, each choice (parsed message, logprobs, token ids as
the server's features allow), usage, and the weight version that generated them."""

from __future__ import annotations

import time
import uuid

from gym_bridge.json_types import JsonObject
from gym_bridge.serving.chat import ChatPrompt
from gym_bridge.serving.engine import Sample, weight_version_of
from gym_bridge.serving.parsers import parse_assistant_text
from gym_bridge.serving.protocol import ChatCompletionRequest, CompletionRequest
from gym_bridge.serving.state import ServingState

#: Response header naming the weight version that generated the response (engines with refits only).
WEIGHT_VERSION_HEADER = "x-gym-bridge-weight-version"


def response_body(
    id_prefix: str, kind: str, model: str | None, state: ServingState, choices: list[JsonObject], usage: dict[str, int]
) -> JsonObject:
    """The OpenAI response envelope both completion routes answer with."""
    return {
        "id": f"{id_prefix}-{uuid.uuid4().hex}",
        "object": kind,
        "created": int(time.time()),
        "model": model or state.served_model_name,
        "choices": choices,
        "usage": usage,
    }


def chat_choice(
    state: ServingState, req: ChatCompletionRequest, prompt: ChatPrompt, index: int, sample: Sample
) -> JsonObject:
    """One chat choice: the parsed message (reasoning, tool calls), logprobs and token ids as the features allow."""
    features = state.features
    use_tools = bool(req.tools) and req.tool_choice != "none"
    text = _text(state, sample, req.stop_strings())
    parsed = parse_assistant_text(text, reasoning=state.reasoning_parser, tools=use_tools)
    finish = sample.finish_reason
    if parsed.tool_calls and finish == "stop":
        finish = "tool_calls"
    message: JsonObject = {"role": "assistant", "content": parsed.content, "tool_calls": parsed.tool_calls}
    if state.reasoning_parser:
        message["reasoning_content"] = parsed.reasoning_content
    if features.token_ids:
        message["prompt_token_ids"] = prompt.token_ids
        message["generation_token_ids"] = sample.token_ids
        message["generation_log_probs"] = sample.logprobs
    as_ids = req.return_tokens_as_token_ids is not False and features.token_ids
    choice: JsonObject = {
        "index": index,
        "message": message,
        "logprobs": _chat_logprobs(state, sample, as_ids) if req.logprobs and features.logprobs else None,
        "finish_reason": finish,
        "stop_reason": None,
    }
    if req.return_token_ids and features.token_ids:
        choice["token_ids"] = sample.token_ids
    if sample.weight_version is not None:
        choice["weight_version"] = sample.weight_version
    return choice


def completion_choice(
    state: ServingState, req: CompletionRequest, prompt_ids: list[int], index: int, sample: Sample
) -> JsonObject:
    """One text-completion choice: the text, logprobs when asked, token ids when asked."""
    as_ids = bool(req.return_tokens_as_token_ids)
    choice: JsonObject = {
        "index": index,
        "text": _text(state, sample, req.stop_strings()),
        "logprobs": _completion_logprobs(state, sample, as_ids) if req.logprobs is not None else None,
        "finish_reason": sample.finish_reason,
        "stop_reason": None,
    }
    if req.return_token_ids:
        choice["prompt_token_ids"] = prompt_ids
        choice["token_ids"] = sample.token_ids
    if sample.weight_version is not None:
        choice["weight_version"] = sample.weight_version
    return choice


def _text(state: ServingState, sample: Sample, stops: list[str]) -> str:
    """The visible text: special tokens skipped, cut before the first stop string (vLLM's default)."""
    text = state.tokenizer.decode(sample.token_ids, skip_special_tokens=True)
    cuts = [text.find(s) for s in stops if s in text]
    return text[: min(cuts)] if cuts else text


def _token_label(state: ServingState, token_id: int, as_ids: bool) -> str:
    return f"token_id:{token_id}" if as_ids else state.tokenizer.decode([token_id], skip_special_tokens=False)


def _chat_logprobs(state: ServingState, sample: Sample, as_ids: bool) -> JsonObject:
    content = []
    for tok, lp in zip(sample.token_ids, sample.logprobs, strict=True):
        label = _token_label(state, tok, as_ids)
        content.append({"token": label, "logprob": lp, "bytes": list(label.encode()), "top_logprobs": []})
    return {"content": content}


def _completion_logprobs(state: ServingState, sample: Sample, as_ids: bool) -> JsonObject:
    tokens = [_token_label(state, t, as_ids) for t in sample.token_ids]
    offsets, pos = [], 0
    for tok in sample.token_ids:
        offsets.append(pos)
        pos += len(state.tokenizer.decode([tok], skip_special_tokens=True))
    return {"tokens": tokens, "token_logprobs": sample.logprobs, "top_logprobs": None, "text_offset": offsets}


def with_weight_version(body: JsonObject, samples: list[Sample], headers: dict[str, str]) -> dict[str, str]:
    """Top-level ``weight_version`` (the oldest among the choices; each choice has its own) and its header."""
    version = weight_version_of(samples)
    if version is None:
        return headers
    body["weight_version"] = version
    return {**headers, WEIGHT_VERSION_HEADER: str(version)}


def usage_of(prompt_tokens: int, samples: list[Sample]) -> dict[str, int]:
    completion = sum(len(s.token_ids) for s in samples)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion}
