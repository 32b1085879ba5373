"""A causal LM's next-token logits over a right-padded token batch, scaled by the sampling temperature: what a
distillation loss reads (the student's, with gradients) and what the teacher's top-k comes from (without)."""

from __future__ import annotations

import torch

from gym_bridge.policy.loss import length_mask


def next_token_logits(
    model: torch.nn.Module, input_ids: torch.Tensor, lengths: torch.Tensor, temperature: float, device: torch.device
) -> torch.Tensor:
    """``[b, S-1, V]`` float32: position ``t``'s logits (predicting token ``t + 1``) divided by ``temperature``."""
    ids, lens = input_ids.to(device), lengths.to(device)
    attention = length_mask(lens, ids.shape[1]).long()
    logits: torch.Tensor = model(input_ids=ids, attention_mask=attention, use_cache=False).logits[:, :-1]
    return logits.float() / temperature


def topk_next_token_logits(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    lengths: torch.Tensor,
    temperature: float,
    device: torch.device,
    *,
    k: int,
    batch_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The top-``k`` of :func:`next_token_logits` and their token ids, ``[B, S-1, k]`` each, ``batch_size`` rows
    at a time without gradients."""
    values, indices = [], []
    with torch.no_grad():
        for s in range(0, input_ids.shape[0], batch_size):
            logits = next_token_logits(model, input_ids[s : s + batch_size], lengths[s : s + batch_size],
                                       temperature, device)  # fmt: skip
            top = torch.topk(logits, k, dim=-1)
            values.append(top.values.cpu())
            indices.append(top.indices.cpu())
    return torch.cat(values), torch.cat(indices)
