"""Generation batches, shared by every backend: checking the input, assembling the output.

Output layout: each row's unpadded input, then its generated tokens, then the pad
id; logprobs are zero on prompt and padding positions.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from gym_bridge.batched import BatchedDataDict
from gym_bridge.failures.errors import SettingError
from gym_bridge.types import LOGPROB_DTYPE, TOKEN_DTYPE, GenerationDatumSpec, GenerationOutputSpec


def check_input(data: BatchedDataDict[GenerationDatumSpec]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids [B, S] int64, input_lengths [B] int64)`` of a right-padded batch, or a clear error."""
    input_ids = torch.as_tensor(data["input_ids"]).cpu()
    lengths = torch.as_tensor(data["input_lengths"]).cpu().to(torch.int64).reshape(-1)
    if input_ids.ndim != 2:
        raise SettingError(f"input_ids must be [B, S], got shape {tuple(input_ids.shape)}")
    if input_ids.dtype.is_floating_point or input_ids.dtype == torch.bool:
        raise TypeError(f"input_ids must be an integer tensor, got {input_ids.dtype}")
    batch, width = input_ids.shape
    if lengths.shape[0] != batch:
        raise SettingError(f"input_lengths has {lengths.shape[0]} rows, input_ids {batch}")
    if batch and (int(lengths.min()) < 1 or int(lengths.max()) > width):
        raise SettingError(f"every input length must be in [1, {width}], got {lengths.tolist()}")
    return input_ids.to(TOKEN_DTYPE), lengths


class GeneratedRow(Protocol):
    """What a backend produced for one row."""

    @property
    def tokens(self) -> list[int]: ...
    @property
    def logprobs(self) -> list[float]: ...
    @property
    def truncated(self) -> bool: ...


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
