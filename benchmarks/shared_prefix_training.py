"""The policy's logprob passes with and without shared prefixes, on a GRPO-shaped batch (SmolLM2 by default).

A batch like `make train-demo`'s: ``--prompts`` prompts that share a few-shot header, ``--samples`` samples of each,
``--generated`` tokens (or fewer) generated per sample. Times one forward and backward (the update) and one forward
without gradients (the old-policy, reference and movement passes) each way, and the largest logprob difference and
the relative gradient difference between them. Appends its section to ``history/<date>-shared-prefix-training.md``.

    uv run python benchmarks/shared_prefix_training.py              # SmolLM2, 4 x 8 rows, 116-token prompts
    uv run python benchmarks/shared_prefix_training.py --model tiny --no-write
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from results_file import git_revision, publish

from gym_bridge.policy.hf import HFPolicy, HFPolicyConfig
from gym_bridge.policy.shared_prefix import fed_tokens, plan_prefixes


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=116, help="the demo's arithmetic prompts: 116")
    parser.add_argument("--header-tokens", type=int, default=100, help="of them, the few-shot header all share")
    parser.add_argument("--generated", type=int, default=24)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--no-write", action="store_true", help="print only; no history section")
    return parser.parse_args()


def grpo_batch(args: argparse.Namespace, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded rows: each prompt (shared header + its own tokens) followed by each sample's tokens."""
    g = torch.Generator().manual_seed(0)
    header = torch.randint(5, vocab, (args.header_tokens,), generator=g)
    rows = []
    for _ in range(args.prompts):
        prompt = torch.cat([header, torch.randint(5, vocab, (args.prompt_tokens - args.header_tokens,), generator=g)])
        for sample in range(args.samples):
            rows.append(torch.cat([prompt, torch.randint(5, vocab, (args.generated - sample % 3,), generator=g)]))
    ids = torch.zeros((len(rows), max(len(r) for r in rows)), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = row
    return ids, torch.tensor([len(r) for r in rows])


def timed(policy: HFPolicy, ids: torch.Tensor, lens: torch.Tensor, first: int, shared: bool, grad: bool):
    """Seconds of one pass, its logprobs and (with ``grad``) the flattened gradients."""
    policy.cfg = policy.cfg.model_copy(update={"shared_prefix": shared})
    policy.model.train(grad)
    policy.model.zero_grad(set_to_none=True)
    started = time.perf_counter()
    with torch.set_grad_enabled(grad):
        logprobs = policy._token_logprobs(policy.model, ids, lens, first=first if grad else 1)
        if grad:
            logprobs.sum().backward()
    seconds = time.perf_counter() - started
    grads = (
        torch.cat([p.grad.flatten() for p in policy.model.parameters() if p.grad is not None]) if grad else None
    )
    return seconds, logprobs.detach(), grads


def main() -> None:
    args = parse_args()
    torch.manual_seed(0)
    policy = HFPolicy(HFPolicyConfig(model=args.model, keep_reference_model=False, freeze_embeddings=True))
    ids, lens = grpo_batch(args, policy.model.config.vocab_size)
    first = args.prompt_tokens
    runs = plan_prefixes(ids, lens)
    lines = [
        f"## {args.model}, {args.prompts} prompts x {args.samples} samples, {args.prompt_tokens}-token prompts "
        f"({args.header_tokens} shared by all), <= {args.generated} generated ({git_revision()})",
        "",
        f"Tokens fed: {int(lens.max()) * len(lens)} as whole rows (padded), {fed_tokens(runs, lens)} shared "
        f"({len(runs)} runs). Median of {args.reps} after one warm-up; torch threads {torch.get_num_threads()}.",
        "",
        "| pass | whole rows (s) | shared prefixes (s) | speed-up | max logprob diff | grad rel diff |",
        "|---|---|---|---|---|---|",
    ]
    for name, grad in (("forward + backward (the update)", True), ("forward, no gradients", False)):
        results = {}
        for shared in (False, True):
            timed(policy, ids, lens, first, shared, grad)
            samples = [timed(policy, ids, lens, first, shared, grad) for _ in range(args.reps)]
            results[shared] = (statistics.median(s for s, _, _ in samples), samples[-1][1], samples[-1][2])
        (whole_s, whole_lp, whole_g), (shared_s, shared_lp, shared_g) = results[False], results[True]
        diff = float((whole_lp - shared_lp).abs().max())
        grad_diff = (
            f"{float((whole_g - shared_g).norm() / whole_g.norm()):.1e}"
            if whole_g is not None and shared_g is not None
            else "-"
        )
        lines.append(
            f"| {name} | {whole_s:.2f} | {shared_s:.2f} | {whole_s / shared_s:.2f}x | {diff:.1e} | {grad_diff} |"
        )
    publish("\n".join(lines) + "\n", topic="shared-prefix-training", write=not args.no_write)


if __name__ == "__main__":
    main()
