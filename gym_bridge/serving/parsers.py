"""Output parsers: Hermes ``<tool_call>`` blocks (vLLM's ``hermes`` tool parser) and ``<think>`` reasoning."""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from gym_bridge.boundary import json_io
from gym_bridge.boundary.errors import UntrustedInputError
from gym_bridge.json_types import JsonObject

_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)\Z", re.DOTALL)


@dataclass
class ParsedMessage:
    """An assistant turn's text split into visible content, reasoning and OpenAI ``tool_calls``."""

    content: str | None
    reasoning_content: str | None = None
    tool_calls: list[JsonObject] = field(default_factory=list)


def parse_reasoning(text: str) -> tuple[str | None, str]:
    """Split ``<think>…</think>`` off ``text``: (reasoning or None, remaining content).

    An opened block that never closes (the turn was cut) is all reasoning.
    """
    start = text.find("<think>")
    end = text.find("</think>")
    if end >= 0 and (start < 0 or start < end):
        begin = start + len("<think>") if start >= 0 else 0
        reasoning = text[begin:end].strip("\n")
        rest = text[: max(start, 0)] + text[end + len("</think>") :]
        return reasoning, rest.lstrip("\n")
    if start >= 0 and end < 0:
        return text[start + len("<think>") :].strip("\n"), text[:start]
    return None, text


def parse_tool_calls(text: str) -> tuple[str | None, list[JsonObject]]:
    """Hermes tool calls: (content outside the calls or None, OpenAI ``tool_calls``).

    Like vLLM's hermes parser, a call whose JSON does not parse (or lacks a name)
    means no tool calls at all: the whole text stays content. The model's text is decoded by the boundary's
    decoder: a call nested past its depth limit is JSON that does not parse.
    """
    if "<tool_call>" not in text:
        return (text or None), []
    calls = []
    for match in _TOOL_CALL.finditer(text):
        body = (match.group(1) if match.group(1) is not None else match.group(2)).strip()
        try:
            obj = json_io.loads(body, "the model's tool call")
        except UntrustedInputError:
            return (text or None), []
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return (text or None), []
        args = obj.get("arguments", obj.get("parameters", {}))
        calls.append(
            {
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {
                    "name": obj["name"],
                    "arguments": args if isinstance(args, str) else json.dumps(args, ensure_ascii=False),
                },
            }
        )
    content = _TOOL_CALL.sub("", text).strip()
    return (content or None), calls


def parse_assistant_text(text: str, *, reasoning: bool, tools: bool) -> ParsedMessage:
    """Reasoning first (when the reasoning parser is on), then tool calls (when tools were offered)."""
    thought = None
    if reasoning:
        thought, text = parse_reasoning(text)
    if tools:
        content, calls = parse_tool_calls(text)
        return ParsedMessage(content, thought, calls)
    return ParsedMessage(text or None, thought)
