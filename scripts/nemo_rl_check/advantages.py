"""gym-bridge's GRPO and GDPO advantages against NeMo-RL's own ``GRPOAdvantageEstimator`` and
``GDPOAdvantageEstimator`` (imported unmodified from a checkout) on the same rewards.

    uv run python scripts/nemo_rl_check/advantages.py --nemo-rl-src /path/to/NeMo-RL

Prints one JSON object per case (``name``, ``seed``, ``max_diff``) and exits 1 when a case differs by more than
:data:`TOLERANCE`. Each seed draws groups of binary and continuous reward components (some groups with no spread);
NeMo-RL gets them as ``reward/<name>`` columns of a flat float32 batch with one prompt id per group, as its Gym path builds
them, and the GRPO cases the components' sum as the reward.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from gym_bridge.training.advantages import gdpo_advantages, grpo_advantages
from nemo_rl_check import imports

TOLERANCE = 1e-5
"""Largest difference of any sample's advantage (float32 rewards: NeMo-RL's baseline matrix is float32)."""
CASES: dict[str, dict[str, Any]] = {
    "grpo": {"name": "grpo"},
    "grpo no leave-one-out": {"name": "grpo", "use_leave_one_out_baseline": False},
    "grpo not normalized": {"name": "grpo", "normalize_rewards": False},
    "gdpo": {"name": "gdpo"},
    "gdpo recipe (no leave-one-out)": {"name": "gdpo", "use_leave_one_out_baseline": False},
    "gdpo weighted": {"name": "gdpo", "use_leave_one_out_baseline": False, "reward_weights": [1.0, 0.5, 0.25]},
    "gdpo not normalized": {"name": "gdpo", "normalize_rewards": False, "reward_weights": [2.0, -1.0, 0.5]},
}


def components(seed: int, groups: int = 5, size: int = 4) -> dict[str, torch.Tensor]:
    """Three components ``[groups, size]``: two binary (``correctness``, ``format``; the first group with no
    spread in either) and one continuous (``schema_valid``)."""
    g = torch.Generator().manual_seed(seed)
    binary = (torch.rand(2, groups, size, generator=g) < 0.5).float()
    binary[:, 0] = 1.0
    return {
        "correctness": binary[0],
        "format": binary[1],
        "schema_valid": torch.rand(groups, size, generator=g),
    }


def ours(case: dict[str, Any], parts: dict[str, torch.Tensor]) -> torch.Tensor:
    options = {
        "leave_one_out": case.get("use_leave_one_out_baseline", True),
        "normalize": case.get("normalize_rewards", True),
    }
    if case["name"] == "grpo":
        return grpo_advantages(sum(parts.values()), **options).double().reshape(-1)
    return gdpo_advantages(parts, weights=case.get("reward_weights"), **options).double().reshape(-1)


def nemo_rls(module: Any, case: dict[str, Any], parts: dict[str, torch.Tensor]) -> torch.Tensor:
    groups, size = next(iter(parts.values())).shape
    config = module.AdvEstimatorConfig(**case)
    estimator_class = module.GDPOAdvantageEstimator if case["name"] == "gdpo" else module.GRPOAdvantageEstimator
    estimator = estimator_class(config, None)
    prompt_ids = torch.arange(groups).repeat_interleave(size)[:, None]
    batch = {f"reward/{name}": values.reshape(-1) for name, values in parts.items()}
    rewards = sum(batch.values())
    advantages = estimator.compute_advantage(
        prompt_ids=prompt_ids, rewards=rewards, mask=torch.ones(groups * size, 3), repeated_batch=batch
    )
    return advantages[:, 0].double()


def compare(root: Path, seeds: range = range(8)) -> list[dict[str, Any]]:
    """Every case of :data:`CASES` on each seed's components, ours against NeMo-RL's."""
    imports.import_nemo_rl(root)
    module = importlib.import_module("nemo_rl.algorithms.advantage_estimator")
    results = []
    for name, case in CASES.items():
        for seed in seeds:
            parts = components(seed)
            diff = (ours(case, parts) - nemo_rls(module, case, parts)).abs().max()
            results.append({"name": name, "seed": seed, "max_diff": float(diff)})
    return results


def main() -> int:
    return imports.comparison_main(__doc__.splitlines()[0], compare, lambda r: r["max_diff"] <= TOLERANCE)


if __name__ == "__main__":
    sys.exit(main())
