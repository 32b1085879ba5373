"""One finished Gym prompt group as NeMo-RL's ``NemoGymRolloutResult``: shaped rewards, metrics, ``final_batch``."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import NotRequired, TypedDict

import torch

from gym_bridge.batched import BatchedDataDict, batched_message_log_to_flat_message
from gym_bridge.gym.protocol.result_fields import caller_fields
from gym_bridge.gym.transport.client import GymGroupResult
from gym_bridge.json_types import JsonObject
from gym_bridge.rollout.nemo_gym import (
    TIMER_PREFIX,
    full_result_table,
    group_metrics as gym_group_metrics,
    gym_completion,
)
from gym_bridge.rollout.nemo_gym_batch_input import LossMultiplier, group_task_index
from gym_bridge.rollout.reward_components import (
    build_reward_component_columns,
    extract_reward_components,
    validate_reward_components_match_scalar,
)
from gym_bridge.rollout.reward_shaper import RewardShaper
from gym_bridge.types import LLMMessageLogType, Tokenizer, padding_id

POSTPROCESS_TIMERS = tuple(
    f"{TIMER_PREFIX}/{step}"
    for step in ("prepare_for_metrics_calculation", "aggregate_metrics", "per_agent_misc_metrics")
)
"""NeMo-RL's timers of one group's post-processing, summed over the call's groups."""


class NemoGymFinalBatch(TypedDict):
    """NeMo-RL's ``final_batch`` keys on the Gym path; ``reward/<name>`` columns join them per reward component."""

    agent_ref: list[JsonObject]
    message_log: list[LLMMessageLogType]
    length: torch.Tensor
    loss_multiplier: LossMultiplier
    total_reward: torch.Tensor
    truncated: torch.Tensor
    mask_sample: NotRequired[torch.Tensor]


@dataclass
class NemoGymRolloutResult:
    """One prompt group (or, with ``returns_entire_batch``, the whole batch) in input-row order."""

    input_ids: torch.Tensor
    """The first user message of each row, flattened and right-padded with the tokenizer's pad id: [B, L]."""
    final_batch: BatchedDataDict[NemoGymFinalBatch]
    """NeMo-RL's keys: ``agent_ref``, ``message_log``, ``length``, ``loss_multiplier``, ``total_reward``,
    ``truncated``, ``mask_sample`` (when masking) and ``reward/<name>`` per reward component."""
    rollout_metrics: JsonObject
    task_index: int | None
    """The group's ``_ng_task_index`` (NeMo-RL's async collector identity); None when the rows carry none."""


@dataclass(frozen=True)
class GroupPost:
    """Turns one finished group into NeMo-RL's ``NemoGymRolloutResult``."""

    tokenizer: Tokenizer
    engine_max_len: int | None
    mask_env_flagged_samples: bool
    log_full_result_tables: bool
    shaping: RewardShaper

    @staticmethod
    def timing(result: NemoGymRolloutResult) -> dict[str, float]:
        """The post-processing steps' seconds of one group, as NeMo-RL's timer names them."""
        return {key: result.rollout_metrics.pop(key) for key in POSTPROCESS_TIMERS}

    def result(
        self, rows: list[JsonObject], group: GymGroupResult, loss_multiplier: LossMultiplier
    ) -> NemoGymRolloutResult:
        t0 = time.perf_counter()
        full_results = [r.full_result for r in group.rows]
        components = [extract_reward_components(r) for r in full_results]
        if any(c is not None for c in components):
            # The verifier's contract (reward == sum of components) is checked before shaping changes the reward.
            validate_reward_components_match_scalar(full_results)
        metrics: JsonObject = self.shaping.shape_gym_rows(rows, group.rows)
        completions = [
            gym_completion(r, max_seq_len=self.engine_max_len, mask_env_flagged_samples=self.mask_env_flagged_samples)
            for r in group.rows
        ]
        agents = [r.agent or rows[r.row_index]["agent_ref"]["name"] for r in group.rows]
        t1 = time.perf_counter()
        fields = [caller_fields(r.metrics, r.full_result, rows[r.row_index]) for r in group.rows]
        metrics.update(gym_group_metrics(completions, agents, fields=fields))
        t2 = time.perf_counter()
        if self.log_full_result_tables:
            for agent in sorted(set(agents)):
                mine = [c.env_extras for c, name in zip(completions, agents, strict=True) if name == agent]
                metrics[f"{agent}/full_result"] = full_result_table(mine)
        t3 = time.perf_counter()
        metrics.update(zip(POSTPROCESS_TIMERS, (t1 - t0, t2 - t1, t3 - t2), strict=True))
        final_batch: BatchedDataDict[NemoGymFinalBatch] = BatchedDataDict(
            {
                "agent_ref": [row["agent_ref"] for row in rows],
                "message_log": [c.message_log for c in completions],
                "length": torch.tensor([int(r.input_message_log[0]["token_ids"].numel()) for r in group.rows]),
                "loss_multiplier": loss_multiplier,
                "total_reward": torch.tensor([r.full_result["reward"] for r in group.rows]),
                "truncated": torch.tensor([c.truncated for c in completions], dtype=torch.bool),
            }
        )
        if self.mask_env_flagged_samples:
            final_batch["mask_sample"] = torch.tensor([c.masked for c in completions], dtype=torch.bool)
        if any(c is not None for c in components):
            final_batch.update(build_reward_component_columns(components))
        flat, _ = batched_message_log_to_flat_message(
            [r.input_message_log for r in group.rows], pad_value_dict={"token_ids": padding_id(self.tokenizer)}
        )
        return NemoGymRolloutResult(
            input_ids=flat["token_ids"],
            final_batch=final_batch,
            rollout_metrics=metrics,
            task_index=group_task_index(rows),
        )
