"""GRPO through NeMo-Gym on a CPU: a real small model gets better at problems it never trained on.

    uv run python examples/grpo_nemo_gym.py examples/grpo_nemo_gym.yaml [--out RUN] [--steps N] [--async] [--seed S]

The recipe is `gym-bridge train` (docs/training.md): each step rolls out a batch of Gym rows N times through
real NeMo-Gym servers, which call our OpenAI-compatible server (a thread of this process) serving the current
weights; computes GRPO advantages; trains the policy on the generated tokens; refits the new weights into the
serving engine and checks that they arrived. Held-out problems are answered greedily through the same Gym
servers at the start, every ``grpo.val_period`` steps and at the end. The run folder gets ``metrics.jsonl``,
``val_results.jsonl``, ``training.png`` / ``training.html`` and a checkpoint; the flags below are NeMo-RL
``key=value`` overrides, and ``--resume --out RUN`` continues a run.
"""

from __future__ import annotations

import argparse
import sys

from gym_bridge import main

ASYNC = [
    "grpo.async_grpo.enabled=true",
    "grpo.use_dynamic_sampling=false",  # NeMo-RL's async loop does not apply dynamic sampling
    # NeMo-RL's decoupled correction for samples one version old, which async needs (NeMo-RL refuses async without it)
    "loss_fn.use_importance_sampling_correction=true",
    "++loss_fn.truncated_importance_sampling_type=tis",
    "++loss_fn.truncated_importance_sampling_ratio=2.0",
]


def overrides(args: argparse.Namespace) -> list[str]:
    """The flags as NeMo-RL overrides."""
    out = [f"grpo.max_num_steps={args.steps}"] if args.steps is not None else []
    out += [f"grpo.seed={args.seed}"] if args.seed is not None else []
    return out + (ASYNC if args.async_rollouts else [])


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config")
    parser.add_argument("--out", default=None, help="run folder (default: runs/<config>-<time>)")
    parser.add_argument("--resume", action="store_true", help="continue the run in --out from its checkpoint")
    parser.add_argument("--steps", type=int, help="grpo.max_num_steps")
    parser.add_argument("--async", dest="async_rollouts", action="store_true", help="grpo.async_grpo.enabled")
    parser.add_argument("--seed", type=int, help="grpo.seed (data order, rollout seeds, training seeds)")
    args = parser.parse_args()
    argv = ["train", args.config, *overrides(args)]
    argv += ["--out", args.out] if args.out else []
    argv += ["--resume"] if args.resume else []
    sys.exit(main(argv))
