"""The GRPO loss on generated tokens only, measuring on-policy fidelity in the same forward pass.

NeMo-RL's clipped policy-gradient loss with ``prev_logprobs`` taken from this very
forward pass (one optimizer step per batch, so the ratio is 1 and the clip never
binds; the gradient is REINFORCE's ``-A * grad logp``), averaged over the global
batch's valid tokens (token-level loss). ``token_mask`` is 1 only on tokens the
engine generated, so prompt and tool tokens never get a gradient.
"""

from __future__ import annotations

from typing import Any

import torch

from gym_bridge.batched import BatchedDataDict
from gym_bridge.training.fidelity import OnPolicyError, on_policy_error


class GRPOLoss:
    """A :class:`~gym_bridge.policy.hf.LossFunction`; ``data`` needs ``advantages``, ``token_mask``,
    ``generation_logprobs`` (all aligned to token positions)."""

    def __init__(self, ratio_clip: float = 0.2) -> None:
        self.ratio_clip = ratio_clip

    def __call__(
        self,
        token_logprobs: torch.Tensor,
        data: BatchedDataDict[Any],
        global_valid_seqs: torch.Tensor,
        global_valid_toks: torch.Tensor,
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        mask = torch.as_tensor(data["token_mask"]).float().to(token_logprobs.device)
        if data.get("sample_mask") is not None:
            mask = mask * torch.as_tensor(data["sample_mask"]).float().to(token_logprobs.device)[:, None]
        advantages = torch.as_tensor(data["advantages"], dtype=token_logprobs.dtype, device=token_logprobs.device)
        if advantages.ndim == 1:
            advantages = advantages[:, None]
        prev = token_logprobs.detach()
        ratio = torch.exp(token_logprobs - prev)
        clipped = ratio.clamp(1 - self.ratio_clip, 1 + self.ratio_clip)
        per_token = -torch.minimum(ratio * advantages, clipped * advantages)
        loss = (per_token * mask).sum() / global_valid_toks.clamp(min=1)
        error = on_policy_error(token_logprobs, torch.as_tensor(data["generation_logprobs"]), mask)
        return loss, {"loss": float(loss.detach()), "num_valid_tokens": float(mask.sum()), "on_policy": error}


def sum_on_policy_errors(mb_metrics: list[dict[str, Any]]) -> OnPolicyError:
    """The whole batch's on-policy error from :meth:`HFPolicy.train`'s ``all_mb_metrics``."""
    total = OnPolicyError(0.0, 0.0, 0.0, 0.0)
    for metrics in mb_metrics:
        total = total + metrics["on_policy"]
    return total
