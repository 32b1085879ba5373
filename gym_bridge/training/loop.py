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
import logging
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from gym_bridge.boundary.files import make_dir, write_atomic
from gym_bridge.boundary.json_io import dumps
from gym_bridge.failures.errors import SettingError
from gym_bridge.rollout.reward_shaper import RewardShaper
from gym_bridge.rollout.sink import CommittedGroup
from gym_bridge.training.agent_metrics import step_agent_metrics
from gym_bridge.training.batch import GroupStats, train_batch
from gym_bridge.training.loop_config import (
    GRPOLoopConfig,
    StepRollouts,
    TrainBatch,
    max_steps_for,
    rollout_digest,
)
from gym_bridge.training.loss import (
    ClippedPGLoss,
)
from gym_bridge.training.metrics import MetricsLine, append_metrics
from gym_bridge.training.prompts import PromptQueue
from gym_bridge.training.refit import RefitTarget, check_refit, refit
from gym_bridge.training.staleness import StalenessBuffer
from gym_bridge.training.step_rollouts import RolloutCollector, RolloutPhase
from gym_bridge.training.trainer_state import STATE_FILE, TrainerState
from gym_bridge.training.update import TeacherPolicy, TrainablePolicy, UpdatePhase, update_metrics
from gym_bridge.training.validation import Validator
from gym_bridge.types import (
    DatumSpec,
    padding_id,
)

logger = logging.getLogger(__name__)

ALL_WRONG_ALARM_STEPS = 3
"""Steps in a row in which no sample passed before the loop says the run has stopped learning."""


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


class GRPOTrainer(RolloutPhase, UpdatePhase):
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
        metric_sinks: Sequence[Callable[[MetricsLine], object]] = (),
        save_checkpoints: bool = True,
        teacher: TeacherPolicy | None = None,
    ) -> None:
        self.cfg = cfg
        self.teacher = teacher
        """With ``cfg.distillation``: the teacher whose top-k logits each step distils."""
        self.save_checkpoints = save_checkpoints
        """False (NeMo-RL's ``checkpointing.enabled: false``): :meth:`run` writes no checkpoint, at the end either."""
        self.manager, self.policy, self.engine = manager, policy, engine
        self.validator = validator
        self.metric_sinks = list(metric_sinks)
        """Each metrics line goes to these too, after ``metrics.jsonl`` (the run's experiment loggers)."""
        self.out_dir = Path(out_dir)
        make_dir(self.out_dir)
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
        """The line's head: the step, the version it trains from, what staleness dropped, the rollout time, and each
        environment's metrics over the groups it trains on (``train/<agent>/<field>/mean``, ...)."""
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
            **step_agent_metrics(usable),
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
        skip = not bool((torch.as_tensor(batch["advantages"]) * trained).ne(0).any()) and self.cfg.distillation is None
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
        self._log(metrics)

    # ------------------------------------------------------------------ the run

    def _log(self, metrics: MetricsLine) -> None:
        """Append one line to ``metrics.jsonl``, then hand it to every metric sink."""
        append_metrics(self.metrics_path, metrics)
        for sink in self.metric_sinks:
            sink(metrics)

    async def validate(self, step: int) -> MetricsLine | None:
        """One validation with the current weights, logged as its own ``kind: val`` line."""
        if self.validator is None:
            return None
        started = time.perf_counter()
        metrics: MetricsLine = {"kind": "val", "step": step, "weight_version": self.state.weight_version}
        metrics.update(await self.validator(step, self.state.weight_version))
        metrics["time/val_s"] = time.perf_counter() - started
        self._log(metrics)
        return metrics

    def _validates_after(self, step: int) -> bool:
        """Whether validation follows the step that makes ``step`` steps done."""
        period = self.cfg.val_period
        return (self.cfg.val_at_end and step == self.max_steps) or bool(period and step % period == 0)

    async def run(self, on_step: Callable[[MetricsLine], object] | None = None) -> list[MetricsLine]:
        """Steps from ``state.step`` to ``max_steps``; validation and checkpoints as configured.

        A validation runs beside the next step's rollouts, which sample with the same weights, and is awaited
        before that step trains and refits the engine (or before a checkpoint): the engine decodes both in one
        batch, and its line still comes before the step's. Its ``time/val_s`` is then shared with the rollouts.

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

        validation: asyncio.Future[MetricsLine | None] | None = None
        try:
            if self.cfg.val_at_start and step == 0:
                validation = asyncio.ensure_future(self.validate(0))
            while step < last:
                step_started = time.perf_counter()
                launch(step)
                groups, sampling = await pending.pop(step)
                rollout_s = time.perf_counter() - step_started
                if validation is not None:  # it used the weights this step's rollouts used; the refit comes next
                    record(await validation)
                    validation = None
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
                    validation = asyncio.ensure_future(self.validate(step))
                every = self.cfg.checkpoint_every_steps
                checkpoint = self.save_checkpoints and (step == last or bool(every and step % every == 0))
                if validation is not None and (checkpoint or step == last):
                    record(await validation)  # a checkpoint comes after the validation of its weights
                    validation = None
                if checkpoint:
                    self.save_checkpoint()
        finally:
            unfinished: list[asyncio.Future[Any]] = [*pending.values()]
            if validation is not None:
                unfinished.append(validation)
            for future in unfinished:
                future.cancel()
            await asyncio.gather(*unfinished, return_exceptions=True)
        return history

    @property
    def checkpoint_dir(self) -> Path:
        """Where :meth:`save_checkpoint` keeps the run's one checkpoint."""
        return self.out_dir / "checkpoint"

    def save_checkpoint(self) -> Path:
        """The policy (weights, tokenizer, optimizer) and the trainer state, replacing the previous checkpoint.

        Prompts whose rollouts are still in flight are saved as queued again: a resumed run redoes them. A link
        planted as ``checkpoint.partial`` or ``checkpoint`` is removed, never written through; the staging folder is
        made and its state file written without following a link (a name planted there while the policy saves is
        refused in one line).
        """
        staging = self.out_dir / "checkpoint.partial"
        _remove(staging)
        make_dir(staging, root=self.out_dir)
        self.policy.save_checkpoint(staging)
        state = TrainerState(**{**asdict(self.state), "prompts": self.prompts.checkpoint_state()})
        write_atomic(staging / STATE_FILE, dumps(asdict(state)), root=self.out_dir)
        _remove(self.checkpoint_dir)
        staging.rename(self.checkpoint_dir)
        return self.checkpoint_dir


def _remove(path: Path) -> None:
    """Remove what ``path`` names, whatever it is: a link (planted in a run folder, so a checkpoint is never written
    through it into the folder it points at) or a file is unlinked, a folder removed with what it holds."""
    if path.is_symlink() or (path.exists() and not path.is_dir()):
        path.unlink()
    else:
        shutil.rmtree(path, ignore_errors=True)
