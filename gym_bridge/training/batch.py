"""A training batch from committed prompt groups: tokens, generated-token mask, sampling logprobs, advantages.

Each completion's message log is flattened in order (its concatenated ``token_ids`` are
exactly what the engine saw and produced). Only messages that carry
``generation_logprobs`` (the engine's own tokens) are trained on; their sampling
logprobs sit at the same positions, aligned as :class:`~gym_bridge.policy.hf.HFPolicy`
aligns its logprobs (``logprobs[b, t]`` scores token ``t``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from gym_bridge.batched import BatchedDataDict, batched_message_log_to_flat_message
from gym_bridge.rollout.sink import CommittedGroup
from gym_bridge.training.advantages import grpo_advantages


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


def _trainable_log(message_log: Sequence[Mapping[str, Any]], where: str) -> list[dict[str, torch.Tensor]]:
    out = []
    for i, message in enumerate(message_log):
        token_ids = torch.as_tensor(message["token_ids"], dtype=torch.int64)
        generated = message.get("generation_logprobs")
        if generated is None:
            logprobs, mask = torch.zeros(len(token_ids)), torch.zeros(len(token_ids))
        else:
            logprobs = torch.as_tensor(generated, dtype=torch.float32)
            if len(logprobs) != len(token_ids):
                raise ValueError(f"{where} message {i}: {len(token_ids)} token_ids but {len(logprobs)} logprobs")
            mask = torch.ones(len(token_ids))
        out.append({"token_ids": token_ids, "generation_logprobs": logprobs, "token_mask": mask})
    return out


def train_batch(
    groups: Sequence[CommittedGroup],
    pad_token_id: int,
    *,
    leave_one_out: bool = True,
    normalize: bool = True,
    pass_threshold: float = 1.0,
) -> tuple[BatchedDataDict[Any], GroupStats]:
    """The right-padded batch ``HFPolicy.train`` takes with :class:`~gym_bridge.training.loss.ClippedPGLoss`."""
    if not groups:
        raise ValueError("no groups to build a training batch from")
    sizes = {len(g.record.completions) for g in groups}
    if len(sizes) != 1:
        raise ValueError(f"groups of different sizes {sorted(sizes)} cannot share a GRPO baseline")
    logs, rewards, truncated, generated, valid = [], [], [], [], []
    for group in groups:
        for j, completion in enumerate(group.record.completions):
            log = _trainable_log(completion.message_log, f"prompt_idx={group.record.prompt_idx} completion {j}")
            if completion.masked:  # NeMo-RL's loss_multiplier = 0
                for message in log:
                    message["token_mask"] = torch.zeros_like(message["token_mask"])
            valid.append(not completion.masked)
            logs.append(log)
            rewards.append(float(completion.reward))
            truncated.append(bool(completion.truncated))
            generated.append(float(sum(m["token_mask"].sum() for m in log)))
    flat, lengths = batched_message_log_to_flat_message(
        logs, pad_value_dict={"token_ids": pad_token_id, "generation_logprobs": 0.0, "token_mask": 0.0}
    )
    reward_matrix = torch.tensor(rewards).view(len(groups), -1)
    valid_matrix = torch.tensor(valid).view(len(groups), -1)
    advantages = grpo_advantages(reward_matrix, leave_one_out=leave_one_out, normalize=normalize, valid=valid_matrix)
    batch: BatchedDataDict[Any] = BatchedDataDict(
        {
            "input_ids": flat["token_ids"],
            "input_lengths": lengths.to(torch.int64),
            "token_mask": flat["token_mask"].float(),
            "generation_logprobs": flat["generation_logprobs"].float(),
            "advantages": advantages.reshape(-1),
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
    )
    return batch, stats
