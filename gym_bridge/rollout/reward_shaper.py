"""The one reward shaper of NeMo-RL's Gym path: effort levels, then reward penalties, resolved once per run.

NeMo-RL shapes rewards inside its Gym rollout functions, before a batch reaches the advantage estimator
(``env.nemo_gym.effort_levels`` first, then ``reward_penalties``). :class:`RewardShaper` resolves both once
(think-tag ids from the tokenizer) and applies them, through the pure functions of
:mod:`gym_bridge.rollout.reward_shaping`, to whichever form a caller holds: NeMo-RL's whole-batch functions
shape a group's Gym rows in place (:meth:`RewardShaper.shape_gym_rows`, Gym's ``reward`` and ours, as
NeMo-RL's ``final_batch`` reads it); the GRPO loop and its validation shape completions
(:meth:`RewardShaper.shape`, :meth:`RewardShaper.shape_groups`), leaving the environment's own result
(``env_extras``) as Gym returned it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from gym_bridge.failures.errors import SettingError
from gym_bridge.gym.protocol.result import GymRowResult
from gym_bridge.json_types import JsonMapping, JsonObject
from gym_bridge.rollout.reward_shaping import (
    PENALTY_FLAGS,
    EffortLevelsConfig,
    PenaltyConfig,
    apply_effort_shaping,
    apply_reward_penalties,
    effort_metrics,
    penalty_metrics,
    resolve_reward_penalty_config,
)
from gym_bridge.rollout.sink import CommittedGroup
from gym_bridge.types import Completion, Tokenizer


class RewardShaper:
    """Effort shaping and reward penalties, resolved once (think-tag ids from ``tokenizer``)."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        effort_levels: EffortLevelsConfig | JsonMapping | None = None,
        reward_penalties: PenaltyConfig | None = None,
        thinking_tags: Sequence[str] | None = None,
    ) -> None:
        if isinstance(effort_levels, Mapping):
            effort_levels = EffortLevelsConfig.model_validate(effort_levels)
        self.effort = effort_levels
        tags = list(thinking_tags) if thinking_tags else None
        self.penalties = resolve_reward_penalty_config(reward_penalties, tokenizer, thinking_tags=tags)

    @property
    def enabled(self) -> bool:
        """Whether any shaping is switched on (effort shaping with a weight and a trigger, or a penalty)."""
        penalties = self.penalties or {}
        return bool(self.effort is not None and self.effort.enabled) or any(
            penalties.get(flag) for flag, _ in PENALTY_FLAGS.values()
        )

    def apply(self, rows: Sequence[JsonMapping], results: Sequence[JsonObject]) -> dict[str, float]:
        """Shape NeMo-RL-shaped results in place (``full_result["reward"]``; row ``i`` is result ``i``'s Gym row)
        in NeMo-RL's order, effort then penalties; return NeMo-RL's shaping metrics (empty when nothing is on)."""
        if not self.enabled or not results:
            return {}
        effort = apply_effort_shaping(results, rows, self.effort)
        counts = apply_reward_penalties(results, self.penalties)
        return {**effort_metrics(effort), **penalty_metrics(self.penalties, counts, len(results))}

    def shape_gym_rows(self, rows: Sequence[JsonMapping], gym_rows: Sequence[GymRowResult]) -> dict[str, float]:
        """Shape one group's Gym rows in place (Gym's ``reward``, the row's ``reward`` and its ``reward`` metric);
        return NeMo-RL's shaping metrics."""
        if not self.enabled:
            return {}
        results: list[JsonObject] = [{"message_log": r.message_log, "full_result": r.full_result} for r in gym_rows]
        metrics = self.apply(rows, results)
        for row in gym_rows:
            reward = float(row.full_result["reward"])
            row.reward = reward
            row.metrics["reward"] = reward
        return metrics

    def shape(
        self, rows: Sequence[JsonMapping], completions: Sequence[Completion]
    ) -> tuple[list[Completion], dict[str, float]]:
        """The completions with shaped rewards (row ``i`` is completion ``i``'s Gym row) and NeMo-RL's metrics;
        each completion's ``env_extras`` stays as Gym returned it.

        Raises :class:`~gym_bridge.failures.errors.SettingError` (a ``ValueError``) for a completion without a
        Gym result (``env_extras``): the shaping reads it.
        """
        if not self.enabled or not completions:
            return list(completions), {}
        results: list[JsonObject] = []
        for i, completion in enumerate(completions):
            if completion.env_extras is None:
                raise SettingError(
                    f"completion {i} has no NeMo-Gym result; env.nemo_gym.effort_levels and reward_penalties "
                    "shape NeMo-Gym rollouts only"
                )
            full_result = {**completion.env_extras, "reward": float(completion.reward)}
            results.append({"message_log": completion.message_log, "full_result": full_result})
        metrics = self.apply(rows, results)
        shaped = [
            dataclasses.replace(completion, reward=float(result["full_result"]["reward"]))
            for completion, result in zip(completions, results, strict=True)
        ]
        return shaped, metrics

    def shape_groups(self, groups: Sequence[CommittedGroup]) -> tuple[list[CommittedGroup], dict[str, float]]:
        """Every group's completions shaped together, as NeMo-RL's sync GRPO shapes one step's batch; each
        completion's row is its group's ``extra_env_info``."""
        if not self.enabled:
            return list(groups), {}
        rows = [g.record.extra_env_info or {} for g in groups for _ in g.record.completions]
        flat = [c for g in groups for c in g.record.completions]
        shaped, metrics = self.shape(rows, flat)
        out, start = [], 0
        for group in groups:
            end = start + len(group.record.completions)
            record = dataclasses.replace(group.record, completions=shaped[start:end])
            out.append(dataclasses.replace(group, record=record))
            start = end
        return out, metrics
