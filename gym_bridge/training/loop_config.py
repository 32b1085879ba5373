"""The GRPO loop's settings (:class:`GRPOLoopConfig`, NeMo-RL's ``grpo`` names) and the pure helpers of a step:
its seed, its rollout digest, the reward-spread test and the run's step bound."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Literal, Self

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from gym_bridge.batched import BatchedDataDict
from gym_bridge.failures.errors import SettingError
from gym_bridge.json_types import JsonObject
from gym_bridge.rollout.reward_shaping import EffortLevelsConfig
from gym_bridge.rollout.sink import CommittedGroup
from gym_bridge.training.batch import AdvantageSettings, TrainBatchSpec
from gym_bridge.training.distillation import DistillationConfig
from gym_bridge.training.loss import (
    ClippedPGLossConfig,
)

type TrainBatch = BatchedDataDict[TrainBatchSpec]
type SamplingMetrics = dict[str, int]
"""Dynamic sampling's ``train/dynamic_sampling_*`` counts for one step; empty without dynamic sampling."""
type StepRollouts = tuple[list[CommittedGroup], SamplingMetrics]
"""A step's groups in prompt order and its dynamic-sampling counts (:meth:`GRPOTrainer.rollout_step_batch`)."""


class GRPOLoopConfig(BaseModel):
    """The loop's settings (NeMo-RL's ``grpo`` section names where they exist)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    num_prompts_per_step: int = Field(8, ge=1)
    max_num_steps: int = Field(40, ge=1)
    max_num_epochs: int | None = Field(None, ge=1)
    """NeMo-RL's epoch bound: the run ends after ``max_num_epochs * (len(dataset) // num_prompts_per_step)`` steps
    when that is fewer than ``max_num_steps`` (NeMo-RL's dataloader drops the last partial batch); None: no bound."""
    adv_estimator: Literal["grpo", "gdpo"] = "grpo"
    """``grpo.adv_estimator.name``: NeMo-RL's GRPO estimator, or GDPO over a multi-reward environment's components."""
    reward_weights: tuple[float, ...] | None = None
    """GDPO's per-component weights (``grpo.adv_estimator.reward_weights``), in sorted component-name order."""
    use_leave_one_out_baseline: bool = True
    normalize_rewards: bool = True
    overlong_filtering: bool = False
    """Truncated samples leave the loss (NeMo-RL's ``loss_multiplier`` 0) and stay in their group's baseline."""
    masked_samples_in_baseline: bool = False
    """Ours (``grpo.masked_samples_in_baseline``): whether a sample the environment masked still counts in its
    group's baseline and std. NeMo-RL's behaviour is True (its mask only zeroes the loss multiplier); the default
    False keeps a reward that is no measurement out of its siblings' advantages."""
    invalid_tool_call_advantage: float | None = None
    """The advantage of every token of an assistant message NeMo-Gym flagged ``is_invalid_tool_call``."""
    malformed_thinking_advantage: float | None = None
    """The advantage of every token of an assistant message NeMo-Gym flagged ``has_malformed_thinking``."""
    advantage_clip_low: float | None = None
    advantage_clip_high: float | None = None
    """Token advantages are clamped to ``[low, high]`` after the message-level penalties; None: open."""
    seq_logprob_error_threshold: float | None = None
    """Sequences whose multiplicative probability error (trainer before the step vs sampler) exceeds this
    leave the loss; the trainer's logprobs come from one extra forward pass before training."""
    effort_levels: EffortLevelsConfig | None = None
    """``env.nemo_gym.effort_levels``: NeMo-RL's length shaping of low-effort prompts' rewards."""
    reward_penalties: JsonObject | None = None
    """``reward_penalties``: NeMo-RL's reward-zeroing penalties (``RewardPenaltyConfig`` keys)."""
    thinking_tags: tuple[str, ...] | None = None
    """``env.nemo_gym.thinking_tags`` for the malformed-think-tag penalty; None: ``<think>``, ``</think>``."""
    loss: ClippedPGLossConfig = Field(default_factory=ClippedPGLossConfig)
    distillation: DistillationConfig | None = None
    """On-policy distillation (NeMo-RL's ``distillation`` / ``teacher`` config): every step trains on the
    distillation loss over the teacher's top-k logits instead of the policy-gradient loss."""
    seed: int = 0
    shuffle_data: bool = True
    async_rollouts: bool = False
    max_trajectory_age_steps: int = Field(1, ge=0)
    use_dynamic_sampling: bool = False
    """NeMo-RL's dynamic sampling (DAPO): groups whose rewards are all equal are dropped and more prompts drawn."""
    batch_multiplier: float = Field(1.0, gt=0.0)
    """With dynamic sampling, each generation batch draws ``int(num_prompts_per_step * batch_multiplier)`` prompts."""
    dynamic_sampling_max_gen_batches: int = Field(10, ge=1)
    """With dynamic sampling, a step still short of groups after this many generation batches plus one stops the
    run (``StepBatchShortfall``), as NeMo-RL raises then."""
    in_flight_weight_updates: bool = False
    """Async only: refit as soon as a step has trained (True), or first wait for the next step's rollouts (False,
    NeMo-RL's default). Either way a request in flight finishes on the weights it started with."""
    stall_timeout_s: float | None = Field(None, gt=0)
    """A step's rollouts that commit nothing for this long are a stall (``RolloutStall``, or a warning)."""
    stall_action: Literal["warn", "abort"] = "warn"
    stall_interval_s: float = Field(30.0, gt=0)
    """How often the stall watch looks for new commits (NeMo-RL's ``async_rl.stall_watchdog.interval_s``)."""
    min_step_batch_fraction: float = Field(0.0, ge=0.0, le=1.0)
    """A step whose committed groups fall below ``ceil(fraction * num_prompts_per_step)`` stops the run."""
    pass_threshold: float = Field(1.0, description="A completion with reward >= this counts as a pass.")
    val_period: int = Field(0, ge=0, description="Validate every this many steps; 0: never between start and end.")
    val_at_start: bool = False
    val_at_end: bool = False
    train_micro_batch_size: int | None = Field(None, ge=1)
    checkpoint_every_steps: int | None = Field(None, ge=1, description="None: only at the end of the run.")

    @model_validator(mode="after")
    def _checks(self) -> Self:
        """NeMo-RL's cross-key checks: dynamic sampling's keys, and what async rollouts need and exclude."""
        if self.batch_multiplier != 1.0 and not self.use_dynamic_sampling:
            raise SettingError(
                f"grpo.batch_multiplier={self.batch_multiplier} needs grpo.use_dynamic_sampling: true "
                "(NeMo-RL asserts the same)"
            )
        if self.reward_weights is not None and self.adv_estimator != "gdpo":
            raise SettingError(
                "grpo.adv_estimator.reward_weights weighs GDPO's reward components; it needs "
                "grpo.adv_estimator.name: gdpo"
            )
        if int(self.num_prompts_per_step * self.batch_multiplier) < 1:
            raise SettingError("grpo.batch_multiplier * num_prompts_per_step must draw at least one prompt")
        if not self.async_rollouts:
            return self
        if self.max_trajectory_age_steps < 1:
            raise SettingError("async rollouts train on samples at least one step old: max_trajectory_age_steps >= 1")
        if not self.loss.use_importance_sampling_correction:
            raise SettingError(
                "async rollouts (grpo.async_grpo.enabled: true) need loss_fn.use_importance_sampling_correction: "
                "true, as NeMo-RL's async_grpo_train asserts: samples from older weights are weighted by "
                "exp(trainer - sampler logprob)"
            )
        if self.use_dynamic_sampling:
            raise SettingError(
                "grpo.use_dynamic_sampling: true with async rollouts: NeMo-RL's async_grpo_train does not apply "
                "dynamic sampling; turn one of them off"
            )
        return self

    @property
    def advantage_settings(self) -> AdvantageSettings:
        """The keys that shape advantages and the loss multiplier, for :func:`train_batch`."""
        return AdvantageSettings(
            estimator=self.adv_estimator,
            reward_weights=self.reward_weights,
            leave_one_out=self.use_leave_one_out_baseline,
            normalize=self.normalize_rewards,
            overlong_filtering=self.overlong_filtering,
            masked_in_baseline=self.masked_samples_in_baseline,
            invalid_tool_call_advantage=self.invalid_tool_call_advantage,
            malformed_thinking_advantage=self.malformed_thinking_advantage,
            advantage_clip_low=self.advantage_clip_low,
            advantage_clip_high=self.advantage_clip_high,
        )

    @property
    def lookahead(self) -> int:
        """How many later steps' rollouts may run while a step trains."""
        return self.max_trajectory_age_steps if self.async_rollouts else 0

    @property
    def prompts_per_gen_batch(self) -> int:
        """Prompts one generation batch draws: NeMo-RL's ``num_prompts_per_step * batch_multiplier``."""
        return int(self.num_prompts_per_step * self.batch_multiplier)


def step_seed(seed: int, step: int) -> int:
    """The torch seed of training step ``step`` in a run seeded ``seed``."""
    return int.from_bytes(hashlib.sha256(f"{seed}:train:{step}".encode()).digest()[:8], "little") >> 1


def rollout_digest(batch: Mapping[str, object]) -> str:
    """A short SHA-256 of a training batch's token ids and lengths, in training order: two runs whose rollouts are
    token for token the same log the same digest at every step."""
    digest = hashlib.sha256()
    for key in ("input_lengths", "input_ids"):
        digest.update(torch.as_tensor(batch[key]).to(torch.int64).contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


def has_reward_spread(group: CommittedGroup) -> bool:
    """Whether a group's rewards differ (a non-zero std): dynamic sampling keeps only such groups."""
    rewards = [float(c.reward) for c in group.record.completions]
    return len(rewards) > 1 and max(rewards) != min(rewards)


def max_steps_for(cfg: GRPOLoopConfig, dataset_size: int) -> int:
    """``max_num_steps``, or fewer when ``max_num_epochs`` passes over a dataset of ``dataset_size`` prompts first
    (an epoch is ``dataset_size // num_prompts_per_step`` steps: NeMo-RL's dataloader drops the last partial
    batch)."""
    if cfg.max_num_epochs is None:
        return cfg.max_num_steps
    steps_per_epoch = dataset_size // cfg.num_prompts_per_step
    if steps_per_epoch < 1:
        raise SettingError(
            f"max_num_epochs needs at least num_prompts_per_step={cfg.num_prompts_per_step} prompts, "
            f"the dataset has {dataset_size}"
        )
    return min(cfg.max_num_steps, cfg.max_num_epochs * steps_per_epoch)
