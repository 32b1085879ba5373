"""The loss contract of ``HFPolicy.train``: the token batch it reads, its token mask, ``LossFunction`` and REINFORCE."""

from __future__ import annotations

from collections.abc import Mapping
from typing import NotRequired, Protocol

import torch

from gym_bridge.batched import BatchedDataDict
from gym_bridge.types import GenerationDatumSpec


class TokenBatchSpec(GenerationDatumSpec):
    """The token batch :meth:`~gym_bridge.policy.hf.HFPolicy.train` reads: right-padded ``input_ids`` ``[B, S]``
    and ``input_lengths`` ``[B]`` (the batch the logprob calls take), optionally ``token_mask`` ``[B, S]`` (the
    tokens to train on) and ``sample_mask`` ``[B]``. A loss function reads further keys of its own."""

    token_mask: NotRequired[torch.Tensor]
    sample_mask: NotRequired[torch.Tensor]


class PolicyGradientBatchSpec(TokenBatchSpec):
    """:func:`policy_gradient_loss`'s batch: the token batch plus ``advantages`` (``[B]`` or ``[B, S]``)."""

    advantages: torch.Tensor


class LossFunction[SpecT: TokenBatchSpec](Protocol):
    """``(token_logprobs [b, S], micro_batch, global_valid_seqs, global_valid_toks) -> (loss, metrics)``.

    ``SpecT`` names the batch the loss reads: the token batch plus the loss's own keys. A loss with a true
    ``reads_logits`` attribute (distillation's) gets the next-token logits ``[b, S-1, V]`` instead."""

    def __call__(
        self,
        token_logprobs: torch.Tensor,
        data: BatchedDataDict[SpecT],
        global_valid_seqs: torch.Tensor,
        global_valid_toks: torch.Tensor,
    ) -> tuple[torch.Tensor, Mapping[str, object]]: ...


def policy_gradient_loss(
    token_logprobs: torch.Tensor,
    data: BatchedDataDict[PolicyGradientBatchSpec],
    global_valid_seqs: torch.Tensor,
    global_valid_toks: torch.Tensor,
) -> tuple[torch.Tensor, dict[str, float]]:
    """REINFORCE: ``-sum(advantage * logprob * token_mask) / global_valid_toks``.

    ``data`` needs ``advantages`` (``[b]`` or ``[b, S]``) and ``token_mask`` ``[b, S]``
    (1 on the tokens to train on); ``sample_mask`` ``[b]`` is optional.
    """
    mask = token_mask(data, token_logprobs.shape)
    advantages = torch.as_tensor(data["advantages"], dtype=token_logprobs.dtype, device=token_logprobs.device)
    if advantages.ndim == 1:
        advantages = advantages[:, None]
    loss = -(advantages * token_logprobs * mask).sum() / global_valid_toks.clamp(min=1)
    return loss, {"loss": float(loss.detach()), "num_valid_tokens": float(mask.sum())}


def length_mask(lengths: torch.Tensor, width: int) -> torch.Tensor:
    """``[b, width]``: True on the first ``lengths[b]`` positions of each row."""
    return torch.arange(width, device=lengths.device)[None, :] < lengths[:, None]


def token_mask(data: BatchedDataDict[TokenBatchSpec], shape: torch.Size) -> torch.Tensor:
    """``token_mask`` (default: every real token after the first) times ``sample_mask``; float ``[b, S]``."""
    lengths = torch.as_tensor(data["input_lengths"]).to(torch.int64)
    if data.get("token_mask") is not None:
        mask = torch.as_tensor(data["token_mask"]).float()
    else:
        mask = length_mask(lengths, shape[1]).float()
        mask[:, 0] = 0.0
    mask = mask * length_mask(lengths, shape[1]).float()
    if data.get("sample_mask") is not None:
        mask = mask * torch.as_tensor(data["sample_mask"]).float()[:, None]
    return mask
