"""On-policy fidelity: the trainer's logprobs of generated tokens against the sampling logprobs.

``gen_kl_error`` is NeMo-RL's: the token-level mean of the k3 estimator of
KL(P_gen || P_train), ``exp(r) - 1 - r`` with ``r = train - gen``, over the masked tokens.
A refit that did not reach the engine shows up here at once (the engine samples from
old weights while the trainer scores with new ones). ``logprob_gap`` gives the same
measures between any two sets of logprobs (the loop's engine mismatch, lag and per-step
movement).

``seq_logprob_error_mask`` is NeMo-RL's ``grpo.seq_logprob_error_threshold``: sequences whose
multiplicative probability error exceeds the threshold are left out of the loss.
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


def logprob_gap(new: torch.Tensor, old: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """How far ``new`` logprobs are from ``old`` ones on the masked tokens: ``abs_diff_mean``, ``abs_diff_max``, ``kl``
    (the k3 estimate of KL(old || new) from tokens sampled from ``old``) and ``tokens``."""
    gap = on_policy_error(new, old, mask)
    return {"abs_diff_mean": gap.mean_abs_diff, "abs_diff_max": gap.abs_diff_max, "kl": gap.gen_kl_error,
            "tokens": gap.tokens}  # fmt: skip


@torch.no_grad()
def seq_logprob_error_mask(
    token_mask: torch.Tensor,
    sample_mask: torch.Tensor,
    prev_logprobs: torch.Tensor,
    generation_logprobs: torch.Tensor,
    rewards: torch.Tensor,
    threshold: float | None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """NeMo-RL's sequence-level logprob error: ``(sample_mask, metrics)``.

    A sequence's error is the mean over its trained tokens of ``exp(|gen - prev|)`` (``prev``: the trainer's
    logprobs before this step), the per-sequence form of ``token_mult_prob_error``. With ``threshold`` set, a
    sequence whose error exceeds it leaves the loss (its ``sample_mask`` entry becomes 0); its reward and its
    place in the group baseline stay. Sequences with no trained token count in no statistic.
    ``masked_correct_pct`` is the share of masked sequences whose reward is exactly 1.
    """
    token_mask, sample_mask = token_mask[:, 1:].float(), sample_mask.float()
    lp_error = (generation_logprobs[:, 1:].float() - prev_logprobs[:, 1:].float()).abs()
    mask = token_mask * sample_mask.unsqueeze(-1)
    denom = mask.sum(dim=-1)
    valid = denom > 0
    error = torch.zeros_like(denom)
    error[valid] = ((torch.exp(lp_error * mask) * mask).sum(dim=-1) / denom.clamp(min=1))[valid]

    def stats(keep: torch.Tensor, suffix: str = "") -> dict[str, float]:
        kept = error[keep]
        return {
            f"{name}_seq_mult_prob_error{suffix}": float(fn(kept)) if kept.numel() else 0.0
            for name, fn in (("max", torch.max), ("mean", torch.mean), ("min", torch.min))
        }

    metrics = stats(valid)
    if threshold is None:
        return sample_mask, {
            **metrics,
            **stats(valid, "_after_mask"),
            "num_masked_seqs": 0.0,
            "masked_correct_pct": 0.0,
        }
    kept = (error <= threshold).float() * sample_mask
    dropped = (sample_mask - kept).bool()
    num_masked = int(dropped.sum())
    correct = int((rewards.reshape(-1)[dropped] == 1).sum()) if num_masked else 0
    return kept, {
        **metrics,
        **stats(kept.bool() & valid, "_after_mask"),
        "num_masked_seqs": float(num_masked),
        "masked_correct_pct": correct / num_masked if num_masked else 0.0,
    }
