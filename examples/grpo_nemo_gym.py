"""GRPO through NeMo-Gym on a CPU: a real small model gets better at problems it never trained on.

    uv run python examples/grpo_nemo_gym.py examples/grpo_nemo_gym.yaml [--out runs/grpo] [--steps N] [--async]

Each step rolls out a batch of Gym rows N times through real NeMo-Gym servers, which
call our OpenAI-compatible server (a thread of this process) serving the current
weights; computes GRPO advantages; trains the policy on the generated tokens; refits
the new weights into the serving engine and checks that they arrived; and bumps the
weight version. Held-out problems are answered greedily through the same Gym servers at
the start, every ``grpo.val_period`` steps and at the end. Writes ``metrics.jsonl``,
``val_results.jsonl`` (every held-out answer), ``reward_curve.png`` and a checkpoint into
the run folder; run again with the same ``--out`` to resume.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from pathlib import Path

import yaml

from gym_bridge.failures import GymBridgeError
from gym_bridge.ray_utils import init_ray
from gym_bridge.recipes.grpo_run import build_grpo_run
from gym_bridge.training.metrics import plot_reward_curve, read_metrics

logger = logging.getLogger("grpo_nemo_gym")

ASYNC_CORRECTION = {
    "use_importance_sampling_correction": True,
    "truncated_importance_sampling_type": "tis",
    "truncated_importance_sampling_ratio": 2.0,
}
"""NeMo-RL's decoupled correction for samples one version old, which async needs (NeMo-RL refuses async without it)."""


def step_line(m: dict) -> str:
    if m.get("kind") == "val":
        sets = ", ".join(f"{k.removeprefix('val/')} {v:.3f}" for k, v in sorted(m.items()) if k.endswith("accuracy"))
        return f"validation after {m['step']:3d} steps: {sets} ({m['time/val_s']:.0f}s)"
    if not m["train/groups"]:
        return f"step {m['step']:3d}: no fresh groups ({m['staleness/dropped']} stale dropped)"
    rollouts = f"rollouts {m['train/rollout_sha256']}"
    if "train/dynamic_sampling_prompts_drawn" in m:
        rollouts = f"{m['train/dynamic_sampling_prompts_drawn']} prompts drawn, {rollouts}"
    if m["train/skipped_zero_advantage"]:
        return f"step {m['step']:3d}: reward {m['train/mean_reward']:.3f}, every advantage zero: no update ({rollouts})"
    return (f"step {m['step']:3d}: reward {m['train/mean_reward']:.3f} pass {m['train/pass_rate']:.2f} "
            f"len {m['train/mean_generated_tokens']:.1f} trunc {m['train/truncation_rate']:.2f} lr {m['train/lr']:.1e} "
            f"|dlogp| engine {m['train/engine_mismatch_abs_diff_mean']:.1e} "
            f"lag {m['train/policy_lag_abs_diff_mean']:.1e} (max {m['train/policy_lag_abs_diff_max']:.2f}) "
            f"step {m['train/policy_step_abs_diff_mean']:.1e} (max {m['train/policy_step_abs_diff_max']:.2f}) "
            f"rollout {m['time/rollout_s']:.1f}s train {m['time/train_s']:.1f}s refit {m['time/refit_s']:.2f}s "
            f"{rollouts}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config")
    parser.add_argument("--out", default="runs/grpo", help="run folder (resumed when it holds a checkpoint)")
    parser.add_argument("--steps", type=int, help="override grpo.max_num_steps")
    parser.add_argument("--async", dest="async_rollouts", action="store_true", help="override grpo.async_grpo.enabled")
    parser.add_argument("--seed", type=int, help="override grpo.seed (data order, rollout seeds, training seeds)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    for noisy in ("httpx", "gym_bridge.gym", "gym_bridge.serving", "ray"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    config = yaml.safe_load(Path(args.config).read_text())
    if args.steps is not None:
        config["grpo"]["max_num_steps"] = args.steps
    if args.async_rollouts:
        config["grpo"].setdefault("async_grpo", {})["enabled"] = True
        if config["grpo"].pop("use_dynamic_sampling", False):
            logger.info("--async: grpo.use_dynamic_sampling off (NeMo-RL's async loop does not apply it)")
        config.setdefault("loss_fn", {}).update(ASYNC_CORRECTION)
        logger.info("--async: importance-sampling correction on (%s)", ASYNC_CORRECTION)
    if args.seed is not None:
        config["grpo"]["seed"] = args.seed
    out = Path(args.out)
    logger.info("seed %d (grpo.seed): each step logs a hash of its rollouts' token ids", config["grpo"].get("seed", 0))
    init_ray(num_cpus=2)
    run = build_grpo_run(config, out)
    try:
        asyncio.run(run.trainer.run(on_step=lambda m: logger.info(step_line(m))))
    finally:
        run.close()
    lines = read_metrics(out / "metrics.jsonl")
    steps = [m for m in lines if m.get("kind", "train") == "train" and "train/mean_reward" in m]
    validations = [m for m in lines if m.get("kind") == "val"]
    png = plot_reward_curve(steps, out / "reward_curve.png", validations=validations)
    if len(validations) >= 2:
        first, last = validations[0], validations[-1]
        for key in sorted(k for k in last if k.startswith("val/") and k.endswith("accuracy")):
            logger.info("held-out %s: %.3f at step %d -> %.3f at step %d",
                        key, first.get(key, float("nan")), first["step"], last[key], last["step"])
    logger.info("metrics: %s", out / "metrics.jsonl")
    logger.info("reward curve: %s", png)
    logger.info("checkpoint: %s", out / "checkpoint")


if __name__ == "__main__":
    try:
        main()
    except GymBridgeError as exc:  # a bad config or a failed start: its message in one line, as the CLI does
        print(f"grpo_nemo_gym: {exc}", file=sys.stderr)
        sys.exit(2)
