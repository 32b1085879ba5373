"""A training batch from committed prompt groups: tokens, generated-token mask, sampling logprobs, advantages.

Each completion's message log is flattened in order (its concatenated ``token_ids`` are
exactly what the engine saw and produced). Only messages that carry
``generation_logprobs`` (the engine's own tokens) are trained on; their sampling
logprobs sit at the same positions, aligned as :class:`~gym_bridge.policy.hf.HFPolicy`
aligns its logprobs (``logprobs[b, t]`` scores token ``t``).

``sample_mask`` is NeMo-RL's ``loss_multiplier``: 0 for a sample the environment masked and, with
``overlong_filtering``, for a truncated one. A truncated sample stays in its group's baseline (NeMo-RL's
GRPO estimator counts every sample); an environment-masked one does not (see ``GroupStats.masked``).
``advantages`` are token-level ``[B, S]``, as NeMo-RL's estimator returns them, so that the message-level
penalties and the clip (:mod:`gym_bridge.training.advantages`) apply per token.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, NotRequired

import torch

from gym_bridge.batched import BatchedDataDict, batched_message_log_to_flat_message
from gym_bridge.failures.errors import SettingError
from gym_bridge.rollout.reward_components import check_component_sum, component_columns
from gym_bridge.rollout.sink import CommittedGroup
from gym_bridge.training.advantages import (
    clip_advantages,
    gdpo_advantages,
    grpo_advantages,
    message_level_advantages,
)
from gym_bridge.types import GenerationDatumSpec, MessageEntry


class TrainBatchSpec(GenerationDatumSpec):
    """The training batch, right-padded ``[B, S]`` columns aligned to token positions (``[B]``: per sample).

    :func:`train_batch` sets ``input_ids``, ``input_lengths`` ``[B]``, ``token_mask``, ``generation_logprobs``,
    ``advantages``, ``sample_mask`` ``[B]`` and ``rewards`` ``[B]``; the loop adds ``prev_logprobs`` (the old
    policy) and, with a KL penalty, ``reference_policy_logprobs`` before the update. The masks are optional in
    the policy's own batch (:class:`~gym_bridge.policy.loss.TokenBatchSpec`), so they are declared so here too.
    """

    token_mask: NotRequired[torch.Tensor]
    sample_mask: NotRequired[torch.Tensor]
    generation_logprobs: torch.Tensor
    advantages: torch.Tensor
    rewards: torch.Tensor
    prev_logprobs: NotRequired[torch.Tensor]
    reference_policy_logprobs: NotRequired[torch.Tensor]


@dataclass(frozen=True)
class GroupStats:
    """What a batch of groups looked like, for the step's metrics."""

    mean_reward: float
    pass_rate: float
    mean_generated_tokens: float
    truncation_rate: float
    zero_std_groups: int
    samples: int
    masked: int = 0
    """Samples the environment masked: no loss, no part of any baseline."""
    overlong_filtered: int = 0
    """Truncated samples ``overlong_filtering`` left out of the loss (they stay in their group's baseline)."""
    advantage_metrics: Mapping[str, float] = field(default_factory=dict)
    """NeMo-RL's message-level penalty rates and counts, when a penalty is configured."""


@dataclass(frozen=True)
class AdvantageSettings:
    """NeMo-RL's ``grpo`` keys that shape the advantages and the loss multiplier."""

    estimator: Literal["grpo", "gdpo"] = "grpo"
    """``grpo.adv_estimator.name``: one group-normalised reward, or GDPO over the reward components."""
    reward_weights: tuple[float, ...] | None = None
    """GDPO's ``grpo.adv_estimator.reward_weights``, in the components' sorted name order; None: 1.0 each."""
    leave_one_out: bool = True
    normalize: bool = True
    overlong_filtering: bool = False
    masked_in_baseline: bool = False
    """A masked sample still counts in its group's baseline and std (NeMo-RL's behaviour); it never trains."""
    invalid_tool_call_advantage: float | None = None
    malformed_thinking_advantage: float | None = None
    advantage_clip_low: float | None = None
    advantage_clip_high: float | None = None


def _trainable_log(message_log: Sequence[MessageEntry], where: str) -> list[dict[str, torch.Tensor]]:
    """Each message's ``token_ids``, its sampling logprobs (0 where the engine did not generate it) and a mask of
    the generated tokens; ``where`` names the completion in an error."""
    out = []
    for i, message in enumerate(message_log):
        token_ids = torch.as_tensor(message["token_ids"], dtype=torch.int64)
        generated = message.get("generation_logprobs")
        if generated is None:
            logprobs, mask = torch.zeros(len(token_ids)), torch.zeros(len(token_ids))
        else:
            logprobs = torch.as_tensor(generated, dtype=torch.float32)
            if len(logprobs) != len(token_ids):
                raise SettingError(f"{where} message {i}: {len(token_ids)} token_ids but {len(logprobs)} logprobs")
            mask = torch.ones(len(token_ids))
        out.append({"token_ids": token_ids, "generation_logprobs": logprobs, "token_mask": mask})
    return out


def _per_sample_advantages(
    groups: Sequence[CommittedGroup], rewards: torch.Tensor, in_baseline: torch.Tensor, settings: AdvantageSettings
) -> torch.Tensor:
    """``[groups, samples]`` advantages of the configured estimator; a multi-reward result's components are first
    checked to sum to its Gym reward (NeMo-RL checks every Gym batch that carries components)."""
    completions = [c for group in groups for c in group.record.completions]
    for group in groups:
        for j, completion in enumerate(group.record.completions):
            gym_reward = (completion.env_extras or {}).get("reward", completion.reward)
            where = f"prompt_idx={group.record.prompt_idx} completion {j}"
            check_component_sum(float(gym_reward), completion.reward_components, where)
    if settings.estimator == "grpo":
        return grpo_advantages(
            rewards, leave_one_out=settings.leave_one_out, normalize=settings.normalize, valid=in_baseline
        )
    columns = component_columns([c.reward_components for c in completions])
    agents = sorted({c.agent or "(no agent)" for c in completions})
    return gdpo_advantages(
        {name: torch.tensor(values).view_as(rewards) for name, values in columns.items()},
        weights=settings.reward_weights,
        leave_one_out=settings.leave_one_out,
        normalize=settings.normalize,
        valid=in_baseline,
        source=f"this step's results from {', '.join(agents)} carry",
    )


def train_batch(
    groups: Sequence[CommittedGroup],
    pad_token_id: int,
    *,
    pass_threshold: float = 1.0,
    settings: AdvantageSettings = AdvantageSettings(),
) -> tuple[BatchedDataDict[TrainBatchSpec], GroupStats]:
    """The right-padded batch ``HFPolicy.train`` takes with :class:`~gym_bridge.training.loss.ClippedPGLoss`."""
    if not groups:
        raise SettingError("no groups to build a training batch from")
    sizes = {len(g.record.completions) for g in groups}
    if len(sizes) != 1:
        raise SettingError(f"groups of different sizes {sorted(sizes)} cannot share a GRPO baseline")
    logs, rewards, truncated, generated, valid, sources = [], [], [], [], [], []
    for group in groups:
        for j, completion in enumerate(group.record.completions):
            log = _trainable_log(completion.message_log, f"prompt_idx={group.record.prompt_idx} completion {j}")
            if completion.masked:  # NeMo-RL's loss_multiplier = 0
                for message in log:
                    message["token_mask"] = torch.zeros_like(message["token_mask"])
            valid.append(not completion.masked)
            logs.append(log)
            sources.append(completion.message_log)
            rewards.append(float(completion.reward))
            truncated.append(bool(completion.truncated))
            generated.append(float(sum(m["token_mask"].sum() for m in log)))
    flat, lengths = batched_message_log_to_flat_message(
        logs, pad_value_dict={"token_ids": pad_token_id, "generation_logprobs": 0.0, "token_mask": 0.0}
    )
    reward_matrix = torch.tensor(rewards).view(len(groups), -1)
    in_baseline = [True] * len(valid) if settings.masked_in_baseline else valid
    per_sample = _per_sample_advantages(
        groups, reward_matrix, torch.tensor(in_baseline).view(len(groups), -1), settings
    ).reshape(-1)
    advantages, penalty_metrics = message_level_advantages(
        per_sample[:, None].expand(flat["token_ids"].shape).clone(),
        sources,
        invalid_tool_call_advantage=settings.invalid_tool_call_advantage,
        malformed_thinking_advantage=settings.malformed_thinking_advantage,
    )
    advantages = clip_advantages(advantages, settings.advantage_clip_low, settings.advantage_clip_high)
    filtered = (
        torch.tensor(truncated) & torch.tensor(valid)
        if settings.overlong_filtering
        else torch.zeros(len(valid), dtype=torch.bool)
    )
    sample_mask = (torch.tensor(valid) & ~filtered).float()
    batch: BatchedDataDict[TrainBatchSpec] = BatchedDataDict(
        {
            "input_ids": flat["token_ids"],
            "input_lengths": lengths.to(torch.int64),
            "token_mask": flat["token_mask"].float(),
            "generation_logprobs": flat["generation_logprobs"].float(),
            "advantages": advantages,
            "sample_mask": sample_mask,
            "rewards": torch.tensor(rewards),
        }
    )
    stats = GroupStats(
        mean_reward=float(reward_matrix.mean()),
        pass_rate=float((reward_matrix >= pass_threshold).float().mean()),
        mean_generated_tokens=sum(generated) / len(generated),
        truncation_rate=sum(truncated) / len(truncated),
        zero_std_groups=int((reward_matrix.std(dim=1, unbiased=False) == 0).sum()),
        samples=len(rewards),
        masked=len(valid) - sum(valid),
        overlong_filtered=int(filtered.sum()),
        advantage_metrics=penalty_metrics,
    )
    return batch, stats
