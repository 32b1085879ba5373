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


def baseline_and_std_per_group(rewards: torch.Tensor, leave_one_out: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """``(baseline, std)``, both shaped like ``rewards`` ``[groups, samples]``."""
    if rewards.ndim != 2:
        raise ValueError(f"rewards must be [groups, samples_per_group], got shape {tuple(rewards.shape)}")
    rewards = rewards.float()
    size = rewards.shape[1]
    if size <= 1:
        return rewards.clone(), torch.zeros_like(rewards)
    weights = torch.ones(size, size) - (torch.eye(size) if leave_one_out else 0.0)
    num_valid = float(size - int(leave_one_out))
    baseline = rewards @ weights.T / num_valid
    square = rewards.square() @ weights.T / num_valid
    if num_valid <= 1:
        # One other sample (leave-one-out, pairs): NeMo-RL's std is 0 * inf = NaN -> 0.
        return baseline, torch.zeros_like(rewards)
    std = ((square - baseline.square()) * (num_valid / (num_valid - 1))).sqrt().nan_to_num(0.0)
    return baseline, std


def grpo_advantages(
    rewards: torch.Tensor, *, leave_one_out: bool = True, normalize: bool = True, epsilon: float = 1e-6
) -> torch.Tensor:
    """Per-sample advantages ``[groups, samples]``; zero-std samples are not rescaled."""
    baseline, std = baseline_and_std_per_group(rewards, leave_one_out)
    advantages = rewards.float() - baseline
    if normalize:
        scale = std > 0
        advantages[scale] = advantages[scale] / (std[scale] + epsilon)
    return advantages
