"""Helpers for tests of a generation backend or a chat endpoint: prompt batches, a row's output, a tool schema.

Shared by our HF, HTTP, serving and proxy tests, so each checks the same padded layout and the
same tool the same way.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from gym_bridge.batched import BatchedDataDict
from gym_bridge.json_types import JsonObject
from gym_bridge.types import Tokenizer, padding_id

if TYPE_CHECKING:
    from transformers import PreTrainedModel

MIXED_PROMPTS = [
    "Hello there",
    "The final answer is 12 + 7 = 19 and then some more words follow here",
    "x",
    '{"name": "add", "arguments": {"a": 2}}',
]
"""Prompts of very different lengths (one token to a sentence), so padding and per-row lengths matter."""

WEATHER_TOOL: JsonObject = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
"""One OpenAI function tool with a required argument."""


def prompt_batch(tokenizer: Tokenizer, prompts: list[str], **extra: object) -> BatchedDataDict[Any]:
    """``input_ids`` right-padded two tokens beyond the longest prompt, with ``input_lengths`` and ``extra`` fields."""
    encoded = [tokenizer.encode(p, add_special_tokens=False) for p in prompts]
    width = max(len(e) for e in encoded) + 2
    ids = torch.full((len(encoded), width), padding_id(tokenizer), dtype=torch.int64)
    for i, e in enumerate(encoded):
        ids[i, : len(e)] = torch.tensor(e)
    lengths = torch.tensor([len(e) for e in encoded])
    return BatchedDataDict({"input_ids": ids, "input_lengths": lengths, **extra})


def unpadded(out: BatchedDataDict[Any], i: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Row ``i``'s prompt-plus-generation ids and logprobs, cut at ``unpadded_sequence_lengths``."""
    n = int(out["unpadded_sequence_lengths"][i])
    return out["output_ids"][i, :n], out["logprobs"][i, :n]


def generated(out: BatchedDataDict[Any], data: BatchedDataDict[Any], i: int) -> list[int]:
    """Only the ids row ``i`` generated (its prompt removed)."""
    n_in = int(data["input_lengths"][i])
    return [int(t) for t in out["output_ids"][i, n_in : int(out["unpadded_sequence_lengths"][i])]]


def assert_output_contract(
    out: BatchedDataDict[Any], data: BatchedDataDict[Any], tokenizer: Tokenizer, *, keys: set[str], max_new_tokens: int
) -> None:
    """NeMo-RL's generation output for ``data``: its keys and dtypes, the input then the generated tokens, right
    padding with the pad id, logprobs only (and negative) on generated positions, every row cut at the cap."""
    assert set(out.keys()) == keys
    bsz, width = data["input_ids"].shape
    assert out["output_ids"].dtype == torch.int64 and out["logprobs"].dtype == torch.float32
    assert out["generation_lengths"].dtype == torch.int64 and out["unpadded_sequence_lengths"].dtype == torch.int64
    assert out["truncated"].dtype == torch.bool
    gen_lens = out["generation_lengths"]
    assert out["output_ids"].shape == out["logprobs"].shape == (bsz, width + int(gen_lens.max()))
    assert torch.equal(out["unpadded_sequence_lengths"], data["input_lengths"] + gen_lens)
    for i in range(bsz):
        n_in, n = int(data["input_lengths"][i]), int(out["unpadded_sequence_lengths"][i])
        assert torch.equal(out["output_ids"][i, :n_in], data["input_ids"][i, :n_in])
        assert (out["output_ids"][i, n:] == padding_id(tokenizer)).all()
        assert (out["logprobs"][i, :n_in] == 0).all() and (out["logprobs"][i, n:] == 0).all()
        assert (out["logprobs"][i, n_in:n] < 0).all()
    assert (gen_lens == max_new_tokens).all() and out["truncated"].all()


def reference_logprobs(
    model: PreTrainedModel, seq: torch.Tensor, n_in: int, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """One full forward pass over ``seq``: the logprobs of its generated tokens (from ``n_in`` on) at
    ``temperature``, and the logits that predicted them."""
    with torch.inference_mode():
        logits = model(seq[None]).logits[0].float()
    pred = logits[n_in - 1 : seq.shape[0] - 1]
    return torch.log_softmax(pred / temperature, dim=-1).gather(-1, seq[n_in:, None]).squeeze(-1), pred
