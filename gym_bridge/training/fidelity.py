"""On-policy fidelity: the trainer's logprobs of generated tokens against the sampling logprobs.

``gen_kl_error`` is NeMo-RL's: the token-level mean of the k3 estimator of
KL(P_gen || P_train), ``exp(r) - 1 - r`` with ``r = train - gen``, over the masked tokens.
A refit that did not reach the engine shows up here at once (the engine samples from
old weights while the trainer scores with new ones).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class OnPolicyError:
    """Sums over a set of tokens; add them up across micro-batches, then read the means."""

    abs_diff_sum: float
    abs_diff_max: float
    k3_sum: float
    tokens: float

    @property
    def mean_abs_diff(self) -> float:
        return self.abs_diff_sum / self.tokens if self.tokens else 0.0

    @property
    def gen_kl_error(self) -> float:
        return self.k3_sum / self.tokens if self.tokens else 0.0

    def __add__(self, other: OnPolicyError) -> OnPolicyError:
        return OnPolicyError(
            self.abs_diff_sum + other.abs_diff_sum,
            max(self.abs_diff_max, other.abs_diff_max),
            self.k3_sum + other.k3_sum,
            self.tokens + other.tokens,
        )

    def as_metrics(self) -> dict[str, float]:
        """``on_policy/*`` metrics: mean and max abs logprob difference, ``gen_kl_error``, token count."""
        return {
            "on_policy/logprob_abs_diff_mean": self.mean_abs_diff,
            "on_policy/logprob_abs_diff_max": self.abs_diff_max,
            "on_policy/gen_kl_error": self.gen_kl_error,
            "on_policy/tokens": self.tokens,
        }


NO_TOKENS = OnPolicyError(0.0, 0.0, 0.0, 0.0)


@torch.no_grad()
def on_policy_error(
    train_logprobs: torch.Tensor, generation_logprobs: torch.Tensor, mask: torch.Tensor
) -> OnPolicyError:
    """Compare ``[b, S]`` logprobs on the positions where ``mask`` is 1."""
    mask = mask.float()
    if not bool(mask.any()):
        return NO_TOKENS
    train, gen = train_logprobs.detach().float(), generation_logprobs.float().to(train_logprobs.device)
    log_ratio = (train - gen) * mask
    k3 = (torch.exp(log_ratio) - 1 - log_ratio) * mask
    return OnPolicyError(
        abs_diff_sum=float(log_ratio.abs().sum()),
        abs_diff_max=float(log_ratio.abs().max()),
        k3_sum=float(k3.sum()),
        tokens=float(mask.sum()),
    )
