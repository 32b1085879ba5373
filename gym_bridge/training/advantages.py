"""GRPO advantages: group baselines and group-normalised rewards, then NeMo-RL's message-level penalties and clip.

``baseline_and_std_per_group`` is NeMo-RL's ``calculate_baseline_and_std_per_prompt``
for groups of equal size (every sample valid): with the leave-one-out baseline, a
sample's baseline and std are those of the *other* samples of its group (Bessel-corrected).
``grpo_advantages`` is ``reward - baseline``, divided by ``std + epsilon`` only where
``std > 0`` (NeMo-RL's ``normalize_advantages_with_epsilon``): a group whose rewards are
all equal gets advantage 0, never a division by zero. ``gdpo_advantages`` is NeMo-RL's GDPO estimator over
a multi-reward environment's components: the same per-group normalisation for each component, a weighted sum,
then one normalisation over the batch.

On the token-level advantages, in NeMo-RL's order: ``message_level_advantages`` overwrites the tokens of
assistant messages NeMo-Gym flagged (``grpo.invalid_tool_call_advantage``, ``grpo.malformed_thinking_advantage``),
then ``clip_advantages`` clamps everything to ``[grpo.advantage_clip_low, grpo.advantage_clip_high]``, the
penalty values included.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from gym_bridge.failures.errors import SettingError
from gym_bridge.types import MessageEntry


def baseline_and_std_per_group(
    rewards: torch.Tensor, leave_one_out: bool = True, valid: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(baseline, std)``, both shaped like ``rewards`` ``[groups, samples]``.

    ``valid`` (bool, same shape) leaves samples out of every baseline and std, as NeMo-RL's ``valid_mask``:
    a sample the environment masked is no measurement, so it must not move its siblings' advantages.
    """
    if rewards.ndim != 2:
        raise SettingError(f"rewards must be [groups, samples_per_group], got shape {tuple(rewards.shape)}")
    rewards = rewards.float()
    size = rewards.shape[1]
    keep = torch.ones_like(rewards) if valid is None else valid.to(rewards.dtype)
    if valid is not None and valid.shape != rewards.shape:
        raise SettingError(f"valid has shape {tuple(valid.shape)}, rewards {tuple(rewards.shape)}")
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


def gdpo_advantages(
    components: Mapping[str, torch.Tensor],
    *,
    weights: Sequence[float] | None = None,
    leave_one_out: bool = True,
    normalize: bool = True,
    epsilon: float = 1e-6,
    valid: torch.Tensor | None = None,
    source: str = "this batch has",
) -> torch.Tensor:
    """NeMo-RL's GDPO advantages ``[groups, samples]`` from named reward components (each ``[groups, samples]``).

    Each component gets its own group baseline and std (:func:`grpo_advantages`); the parts are summed with
    ``weights`` in sorted name order (None: 1.0 each), then the sum is normalised over the whole batch,
    ``(A - mean) / std`` (Bessel-corrected std; only ``A - mean`` when it is 0 or undefined). ``valid`` leaves
    samples out of every statistic, as in :func:`grpo_advantages`; their advantage is 0. Fewer than two components
    or a weight count that differs from theirs is a :class:`SettingError`, as NeMo-RL raises; ``source`` says
    whose components the message counts.
    """
    names = sorted(components)
    if len(names) < 2:
        raise SettingError(
            f"grpo.adv_estimator.name: gdpo needs two or more reward components (Gym's reward_components, NeMo-RL's "
            f"reward/<name>); {source} {len(names)}: {names}. Point env.nemo_gym at a multi-reward environment or "
            "set grpo.adv_estimator.name: grpo"
        )
    if weights is None:
        weights = [1.0] * len(names)
    elif len(weights) != len(names):
        raise SettingError(
            f"grpo.adv_estimator.reward_weights has {len(weights)} entries but this batch has {len(names)} reward "
            f"components {names}: give one weight per component, in the components' sorted name order"
        )
    combined = sum(
        (
            weight
            * grpo_advantages(
                components[name], leave_one_out=leave_one_out, normalize=normalize, epsilon=epsilon, valid=valid
            )
            for weight, name in zip(weights, names, strict=True)
        ),
        torch.zeros_like(components[names[0]], dtype=torch.float32),
    )
    keep = torch.ones_like(combined, dtype=torch.bool) if valid is None else valid.bool()
    counted = combined[keep]
    std = counted.std() if counted.numel() > 1 else torch.tensor(0.0)
    centred = combined - (counted.mean() if counted.numel() else 0.0)
    advantages = centred / std if std > 0 else centred
    return advantages * keep.to(advantages.dtype)


def message_level_advantages(
    advantages: torch.Tensor,
    message_logs: Sequence[Sequence[MessageEntry]],
    *,
    invalid_tool_call_advantage: float | None = None,
    malformed_thinking_advantage: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """NeMo-RL's message-level advantage penalties on token-level ``advantages`` ``[B, S]``.

    Each generated assistant message (one with ``generation_logprobs``) that NeMo-Gym flagged
    ``is_invalid_tool_call`` gets ``invalid_tool_call_advantage`` on every one of its tokens; otherwise, when
    flagged ``has_malformed_thinking``, ``malformed_thinking_advantage``. Token positions are those of the
    message log flattened in order, as the batch is. Returns the (new) advantages and NeMo-RL's rates and
    counts; with neither value set, ``advantages`` unchanged and no metrics.
    """
    if invalid_tool_call_advantage is None and malformed_thinking_advantage is None:
        return advantages, {}
    advantages = advantages.clone()
    invalid = malformed = assistant = 0
    for i, message_log in enumerate(message_logs):
        offset = 0
        for message in message_log:
            length = len(message["token_ids"])
            if message["role"] == "assistant" and "generation_logprobs" in message:
                assistant += 1
                if invalid_tool_call_advantage is not None and message.get("is_invalid_tool_call", False):
                    invalid += 1
                    advantages[i, offset : offset + length] = invalid_tool_call_advantage
                elif malformed_thinking_advantage is not None and message.get("has_malformed_thinking", False):
                    malformed += 1
                    advantages[i, offset : offset + length] = malformed_thinking_advantage
            offset += length
    return advantages, {
        "invalid_tool_call_rate": invalid / max(assistant, 1),
        "malformed_thinking_rate": malformed / max(assistant, 1),
        "num_invalid_tool_calls": float(invalid),
        "num_malformed_thinking": float(malformed),
        "num_assistant_messages": float(assistant),
    }


def clip_advantages(advantages: torch.Tensor, low: float | None = None, high: float | None = None) -> torch.Tensor:
    """``advantages`` clamped to ``[low, high]`` (either bound None: open), NeMo-RL's ``advantage_clip_*``."""
    if low is not None:
        advantages = advantages.clamp(min=low)
    if high is not None:
        advantages = advantages.clamp(max=high)
    return advantages
