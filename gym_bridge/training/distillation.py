"""On-policy distillation's loss: NeMo-RL's ``DistillationLossFn`` over the teacher's top-k next-token logits.

The student's rollouts go through Gym as GRPO's do; the teacher scores the student's own tokens. At each position
the teacher's top ``k`` logits (``get_topk_logits``, ``distillation.topk_logits_k``) and the student's logits at
the same token ids are each renormalised over those ``k`` (a ``log_softmax`` over the gathered logits), and the KL
between the two is ``forward`` (teacher || student), ``reverse`` (student || teacher) or ``mixed``
(``mixed_kl_weight`` forward + the rest reverse), summed over the ``k`` ids. With ``zero_outside_topk`` the
student's logprobs are over the whole vocabulary, and a reverse part adds the mass outside the top ``k``
(its entropy there, and ``-log(1e-100)`` times its probability there: the teacher's zero). The per-token KL is
summed over generated tokens (position ``t`` predicts token ``t + 1``) and divided by the global batch's count of
them, as :class:`~gym_bridge.training.loss.ClippedPGLoss` divides its token-level loss.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from gym_bridge.batched import BatchedDataDict
from gym_bridge.policy.loss import TokenBatchSpec, token_mask

LOG_INFINITESIMAL = -100.0
"""NeMo-RL's log-probability of a token outside the teacher's top ``k``."""


class DistillationConfig(BaseModel):
    """NeMo-RL's distillation keys: ``teacher.model_name``, ``distillation.topk_logits_k`` and ``loss_fn``'s."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    teacher_model: str
    """``teacher.model_name``: a local model folder or a built-in model name."""
    topk_logits_k: int = Field(64, ge=1)
    kl_type: Literal["forward", "reverse", "mixed"] = "mixed"
    mixed_kl_weight: float = Field(0.5, ge=0.0, le=1.0)
    """With ``kl_type: mixed``: the forward KL's weight; the reverse KL gets the rest."""
    zero_outside_topk: bool = False


class DistillationBatchSpec(TokenBatchSpec):
    """The token batch plus the teacher's ``teacher_topk_logits`` and ``teacher_topk_indices``, ``[B, S-1, k]``."""

    teacher_topk_logits: torch.Tensor
    teacher_topk_indices: torch.Tensor


class DistillationLoss:
    """NeMo-RL's ``DistillationLossFn``; it reads the student's next-token logits ``[b, S-1, V]``
    (:attr:`reads_logits`), not its token logprobs."""

    reads_logits = True

    def __init__(self, cfg: DistillationConfig) -> None:
        self.cfg = cfg

    def __call__(
        self,
        token_logprobs: torch.Tensor,
        data: BatchedDataDict[DistillationBatchSpec],
        global_valid_seqs: torch.Tensor,
        global_valid_toks: torch.Tensor,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        cfg, logits = self.cfg, token_logprobs  # the next-token logits: ``reads_logits``
        width = logits.shape[1]
        indices = torch.as_tensor(data["teacher_topk_indices"]).to(logits.device)[:, :width].long()
        teacher = torch.log_softmax(torch.as_tensor(data["teacher_topk_logits"]).to(logits)[:, :width], dim=-1)
        logits = logits.float()
        correction = torch.zeros(logits.shape[:2], device=logits.device)
        if cfg.zero_outside_topk:  # the student's logprobs over the whole vocabulary
            full = torch.log_softmax(logits, dim=-1)
            student = full.gather(-1, indices)
            if cfg.kl_type != "forward":
                entropy_rest = (full.exp() * full).sum(-1) - (student.exp() * student).sum(-1)
                correction = entropy_rest - LOG_INFINITESIMAL * (1 - student.exp().sum(-1))
                if cfg.kl_type == "mixed":
                    correction = correction * (1.0 - cfg.mixed_kl_weight)
        else:
            student = torch.log_softmax(logits.gather(-1, indices), dim=-1)
        forward = teacher.exp() * (teacher - student)
        reverse = student.exp() * (student - teacher)
        if cfg.kl_type == "forward":
            per_token = forward
        elif cfg.kl_type == "reverse":
            per_token = reverse
        else:
            per_token = cfg.mixed_kl_weight * forward + (1.0 - cfg.mixed_kl_weight) * reverse
        kl = per_token.sum(-1) + correction
        mask = token_mask(data, torch.Size((logits.shape[0], width + 1)))[:, 1:].to(kl.device)
        loss = (kl * mask).sum() / global_valid_toks.clamp(min=1)
        return loss, {"loss": float(loss.detach()), "num_valid_samples": float(logits.shape[0])}
