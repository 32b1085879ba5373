"""A GRPO step's rollouts: prompts drawn from the queue, each sent through ``manager.collect``, the committed
groups in prompt order; dynamic sampling (NeMo-RL's DAPO) and the stall watch. Mixed into
:class:`~gym_bridge.training.loop.GRPOTrainer`."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import Protocol

from gym_bridge.failures import RolloutStall, StepBatchShortfall
from gym_bridge.rollout.reward_shaper import RewardShaper
from gym_bridge.rollout.sink import CommittedGroup, InMemorySink, RolloutSink
from gym_bridge.training.loop_config import GRPOLoopConfig, StepRollouts, has_reward_spread
from gym_bridge.training.prompts import PromptQueue
from gym_bridge.training.refit import VersionTagger
from gym_bridge.training.trainer_state import TrainerState
from gym_bridge.types import (
    DatumSpec,
)

logger = logging.getLogger(__name__)


class RolloutCollector(VersionTagger, Protocol):
    """What the loop calls on its rollouts (``RolloutManager``): ``collect`` one prompt's group into a sink, and
    ``set_weight_version`` after each refit."""

    async def collect(self, datum: DatumSpec, sink: RolloutSink) -> object: ...


class RolloutPhase:
    """The trainer's rollout phase; the trainer sets the attributes it reads."""

    cfg: GRPOLoopConfig
    manager: RolloutCollector
    prompts: PromptQueue
    state: TrainerState
    reward_shaper: RewardShaper

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
