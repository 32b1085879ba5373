"""NeMo-RL's clipped policy-gradient loss on generated tokens, measuring on-policy fidelity in the same pass.

The old policy of the PPO ratio is ``prev_logprobs``: the trainer's own logprobs of the
batch before its update, computed by a separate pass before training, as NeMo-RL's
``grpo_train`` computes them with ``policy.get_logprobs``. They stay fixed however many
optimizer steps the batch takes. With ``force_on_policy_ratio`` (NeMo-RL's key; exact when a
batch takes one optimizer step, as the GRPO loop's do) the old policy is the training forward's
own logprobs, detached, and the separate pass is skipped: the ratio is 1 in value and the
gradient is the same. With ``use_importance_sampling_correction`` each token is
also weighted by ``exp(prev - gen)`` (``gen``: the engine's sampling logprobs), truncated
as ``truncated_importance_sampling_type`` says: NeMo-RL's decoupled form, which corrects
for samples from older weights or an engine that differs from the trainer. The loss is
averaged over the global batch's valid tokens; ``token_mask`` is 1 only on tokens the
engine generated. ``on_policy`` compares ``prev`` with ``gen``, as NeMo-RL's
``gen_kl_error`` does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, Self, TypedDict

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from gym_bridge.batched import BatchedDataDict
from gym_bridge.failures.errors import SettingError
from gym_bridge.training.batch import TrainBatchSpec
from gym_bridge.training.fidelity import OnPolicyError, on_policy_error


class ClippedPGLossConfig(BaseModel):
    """NeMo-RL's ``loss_fn`` keys that this loss implements."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    ratio_clip_min: float = Field(0.2, ge=0.0)
    ratio_clip_max: float = Field(0.2, ge=0.0)
    ratio_clip_c: float | None = Field(None, gt=1.0, description="Dual clip for negative advantages; None: off.")
    reference_policy_kl_penalty: float = Field(0.0, ge=0.0)
    reference_policy_kl_type: Literal["k1", "k2", "k3"] = "k3"
    kl_input_clamp_value: float | None = Field(20.0, gt=0.0)
    """The reference log-ratio is clamped to +-this before the KL estimate (NeMo-RL's default 20); None: no clamp."""
    kl_output_clamp_value: float | None = Field(10.0, gt=0.0)
    """The per-token KL estimate is clamped to +-this (NeMo-RL's default 10); None: no clamp."""
    use_on_policy_kl_approximation: bool = False
    """The reference KL's per-token weight is ``exp(curr - gen)``, the importance weight of the sampling policy,
    instead of ``exp(curr - curr.detach())`` (NeMo-RL's on-policy KL approximation)."""
    use_importance_sampling_correction: bool = False
    truncated_importance_sampling_type: Literal["tis", "icepop"] | None = None
    truncated_importance_sampling_ratio: float | None = Field(None, gt=0.0)
    truncated_importance_sampling_ratio_min: float | None = Field(None, ge=0.0)
    force_on_policy_ratio: bool = False
    """The old policy is the training forward's own logprobs, detached (NeMo-RL's ``force_on_policy_ratio``): no
    ``prev_logprobs`` pass. Exact only when the batch takes one optimizer step."""
    token_level_loss: bool = True
    """False: each sample's loss is the mean over its tokens, and the batch's the mean over samples (NeMo-RL's
    sequence-level loss)."""
    sequence_level_importance_ratios: bool = False
    """GSPO (with ``token_level_loss: false``): one PPO ratio per sample, ``exp`` of the mean token log-ratio, and
    one importance weight per sample, ``exp`` of the summed ``prev - gen``."""

    @model_validator(mode="after")
    def _gspo_is_sequence_level(self) -> Self:
        if self.sequence_level_importance_ratios and self.token_level_loss:
            raise SettingError(
                "loss_fn.sequence_level_importance_ratios (GSPO) needs loss_fn.token_level_loss: false (NeMo-RL "
                "refuses the pair)"
            )
        return self

    @model_validator(mode="after")
    def _truncation_is_complete(self) -> Self:
        kind = self.truncated_importance_sampling_type
        if kind is None:
            return self
        if not self.use_importance_sampling_correction:
            raise SettingError("truncated_importance_sampling_type needs use_importance_sampling_correction: true")
        if self.truncated_importance_sampling_ratio is None:
            raise SettingError(f"truncated_importance_sampling_type {kind!r} needs truncated_importance_sampling_ratio")
        if kind == "icepop" and self.truncated_importance_sampling_ratio_min is None:
            raise SettingError("'icepop' truncation needs truncated_importance_sampling_ratio_min")
        return self


def kl_estimate(
    logprobs: torch.Tensor,
    reference: torch.Tensor,
    kind: str,
    input_clamp: float | None = None,
    output_clamp: float | None = None,
    importance_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token estimate of KL(current || reference) from sampled tokens (Schulman's k1, k2, k3): NeMo-RL's
    ``calculate_kl``. The log-ratio is clamped to ``+-input_clamp``, the estimate times ``importance_weights``
    (where given; detached where the input clamp acts) to ``+-output_clamp`` (None: no clamp)."""
    log_ratio = reference - logprobs
    if input_clamp is not None:
        clamped = log_ratio.clamp(min=-input_clamp, max=input_clamp)
        if importance_weights is not None:
            importance_weights = torch.where(log_ratio == clamped, importance_weights, importance_weights.detach())
        log_ratio = clamped
    if kind == "k1":
        kl = -log_ratio
    elif kind == "k2":
        kl = 0.5 * log_ratio**2
    else:
        kl = torch.exp(log_ratio) - 1 - log_ratio
    if importance_weights is not None:
        kl = importance_weights * kl
    if output_clamp is not None:
        kl = kl.clamp(min=-output_clamp, max=output_clamp)
    return kl


_EPS = 1e-8
"""NeMo-RL's ``masked_mean`` adds it to a per-sample token count (a sample without valid tokens gives 0, not NaN)."""


class ClippedPGLossMetrics(TypedDict):
    """One micro-batch's metrics: sums over its valid tokens, which :func:`loss_metrics` and
    :func:`sum_on_policy_errors` add up over the batch."""

    loss: float
    num_valid_tokens: float
    on_policy: OnPolicyError
    clipped_tokens: float
    is_out_of_bounds_tokens: float
    kl_sum: float


class ClippedPGLoss:
    """A :class:`~gym_bridge.policy.loss.LossFunction`; ``data`` needs ``advantages``, ``token_mask``,
    ``generation_logprobs`` and (unless ``force_on_policy_ratio``) ``prev_logprobs``, aligned to token positions, and
    ``reference_policy_logprobs`` when the KL penalty is on."""

    def __init__(self, cfg: ClippedPGLossConfig | None = None) -> None:
        self.cfg = cfg or ClippedPGLossConfig()

    def importance_weights(self, prev: torch.Tensor, gen: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(weights, out_of_bounds)``: ``exp(prev - gen)`` truncated per the config, and where it was cut."""
        weights = torch.nan_to_num(torch.exp(prev - gen), nan=0.0, posinf=0.0, neginf=0.0)
        cfg, high = self.cfg, self.cfg.truncated_importance_sampling_ratio
        if cfg.truncated_importance_sampling_type is None or high is None:
            return weights, torch.zeros_like(weights, dtype=torch.bool)
        low = cfg.truncated_importance_sampling_ratio_min or 0.0
        out = (weights > high) | (weights < low)
        if cfg.truncated_importance_sampling_type == "tis":
            return weights.clamp(min=low, max=high), out
        return torch.where(out, torch.zeros_like(weights), weights), out

    def __call__(
        self,
        token_logprobs: torch.Tensor,
        data: BatchedDataDict[TrainBatchSpec],
        global_valid_seqs: torch.Tensor,
        global_valid_toks: torch.Tensor,
    ) -> tuple[torch.Tensor, ClippedPGLossMetrics]:
        """The loss of one micro-batch, normalised by the global batch's valid tokens (or, with
        ``token_level_loss: false``, its valid samples), and its metrics."""
        cfg, device, dtype = self.cfg, token_logprobs.device, token_logprobs.dtype
        tokens = torch.as_tensor(data["token_mask"]).float().to(device)
        samples = torch.ones(tokens.shape[0], device=device)
        if data.get("sample_mask") is not None:
            samples = torch.as_tensor(data["sample_mask"]).float().to(device)
        mask = tokens * samples[:, None]
        advantages = torch.as_tensor(data["advantages"], dtype=dtype, device=device)
        if advantages.ndim == 1:
            advantages = advantages[:, None]
        gen = torch.as_tensor(data["generation_logprobs"], dtype=dtype, device=device)
        prev = self._old_policy(token_logprobs, data)
        weights, out_of_bounds = self._weights(prev, gen, mask)
        ratio = self._ratio(token_logprobs, prev, tokens)
        clamped = ratio.clamp(1 - cfg.ratio_clip_min, 1 + cfg.ratio_clip_max)
        per_token = torch.maximum(-advantages * ratio, -advantages * clamped)
        if cfg.ratio_clip_c is not None:
            dual = torch.minimum(per_token, -advantages * cfg.ratio_clip_c)
            per_token = torch.where(advantages < 0, dual, per_token)
        per_token = per_token * weights
        clipped = (-advantages * clamped > -advantages * ratio).float()
        loss = self._reduce(per_token, tokens, samples, global_valid_seqs, global_valid_toks)
        kl_sum = 0.0
        if cfg.reference_policy_kl_penalty:
            reference = torch.as_tensor(data["reference_policy_logprobs"], dtype=dtype, device=device)
            # NeMo-RL's weight exp(curr - curr.detach()): 1 in value, and it adds the score-function term
            # kl * grad(logprob), since the tokens were sampled from the policy being optimised; with the on-policy
            # approximation, exp(curr - gen) also reweights tokens sampled by the generation policy.
            sampler = gen if cfg.use_on_policy_kl_approximation else token_logprobs.detach()
            per_token_kl = kl_estimate(
                token_logprobs,
                reference,
                cfg.reference_policy_kl_type,
                cfg.kl_input_clamp_value,
                cfg.kl_output_clamp_value,
                importance_weights=torch.nan_to_num(
                    torch.exp(token_logprobs - sampler), nan=0.0, posinf=0.0, neginf=0.0
                ),
            )
            kl_sum = float((per_token_kl.detach() * mask).sum())
            loss = loss + cfg.reference_policy_kl_penalty * self._reduce(
                per_token_kl, tokens, samples, global_valid_seqs, global_valid_toks
            )
        error = on_policy_error(prev, gen, mask)
        return loss, {
            "loss": float(loss.detach()),
            "num_valid_tokens": float(mask.sum()),
            "on_policy": error,
            "clipped_tokens": float((clipped * mask).sum()),
            "is_out_of_bounds_tokens": float((out_of_bounds.float() * mask).sum()),
            "kl_sum": kl_sum,
        }

    def _old_policy(self, token_logprobs: torch.Tensor, data: BatchedDataDict[TrainBatchSpec]) -> torch.Tensor:
        """The PPO ratio's old policy: ``prev_logprobs``, or the forward's own logprobs (``force_on_policy_ratio``)."""
        if self.cfg.force_on_policy_ratio:
            return token_logprobs.detach()
        if data.get("prev_logprobs") is None:
            raise KeyError(
                "ClippedPGLoss needs data['prev_logprobs']: the trainer's logprobs of the batch before its update "
                "(policy.get_logprobs), the old policy of the PPO ratio; or loss_fn.force_on_policy_ratio: true"
            )
        return torch.as_tensor(data["prev_logprobs"], dtype=token_logprobs.dtype, device=token_logprobs.device)

    def _ratio(self, token_logprobs: torch.Tensor, prev: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Per token ``exp(curr - prev)``; GSPO: each sample's ``exp`` of its mean token log-ratio, on every token."""
        log_ratio = token_logprobs - prev
        if self.cfg.force_on_policy_ratio or not self.cfg.sequence_level_importance_ratios:
            return torch.exp(log_ratio)
        mean = (log_ratio * tokens).sum(dim=-1, keepdim=True) / (tokens.sum(dim=-1, keepdim=True) + _EPS)
        return torch.exp(mean).expand_as(log_ratio)

    def _weights(self, prev: torch.Tensor, gen: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The importance weights (ones without the correction) and where truncation cut them; GSPO: one weight per
        sample, ``exp`` of its summed ``prev - gen``."""
        if not self.cfg.use_importance_sampling_correction:
            return torch.ones_like(gen), torch.zeros_like(gen, dtype=torch.bool)
        if not self.cfg.sequence_level_importance_ratios:
            return self.importance_weights(prev, gen)
        summed = ((prev - gen) * mask).sum(dim=-1, keepdim=True)
        weights, out = self.importance_weights(summed.detach(), torch.zeros_like(summed))
        return weights, out.expand_as(gen)

    def _reduce(
        self,
        per_token: torch.Tensor,
        tokens: torch.Tensor,
        samples: torch.Tensor,
        global_valid_seqs: torch.Tensor,
        global_valid_toks: torch.Tensor,
    ) -> torch.Tensor:
        """The micro-batch's share of the global batch's mean: over valid tokens, or (``token_level_loss: false``)
        each sample's mean over its tokens, then over valid samples (NeMo-RL's ``masked_mean`` twice)."""
        if self.cfg.token_level_loss:
            return (per_token * tokens * samples[:, None]).sum() / global_valid_toks.clamp(min=1)
        per_sample = (per_token * tokens).sum(dim=-1) / (tokens.sum(dim=-1) + _EPS)
        return (per_sample * samples).sum() / global_valid_seqs.clamp(min=1)


class LogprobRecorder:
    """A loss that records the logprobs each micro-batch trains with (detached, on the CPU) and hands the call on.

    With ``force_on_policy_ratio`` they are the batch's old-policy logprobs, so the trainer has them for its
    metrics without a pass of their own. Micro-batches are recorded in call order, which a policy's ``train``
    takes in row order."""

    def __init__(self, loss: ClippedPGLoss) -> None:
        self.loss = loss
        self.parts: list[torch.Tensor] = []

    def __call__(
        self,
        token_logprobs: torch.Tensor,
        data: BatchedDataDict[TrainBatchSpec],
        global_valid_seqs: torch.Tensor,
        global_valid_toks: torch.Tensor,
    ) -> tuple[torch.Tensor, ClippedPGLossMetrics]:
        self.parts.append(token_logprobs.detach().float().cpu())
        return self.loss(token_logprobs, data, global_valid_seqs, global_valid_toks)

    def logprobs(self, rows: int) -> torch.Tensor:
        """The recorded logprobs as one ``[rows, S]`` tensor; a record of another size is an error."""
        out = torch.cat(self.parts) if self.parts else torch.zeros((0, 0))
        if out.shape[0] != rows:
            raise SettingError(
                f"loss_fn.force_on_policy_ratio: the policy's train passed {out.shape[0]} rows through the loss for "
                f"a batch of {rows}; it must call the loss once per row, in row order, in one optimizer step"
            )
        return out


def sum_on_policy_errors(mb_metrics: Sequence[ClippedPGLossMetrics]) -> OnPolicyError:
    """The whole batch's on-policy error from :meth:`HFPolicy.train`'s ``all_mb_metrics``."""
    total = OnPolicyError(0.0, 0.0, 0.0, 0.0)
    for metrics in mb_metrics:
        total = total + metrics["on_policy"]
    return total


def loss_metrics(mb_metrics: Sequence[ClippedPGLossMetrics]) -> dict[str, float]:
    """``loss/*`` rates over the batch's valid tokens: clipped, importance weight truncated, mean KL."""
    tokens = sum(m["num_valid_tokens"] for m in mb_metrics) or 1.0
    return {
        "loss/clip_fraction": sum(m["clipped_tokens"] for m in mb_metrics) / tokens,
        "loss/is_oob_ratio": sum(m["is_out_of_bounds_tokens"] for m in mb_metrics) / tokens,
        "loss/reference_kl": sum(m["kl_sum"] for m in mb_metrics) / tokens,
    }
