"""GRPO advantages: group baselines and group-normalised rewards, as NeMo-RL computes them.

``baseline_and_std_per_group`` is NeMo-RL's ``calculate_baseline_and_std_per_prompt``
for groups of equal size (every sample valid): with the leave-one-out baseline, a
sample's baseline and std are those of the *other* samples of its group (Bessel-corrected).
``grpo_advantages`` is ``reward - baseline``, divided by ``std + epsilon`` only where
``std > 0`` (NeMo-RL's ``normalize_advantages_with_epsilon``): a group whose rewards are
all equal gets advantage 0, never a division by zero.
"""

from __future__ import annotations

import torch


def baseline_and_std_per_group(
    rewards: torch.Tensor, leave_one_out: bool = True, valid: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(baseline, std)``, both shaped like ``rewards`` ``[groups, samples]``.

    ``valid`` (bool, same shape) leaves samples out of every baseline and std, as NeMo-RL's ``valid_mask``:
    a sample the environment masked is no measurement, so it must not move its siblings' advantages.
    """
    if rewards.ndim != 2:
        raise ValueError(f"rewards must be [groups, samples_per_group], got shape {tuple(rewards.shape)}")
    rewards = rewards.float()
    size = rewards.shape[1]
    keep = torch.ones_like(rewards) if valid is None else valid.to(rewards.dtype)
    if valid is not None and valid.shape != rewards.shape:
        raise ValueError(f"valid has shape {tuple(valid.shape)}, rewards {tuple(rewards.shape)}")
    others = torch.ones(size, size) - (torch.eye(size) if leave_one_out else 0.0)
    weights = keep.unsqueeze(1) * others  # [groups, i, j]: sample j counts in sample i's baseline
    num_valid = weights.sum(dim=2)
    counted = rewards * keep
    baseline = torch.einsum("gij,gj->gi", others.expand_as(weights), counted) / num_valid.clamp(min=1)
    baseline = torch.where(num_valid > 0, baseline, rewards)  # nobody to compare with: advantage 0
    square = torch.einsum("gij,gj->gi", others.expand_as(weights), counted * rewards) / num_valid.clamp(min=1)
    # One other sample (leave-one-out pairs) or none: NeMo-RL's std is 0 * inf = NaN -> 0.
    bessel = num_valid / (num_valid - 1).clamp(min=1)
    std = ((square - baseline.square()) * bessel).clamp(min=0).sqrt()
    std = torch.where(num_valid > 1, std, torch.zeros_like(std)).nan_to_num(0.0)
    return baseline, std


def grpo_advantages(
    rewards: torch.Tensor,
    *,
    leave_one_out: bool = True,
    normalize: bool = True,
    epsilon: float = 1e-6,
    valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-sample advantages ``[groups, samples]``; zero-std samples are not rescaled, invalid ones are 0."""
    baseline, std = baseline_and_std_per_group(rewards, leave_one_out, valid)
    advantages = rewards.float() - baseline
    if normalize:
        scale = std > 0
        advantages[scale] = advantages[scale] / (std[scale] + epsilon)
    if valid is not None:
        advantages = advantages * valid.to(advantages.dtype)
    return advantages
