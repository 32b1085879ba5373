"""Helpers for tests of a generation backend or a chat endpoint: prompt batches, a row's output, a tool schema.

Shared by our HF, HTTP, serving and proxy tests, so each checks the same padded layout and the
same tool the same way.
"""

from __future__ import annotations

from typing import Any

import torch

from gym_bridge.batched import BatchedDataDict
from gym_bridge.types import Tokenizer, padding_id

MIXED_PROMPTS = [
    "Hello there",
    "The final answer is 12 + 7 = 19 and then some more words follow here",
    "x",
    '{"name": "add", "arguments": {"a": 2}}',
]
"""Prompts of very different lengths (one token to a sentence), so padding and per-row lengths matter."""

WEATHER_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
"""One OpenAI function tool with a required argument."""


def prompt_batch(tokenizer: Tokenizer, prompts: list[str], **extra: Any) -> BatchedDataDict:
    """``input_ids`` right-padded two tokens beyond the longest prompt, with ``input_lengths`` and ``extra`` fields."""
    encoded = [tokenizer.encode(p, add_special_tokens=False) for p in prompts]
    width = max(len(e) for e in encoded) + 2
    ids = torch.full((len(encoded), width), padding_id(tokenizer), dtype=torch.int64)
    for i, e in enumerate(encoded):
        ids[i, : len(e)] = torch.tensor(e)
    lengths = torch.tensor([len(e) for e in encoded])
    return BatchedDataDict({"input_ids": ids, "input_lengths": lengths, **extra})


def unpadded(out: BatchedDataDict, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Row ``i``'s prompt-plus-generation ids and logprobs, cut at ``unpadded_sequence_lengths``."""
    n = int(out["unpadded_sequence_lengths"][i])
    return out["output_ids"][i, :n], out["logprobs"][i, :n]


def generated(out: BatchedDataDict, data: BatchedDataDict, i: int) -> list[int]:
    """Only the ids row ``i`` generated (its prompt removed)."""
    n_in = int(data["input_lengths"][i])
    return out["output_ids"][i, n_in : int(out["unpadded_sequence_lengths"][i])].tolist()
