"""gym-bridge's DistillationLoss against NeMo-RL's own ``DistillationLossFn`` and
``get_distillation_topk_logprobs_from_logits`` (imported unmodified from a checkout) on the same logits.

    uv run python scripts/nemo_rl_check/distillation.py --nemo-rl-src /path/to/NeMo-RL

Prints one JSON object per case (``name``, ``seed``, ``loss_diff``, ``grad_max_diff``) and exits 1 when a case
differs by more than :data:`TOLERANCE`. NeMo-RL's tensors have one more position at the end (its functions drop the
last position: it predicts past the sequence), which ours never computes.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from gym_bridge.batched import BatchedDataDict
from gym_bridge.training.distillation import DistillationConfig, DistillationLoss
from nemo_rl_check import imports

TOLERANCE = 1e-5
CASES: dict[str, dict[str, Any]] = {
    "forward": {"kl_type": "forward"},
    "reverse": {"kl_type": "reverse"},
    "mixed": {"kl_type": "mixed", "mixed_kl_weight": 0.3},
    "forward zero outside top-k": {"kl_type": "forward", "zero_outside_topk": True},
    "reverse zero outside top-k": {"kl_type": "reverse", "zero_outside_topk": True},
    "mixed zero outside top-k": {"kl_type": "mixed", "mixed_kl_weight": 0.7, "zero_outside_topk": True},
}


def tensors(seed: int, rows: int = 3, width: int = 7, vocab: int = 11, k: int = 4) -> dict[str, torch.Tensor]:
    """Student logits and teacher logits ``[rows, width + 1, vocab]`` (the extra last position for NeMo-RL), the
    teacher's top-``k``, ragged token masks and one masked-out sample."""
    g = torch.Generator().manual_seed(seed)
    student = torch.randn(rows, width + 1, vocab, generator=g, dtype=torch.float64) * 2
    teacher = torch.randn(rows, width + 1, vocab, generator=g, dtype=torch.float64) * 2
    top = torch.topk(teacher, k, dim=-1)
    lengths = torch.randint(3, width + 2, (rows,), generator=g)
    token_mask = (torch.arange(width + 1)[None, :] < lengths[:, None]).double()
    token_mask[:, :2] = 0.0  # a two-token prompt
    sample_mask = torch.ones(rows, dtype=torch.float64)
    sample_mask[-1] = 0.0
    return {"student": student, "topk_logits": top.values, "topk_indices": top.indices, "token_mask": token_mask,
            "sample_mask": sample_mask, "lengths": torch.full((rows,), width + 1)}  # fmt: skip


def _tokens(t: dict[str, torch.Tensor]) -> torch.Tensor:
    return (t["token_mask"][:, 1:] * t["sample_mask"][:, None]).sum()


def ours(case: dict[str, Any], t: dict[str, torch.Tensor]) -> tuple[float, torch.Tensor]:
    logits = t["student"][:, :-1].clone().requires_grad_(True)
    data = BatchedDataDict({
        "input_ids": torch.zeros_like(t["token_mask"], dtype=torch.int64), "input_lengths": t["lengths"],
        "token_mask": t["token_mask"], "sample_mask": t["sample_mask"],
        "teacher_topk_logits": t["topk_logits"][:, :-1], "teacher_topk_indices": t["topk_indices"][:, :-1],
    })  # fmt: skip
    loss, _ = DistillationLoss(DistillationConfig(teacher_model="x", **case))(
        logits, data, t["sample_mask"].sum(), _tokens(t)
    )
    loss.backward()
    assert logits.grad is not None
    return float(loss.detach()), logits.grad


def nemo_rls(case: dict[str, Any], t: dict[str, torch.Tensor]) -> tuple[float, torch.Tensor]:
    losses = importlib.import_module("nemo_rl.algorithms.loss.loss_functions")
    model_utils = importlib.import_module("nemo_rl.distributed.model_utils")
    cfg = losses.DistillationLossConfig(**case)
    loss_fn = losses.DistillationLossFn(cfg)
    logits = t["student"].clone().requires_grad_(True)
    student, teacher, entropy = model_utils.get_distillation_topk_logprobs_from_logits(
        student_logits=logits, teacher_topk_logits=t["topk_logits"], teacher_topk_indices=t["topk_indices"],
        zero_outside_topk=cfg.zero_outside_topk, calculate_entropy=cfg.zero_outside_topk and cfg.kl_type != "forward",
    )  # fmt: skip
    data = {"input_ids": torch.zeros_like(t["token_mask"]), "token_mask": t["token_mask"],
            "sample_mask": t["sample_mask"]}  # fmt: skip
    loss, _ = loss_fn(student, teacher, entropy, data, t["sample_mask"].sum(), _tokens(t))
    loss.backward()
    assert logits.grad is not None
    return float(loss.detach()), logits.grad[:, :-1]


def compare(root: Path, seeds: range = range(5)) -> list[dict[str, Any]]:
    """Every case of :data:`CASES` on each seed's tensors, ours against NeMo-RL's."""
    imports.import_nemo_rl(root)
    results = []
    for name, case in CASES.items():
        for seed in seeds:
            t = tensors(seed)
            (loss_a, grad_a), (loss_b, grad_b) = ours(case, t), nemo_rls(case, t)
            results.append({"name": name, "seed": seed, "loss_ours": loss_a, "loss_nemo_rl": loss_b,
                            "loss_diff": abs(loss_a - loss_b), "grad_max_diff": float((grad_a - grad_b).abs().max())})  # fmt: skip
    return results


def main() -> int:
    return imports.comparison_main(
        __doc__.splitlines()[0], compare, lambda r: r["loss_diff"] <= TOLERANCE and r["grad_max_diff"] <= TOLERANCE
    )


if __name__ == "__main__":
    sys.exit(main())
