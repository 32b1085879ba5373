"""ScriptedGeneration: the rules, caps, stop strings, and both generate paths."""

from __future__ import annotations

import asyncio

import torch

from gym_bridge.batched import BatchedDataDict
from gym_bridge.generation.scripted import SCRIPTED_LOGPROB, ScriptedGeneration

TOOL = {
    "type": "function",
    "function": {
        "name": "search",
        "parameters": {
            "type": "object",
            "properties": {"limit": {"type": "integer"}, "query": {"type": "string"}},
            "required": ["limit", "query"],
        },
    },
}


def _batch(tokenizer, conversations, tools=None, stop=None):
    rows = [
        tokenizer.encode(
            tokenizer.apply_chat_template(c, tools=tools, add_generation_prompt=True, tokenize=False),
            add_special_tokens=False,
        )
        for c in conversations
    ]
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.int64)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
    data = {"input_ids": ids, "input_lengths": torch.tensor([len(r) for r in rows])}
    if stop is not None:
        data["stop_strings"] = stop
    return BatchedDataDict(data), rows


def _generated(tokenizer, out, rows, i):
    n = len(rows[i])
    g = int(out["generation_lengths"][i])
    return out["output_ids"][i, n : n + g].tolist(), out["logprobs"][i, n : n + g]


def test_rules(tiny_tokenizer):
    gen = ScriptedGeneration(tiny_tokenizer)
    data, rows = _batch(
        tiny_tokenizer,
        [[{"role": "user", "content": "Reply with exactly: 42"}], [{"role": "user", "content": "Hello there"}]],
    )
    out = gen.generate(data)
    ids, lps = _generated(tiny_tokenizer, out, rows, 0)
    assert ids[-1] == tiny_tokenizer.eos_token_id
    assert tiny_tokenizer.decode(ids, skip_special_tokens=True) == "42"
    assert torch.allclose(lps, torch.full_like(lps, SCRIPTED_LOGPROB))
    ids, _ = _generated(tiny_tokenizer, out, rows, 1)
    assert tiny_tokenizer.decode(ids, skip_special_tokens=True) == "I am a scripted assistant."
    assert not out["truncated"].any()
    assert out["unpadded_sequence_lengths"].tolist() == [
        len(rows[0]) + len(_generated(tiny_tokenizer, out, rows, 0)[0]),
        len(rows[1]) + int(out["generation_lengths"][1]),
    ]


def test_tool_call_then_answer(tiny_tokenizer):
    gen = ScriptedGeneration(tiny_tokenizer)
    first = [{"role": "user", "content": "Find cheap flights"}]
    data, rows = _batch(tiny_tokenizer, [first], tools=[TOOL])
    ids, _ = _generated(tiny_tokenizer, gen.generate(data), rows, 0)
    text = tiny_tokenizer.decode(ids, skip_special_tokens=True)
    assert text == '<tool_call>\n{"name": "search", "arguments": {"query": "flights"}}\n</tool_call>'
    second = first + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"type": "function", "function": {"name": "search", "arguments": {"query": "flights"}}}],
        },
        {"role": "tool", "content": "none found"},
    ]
    data, rows = _batch(tiny_tokenizer, [second], tools=[TOOL])
    ids, _ = _generated(tiny_tokenizer, gen.generate(data), rows, 0)
    assert tiny_tokenizer.decode(ids, skip_special_tokens=True) == "I am a scripted assistant."


def test_caps_and_stop_strings_async(tiny_tokenizer):
    gen = ScriptedGeneration(tiny_tokenizer, max_new_tokens=3)
    data, rows = _batch(tiny_tokenizer, [[{"role": "user", "content": "Hello"}]] * 2, stop=[None, ["scripted"]])

    async def collect():
        return [item async for item in gen.generate_async(data)]

    got = dict(asyncio.run(collect()))
    assert set(got) == {0, 1}
    assert int(got[0]["generation_lengths"][0]) == 3 and bool(got[0]["truncated"][0])

    gen = ScriptedGeneration(tiny_tokenizer)
    got = dict(asyncio.run(collect()))
    n = len(rows[1])
    ids = got[1]["output_ids"][0, n : n + int(got[1]["generation_lengths"][0])].tolist()
    text = tiny_tokenizer.decode(ids)
    assert "scripted" in text and "assistant" not in text
    assert not bool(got[1]["truncated"][0])


def test_the_context_is_max_model_len_else_the_tokenizers_model_max_length(tiny_tokenizer):
    """Why Gym's long ``lc`` rows fail on the tiny tokenizer (docs/nemo_gym.md, the ``gym dataset collate``
    walk-through): without ``max_model_len`` the context is the tokenizer's ``model_max_length``, 2,048 for tiny, and
    our server reads the engine's as its own. A prompt that fills it gets no tokens, cut (``truncated``)."""
    from gym_bridge.serving.engine import EngineProfile

    default = ScriptedGeneration(tiny_tokenizer)
    assert default.max_model_len == tiny_tokenizer.model_max_length == 2048
    assert EngineProfile.of(default, tiny_tokenizer).max_model_len == 2048
    assert ScriptedGeneration(tiny_tokenizer, max_model_len=8192).max_model_len == 8192
    long = [{"role": "user", "content": "Reply with exactly: 42 " + "word " * 2100}]
    data, rows = _batch(tiny_tokenizer, [long])
    assert len(rows[0]) > 2048
    out = default.generate(data)
    assert int(out["generation_lengths"][0]) == 0 and bool(out["truncated"][0])
    out = ScriptedGeneration(tiny_tokenizer, max_model_len=len(rows[0]) + 64).generate(data)
    ids, _ = _generated(tiny_tokenizer, out, rows, 0)
    assert tiny_tokenizer.decode(ids, skip_special_tokens=True).startswith("42 word")
