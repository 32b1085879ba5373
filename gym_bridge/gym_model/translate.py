"""Responses API <-> chat, as the installed NeMo-Gym's ``vllm_model`` does it, on plain dicts.

:func:`responses_to_chat` mirrors ``ResponsesConverter.responses_to_chat_completion_create_params``
plus ``VLLMModel._preprocess_chat_completion_create_params`` (role mapping, chat-template
kwargs and ``extra_body`` from the config and the row's ``metadata``, ``<think>`` moved
out of earlier assistant turns). :func:`output_items` and :func:`response_body` mirror
``postprocess_assistant_message_dict`` and the ``NeMoGymResponse`` that ``vllm_model``
returns, field for field. What differs between Gym versions comes from :mod:`gym_bridge.gym_versions`.
No pydantic on the request path: these run once per model turn.
"""

from __future__ import annotations

import re
import time
import uuid
from dataclasses import dataclass, field

from gym_bridge.boundary import json_io
from gym_bridge.boundary.errors import UntrustedInputError
from gym_bridge.failures import GymBridgeError
from gym_bridge.gym_versions import installed_gym
from gym_bridge.json_types import JsonMapping, JsonObject

_THINK = re.compile(r"<think>(.*?)</think>", re.DOTALL)
_FUNCTION_KEYS = ("name", "description", "parameters")
_TOKEN_KEYS = ("prompt_token_ids", "generation_token_ids", "generation_log_probs")


class TranslationError(GymBridgeError, ValueError):
    """A Responses request this server cannot turn into a chat (a 400 naming the item and field)."""


@dataclass
class ChatTurn:
    """One model turn as a chat: what is rendered, how it is sampled, what is echoed back."""

    messages: list[JsonObject]
    tools: list[JsonObject] | None
    chat_template_kwargs: JsonObject
    sampling: JsonObject
    """``max_tokens``, ``temperature``, ``top_p`` when the request set them, plus ``extra_body``."""
    parse_tools: bool
    """Tools were offered and ``tool_choice`` is not ``"none"``: Hermes ``<tool_call>``s are parsed."""
    echo: JsonObject = field(default_factory=dict)


@dataclass
class _State:
    per_turn: bool
    """Gym 0.6+'s converter (``GymVersion.converter_flushes_per_turn``); before, the last token ids seen ride on
    every later assistant message and an assistant message always has ``tool_calls``."""
    messages: list[JsonObject] = field(default_factory=list)
    content: str = ""
    tool_calls: list[JsonObject] = field(default_factory=list)
    token_info: JsonObject | None = None
    buffered: bool = False
    """An assistant, reasoning or function-call item was seen since the last flush (Gym 0.6+ flushes it even empty)."""

    def flush_assistant(self) -> None:
        if not (self.content or self.tool_calls or (self.per_turn and self.buffered)):
            if self.per_turn:
                self.token_info = None
            return
        message: JsonObject = {"content": self.content or None, "role": "assistant"}
        if self.tool_calls or not self.per_turn:
            message["tool_calls"] = self.tool_calls
        if self.token_info:
            message.update(self.token_info)
        self.messages.append(message)
        self.content, self.tool_calls, self.buffered = "", [], False
        if self.per_turn:
            self.token_info = None


def responses_to_chat(
    body: JsonObject,
    *,
    uses_reasoning_parser: bool,
    uses_interleaved_reasoning: bool = True,
    replace_developer_role_with_system: bool = False,
    chat_template_kwargs: JsonObject | None = None,
    extra_body: JsonObject | None = None,
) -> ChatTurn:
    """The chat ``vllm_model`` would send for the Responses request ``body`` (a parsed JSON object)."""
    messages = _input_messages(body.get("input"))

    if replace_developer_role_with_system:
        for message in messages:
            if message.get("role") == "developer":
                message["role"] = "system"
    metadata = body.get("metadata") or {}
    template_kwargs = dict(chat_template_kwargs or {})
    template_kwargs.update(_json_object(metadata.get("chat_template_kwargs", "{}"), "metadata.chat_template_kwargs"))
    extra = dict(extra_body or {})
    extra.update(_json_object(metadata.get("extra_body", "{}"), "metadata.extra_body"))
    if uses_reasoning_parser:
        for message in messages:
            _move_reasoning(message, uses_interleaved_reasoning)

    tools = [_chat_tool(t, i) for i, t in enumerate(body.get("tools") or [])] or None
    sampling: JsonObject = {}
    if body.get("max_output_tokens") is not None:
        sampling["max_tokens"] = body["max_output_tokens"]
    for key in ("temperature", "top_p"):
        if body.get(key) is not None:
            sampling[key] = body[key]
    extra_template_kwargs = extra.pop("chat_template_kwargs", None)
    if not template_kwargs and extra_template_kwargs:  # as in Gym, the request's own kwargs win over extra_body's
        template_kwargs = dict(extra_template_kwargs)
    sampling = {**extra, **sampling}
    tool_choice = body.get("tool_choice", "auto")
    return ChatTurn(
        messages=messages,
        tools=tools,
        chat_template_kwargs=template_kwargs,
        sampling=sampling,
        parse_tools=bool(tools) and tool_choice != "none",
        echo=body,
    )


def _input_messages(raw_input: object) -> list[JsonObject]:
    """The chat messages of a Responses ``input`` (a string, or a list of message, reasoning, function-call and
    function-call-output items), turns grouped as the installed Gym's converter groups them."""
    if isinstance(raw_input, str):
        items: list[object] = [
            {"content": [{"text": raw_input, "type": "input_text"}], "role": "user", "type": "message"}
        ]
    elif isinstance(raw_input, list):
        items = raw_input
    else:
        raise TranslationError("input must be a string or a list of items")
    state = _State(per_turn=installed_gym().converter_flushes_per_turn)
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise TranslationError(f"input[{i}] must be an object")
        kind = item.get("type") or ("message" if item.get("role") else None)
        try:
            if kind == "message":
                _message(item, state)
            elif kind == "reasoning":
                state.buffered = True
                texts = [s["text"] for s in item.get("summary") or []]
                state.content += "".join(f"<think>{t}</think>" for t in texts if t)
            elif kind == "function_call":
                state.buffered = True
                state.tool_calls.append(
                    {
                        "id": item["call_id"],
                        "function": {"arguments": item["arguments"], "name": item["name"]},
                        "type": "function",
                    }
                )
            elif kind == "function_call_output":
                state.flush_assistant()
                state.messages.append({"content": item["output"], "role": "tool", "tool_call_id": item["call_id"]})
            else:
                raise TranslationError(f"input[{i}] has an unsupported type {kind!r}")
        except KeyError as exc:
            raise TranslationError(f"input[{i}] ({kind}) lacks the field {exc.args[0]!r}") from None
        if item.get("prompt_token_ids"):
            try:
                info = {key: item[key] for key in _TOKEN_KEYS}
            except KeyError as exc:
                raise TranslationError(f"input[{i}] carries prompt_token_ids but not {exc.args[0]!r}") from None
            if item.get("routed_experts") is not None:
                info["routed_experts"] = item["routed_experts"]
            state.token_info = info
    state.flush_assistant()
    return state.messages


def _message(item: JsonMapping, state: _State) -> None:
    role = item["role"]
    content = item["content"]
    if isinstance(content, list) and role != "assistant":
        parts = []
        for part in content:
            kind = part.get("type")
            if kind == "input_text":
                parts.append({"type": "text", "text": part["text"]})
            elif kind == "input_image":
                parts.append(
                    {
                        "type": "image_url",
                        "image_url": {"url": part.get("image_url", ""), "detail": part.get("detail", "auto")},
                    }
                )
            else:
                raise TranslationError(f"unsupported content part type {kind!r}")
        content = parts
    if role == "assistant":
        state.buffered = True
        if isinstance(content, list):
            state.content += "".join(part.get("text", "") for part in content)
        elif isinstance(content, str):
            state.content += content
        else:
            raise TranslationError("an assistant message's content must be a string or a list of parts")
    elif role in ("user", "system", "developer"):
        state.flush_assistant()
        state.messages.append({"content": content, "role": role})
    else:
        raise TranslationError(f"unsupported message role {role!r}")


def _move_reasoning(message: JsonObject, interleaved: bool) -> None:
    """``<think>`` of an earlier assistant turn goes to ``reasoning_content`` (as ``vllm_model`` sends it)."""
    if message.get("role") != "assistant" or "content" not in message:
        return
    content = message["content"]
    if isinstance(content, str):
        found, message["content"] = _THINK.findall(content), _THINK.sub("", content)
        if found and interleaved:
            message["reasoning_content"] = message["reasoning"] = found[0]


def _chat_tool(tool: object, i: int) -> JsonObject:
    if not isinstance(tool, dict) or not isinstance(tool.get("name"), str):
        raise TranslationError(f"tools[{i}] must be a function tool with a name")
    # Key order as Gym's TypedDicts dump them: templates render tools with ``tojson``, so it is part of the tokens.
    function = {k: tool[k] for k in _FUNCTION_KEYS if k in tool}
    function.update((k, v) for k, v in tool.items() if k not in function and k not in ("type", "strict"))
    return {"function": function, "type": "function"}


def _json_object(text: object, where: str) -> JsonObject:
    """``text`` decoded by the boundary's decoder (its depth limit included) as a JSON object."""
    try:
        value = json_io.loads(text, where) if isinstance(text, str) else text
    except UntrustedInputError as exc:
        raise TranslationError(f"{where} is not JSON we accept: {str(exc).removeprefix(f'{where}: ')}") from None
    if not isinstance(value, dict):
        raise TranslationError(f"{where} must be a JSON object")
    return value


# ---------------------------------------------------------------------- output


def output_items(
    content: str | None,
    tool_calls: list[JsonObject],
    *,
    uses_reasoning_parser: bool,
    token_fields: JsonObject | None,
) -> list[JsonObject]:
    """The output items of one turn: reasoning, message (if text, or if nothing at all), function calls.

    ``token_fields`` (``prompt_token_ids`` ...) go on the last item, as Gym's training items carry them.
    """
    items: list[JsonObject] = []
    text = content or ""
    found: list[str] = []
    if uses_reasoning_parser:
        found, text = _THINK.findall(text), _THINK.sub("", text)
    if found:
        items.append(
            {
                "id": f"rs_{uuid.uuid4().hex}",
                "summary": [{"text": t, "type": "summary_text"} for t in found],
                "type": "reasoning",
                "encrypted_content": None,
            }
        )
    if text or not (items or tool_calls):
        items.append(
            {
                "id": f"msg_{uuid.uuid4().hex}",
                "content": [{"annotations": [], "text": text, "type": "output_text", "logprobs": None}],
                "role": "assistant",
                "status": "completed",
                "type": "message",
            }
        )
    for call in tool_calls:
        items.append(
            {
                "arguments": call["function"]["arguments"],
                "call_id": call["id"],
                "name": call["function"]["name"],
                "type": "function_call",
                "id": call["id"],
                "status": "completed",
            }
        )
    if token_fields is not None:
        items[-1] = {**token_fields, "routed_experts": None, **items[-1]}
    null_fields = installed_gym().output_item_null_fields
    return [{**item, **dict.fromkeys(null_fields.get(item["type"], ()))} for item in items]


def empty_output_items() -> list[JsonObject]:
    """What ``vllm_model`` returns for a prompt over the context length: one empty message, no token ids."""
    return output_items(None, [], uses_reasoning_parser=False, token_fields=None)


def response_body(
    echo: JsonMapping,
    model: str,
    output: list[JsonObject],
    *,
    finish_reason: str,
    usage: tuple[int, int] | None,
) -> JsonObject:
    """The ``NeMoGymResponse`` JSON ``vllm_model`` returns, every field present (nulls included)."""
    incomplete = {"reason": "max_output_tokens"} if finish_reason == "length" else None
    if finish_reason == "content_filter":
        incomplete = {"reason": "content_filter"}
    usage_body = None
    if usage is not None:
        prompt, completion = usage
        unreported = None if installed_gym().usage_details_unknown else 0
        usage_body = {
            "input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": unreported},
            "output_tokens": completion,
            "output_tokens_details": {"reasoning_tokens": unreported},
            "total_tokens": prompt + completion,
        }
    get = echo.get
    tool_choice = get("tool_choice")
    return {
        "id": f"resp_{uuid.uuid4().hex}",
        "created_at": float(int(time.time())),
        "error": None,
        "incomplete_details": incomplete,
        "instructions": get("instructions"),
        "metadata": get("metadata"),
        "model": model,
        "object": "response",
        "output": output,
        "parallel_tool_calls": get("parallel_tool_calls", True),
        "temperature": get("temperature"),
        "tool_choice": tool_choice if tool_choice is not None else "auto",
        "tools": get("tools") or [],
        "top_p": get("top_p"),
        "background": get("background"),
        "conversation": None,
        "max_output_tokens": get("max_output_tokens"),
        "max_tool_calls": get("max_tool_calls"),
        "previous_response_id": get("previous_response_id"),
        "prompt": get("prompt"),
        "prompt_cache_key": None,
        "reasoning": get("reasoning"),
        "safety_identifier": None,
        "service_tier": get("service_tier"),
        "status": ("incomplete" if incomplete else "completed") if installed_gym().response_status else None,
        "text": get("text"),
        "top_logprobs": get("top_logprobs"),
        "truncation": get("truncation"),
        "usage": usage_body,
        "user": get("user"),
        **dict.fromkeys(installed_gym().response_null_fields),
    }
