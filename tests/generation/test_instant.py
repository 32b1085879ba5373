"""InstantGeneration: the fixed reply, its logprobs, the caps, both generate paths, and the serve flag."""

from __future__ import annotations

import asyncio

import pytest
import torch

from gym_bridge.batched import BatchedDataDict
from gym_bridge.cli import build_parser
from gym_bridge.generation.instant import INSTANT_LOGPROB, InstantGeneration


def _batch(prompts: list[list[int]], pad: int, **extra) -> BatchedDataDict:
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad, dtype=torch.int64)
    for i, p in enumerate(prompts):
        ids[i, : len(p)] = torch.tensor(p)
    return BatchedDataDict({"input_ids": ids, "input_lengths": torch.tensor([len(p) for p in prompts]), **extra})


def test_fixed_reply_ends_in_eos_and_round_trips(tiny_tokenizer):
    gen = InstantGeneration(tiny_tokenizer, answer_tokens=16)
    prompts = [tiny_tokenizer.encode("Hello", add_special_tokens=False), [5, 6, 7, 8, 9, 10]]
    out = gen.generate(_batch(prompts, gen.pad_token_id))
    assert out["generation_lengths"].tolist() == [16, 16]
    assert not out["truncated"].any()
    for i, prompt in enumerate(prompts):
        n = len(prompt)
        ids = out["output_ids"][i, n : n + 16].tolist()
        assert out["output_ids"][i, :n].tolist() == prompt
        assert ids == list(gen.answer) and ids[-1] == tiny_tokenizer.eos_token_id
        assert torch.allclose(out["logprobs"][i, n : n + 16], torch.full((16,), INSTANT_LOGPROB))
        assert out["logprobs"][i, :n].abs().sum() == 0
        body = tiny_tokenizer.decode(ids[:-1])
        assert tiny_tokenizer.encode(body, add_special_tokens=False) == ids[:-1]
    assert out["unpadded_sequence_lengths"].tolist() == [len(p) + 16 for p in prompts]


def test_caps_truncate(tiny_tokenizer):
    gen = InstantGeneration(tiny_tokenizer, answer_tokens=8, max_new_tokens=5, max_model_len=12)
    out = gen.generate(_batch([[1, 2, 3], [1] * 10, [1, 2]], gen.pad_token_id, max_new_tokens=[None, 100, 20]))
    assert out["generation_lengths"].tolist() == [5, 2, 8]
    assert out["truncated"].tolist() == [True, True, False]
    assert gen.reply(prompt_len=12, max_new_tokens=100).tokens == []


def test_generate_async_matches_generate(tiny_tokenizer):
    gen = InstantGeneration(tiny_tokenizer, answer_tokens=4)
    data = _batch([[1, 2, 3], [4, 5]], gen.pad_token_id)

    async def collect():
        return [item async for item in gen.generate_async(data)]

    rows = asyncio.run(collect())
    assert [i for i, _ in rows] == [0, 1]
    whole = gen.generate(data)
    for i, out in rows:
        n = int(data["input_lengths"][i])
        assert out["output_ids"][0, : n + 4].tolist() == whole["output_ids"][i, : n + 4].tolist()


def test_rejects_empty_answer(tiny_tokenizer):
    with pytest.raises(ValueError, match="answer_tokens"):
        InstantGeneration(tiny_tokenizer, answer_tokens=0)


def test_serve_accepts_instant_policy():
    args = build_parser().parse_args(["serve", "--policy", "instant", "--answer-tokens", "8"])
    assert (args.policy, args.answer_tokens) == ("instant", 8)
