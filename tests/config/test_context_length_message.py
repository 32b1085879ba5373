"""The MissingGenerationData message counts the whole first prompt the model server renders, tools included: a row
whose tool list pushes it past the context names a length over the context, not the length of its messages alone."""

from __future__ import annotations

import re

import pytest

from gym_bridge.failures import MissingGenerationData
from gym_bridge.gym.protocol.convert import convert_gym_result
from gym_bridge.serving.chat import render_ids

MAX_SEQ_LEN = 1024


def _tool(i: int) -> dict:
    """A Responses API function tool (Gym's shape: ``name`` at the top, ``strict``), with a long description."""
    return {
        "type": "function",
        "name": f"lookup_record_{i}",
        "description": f"Looks up record {i} in the workplace directory and returns every field it holds. " * 3,
        "parameters": {"type": "object", "properties": {"record_id": {"type": "string"}}, "required": ["record_id"]},
        "strict": True,
    }


def _empty_result(tools: list[dict]) -> dict:
    """What Gym returns when the endpoint refused the first prompt as over the context: one empty message."""
    message = {"id": "msg_1", "content": [], "role": "assistant", "status": "completed", "type": "message"}
    return {
        "responses_create_params": {
            "input": [{"role": "user", "content": "Book a room.", "type": "message"}],
            "tools": tools,
        },
        "response": {"id": "resp_1", "object": "response", "output": [message], "incomplete_details": None},
        "reward": 0.0,
    }


def _reported_length(result: dict, tokenizer) -> tuple[int, str]:
    with pytest.raises(MissingGenerationData) as info:
        convert_gym_result(result, tokenizer)
    message = str(info.value)
    match = re.search(r"first prompt ~(\d+) tokens by the chat template", message)
    assert match, message
    return int(match.group(1)), message


def test_the_first_prompt_length_counts_the_tools_that_overflow_the_context(tiny_tokenizer):
    tools = [_tool(i) for i in range(12)]
    length, message = _reported_length(_empty_result(tools), tiny_tokenizer)
    chat_tools = [
        {"type": "function", "function": {k: v for k, v in t.items() if k not in ("type", "strict")}} for t in tools
    ]
    expected = render_ids(tiny_tokenizer, [{"role": "user", "content": "Book a room."}], chat_tools, True, None)
    assert length == len(expected) > MAX_SEQ_LEN  # the number points at the cause: the prompt is over the context
    assert "12 tools included" in message
    bare, bare_message = _reported_length(_empty_result([]), tiny_tokenizer)
    assert bare < 100 < MAX_SEQ_LEN < length  # the messages alone would have pointed away from it
    assert "tools included" not in bare_message
