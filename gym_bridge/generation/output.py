"""Assembling a :class:`~gym_bridge.types.GenerationOutputSpec` batch, shared by every backend.

Layout: each row's unpadded input, then its generated tokens, then the pad id;
logprobs are zero on prompt and padding positions.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from gym_bridge.batched import BatchedDataDict
from gym_bridge.types import LOGPROB_DTYPE, TOKEN_DTYPE, GenerationOutputSpec


class GeneratedRow(Protocol):
    """What a backend produced for one row."""

    tokens: list[int]
    logprobs: list[float]
    truncated: bool


def assemble_output(
    input_ids: torch.Tensor, lengths: torch.Tensor, rows: Sequence[GeneratedRow], pad_id: int
) -> BatchedDataDict[GenerationOutputSpec]:
    """The output batch for ``rows`` generated from the right-padded ``input_ids``."""
    batch, width = input_ids.shape
    gen_lens = [len(r.tokens) for r in rows]
    total = width + max(gen_lens, default=0)
    output_ids = torch.full((batch, total), pad_id, dtype=TOKEN_DTYPE)
    logprobs = torch.zeros((batch, total), dtype=LOGPROB_DTYPE)
    for i, row in enumerate(rows):
        n_in = int(lengths[i])
        output_ids[i, :n_in] = input_ids[i, :n_in]
        if row.tokens:
            output_ids[i, n_in : n_in + len(row.tokens)] = torch.tensor(row.tokens, dtype=TOKEN_DTYPE)
            logprobs[i, n_in : n_in + len(row.tokens)] = torch.tensor(row.logprobs, dtype=LOGPROB_DTYPE)
    generation_lengths = torch.tensor(gen_lens, dtype=torch.int64)
    return BatchedDataDict(
        {
            "output_ids": output_ids,
            "logprobs": logprobs,
            "generation_lengths": generation_lengths,
            "unpadded_sequence_lengths": lengths.to(torch.int64) + generation_lengths,
            "truncated": torch.tensor([r.truncated for r in rows], dtype=torch.bool),
        }
    )
