"""A GRPO step's update: one optimizer step under the step's seed, the PPO old policy, reference logprobs, the
sequence-level logprob-error mask, and the split of the logprob gap (engine mismatch, policy lag, policy step).
Mixed into :class:`~gym_bridge.training.loop.GRPOTrainer`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, cast, runtime_checkable

import torch

from gym_bridge.batched import BatchedDataDict
from gym_bridge.failures.errors import SettingError
from gym_bridge.json_types import JsonObject
from gym_bridge.policy.loss import LossFunction, TokenBatchSpec
from gym_bridge.training.distillation import DistillationBatchSpec, DistillationConfig, DistillationLoss
from gym_bridge.training.fidelity import logprob_gap, seq_logprob_error_mask
from gym_bridge.training.loop_config import GRPOLoopConfig, TrainBatch, step_seed
from gym_bridge.training.loss import (
    ClippedPGLoss,
    LogprobRecorder,
    loss_metrics,
    sum_on_policy_errors,
)
from gym_bridge.training.metrics import MetricsLine
from gym_bridge.training.refit import RefitSource
from gym_bridge.training.trainer_state import TrainerState
from gym_bridge.types import (
    LogprobOutputSpec,
    ReferenceLogprobOutputSpec,
    Tokenizer,
    TopkLogitsOutputSpec,
)


class TrainablePolicy(RefitSource, Protocol):
    """What the loop calls on its policy (``HFPolicy``): NeMo-RL's logprob and train calls, the tokenizer (reward
    shaping, padding), a checkpoint, and the weights a refit sends."""

    @property
    def tokenizer(self) -> Tokenizer: ...

    def get_logprobs(self, data: TrainBatch) -> BatchedDataDict[LogprobOutputSpec]: ...

    def get_reference_policy_logprobs(
        self, data: TrainBatch, micro_batch_size: int | None = None
    ) -> BatchedDataDict[ReferenceLogprobOutputSpec]: ...

    def train[SpecT: TokenBatchSpec](
        self, data: BatchedDataDict[SpecT], loss_fn: LossFunction[SpecT], *, mbs: int | None = None
    ) -> JsonObject: ...

    def save_checkpoint(self, path: Path) -> None: ...


class TeacherPolicy(Protocol):
    """A distillation teacher: the top-k of its next-token logits over a batch (``HFPolicy.get_topk_logits``)."""

    def get_topk_logits(self, data: TrainBatch, k: int) -> BatchedDataDict[TopkLogitsOutputSpec]: ...


@runtime_checkable
class SnapshotPolicy(Protocol):
    """A policy that copies its weights and scores with a copy later (``HFPolicy``); async runs use it to score
    each sample at the weights that sampled it."""

    def weights_snapshot(self) -> dict[str, torch.Tensor]: ...

    def get_logprobs_at(self, data: TrainBatch, weights: Mapping[str, torch.Tensor]) -> torch.Tensor: ...


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
        **_loss_rates(result["all_mb_metrics"]),
    }


def _loss_rates(mb_metrics: list[Any]) -> MetricsLine:
    """The policy-gradient loss's on-policy error and ``loss/*`` rates; none for the distillation loss, whose
    micro-batches report only ``loss`` and ``num_valid_samples``."""
    if not mb_metrics or any("on_policy" not in m for m in mb_metrics):
        return {}
    return {**sum_on_policy_errors(mb_metrics).as_metrics(), **loss_metrics(mb_metrics)}


class UpdatePhase:
    """The trainer's update phase; the trainer sets the attributes it reads."""

    cfg: GRPOLoopConfig
    policy: TrainablePolicy
    state: TrainerState
    loss: ClippedPGLoss
    weight_snapshots: dict[int, Mapping[str, torch.Tensor]]
    teacher: TeacherPolicy | None

    def _train(self, batch: TrainBatch, versions: Sequence[int], step: int) -> TrainOutcome:
        """One optimizer step under the step's torch seed (:func:`step_seed`).

        The old policy (``prev_logprobs``) is the trainer's logprobs of the batch at its current weights: NeMo-RL's
        ``policy.get_logprobs`` before training, or, with ``loss_fn.force_on_policy_ratio`` and no
        ``seq_logprob_error_threshold`` (which needs them first), the update's own forward, recorded
        (:class:`LogprobRecorder`). Reference logprobs come first when the loss has a KL penalty; afterwards the
        logprobs at the new weights. ``versions``: each sample's sampling weight version, for
        :meth:`_policy_movement`. With ``cfg.distillation`` the update is the distillation loss over the teacher's
        top-k logits (:meth:`_distil`), the old policy's logprobs taken first for the same metrics.
        """
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(step_seed(self.cfg.seed, step))
            self._keep_weight_snapshot()
            self._add_reference_logprobs(batch)
            if self.cfg.distillation is not None:
                prev, seq_metrics = self._old_policy_logprobs(batch), dict[str, float]()
                result = self._distil(batch, self.cfg.distillation)
            elif self.cfg.loss.force_on_policy_ratio and self.cfg.seq_logprob_error_threshold is None:
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

    def _distil(self, batch: TrainBatch, cfg: DistillationConfig) -> dict[str, Any]:
        """One distillation update: the teacher's top-k logits of the student's batch, then the distillation loss."""
        if self.teacher is None:
            raise SettingError("a distillation run needs its teacher: this GRPOTrainer was built with teacher=None")
        top = self.teacher.get_topk_logits(batch, cfg.topk_logits_k)
        data = cast(BatchedDataDict[DistillationBatchSpec], batch)
        data["teacher_topk_logits"], data["teacher_topk_indices"] = top["topk_logits"], top["topk_indices"]
        return dict(self.policy.train(data, DistillationLoss(cfg), mbs=self.cfg.train_micro_batch_size))

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
