"""``GRPOTrainer``: roll out through a ``RolloutManager``, train the policy, refit the engine, bump the version.

One step: ``num_prompts_per_step`` prompts, each rolled out N times through
``manager.collect`` (any backend; the recipe uses ``nemo_gym``), group-normalised
advantages, one optimizer step on the generated tokens, a refit of the serving
engine, and the new weight version on the manager. With ``async_rollouts`` the
next step's rollouts run while this step trains and refits; every group is checked
against ``max_trajectory_age_steps`` before it is trained on (too old: dropped and
counted). Every step appends one line to ``metrics.jsonl``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import shutil
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from gym_bridge.failures import RolloutStall, StepBatchShortfall
from gym_bridge.rollout.sink import CommittedGroup, InMemorySink
from gym_bridge.training.batch import train_batch
from gym_bridge.training.loss import GRPOLoss, sum_on_policy_errors
from gym_bridge.training.metrics import append_metrics
from gym_bridge.training.refit import refit
from gym_bridge.training.staleness import StalenessBuffer
from gym_bridge.types import DatumSpec

logger = logging.getLogger(__name__)

STATE_FILE = "trainer_state.json"


class GRPOLoopConfig(BaseModel):
    """The loop's settings (NeMo-RL's ``grpo`` section names where they exist)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    num_prompts_per_step: int = Field(8, ge=1)
    max_num_steps: int = Field(40, ge=1)
    use_leave_one_out_baseline: bool = True
    normalize_rewards: bool = True
    ratio_clip: float = Field(0.2, gt=0.0)
    async_rollouts: bool = False
    max_trajectory_age_steps: int = Field(1, ge=0)
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
    train_micro_batch_size: int | None = Field(None, ge=1)
    checkpoint_every_steps: int | None = Field(None, ge=1, description="None: only at the end of the run.")


@dataclass
class TrainerState:
    """What a checkpoint restores besides the weights and the optimizer."""

    step: int = 0
    weight_version: int = 0
    dropped_stale_total: int = 0


class GRPOTrainer:
    """The GRPO loop over a manager, a trainable policy (``HFPolicy``) and the engine serving it."""

    def __init__(
        self,
        cfg: GRPOLoopConfig,
        *,
        manager: Any,
        policy: Any,
        engine: Any,
        dataset: Sequence[DatumSpec],
        out_dir: Path,
        state: TrainerState | None = None,
    ) -> None:
        if not dataset:
            raise ValueError("the training dataset is empty")
        self.cfg = cfg
        self.manager, self.policy, self.engine = manager, policy, engine
        self.dataset = list(dataset)
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.out_dir / "metrics.jsonl"
        self.state = state or TrainerState()
        self.buffer = StalenessBuffer(cfg.max_trajectory_age_steps)
        self.buffer.dropped_total = self.state.dropped_stale_total
        self.loss = GRPOLoss(cfg.ratio_clip)
        self.pad_token_id = int(
            policy.tokenizer.pad_token_id
            if policy.tokenizer.pad_token_id is not None
            else policy.tokenizer.eos_token_id
        )
        manager.set_weight_version(self.state.weight_version)

    def prompts_for(self, step: int) -> list[DatumSpec]:
        """The step's prompts: the dataset in order, cycling; ``idx`` is unique across the run."""
        per_step = self.cfg.num_prompts_per_step
        out: list[DatumSpec] = []
        for i in range(per_step):
            position = step * per_step + i
            datum: DatumSpec = {**self.dataset[position % len(self.dataset)], "idx": position}
            out.append(datum)
        return out

    async def rollout(self, step: int) -> list[CommittedGroup]:
        """Every prompt of ``step`` through ``manager.collect``; the committed groups with their versions.

        Raises ``RolloutStall`` when nothing commits for ``stall_timeout_s`` (with ``stall_action: abort``)
        and ``StepBatchShortfall`` when fewer groups than ``min_step_batch_fraction`` allows committed.
        """
        sink = InMemorySink()
        prompts = self.prompts_for(step)
        collects = asyncio.gather(*(self.manager.collect(datum, sink) for datum in prompts))
        try:
            await self._watch_stall(step, collects, sink)
        finally:
            if not collects.done():
                collects.cancel()
                await asyncio.gather(collects, return_exceptions=True)
        groups = sink.take()
        floor = math.ceil(self.cfg.min_step_batch_fraction * len(prompts))
        if len(groups) < floor:
            raise StepBatchShortfall(
                f"step {step} committed {len(groups)} of {len(prompts)} prompt groups, below the floor of {floor} "
                f"set by min_step_batch_fraction={self.cfg.min_step_batch_fraction}"
            )
        return groups

    async def _watch_stall(self, step: int, collects: asyncio.Future[Any], sink: InMemorySink) -> None:
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
                f"step {step}: no rollout committed in {timeout:.0f}s ({committed} groups committed so far, "
                f"stall_timeout_s={timeout})"
            )
            if self.cfg.stall_action == "abort":
                raise RolloutStall(message)
            logger.warning("rollout stall: %s", message)
            idle_since = time.monotonic()

    async def train_step(
        self,
        step: int,
        groups: list[CommittedGroup],
        rollout_s: float,
        *,
        refit_engine: bool = True,
        step_started: float | None = None,
        refit_after: asyncio.Future[Any] | None = None,
    ) -> dict[str, Any]:
        """Train on the fresh groups, refit the engine (unless told not to), log one metrics line.

        ``step_started`` (a ``perf_counter`` value) adds ``time/step_s``, the whole step's wall time;
        ``refit_after``: the refit waits for it to finish (the next step's rollouts, ``in_flight_weight_updates``
        off), counted in ``time/refit_wait_s``.
        """
        self.buffer.add(groups)
        usable, dropped = self.buffer.take(self.state.weight_version)
        metrics: dict[str, Any] = {
            "step": step,
            "weight_version": self.state.weight_version,
            "staleness/dropped": dropped,
            "staleness/dropped_total": self.buffer.dropped_total,
            "staleness/trained_start_versions": sorted({g.start_weight_version for g in usable}),
            "staleness/max_age": max((self.state.weight_version - g.start_weight_version for g in usable), default=0),
            "time/rollout_s": rollout_s,
            "train/groups": len(usable),
        }
        train_s = refit_s = 0.0
        if usable:
            batch, stats = train_batch(
                usable,
                self.pad_token_id,
                leave_one_out=self.cfg.use_leave_one_out_baseline,
                normalize=self.cfg.normalize_rewards,
                pass_threshold=self.cfg.pass_threshold,
            )
            started = time.perf_counter()
            result = await asyncio.to_thread(self.policy.train, batch, self.loss, mbs=self.cfg.train_micro_batch_size)
            train_s = time.perf_counter() - started
            error = sum_on_policy_errors(result["all_mb_metrics"])
            new_version = self.state.weight_version + 1
            if refit_after is not None:
                waited = time.perf_counter()
                await asyncio.wait([refit_after])
                metrics["time/refit_wait_s"] = time.perf_counter() - waited
            if refit_engine:
                refit_s = await asyncio.to_thread(refit, self.policy, self.engine, new_version, self.manager)
            self.state.weight_version = new_version
            metrics.update(
                {
                    "train/mean_reward": stats.mean_reward,
                    "train/pass_rate": stats.pass_rate,
                    "train/mean_generated_tokens": stats.mean_generated_tokens,
                    "train/truncation_rate": stats.truncation_rate,
                    "train/zero_std_groups": stats.zero_std_groups,
                    "train/samples": stats.samples,
                    "train/loss": result["loss"],
                    "train/grad_norm": result["grad_norm"],
                    "train/refit": refit_engine,
                    **error.as_metrics(),
                }
            )
        else:
            logger.warning("step %d: no group fresh enough to train on (%d dropped as stale)", step, dropped)
        metrics.update({"time/train_s": train_s, "time/refit_s": refit_s})
        if step_started is not None:
            metrics["time/step_s"] = time.perf_counter() - step_started
        self.state.step = step + 1
        self.state.dropped_stale_total = self.buffer.dropped_total
        append_metrics(self.metrics_path, metrics)
        return metrics

    async def run(self, on_step: Any = None) -> list[dict[str, Any]]:
        """Steps from ``state.step`` to ``max_num_steps``; checkpoints as configured and at the end."""
        history: list[dict[str, Any]] = []
        last = self.cfg.max_num_steps
        step = self.state.step
        if step >= last:
            return history
        pending: asyncio.Future[list[CommittedGroup]] = asyncio.ensure_future(self.rollout(step))
        try:
            while step < last:
                step_started = time.perf_counter()
                groups = await pending
                rollout_s = time.perf_counter() - step_started
                overlap = self.cfg.async_rollouts and step + 1 < last
                if overlap:
                    pending = asyncio.ensure_future(self.rollout(step + 1))
                wait_for = pending if overlap and not self.cfg.in_flight_weight_updates else None
                metrics = await self.train_step(
                    step, groups, rollout_s, step_started=step_started, refit_after=wait_for
                )
                history.append(metrics)
                if on_step is not None:
                    on_step(metrics)
                step += 1
                every = self.cfg.checkpoint_every_steps
                if step == last or (every and step % every == 0):
                    self.save_checkpoint()
                if not self.cfg.async_rollouts and step < last:
                    pending = asyncio.ensure_future(self.rollout(step))
        finally:
            if not pending.done():
                pending.cancel()
                await asyncio.gather(pending, return_exceptions=True)
        return history

    @property
    def checkpoint_dir(self) -> Path:
        return self.out_dir / "checkpoint"

    def save_checkpoint(self) -> Path:
        """The policy (weights, tokenizer, optimizer) and the trainer state, replacing the previous checkpoint."""
        staging = self.out_dir / "checkpoint.partial"
        shutil.rmtree(staging, ignore_errors=True)
        self.policy.save_checkpoint(staging)
        (staging / STATE_FILE).write_text(json.dumps(asdict(self.state)))
        shutil.rmtree(self.checkpoint_dir, ignore_errors=True)
        staging.rename(self.checkpoint_dir)
        return self.checkpoint_dir


def load_trainer_state(checkpoint_dir: Path) -> TrainerState | None:
    """The state saved with a checkpoint, or None when there is no complete checkpoint."""
    path = Path(checkpoint_dir) / STATE_FILE
    if not path.exists():
        return None
    return TrainerState(**json.loads(path.read_text()))
