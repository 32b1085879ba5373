"""``HFPolicy``: a trainable :class:`PolicyInterface` over a local transformers causal LM (CPU or GPU).

Token batches are NeMo-RL's: right-padded ``input_ids`` ``[B, S]`` with
``input_lengths`` ``[B]``. Logprobs are aligned to the token they score:
``logprobs[b, t] = log_softmax(logits[b, t - 1] / T)[input_ids[b, t]]``, with 0 at
position 0 and on padding. ``T`` is ``cfg.temperature`` (1 by default), so at
``T = 1`` they equal :class:`~gym_bridge.generation.hf.HFGeneration`'s sampling
logprobs for the same tokens, up to float rounding (the training/inference
mismatch check).

``train`` takes a loss function with the signature of :class:`~gym_bridge.policy.loss.LossFunction`:
it receives the micro-batch's token logprobs (as above, with gradients) and the
micro-batch, plus the global batch's valid sequence and token counts, so that a
loss normalised by those counts sums over micro-batches to the global-batch loss
(gradient accumulation is then exact). :func:`~gym_bridge.policy.loss.policy_gradient_loss` is such a loss.

The learning rate follows ``cfg.scheduler``, NeMo-RL's ``policy.scheduler`` (built by
:func:`~gym_bridge.policy.lr_scheduler.build_lr_scheduler`): one
``torch.optim.lr_scheduler`` class (``{name, kwargs}``), or a list of them with a
``{milestones: [...]}`` entry, chained by ``SequentialLR``; none: a constant rate. As in
NeMo-RL's DTensor policy workers, it steps once per :meth:`HFPolicy.train` call (one GRPO
step), and its state is saved with the optimizer.

A checkpoint is the model's ``save_pretrained`` folder (safetensors weights) plus ``optimizer.pt``
(:mod:`gym_bridge.policy.optimizer_file`, read as untrusted input).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

import torch
from pydantic import BaseModel, ConfigDict, Field

from gym_bridge.batched import BatchedDataDict
from gym_bridge.boundary.files import make_dir, write_atomic
from gym_bridge.boundary.text import shown
from gym_bridge.failures.errors import CheckpointError, GymBridgeError, SettingError
from gym_bridge.interfaces import PolicyInterface
from gym_bridge.json_types import JsonMapping, JsonObject
from gym_bridge.models.loading import causal_lm_on_device
from gym_bridge.policy.logits import next_token_logits, topk_next_token_logits
from gym_bridge.policy.loss import (
    LossFunction,
    TokenBatchSpec,
    length_mask,
    token_mask,
)
from gym_bridge.policy.lr_scheduler import build_lr_scheduler
from gym_bridge.policy.optimizer_file import (
    OPTIMIZER_FILE,
    optimizer_file_cap,
    optimizer_file_writer,
    read_optimizer_file,
    state_problem,
)
from gym_bridge.policy.shared_prefix import plan_prefixes, shared_prefix_logprobs, worth_sharing
from gym_bridge.types import (
    GenerationDatumSpec,
    LogprobOutputSpec,
    ReferenceLogprobOutputSpec,
    Tokenizer,
    TopkLogitsOutputSpec,
)

if TYPE_CHECKING:
    from transformers import PreTrainedModel

logger = logging.getLogger(__name__)


class ReferenceModelMissing(GymBridgeError, RuntimeError):
    """Reference logprobs were asked of a policy built with ``keep_reference_model=False``."""


class SavableTokenizer(Tokenizer, Protocol):
    """A :class:`~gym_bridge.types.Tokenizer` that writes itself into a checkpoint folder (any Hugging Face one)."""

    def save_pretrained(self, save_directory: str | Path) -> object: ...


class HFPolicyConfig(BaseModel):
    """Settings of :class:`HFPolicy`."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: str = Field("tiny", description='A local model folder, or a built-in model: "tiny", "smollm2".')
    device: str = "cpu"
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    learning_rate: float = Field(1e-5, gt=0.0)
    weight_decay: float = Field(0.0, ge=0.0)
    betas: tuple[float, float] = (0.9, 0.999)
    max_grad_norm: float | None = Field(1.0, gt=0.0, description="None: no clipping.")
    train_global_batch_size: int | None = Field(None, ge=1, description="None: the whole batch is one step.")
    train_micro_batch_size: int | None = Field(None, ge=1, description="None: the global batch in one pass.")
    logprob_batch_size: int = Field(8, ge=1)
    temperature: float = Field(1.0, gt=0.0, description="Logits are divided by it, as at generation.")
    keep_reference_model: bool = Field(True, description="Keep a frozen copy of the initial weights.")
    freeze_embeddings: bool = Field(False, description="Do not train the input embedding (tied: nor the LM head).")
    shared_prefix: bool = Field(
        True,
        description="Compute the prefix that neighbouring rows share (the N samples of a prompt) once per pass "
        "(gym_bridge.policy.shared_prefix); False: one forward over every whole row.",
    )
    scheduler: list[JsonObject] | JsonObject | None = Field(
        None, description="NeMo-RL's policy.scheduler (see build_lr_scheduler); None: a constant learning rate."
    )


def _train_sizes(size: int, gbs: int, mbs: int) -> None:
    """Raise :class:`~gym_bridge.failures.errors.SettingError` unless ``size`` samples split into global batches
    of ``gbs`` and those into micro-batches of ``mbs``."""
    if gbs % mbs:
        raise SettingError(f"the global batch size {gbs} must be a multiple of the micro-batch size {mbs}")
    if size % gbs:
        raise SettingError(f"the batch of {size} samples is not a whole number of global batches of {gbs}")


class HFPolicy(PolicyInterface):
    """A policy trained with AdamW in this process; see the module docstring for the data contract."""

    def __init__(
        self,
        cfg: HFPolicyConfig | JsonMapping | None = None,
        *,
        model: PreTrainedModel | None = None,
        tokenizer: SavableTokenizer | None = None,
    ) -> None:
        """Load ``cfg.model`` (a folder or a built-in name), or train an already loaded ``model`` (in place)."""
        if cfg is None:
            cfg = HFPolicyConfig()
        elif not isinstance(cfg, HFPolicyConfig):
            cfg = HFPolicyConfig(**dict(cfg))
        self.cfg: HFPolicyConfig = cfg
        tokenizer, model = causal_lm_on_device(cfg.model, cfg.dtype, cfg.device, model=model, tokenizer=tokenizer)
        self.tokenizer: SavableTokenizer = tokenizer
        self.model: PreTrainedModel = model
        self.device = torch.device(cfg.device)
        self.reference_model: PreTrainedModel | None = None
        if cfg.keep_reference_model:
            self.reference_model = copy.deepcopy(self.model).eval().requires_grad_(False)
        if cfg.freeze_embeddings:
            self.model.get_input_embeddings().weight.requires_grad_(False)
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad],
            lr=cfg.learning_rate,
            betas=cfg.betas,
            weight_decay=cfg.weight_decay,
        )
        self.scheduler = build_lr_scheduler(self.optimizer, cfg.scheduler)
        self.steps_taken = 0

    # ------------------------------------------------------------------ logprobs

    def _token_logprobs(
        self,
        model: torch.nn.Module,
        input_ids: torch.Tensor,
        lengths: torch.Tensor,
        first: int = 1,
        weights: Mapping[str, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """``[b, S]`` logprob of each token given its prefix; 0 at position 0 and on padding.

        Positions before ``first`` are 0 too, and their logits are never computed: training
        reads only generated tokens, and the prompt's vocabulary projections are most of the
        ``[b, S, V]`` logits on a short completion. ``weights`` replace the model's parameters of those
        names for this forward pass (``torch.func.functional_call``). With ``cfg.shared_prefix``, the prefix that
        neighbouring rows share is fed once (:mod:`gym_bridge.policy.shared_prefix`) when that saves enough tokens.
        """
        first = max(1, min(first, input_ids.shape[1] - 1))

        def forward(**inputs: object) -> Any:
            if weights is None:
                return model(**inputs)
            return torch.func.functional_call(model, dict(weights), args=(), kwargs=inputs)

        input_ids, lengths = input_ids.to(self.device), lengths.to(self.device)
        if self.cfg.shared_prefix and input_ids.shape[0] > 1 and int(lengths.min()) >= 2:
            runs = plan_prefixes(input_ids, lengths)
            if worth_sharing(runs, lengths):
                return shared_prefix_logprobs(forward, input_ids, lengths, runs, first, self.cfg.temperature)
        attention = length_mask(lengths, input_ids.shape[1]).long()
        keep = {"logits_to_keep": input_ids.shape[1] - first + 1} if first > 1 else {}
        logits = forward(input_ids=input_ids, attention_mask=attention, use_cache=False, **keep).logits
        logp = torch.log_softmax(logits[:, :-1].float() / self.cfg.temperature, dim=-1)
        picked = logp.gather(-1, input_ids[:, first:, None]).squeeze(-1)
        out = torch.cat([picked.new_zeros((picked.shape[0], first)), picked], dim=1)
        return out * attention.to(out.dtype)

    def _batched_logprobs(
        self,
        model: torch.nn.Module,
        data: BatchedDataDict[GenerationDatumSpec],
        micro_batch_size: int | None,
        weights: Mapping[str, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """:meth:`_token_logprobs` of the whole batch, ``micro_batch_size`` rows at a time, without gradients."""
        input_ids = torch.as_tensor(data["input_ids"]).to(torch.int64)
        lengths = torch.as_tensor(data["input_lengths"]).to(torch.int64).reshape(-1)
        step = micro_batch_size or self.cfg.logprob_batch_size
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                parts = [
                    self._token_logprobs(model, input_ids[s : s + step], lengths[s : s + step], weights=weights).cpu()
                    for s in range(0, input_ids.shape[0], step)
                ]
        finally:
            model.train(was_training)
        return torch.cat(parts) if parts else torch.zeros(input_ids.shape, dtype=torch.float32)

    def get_logprobs(
        self, data: BatchedDataDict[GenerationDatumSpec], timer: object = None
    ) -> BatchedDataDict[LogprobOutputSpec]:
        return BatchedDataDict({"logprobs": self._batched_logprobs(self.model, data, None)})

    def get_reference_policy_logprobs(
        self, data: BatchedDataDict[GenerationDatumSpec], micro_batch_size: int | None = None, timer: object = None
    ) -> BatchedDataDict[ReferenceLogprobOutputSpec]:
        if self.reference_model is None:
            raise ReferenceModelMissing("HFPolicy was built with keep_reference_model=False")
        return BatchedDataDict(
            {"reference_logprobs": self._batched_logprobs(self.reference_model, data, micro_batch_size)}
        )

    def get_topk_logits(
        self,
        data: BatchedDataDict[GenerationDatumSpec],
        k: int,
        micro_batch_size: int | None = None,
        timer: object = None,
    ) -> BatchedDataDict[TopkLogitsOutputSpec]:
        """Top-``k`` of ``logits / T`` at positions ``0 .. S-2`` (each predicts the next token): ``[B, S-1, k]``."""
        values, indices = topk_next_token_logits(
            self.model,
            torch.as_tensor(data["input_ids"]).to(torch.int64),
            torch.as_tensor(data["input_lengths"]).to(torch.int64).reshape(-1),
            self.cfg.temperature,
            self.device,
            k=k,
            batch_size=micro_batch_size or self.cfg.logprob_batch_size,
        )
        return BatchedDataDict({"topk_logits": values, "topk_indices": indices})

    # ------------------------------------------------------------------ training

    def train[SpecT: TokenBatchSpec](
        self,
        data: BatchedDataDict[SpecT],
        loss_fn: LossFunction[SpecT],
        eval_mode: bool = False,
        gbs: int | None = None,
        mbs: int | None = None,
        *,
        timer: object = None,
    ) -> JsonObject:
        """One optimizer step per global batch of ``gbs`` samples, accumulated over micro-batches of ``mbs``.

        ``eval_mode`` computes the loss without gradients or an update. The learning-rate scheduler steps
        once per call that trains, after its last optimizer step (NeMo-RL's DTensor workers do the same).
        Returns ``loss`` (mean over global batches of the summed micro-batch losses),
        ``global_batch_losses``, ``grad_norm`` (of the last step, before clipping),
        ``lr`` (the rate this call trained with), ``num_global_batches``, ``num_micro_batches`` and
        ``all_mb_metrics``.
        """
        size = len(torch.as_tensor(data["input_lengths"]))
        if size == 0:
            raise SettingError("cannot train on an empty batch")
        gbs = gbs or self.cfg.train_global_batch_size or size
        mbs = mbs or self.cfg.train_micro_batch_size or gbs
        _train_sizes(size, gbs, mbs)
        self.model.train(not eval_mode)
        global_losses: list[float] = []
        all_mb_metrics: list[Mapping[str, object]] = []
        grad_norm = 0.0
        lr = float(self.optimizer.param_groups[0]["lr"])
        try:
            for g in range(0, size, gbs):
                total, mb_metrics = self._accumulate(data.slice(g, g + gbs), gbs, mbs, loss_fn, eval_mode)
                all_mb_metrics.extend(mb_metrics)
                if not eval_mode:
                    grad_norm = self._optimizer_step()
                global_losses.append(total)
            if not eval_mode:
                self.scheduler.step()
        finally:
            self.model.eval()
        return {
            "loss": sum(global_losses) / len(global_losses),
            "global_batch_losses": global_losses,
            "grad_norm": grad_norm,
            "lr": lr,
            "num_global_batches": len(global_losses),
            "num_micro_batches": len(all_mb_metrics),
            "all_mb_metrics": all_mb_metrics,
        }

    def _accumulate[SpecT: TokenBatchSpec](
        self,
        global_batch: BatchedDataDict[SpecT],
        gbs: int,
        mbs: int,
        loss_fn: LossFunction[SpecT],
        eval_mode: bool,
    ) -> tuple[float, list[Mapping[str, object]]]:
        """One global batch's summed micro-batch losses and their metrics; unless ``eval_mode``, its gradients are
        accumulated in the (zeroed) parameters' ``.grad``. Losses see the global batch's valid sequence and token
        counts, so their sum is the global batch's loss."""
        width = torch.as_tensor(global_batch["input_ids"]).shape[1]
        mask = token_mask(global_batch, torch.Size((gbs, width)))
        valid_toks = mask.sum()
        valid_seqs = (
            torch.as_tensor(global_batch["sample_mask"]).float().sum()
            if global_batch.get("sample_mask") is not None
            else torch.tensor(float(gbs))
        )
        if not eval_mode:
            self.optimizer.zero_grad(set_to_none=True)
        total = 0.0
        all_mb_metrics: list[Mapping[str, object]] = []
        for m in range(0, gbs, mbs):
            micro = global_batch.slice(m, m + mbs)
            trained = mask[m : m + mbs].any(dim=0).nonzero()
            ids = torch.as_tensor(micro["input_ids"]).to(torch.int64)
            lengths = torch.as_tensor(micro["input_lengths"]).to(torch.int64)
            with torch.set_grad_enabled(not eval_mode):
                if getattr(loss_fn, "reads_logits", False):  # a distillation loss: the next-token logits
                    logprobs = next_token_logits(self.model, ids, lengths, self.cfg.temperature, self.device)
                else:
                    first = int(trained[0]) if len(trained) else 1
                    logprobs = self._token_logprobs(self.model, ids, lengths, first=first)
                loss, mb_metrics = loss_fn(
                    logprobs, micro, valid_seqs.to(logprobs.device), valid_toks.to(logprobs.device)
                )
            if not eval_mode:
                loss.backward()
            total += float(loss.detach())
            all_mb_metrics.append(mb_metrics)
        return total, all_mb_metrics

    def _optimizer_step(self) -> float:
        """Clip the accumulated gradients to ``max_grad_norm`` and step; returns the norm before clipping."""
        grad_norm = float(
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.max_grad_norm or float("inf"))
        )
        self.optimizer.step()
        self.steps_taken += 1
        return grad_norm

    def calibrate_qkv_fp8_scales(
        self,
        data: BatchedDataDict[GenerationDatumSpec],
        micro_batch_size: int | None = None,
        percentile: float = 99.9,
        margin: float = 1.05,
        include_q: bool = False,
    ) -> dict[str, float]:
        raise NotImplementedError("HFPolicy does not calibrate FP8 KV scales")

    # ------------------------------------------------------------------ lifecycle

    def prepare_for_training(self, *args: object, **kwargs: object) -> None:
        self.model.train()

    def finish_training(self, *args: object, **kwargs: object) -> None:
        self.model.eval()

    def save_checkpoint(self, path: str | Path, *args: object, save_optimizer: bool = True, **kwargs: object) -> None:
        """``save_pretrained`` of the model (safetensors) and tokenizer into ``path``, plus ``optimizer.pt`` (the
        optimizer's and the learning-rate scheduler's ``state_dict()`` and the step count: tensors and plain
        containers, which :meth:`load_optimizer` reads with ``weights_only=True``). ``path`` itself is never
        followed as a link, and ``optimizer.pt`` is written through a temporary file and ``os.replace``.

        Raises:
            UntrustedInputError: ``path`` is a link, a file, or cannot be made (one line naming it).
        """
        path = Path(path)
        make_dir(path, root=make_dir(path.parent))  # the caller's folder may be a link; the checkpoint is not
        self.model.save_pretrained(path, safe_serialization=True)
        if self.tokenizer is not None:
            self.tokenizer.save_pretrained(path)
        if save_optimizer:
            writer = optimizer_file_writer(self.optimizer, self.scheduler, int(self.steps_taken))
            write_atomic(path / OPTIMIZER_FILE, writer, root=path)

    def load_optimizer(self, path: str | Path) -> None:
        """Restore the optimizer, the scheduler and the step count that :meth:`save_checkpoint` wrote into ``path``.

        The file is read by :func:`read_optimizer_file` and checked against this policy's optimizer and scheduler
        before either loads it. A checkpoint without scheduler state restarts the configured schedule at this step
        count.

        Raises:
            CheckpointError: ``optimizer.pt`` is missing, not a regular file, too large for this model, not tensors
                and plain containers, or not this optimizer's state; one line naming the file.
        """
        file = Path(path) / OPTIMIZER_FILE
        saved = read_optimizer_file(file, optimizer_file_cap(self.optimizer))
        problem = state_problem(saved, self.optimizer, self.scheduler)
        if problem is not None:
            raise CheckpointError(f"{shown(file)}: {problem}; not the state of this policy's optimizer and scheduler")
        try:
            self.optimizer.load_state_dict(saved["optimizer"])
            if saved.get("scheduler") is not None:
                self.scheduler.load_state_dict(saved["scheduler"])
        except (ValueError, KeyError, TypeError, IndexError, RuntimeError) as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise CheckpointError(f"{shown(file)}: does not load into this policy's optimizer ({first})") from None
        self.steps_taken = saved["steps_taken"]
        if saved.get("scheduler") is None:
            for _ in range(self.steps_taken):
                self.scheduler.step()

    def weights_snapshot(self) -> dict[str, torch.Tensor]:
        """A copy of the trainable weights by name: :meth:`get_logprobs_at` scores with them later."""
        return {name: p.detach().clone() for name, p in self.model.named_parameters() if p.requires_grad}

    def get_logprobs_at(
        self, data: BatchedDataDict[GenerationDatumSpec], weights: Mapping[str, torch.Tensor]
    ) -> torch.Tensor:
        """:meth:`get_logprobs`'s ``logprobs`` with ``weights`` (a :meth:`weights_snapshot`) in place of the
        trained ones; the model itself is not touched."""
        return self._batched_logprobs(self.model, data, None, weights=weights)

    def state_dict_for_refit(self) -> dict[str, torch.Tensor]:
        """The current weights by name, detached (no copy): what a generation engine's refit loads."""
        return {name: tensor.detach() for name, tensor in self.model.state_dict().items()}

    def shutdown(self) -> bool:
        self.optimizer.zero_grad(set_to_none=True)
        return True
