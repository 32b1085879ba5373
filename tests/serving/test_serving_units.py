"""Serving helpers without HTTP: the prefix splice and the output parsers."""

from __future__ import annotations

import json

import pytest

from gym_bridge.serving import ServingError, parse_reasoning, parse_tool_calls, replace_prefix_tokens


class _Tok:
    eos_token_id = 0

    def decode(self, ids):
        return " ".join(map(str, ids))


def test_replace_prefix_tokens():
    tok = _Tok()
    template_prefix = [5, 6, 0, 7, 8, 0]
    template = [5, 6, 0, 7, 9, 0, 3, 4]
    assert replace_prefix_tokens(tok, [], template_prefix, template) == template
    # model stopped with EOS: its EOS is replaced by the template's
    assert replace_prefix_tokens(tok, [5, 6, 0, 7, 1, 2, 0], template_prefix, template) == [5, 6, 0, 7, 1, 2, 0, 3, 4]
    # model stopped for length: the template's EOS is appended
    assert replace_prefix_tokens(tok, [5, 6, 0, 7, 1], template_prefix, template) == [5, 6, 0, 7, 1, 0, 3, 4]
    with pytest.raises(ServingError, match="EOS"):
        replace_prefix_tokens(tok, [1], [0, 0, 0], [0, 1])
    with pytest.raises(ServingError, match="no EOS"):
        replace_prefix_tokens(tok, [1], [1, 2], [1, 2])


def test_parse_tool_calls():
    content, calls = parse_tool_calls('Sure.\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>')
    assert content == "Sure." and calls[0]["function"]["name"] == "f"
    assert json.loads(calls[0]["function"]["arguments"]) == {"x": 1}
    content, calls = parse_tool_calls(
        '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b", "arguments": {}}'
    )
    assert content is None and [c["function"]["name"] for c in calls] == ["a", "b"]
    assert parse_tool_calls("<tool_call>{broken</tool_call>") == ("<tool_call>{broken</tool_call>", [])
    assert parse_tool_calls("") == (None, [])


def test_parse_reasoning():
    assert parse_reasoning("<think>\nhmm\n</think>\nanswer") == ("hmm", "answer")
    assert parse_reasoning("hmm</think>answer") == ("hmm", "answer")
    assert parse_reasoning("<think>cut off") == ("cut off", "")
    assert parse_reasoning("plain") == (None, "plain")
