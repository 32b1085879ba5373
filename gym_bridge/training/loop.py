"""``GRPOTrainer``: roll out through a ``RolloutManager``, train the policy, refit the engine, bump the version.

One step: ``num_prompts_per_step`` prompts (the dataset shuffled with ``seed``), each
rolled out N times through ``manager.collect`` (any backend; the recipe uses
``nemo_gym``), NeMo-RL's Gym reward shaping (effort levels, reward penalties), group-normalised
advantages with NeMo-RL's message-level penalties and clip, overlong filtering and the
sequence-level logprob-error mask when configured, the trainer's own logprobs before the
update (the PPO old policy), one optimizer step of
:class:`~gym_bridge.training.loss.ClippedPGLoss` on the generated tokens (skipped when
every advantage is zero), a refit of the serving engine checked against its weight
version and fingerprint, and the new weight version on the manager. With
``use_dynamic_sampling`` groups whose rewards are all equal are dropped and more prompts
drawn until the step has ``num_prompts_per_step`` groups with a reward spread. With
``async_rollouts`` the rollouts of up to ``max_trajectory_age_steps`` later steps run
while this step trains; a group older than that is dropped, counted, and its prompt
queued again, as is the prompt of a group that never committed. Validation runs at
start, every ``val_period`` steps and at the end. Every step and every validation
appends one line to ``metrics.jsonl``.

On one machine a run repeats given the same rollouts: groups are trained in prompt order
(``prompt_idx``, the order prompts were drawn), whatever order they committed in; the data
order comes from ``seed``; each training step runs under a torch seed derived from ``seed``
and the step.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import math
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal, Protocol, Self, runtime_checkable

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from gym_bridge.batched import BatchedDataDict
from gym_bridge.failures import RolloutStall, StepBatchShortfall
from gym_bridge.failures.errors import SettingError
from gym_bridge.json_types import JsonObject
from gym_bridge.rollout.reward_shaping import EffortLevelsConfig
from gym_bridge.rollout.sink import CommittedGroup, InMemorySink, RolloutSink
from gym_bridge.training.batch import AdvantageSettings, GroupStats, TrainBatchSpec, train_batch
from gym_bridge.training.fidelity import logprob_gap, seq_logprob_error_mask
from gym_bridge.training.loss import (
    ClippedPGLoss,
    ClippedPGLossConfig,
    LogprobRecorder,
    loss_metrics,
    sum_on_policy_errors,
)
from gym_bridge.training.metrics import MetricsLine, append_metrics
from gym_bridge.training.prompts import PromptQueue, PromptQueueState
from gym_bridge.training.refit import RefitSource, RefitTarget, VersionTagger, check_refit, refit
from gym_bridge.training.rewards import RewardShaper
from gym_bridge.training.staleness import StalenessBuffer
from gym_bridge.training.validation import Validator
from gym_bridge.types import (
    DatumSpec,
    LogprobOutputSpec,
    ReferenceLogprobOutputSpec,
    Tokenizer,
    padding_id,
)

logger = logging.getLogger(__name__)

STATE_FILE = "trainer_state.json"
ALL_WRONG_ALARM_STEPS = 3
"""Steps in a row in which no sample passed before the loop says the run has stopped learning."""

type TrainBatch = BatchedDataDict[TrainBatchSpec]
type SamplingMetrics = dict[str, int]
"""Dynamic sampling's ``train/dynamic_sampling_*`` counts for one step; empty without dynamic sampling."""
type StepRollouts = tuple[list[CommittedGroup], SamplingMetrics]
"""A step's groups in prompt order and its dynamic-sampling counts (:meth:`GRPOTrainer.rollout_step_batch`)."""


class RolloutCollector(VersionTagger, Protocol):
    """What the loop calls on its rollouts (``RolloutManager``): ``collect`` one prompt's group into a sink, and
    ``set_weight_version`` after each refit."""

    async def collect(self, datum: DatumSpec, sink: RolloutSink) -> object: ...


class TrainablePolicy(RefitSource, Protocol):
    """What the loop calls on its policy (``HFPolicy``): NeMo-RL's logprob and train calls, the tokenizer (reward
    shaping, padding), a checkpoint, and the weights a refit sends."""

    @property
    def tokenizer(self) -> Tokenizer: ...

    def get_logprobs(self, data: TrainBatch) -> BatchedDataDict[LogprobOutputSpec]: ...

    def get_reference_policy_logprobs(
        self, data: TrainBatch, micro_batch_size: int | None = None
    ) -> BatchedDataDict[ReferenceLogprobOutputSpec]: ...

    def train(
        self, data: TrainBatch, loss_fn: ClippedPGLoss | LogprobRecorder, *, mbs: int | None = None
    ) -> JsonObject: ...

    def save_checkpoint(self, path: Path) -> None: ...


@runtime_checkable
class SnapshotPolicy(Protocol):
    """A policy that copies its weights and scores with a copy later (``HFPolicy``); async runs use it to score
    each sample at the weights that sampled it."""

    def weights_snapshot(self) -> dict[str, torch.Tensor]: ...

    def get_logprobs_at(self, data: TrainBatch, weights: Mapping[str, torch.Tensor]) -> torch.Tensor: ...


class GRPOLoopConfig(BaseModel):
    """The loop's settings (NeMo-RL's ``grpo`` section names where they exist)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    num_prompts_per_step: int = Field(8, ge=1)
    max_num_steps: int = Field(40, ge=1)
    max_num_epochs: int | None = Field(None, ge=1)
    """NeMo-RL's epoch bound: the run ends after ``max_num_epochs * (len(dataset) // num_prompts_per_step)`` steps
    when that is fewer than ``max_num_steps`` (NeMo-RL's dataloader drops the last partial batch); None: no bound."""
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


def batch_metrics(stats: GroupStats, shaping_metrics: Mapping[str, float], overlong_filtering: bool) -> MetricsLine:
    """The ``train/*`` description of the step's groups: rewards, pass rate, lengths, reward shaping, penalties."""
    return {
        "train/mean_reward": stats.mean_reward,
        "train/pass_rate": stats.pass_rate,
        "train/mean_generated_tokens": stats.mean_generated_tokens,
        "train/truncation_rate": stats.truncation_rate,
        "train/zero_std_groups": stats.zero_std_groups,
        "train/samples": stats.samples,
        **({"train/overlong_filtered": stats.overlong_filtered} if overlong_filtering else {}),
        **{f"train/{key}": value for key, value in {**shaping_metrics, **stats.advantage_metrics}.items()},
    }


@dataclass(frozen=True)
class TrainOutcome:
    """What one optimizer step reports: the policy's ``train`` result, the sequence-level logprob-error mask's
    metrics (empty when it is off) and the split of the logprob gap (:meth:`GRPOTrainer._policy_movement`)."""

    result: JsonObject
    seq_logprob_error: dict[str, float]
    policy_movement: dict[str, float]


def update_metrics(outcome: TrainOutcome, refit_engine: bool) -> MetricsLine:
    """The update's metrics: the logprob-error mask, the gap split, loss, gradient norm, learning rate, whether the
    engine was refit, the on-policy error and the loss's ``loss/*`` rates."""
    result = outcome.result
    return {
        **{f"train/{key}": value for key, value in outcome.seq_logprob_error.items()},
        **outcome.policy_movement,
        "train/loss": result["loss"],
        "train/grad_norm": result["grad_norm"],
        **({"train/lr": result["lr"]} if "lr" in result else {}),
        "train/refit": refit_engine,
        **sum_on_policy_errors(result["all_mb_metrics"]).as_metrics(),
        **loss_metrics(result["all_mb_metrics"]),
    }


@dataclass
class TrainerState:
    """What a checkpoint restores besides the weights and the optimizer."""

    step: int = 0
    weight_version: int = 0
    dropped_stale_total: int = 0
    requeued_total: int = 0
    prompts: PromptQueueState = field(default_factory=PromptQueueState)


class GRPOTrainer:
    """The GRPO loop over a manager, a trainable policy (``HFPolicy``) and the engine serving it.

    ``engine`` may be None for a trainer that never refits (every ``train_step`` with ``refit_engine=False``).
    """

    def __init__(
        self,
        cfg: GRPOLoopConfig,
        *,
        manager: RolloutCollector,
        policy: TrainablePolicy,
        engine: RefitTarget | None,
        dataset: Sequence[DatumSpec],
        out_dir: Path,
        state: TrainerState | None = None,
        validator: Validator | None = None,
    ) -> None:
        self.cfg = cfg
        self.manager, self.policy, self.engine = manager, policy, engine
        self.validator = validator
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.out_dir / "metrics.jsonl"
        self.state = state or TrainerState()
        self.prompts = PromptQueue(dataset, seed=cfg.seed, shuffle=cfg.shuffle_data, state=self.state.prompts)
        self.max_steps = max_steps_for(cfg, len(dataset))
        self.buffer = StalenessBuffer(cfg.max_trajectory_age_steps)
        self.buffer.dropped_total = self.state.dropped_stale_total
        self.loss = ClippedPGLoss(cfg.loss)
        self.reward_shaper = RewardShaper(
            policy.tokenizer,
            effort_levels=cfg.effort_levels,
            reward_penalties=cfg.reward_penalties,
            thinking_tags=cfg.thinking_tags,
        )
        self.all_wrong_in_a_row = 0
        self.pad_token_id = padding_id(policy.tokenizer)
        self.weight_snapshots: dict[int, Mapping[str, torch.Tensor]] = {}
        """Async only: the trainer's weights at each version a group in flight may have been sampled at."""
        manager.set_weight_version(self.state.weight_version)

    # ------------------------------------------------------------------ rollouts

    async def rollout(self, step: int, count: int | None = None) -> list[CommittedGroup]:
        """Draw ``count`` prompts (default ``num_prompts_per_step``) and send each through ``manager.collect``;
        the committed groups in prompt order (``prompt_idx``), whatever order they committed in.

        A prompt whose group did not commit is queued again. Raises ``RolloutStall`` when nothing
        commits for ``stall_timeout_s`` (with ``stall_action: abort``) and ``StepBatchShortfall``
        when fewer groups than ``min_step_batch_fraction`` allows committed.
        """
        sink = InMemorySink()
        prompts = self.prompts.draw(count or self.cfg.num_prompts_per_step)
        collects = asyncio.gather(*(self.manager.collect(datum, sink) for datum in prompts))
        try:
            await self._watch_stall(step, collects, sink)
        finally:
            if not collects.done():
                collects.cancel()
                await asyncio.gather(collects, return_exceptions=True)
        groups = sorted(sink.take(), key=lambda g: g.record.prompt_idx)
        committed = {g.record.prompt_idx for g in groups}
        lost = self.prompts.requeue(d["idx"] for d in prompts if d["idx"] not in committed)
        self.state.requeued_total += lost
        floor = math.ceil(self.cfg.min_step_batch_fraction * len(prompts))
        if len(groups) < floor:
            raise StepBatchShortfall(
                f"step {step} committed {len(groups)} of {len(prompts)} prompt groups, below the floor of {floor} "
                f"set by min_step_batch_fraction={self.cfg.min_step_batch_fraction}"
            )
        return groups

    async def rollout_step_batch(self, step: int) -> StepRollouts:
        """The step's groups and its ``train/dynamic_sampling_*`` metrics (empty without dynamic sampling).

        With ``use_dynamic_sampling`` (NeMo-RL's ``dynamic_sampling``): each generation batch draws
        ``prompts_per_gen_batch`` prompts; groups whose shaped rewards are all equal are dropped, the others kept in
        prompt order, until ``num_prompts_per_step`` are kept; the first that many train and the rest are discarded.
        A step still short after generation batch ``dynamic_sampling_max_gen_batches + 1`` raises
        ``StepBatchShortfall`` (NeMo-RL raises after the same count: it goes on while the batches so far are at
        most the bound). Dropped and discarded prompts count as used: they are not drawn again.
        """
        if not self.cfg.use_dynamic_sampling:
            return await self.rollout(step), {}
        need, bound = self.cfg.num_prompts_per_step, self.cfg.dynamic_sampling_max_gen_batches
        kept: list[CommittedGroup] = []
        drawn = dropped = batches = 0
        while True:
            batches += 1
            groups = await self.rollout(step, self.cfg.prompts_per_gen_batch)
            drawn += self.cfg.prompts_per_gen_batch
            spread = self._with_reward_spread(groups)
            dropped += len(groups) - len(spread)
            kept.extend(spread)
            if len(kept) >= need:
                break
            logger.info(
                "step %d: %d of %d groups with a reward spread after %d generation batches (bound %d); drawing more",
                step, len(kept), need, batches, bound,
            )  # fmt: skip
            if batches > bound:
                raise StepBatchShortfall(
                    f"step {step}: dynamic sampling kept {len(kept)} of the {need} groups with a reward spread it "
                    f"needs after {batches} generation batches ({drawn} prompts drawn, {dropped} groups with equal "
                    f"rewards dropped), past grpo.dynamic_sampling_max_gen_batches={bound}"
                )
        for group in kept[need:]:
            self.prompts.settle(group.record.prompt_idx)
        samples = len(kept[0].record.completions)
        return kept[:need], {
            "train/dynamic_sampling_num_gen_batches": batches,
            "train/dynamic_sampling_prompts_drawn": drawn,
            "train/dynamic_sampling_groups_dropped": dropped,
            "train/dynamic_sampling_num_discarded_valid_samples": (len(kept) - need) * samples,
        }

    def _with_reward_spread(self, groups: list[CommittedGroup]) -> list[CommittedGroup]:
        """The groups (unshaped, in order) whose shaped rewards differ; the others' prompts count as used."""
        shaped, _ = self.reward_shaper.shape_groups(groups)
        spread: list[CommittedGroup] = []
        for group, scored in zip(groups, shaped, strict=True):
            if has_reward_spread(scored):
                spread.append(group)
            else:
                self.prompts.settle(group.record.prompt_idx)
        return spread

    async def _watch_stall(self, step: int, collects: asyncio.Future[list[object]], sink: InMemorySink) -> None:
        """Wait for the step's rollouts; with ``stall_timeout_s``, warn or raise when none commits that long."""
        timeout = self.cfg.stall_timeout_s
        committed, idle_since = 0, time.monotonic()
        while True:
            remaining = None if timeout is None else max(0.0, idle_since + timeout - time.monotonic())
            wait = None if remaining is None else min(self.cfg.stall_interval_s, remaining)
            done, _ = await asyncio.wait([collects], timeout=wait)
            if done:
                collects.result()
                return
            if len(sink.groups) > committed:
                committed, idle_since = len(sink.groups), time.monotonic()
                continue
            if timeout is None or time.monotonic() - idle_since < timeout:
                continue
            message = (
                f"step {step}: no rollout committed in {timeout:g}s ({committed} groups committed so far, "
                f"stall_timeout_s={timeout})"
            )
            if self.cfg.stall_action == "abort":
                raise RolloutStall(message)
            logger.warning("rollout stall: %s", message)
            idle_since = time.monotonic()

    # ------------------------------------------------------------------ one training step

    async def train_step(
        self,
        step: int,
        groups: list[CommittedGroup],
        rollout_s: float,
        *,
        refit_engine: bool = True,
        step_started: float | None = None,
        refit_after: Sequence[asyncio.Future[StepRollouts]] = (),
        sampling_metrics: Mapping[str, int] | None = None,
    ) -> MetricsLine:
        """Train on the fresh groups, refit the engine (unless told not to) and check it, log one metrics line.

        Groups train in prompt order (``prompt_idx``), whatever order they arrive in.
        ``step_started`` (a ``perf_counter`` value) adds ``time/step_s``, the whole step's wall time;
        ``refit_after``: the refit waits for these to finish (later steps' rollouts, ``in_flight_weight_updates``
        off), counted in ``time/refit_wait_s``; ``sampling_metrics`` (dynamic sampling's) join the line. A batch
        whose advantages are all zero trains nothing: no optimizer step, no refit, the version stays.
        """
        usable, stale = self._take_fresh(groups)
        metrics = self._staleness_metrics(step, usable, stale, rollout_s, sampling_metrics)
        train_s = refit_s = 0.0
        if usable:
            train_s, refit_s, trained = await self._train_groups(step, usable, refit_engine, refit_after)
            metrics.update(trained)
        else:
            logger.warning("step %d: no group fresh enough to train on (%d dropped as stale)", step, len(stale))
        metrics.update({"time/train_s": train_s, "time/refit_s": refit_s})
        self._end_step(step, metrics, step_started)
        return metrics

    def _take_fresh(self, groups: list[CommittedGroup]) -> tuple[list[CommittedGroup], list[CommittedGroup]]:
        """``(usable, stale)``: the held groups young enough to train on, in prompt order and settled, and those
        too old, whose prompts are queued again."""
        self.buffer.add(groups)
        usable, stale = self.buffer.take(self.state.weight_version)
        usable.sort(key=lambda g: g.record.prompt_idx)
        self.state.requeued_total += self.prompts.requeue(g.record.prompt_idx for g in stale)
        for group in usable:
            self.prompts.settle(group.record.prompt_idx)
        return usable, stale

    def _staleness_metrics(
        self,
        step: int,
        usable: list[CommittedGroup],
        stale: list[CommittedGroup],
        rollout_s: float,
        sampling_metrics: Mapping[str, int] | None,
    ) -> MetricsLine:
        """The line's head: the step, the version it trains from, what staleness dropped, the rollout time."""
        return {
            "kind": "train",
            "step": step,
            "weight_version": self.state.weight_version,
            "staleness/dropped": len(stale),
            "staleness/dropped_total": self.buffer.dropped_total,
            "staleness/requeued_total": self.state.requeued_total,
            "staleness/trained_start_versions": sorted({g.start_weight_version for g in usable}),
            "staleness/max_age": max((self.state.weight_version - g.start_weight_version for g in usable), default=0),
            "time/rollout_s": rollout_s,
            "train/groups": len(usable),
            **(sampling_metrics or {}),
        }

    async def _train_groups(
        self,
        step: int,
        usable: list[CommittedGroup],
        refit_engine: bool,
        refit_after: Sequence[asyncio.Future[StepRollouts]],
    ) -> tuple[float, float, MetricsLine]:
        """``(train_s, refit_s, metrics)`` of training on ``usable``: the batch, then (when some advantage is not
        zero) the update under the step's seed, the refit with its check, and the new version."""
        batch, stats, metrics = self._build_batch(usable)
        skip, signal = self._check_signal(step, stats, batch)
        metrics.update(signal)
        if skip:
            return 0.0, 0.0, metrics
        started = time.perf_counter()
        versions = [g.start_weight_version for g in usable for _ in g.record.completions]
        outcome = await asyncio.to_thread(self._train, batch, versions, step)
        train_s = time.perf_counter() - started
        refit_s, refit_metrics = await self._refit(step, refit_engine, refit_after)
        metrics.update(refit_metrics)
        metrics.update(update_metrics(outcome, refit_engine))
        return train_s, refit_s, metrics

    def _build_batch(self, usable: list[CommittedGroup]) -> tuple[TrainBatch, GroupStats, MetricsLine]:
        """The groups' rewards shaped, then the training batch, its stats and its ``train/*`` metrics (with the
        rollout digest)."""
        shaped, shaping_metrics = self.reward_shaper.shape_groups(usable)
        batch, stats = train_batch(
            shaped, self.pad_token_id, pass_threshold=self.cfg.pass_threshold, settings=self.cfg.advantage_settings
        )
        metrics = batch_metrics(stats, shaping_metrics, self.cfg.overlong_filtering)
        metrics["train/rollout_sha256"] = rollout_digest(batch)
        return batch, stats, metrics

    def _check_signal(self, step: int, stats: GroupStats, batch: TrainBatch) -> tuple[bool, MetricsLine]:
        """``(skip, metrics)``: skip when no trained token has a non-zero advantage. Counts the skipped steps in a row
        in which no sample passed, and warns at every ``ALL_WRONG_ALARM_STEPS`` of them: while every reward is a
        fail, no group has a reward spread, so no step updates the policy."""
        trained = torch.as_tensor(batch["token_mask"]) * torch.as_tensor(batch["sample_mask"])[:, None]
        skip = not bool((torch.as_tensor(batch["advantages"]) * trained).ne(0).any())
        self.all_wrong_in_a_row = self.all_wrong_in_a_row + 1 if skip and stats.pass_rate == 0.0 else 0
        if self.all_wrong_in_a_row and self.all_wrong_in_a_row % ALL_WRONG_ALARM_STEPS == 0:
            logger.warning(
                "steps %d-%d: no sample of any group passed, %d steps in a row: no group has a reward spread, so "
                "no step updates the policy while this lasts; the run is likely not learning (see val/accuracy)",
                step - self.all_wrong_in_a_row + 1, step, self.all_wrong_in_a_row,
            )  # fmt: skip
        if skip:
            logger.warning(
                "step %d: every advantage is zero (each group's rewards are equal); optimizer step skipped", step
            )
        return skip, {"train/skipped_zero_advantage": skip, "train/all_wrong_steps_in_a_row": self.all_wrong_in_a_row}

    async def _refit(
        self, step: int, refit_engine: bool, refit_after: Sequence[asyncio.Future[StepRollouts]]
    ) -> tuple[float, MetricsLine]:
        """``(refit_s, metrics)``: wait for ``refit_after``, refit the engine as the next version and check that it
        serves the trained weights (when ``refit_engine``), and make that version the trainer's."""
        new_version = self.state.weight_version + 1
        metrics: MetricsLine = {}
        refit_s = 0.0
        if refit_after:
            waited = time.perf_counter()
            await asyncio.wait(refit_after)
            metrics["time/refit_wait_s"] = time.perf_counter() - waited
        if refit_engine:
            if self.engine is None:
                raise SettingError("refit_engine=True needs an engine: this GRPOTrainer was built with engine=None")
            refit_s = await asyncio.to_thread(refit, self.policy, self.engine, new_version, self.manager)
            metrics.update(check_refit(self.policy, self.engine, new_version, step=step))
        self.state.weight_version = new_version
        return refit_s, metrics

    def _end_step(self, step: int, metrics: MetricsLine, step_started: float | None) -> None:
        """Add the step's wall time, count the step done and append its line to ``metrics.jsonl``."""
        if step_started is not None:
            metrics["time/step_s"] = time.perf_counter() - step_started
        self.state.step = step + 1
        self.state.dropped_stale_total = self.buffer.dropped_total
        append_metrics(self.metrics_path, metrics)

    # ------------------------------------------------------------------ the update

    def _train(self, batch: TrainBatch, versions: Sequence[int], step: int) -> TrainOutcome:
        """One optimizer step under the step's torch seed (:func:`step_seed`).

        The old policy (``prev_logprobs``) is the trainer's logprobs of the batch at its current weights: NeMo-RL's
        ``policy.get_logprobs`` before training, or, with ``loss_fn.force_on_policy_ratio`` and no
        ``seq_logprob_error_threshold`` (which needs them first), the update's own forward, recorded
        (:class:`LogprobRecorder`). Reference logprobs come first when the loss has a KL penalty; afterwards the
        logprobs at the new weights. ``versions``: each sample's sampling weight version, for
        :meth:`_policy_movement`.
        """
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(step_seed(self.cfg.seed, step))
            self._keep_weight_snapshot()
            self._add_reference_logprobs(batch)
            if self.cfg.loss.force_on_policy_ratio and self.cfg.seq_logprob_error_threshold is None:
                recorder = LogprobRecorder(self.loss)
                result = dict(self.policy.train(batch, recorder, mbs=self.cfg.train_micro_batch_size))
                prev, seq_metrics = recorder.logprobs(len(versions)), {}
            else:
                prev = self._old_policy_logprobs(batch)
                seq_metrics = self._mask_seq_logprob_errors(batch, prev)
                result = dict(self.policy.train(batch, self.loss, mbs=self.cfg.train_micro_batch_size))
            after = torch.as_tensor(self.policy.get_logprobs(batch)["logprobs"]).float()
        scored = torch.as_tensor(batch["token_mask"]).float() * torch.as_tensor(batch["sample_mask"]).float()[:, None]
        at_sampling = self._logprobs_at_sampling(batch, prev, versions)
        gen = torch.as_tensor(batch["generation_logprobs"]).float()
        movement = self._policy_movement(gen, prev, at_sampling, after, scored)
        return TrainOutcome(result, seq_metrics, movement)

    def _old_policy_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """The trainer's logprobs of the batch before the update, set as its ``prev_logprobs``."""
        prev = torch.as_tensor(self.policy.get_logprobs(batch)["logprobs"]).float()
        batch["prev_logprobs"] = prev
        return prev

    def _mask_seq_logprob_errors(self, batch: TrainBatch, prev: torch.Tensor) -> dict[str, float]:
        """With ``seq_logprob_error_threshold``: sequences whose probability error is above it leave the loss
        (``sample_mask``); its metrics, or none when it is off."""
        if self.cfg.seq_logprob_error_threshold is None:
            return {}
        batch["sample_mask"], metrics = seq_logprob_error_mask(
            batch["token_mask"],
            batch["sample_mask"],
            prev,
            batch["generation_logprobs"],
            batch["rewards"],
            self.cfg.seq_logprob_error_threshold,
        )
        metrics["num_masked_seqs_by_logprob_error"] = metrics.pop("num_masked_seqs")
        return metrics

    def _add_reference_logprobs(self, batch: TrainBatch) -> None:
        """With a KL penalty: the reference policy's logprobs of the batch, as ``reference_policy_logprobs``."""
        if self.cfg.loss.reference_policy_kl_penalty:
            reference = self.policy.get_reference_policy_logprobs(batch, self.cfg.train_micro_batch_size)
            batch["reference_policy_logprobs"] = reference["reference_logprobs"]

    def _keep_weight_snapshot(self) -> None:
        """Async only: a copy of the weights before this update, to score later samples of this version with."""
        if self.cfg.lookahead and isinstance(self.policy, SnapshotPolicy):
            self.weight_snapshots[self.state.weight_version] = self.policy.weights_snapshot()

    def _logprobs_at_sampling(
        self, batch: TrainBatch, prev: torch.Tensor, versions: Sequence[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(logprobs, known)``: the trainer's logprobs of each sample at the weights that sampled it, and which
        samples have them. A sample of the current version has ``prev``; an older one is scored with the weights
        kept for its version (async only: :attr:`weight_snapshots`, as many as ``max_trajectory_age_steps``)."""
        current = self.state.weight_version
        version = torch.as_tensor(list(versions), dtype=torch.int64)
        logprobs, known = prev.clone(), version == current
        policy = self.policy
        if self.cfg.lookahead and isinstance(policy, SnapshotPolicy):
            for v in sorted(set(version.tolist()) - {current}):
                if v not in self.weight_snapshots:
                    continue
                rows = (version == v).nonzero().flatten()
                part = type(batch)({key: batch[key][rows] for key in ("input_ids", "input_lengths")})
                logprobs[rows] = torch.as_tensor(policy.get_logprobs_at(part, self.weight_snapshots[v])).float()
                known[rows] = True
            oldest = current + 1 - self.cfg.max_trajectory_age_steps  # the oldest version the next update can use
            self.weight_snapshots = {v: w for v, w in self.weight_snapshots.items() if v >= oldest}
        return logprobs, known

    @staticmethod
    def _policy_movement(
        gen: torch.Tensor,
        prev: torch.Tensor,
        at_sampling: tuple[torch.Tensor, torch.Tensor],
        after: torch.Tensor,
        scored: torch.Tensor,
    ) -> dict[str, float]:
        """The gap between the engine's sampling logprobs and the trainer's, split, plus this step's movement.

        ``train/engine_mismatch_*``: the trainer at the sampling version vs the engine (the same weights: float
        noise, unless a refit went wrong); ``train/policy_lag_*``: the trainer before this update vs at the
        sampling version (how far the updates since sampling moved it; 0 in sync); ``train/policy_step_*``: after
        this update vs before. Each as ``abs_diff_mean``, ``abs_diff_max`` and ``kl`` (k3) over the trained tokens;
        the split covers the samples whose sampling version's weights were kept (``train/engine_mismatch_tokens``).
        """
        at, known = at_sampling
        split_mask = scored * known.float()[:, None]
        out: dict[str, float] = {}
        for name, new, old, mask in (
            ("engine_mismatch", at, gen, split_mask),
            ("policy_lag", prev, at, split_mask),
            ("policy_step", after, prev, scored),
        ):
            out.update({f"train/{name}_{key}": value for key, value in logprob_gap(new, old, mask).items()})
        return out

    # ------------------------------------------------------------------ the run

    async def validate(self, step: int) -> MetricsLine | None:
        """One validation with the current weights, logged as its own ``kind: val`` line."""
        if self.validator is None:
            return None
        started = time.perf_counter()
        metrics: MetricsLine = {"kind": "val", "step": step, "weight_version": self.state.weight_version}
        metrics.update(await self.validator(step, self.state.weight_version))
        metrics["time/val_s"] = time.perf_counter() - started
        append_metrics(self.metrics_path, metrics)
        return metrics

    def _validates_after(self, step: int) -> bool:
        """Whether validation follows the step that makes ``step`` steps done."""
        period = self.cfg.val_period
        return (self.cfg.val_at_end and step == self.max_steps) or bool(period and step % period == 0)

    async def run(self, on_step: Callable[[MetricsLine], object] | None = None) -> list[MetricsLine]:
        """Steps from ``state.step`` to ``max_steps``; validation and checkpoints as configured.

        ``on_step`` gets every metrics line (training steps and validations).
        """
        history: list[MetricsLine] = []
        last = self.max_steps
        step = self.state.step
        if step >= last:
            return history
        pending: dict[int, asyncio.Future[StepRollouts]] = {}
        launched = step

        def launch(through: int) -> None:
            nonlocal launched
            while launched <= min(through, last - 1):
                pending[launched] = asyncio.ensure_future(self.rollout_step_batch(launched))
                launched += 1

        def record(metrics: MetricsLine | None) -> None:
            if metrics is not None:
                history.append(metrics)
                if on_step is not None:
                    on_step(metrics)

        try:
            if self.cfg.val_at_start and step == 0:
                record(await self.validate(0))
            while step < last:
                step_started = time.perf_counter()
                launch(step)
                groups, sampling = await pending.pop(step)
                rollout_s = time.perf_counter() - step_started
                launch(step + self.cfg.lookahead)
                wait_for = [] if self.cfg.in_flight_weight_updates else list(pending.values())
                record(
                    await self.train_step(
                        step,
                        groups,
                        rollout_s,
                        step_started=step_started,
                        refit_after=wait_for,
                        sampling_metrics=sampling,
                    )
                )
                step += 1
                if self._validates_after(step):
                    record(await self.validate(step))
                every = self.cfg.checkpoint_every_steps
                if step == last or (every and step % every == 0):
                    self.save_checkpoint()
        finally:
            for future in pending.values():
                future.cancel()
            await asyncio.gather(*pending.values(), return_exceptions=True)
        return history

    @property
    def checkpoint_dir(self) -> Path:
        """Where :meth:`save_checkpoint` keeps the run's one checkpoint."""
        return self.out_dir / "checkpoint"

    def save_checkpoint(self) -> Path:
        """The policy (weights, tokenizer, optimizer) and the trainer state, replacing the previous checkpoint.

        Prompts whose rollouts are still in flight are saved as queued again: a resumed run redoes them.
        """
        staging = self.out_dir / "checkpoint.partial"
        shutil.rmtree(staging, ignore_errors=True)
        self.policy.save_checkpoint(staging)
        state = TrainerState(**{**asdict(self.state), "prompts": self.prompts.checkpoint_state()})
        (staging / STATE_FILE).write_text(json.dumps(asdict(state)))
        shutil.rmtree(self.checkpoint_dir, ignore_errors=True)
        staging.rename(self.checkpoint_dir)
        return self.checkpoint_dir


def load_trainer_state(checkpoint_dir: Path) -> TrainerState | None:
    """The state saved with a checkpoint, or None when there is no complete checkpoint."""
    path = Path(checkpoint_dir) / STATE_FILE
    if not path.exists():
        return None
    saved = json.loads(path.read_text())
    return TrainerState(**{**saved, "prompts": PromptQueueState(**saved.get("prompts", {}))})
