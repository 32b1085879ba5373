"""gym-bridge's ClippedPGLoss against NeMo-RL's own ``ClippedPGLossFn`` (imported unmodified from a checkout) on the
same tensors: the loss and its gradient for each loss variant both implement.

    uv run python scripts/nemo_rl_check/losses.py --nemo-rl-src /path/to/NeMo-RL

Prints one JSON object per case (``name``, ``loss_ours``, ``loss_nemo_rl``, ``grad_max_diff``) and exits 1 when a
case differs by more than :data:`TOLERANCE`. NeMo-RL's tensors are ours with one leading column (its loss reads
``[:, 1:]``: next-token positions), its sample mask the same, and both get the same global token and sample counts.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from gym_bridge.batched import BatchedDataDict
from gym_bridge.training.loss import ClippedPGLoss, ClippedPGLossConfig
from nemo_rl_check import imports

TOLERANCE = 1e-5
"""Largest difference in the loss or any gradient entry (float64 tensors; NeMo-RL adds 1e-8 to its denominators)."""
GSPO = {"token_level_loss": False, "sequence_level_importance_ratios": True}
CASES: dict[str, dict[str, Any]] = {
    "grpo": {},
    "grpo dual clip": {"ratio_clip_c": 3.0},
    "grpo kl k3": {"reference_policy_kl_penalty": 0.05},
    "grpo importance sampling tis": {
        "use_importance_sampling_correction": True,
        "truncated_importance_sampling_type": "tis",
        "truncated_importance_sampling_ratio": 1.5,
    },
    "sequence-level loss": {"token_level_loss": False},
    "sequence-level loss kl k1": {
        "token_level_loss": False,
        "reference_policy_kl_penalty": 0.1,
        "reference_policy_kl_type": "k1",
    },
    "gspo": GSPO,
    "gspo dual clip asymmetric": {**GSPO, "ratio_clip_min": 0.1, "ratio_clip_max": 0.28, "ratio_clip_c": 3.0},
    "gspo importance sampling": {**GSPO, "use_importance_sampling_correction": True},
    "gspo importance sampling tis": {
        **GSPO,
        "use_importance_sampling_correction": True,
        "truncated_importance_sampling_type": "tis",
        "truncated_importance_sampling_ratio": 1.2,
    },
    "gspo kl k3": {**GSPO, "reference_policy_kl_penalty": 0.05},
    "on-policy kl approximation": {"reference_policy_kl_penalty": 0.05, "use_on_policy_kl_approximation": True},
    "sequence-level on-policy kl approximation k2": {
        "token_level_loss": False,
        "reference_policy_kl_penalty": 0.1,
        "reference_policy_kl_type": "k2",
        "use_on_policy_kl_approximation": True,
    },
}


def tensors(seed: int, rows: int = 6, width: int = 9) -> dict[str, torch.Tensor]:
    """A micro-batch with ragged token masks, one masked-out sample, per-token advantages and logprobs that differ
    (from seed 3 on by enough that ratios pass the dual clip and weights the truncation)."""
    spread = 0.3 if seed < 3 else 1.5
    g = torch.Generator().manual_seed(seed)
    gen = -torch.rand(rows, width, generator=g, dtype=torch.float64) * 3
    lengths = torch.randint(1, width + 1, (rows,), generator=g)
    token_mask = (torch.arange(width)[None, :] < lengths[:, None]).double()
    sample_mask = torch.ones(rows, dtype=torch.float64)
    sample_mask[rows - 1] = 0.0
    return {
        "curr": gen + torch.randn(rows, width, generator=g, dtype=torch.float64) * spread,
        "prev": gen + torch.randn(rows, width, generator=g, dtype=torch.float64) * spread / 3,
        "gen": gen,
        "ref": gen + torch.randn(rows, width, generator=g, dtype=torch.float64) * 0.2,
        "advantages": torch.randn(rows, 1, generator=g, dtype=torch.float64).expand(rows, width).clone(),
        "token_mask": token_mask,
        "sample_mask": sample_mask,
    }


def ours(case: dict[str, Any], t: dict[str, torch.Tensor]) -> tuple[float, torch.Tensor]:
    cfg = ClippedPGLossConfig(**({"reference_policy_kl_penalty": 0.0} | case))
    curr = t["curr"].clone().requires_grad_(True)
    data = BatchedDataDict(
        {
            "generation_logprobs": t["gen"],
            "prev_logprobs": t["prev"],
            "reference_policy_logprobs": t["ref"],
            "advantages": t["advantages"],
            "token_mask": t["token_mask"],
            "sample_mask": t["sample_mask"],
        }
    )
    loss, _ = ClippedPGLoss(cfg)(curr, data, *_counts(t))
    loss.backward()
    assert curr.grad is not None
    return float(loss.detach()), curr.grad


def nemo_rls(module: Any, case: dict[str, Any], t: dict[str, torch.Tensor]) -> tuple[float, torch.Tensor]:
    batched = importlib.import_module("nemo_rl.distributed.batched_data_dict")
    cfg = module.ClippedPGLossConfig(**({"reference_policy_kl_penalty": 0.0} | case))
    curr = t["curr"].clone().requires_grad_(True)

    def shifted(x: torch.Tensor) -> torch.Tensor:
        return torch.cat([torch.zeros_like(x[:, :1]), x], dim=1)

    data = batched.BatchedDataDict(
        {
            "generation_logprobs": shifted(t["gen"]),
            "prev_logprobs": shifted(t["prev"]),
            "reference_policy_logprobs": shifted(t["ref"]),
            "advantages": shifted(t["advantages"]),
            "token_mask": shifted(t["token_mask"]),
            "sample_mask": t["sample_mask"],
        }
    )
    loss, _ = module.ClippedPGLossFn(cfg)(curr, data, *_counts(t))
    loss.backward()
    assert curr.grad is not None
    return float(loss.detach()), curr.grad


def _counts(t: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch's valid samples and tokens, as NeMo-RL's trainer counts them."""
    return t["sample_mask"].sum(), (t["token_mask"] * t["sample_mask"][:, None]).sum()


def compare(root: Path, seeds: range = range(6)) -> list[dict[str, Any]]:
    """Every case of :data:`CASES` on each seed's tensors, ours against NeMo-RL's."""
    imports.import_nemo_rl(root)
    module = importlib.import_module("nemo_rl.algorithms.loss.loss_functions")
    results = []
    for name, case in CASES.items():
        for seed in seeds:
            t = tensors(seed)
            loss_a, grad_a = ours(case, t)
            loss_b, grad_b = nemo_rls(module, case, t)
            results.append(
                {
                    "name": name,
                    "seed": seed,
                    "loss_ours": loss_a,
                    "loss_nemo_rl": loss_b,
                    "loss_diff": abs(loss_a - loss_b),
                    "grad_max_diff": float((grad_a - grad_b).abs().max()),
                }
            )
    return results


def main() -> int:
    return imports.comparison_main(__doc__.splitlines()[0], compare, lambda r: r["loss_diff"] <= TOLERANCE and r["grad_max_diff"] <= TOLERANCE)


if __name__ == "__main__":
    sys.exit(main())
