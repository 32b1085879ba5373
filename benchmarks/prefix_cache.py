"""Prefix sharing in HFGeneration: the same rows with ``enable_prefix_caching`` on and off.

Two cases, each run through :meth:`HFGeneration.generate_async` (the path the OpenAI server takes):

- ``samples``: N seeded samples of one chat prompt of ~500 tokens (a few-shot header and a question), one request;
- ``multi-turn``: R rollouts of T turns over one shared system prompt; each turn's prompt is the rollout's previous
  prompt, its generation and an observation, so every turn extends the last one.

Each case runs on a fresh engine per setting (the model is loaded once), after a warm-up on another prompt, ``--reps``
times alternating off and on; the median wall time and CPU time of this process (less sensitive to a shared
machine), their ratios, the hit rate (``prefix_cache_hits /
prefix_cache_queries``) and the largest logprob difference between the two settings are printed (tokens must match).

Run: ``uv run python benchmarks/prefix_cache.py`` (``--model tiny`` for the embedded model; ``--help``).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import statistics
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import torch

from gym_bridge.batched import BatchedDataDict
from gym_bridge.generation.hf import HFGeneration
from gym_bridge.generation.hf_config import HFGenerationConfig
from gym_bridge.models.loading import load_causal_lm
from gym_bridge.models.registry import resolve_model_path
from gym_bridge.serving.chat import render_ids
from gym_bridge.types import Tokenizer

logger = logging.getLogger("benchmarks.prefix_cache")

FEW_SHOT = [
    ("What is 17 + 25?", "17 + 25 = 42. The answer is 42."),
    ("A shop sells pens at 3 dollars each. How much do 7 pens cost?", "7 pens cost 7 x 3 = 21 dollars."),
    ("Tom has 12 apples and gives away 5. How many are left?", "12 - 5 = 7 apples are left."),
    ("What is 144 divided by 12?", "144 / 12 = 12. The answer is 12."),
    ("A train travels 60 km per hour for 3 hours. How far does it go?", "60 x 3 = 180 km."),
    ("What is 9 squared?", "9 x 9 = 81. The answer is 81."),
]
SYSTEM = (
    "You are a careful assistant that solves arithmetic word problems. Think about the quantities in the question, "
    "write the calculation you do, and end with one sentence that states the answer. Keep answers short. "
)


@dataclass
class Run:
    """One timed run of a case: wall and CPU time, its outputs in a fixed order, and the prefix-cache counts."""

    wall_s: float
    cpu_s: float
    outputs: list[BatchedDataDict]
    queries: int
    hits: int


def chat_ids(tokenizer: Tokenizer, messages: list[dict[str, Any]]) -> list[int]:
    """A chat rendered as the server renders it."""
    return render_ids(tokenizer, messages, None, True, None)


def header(repeat: int) -> list[dict[str, Any]]:
    """The shared system prompt and few-shot turns (``repeat`` copies of the examples)."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
    for _ in range(repeat):
        for question, answer in FEW_SHOT:
            messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    return messages


def batch(prompts: list[list[int]], seeds: list[int], max_new_tokens: int) -> BatchedDataDict:
    """Right-padded token-id prompts with one seed per row."""
    width = max(len(p) for p in prompts)
    ids = torch.zeros((len(prompts), width), dtype=torch.int64)
    for i, p in enumerate(prompts):
        ids[i, : len(p)] = torch.tensor(p)
    return BatchedDataDict(
        {
            "input_ids": ids,
            "input_lengths": torch.tensor([len(p) for p in prompts]),
            "seed": seeds,
            "max_new_tokens": [max_new_tokens] * len(prompts),
        }
    )


async def rows_of(engine: HFGeneration, data: BatchedDataDict) -> list[BatchedDataDict]:
    """Every row of ``data`` through the worker thread, in row order."""
    out: dict[int, BatchedDataDict] = {}
    async for i, row in engine.generate_async(data):
        out[i] = row
    return [out[i] for i in range(len(out))]


def generated(row: BatchedDataDict, prompt_len: int) -> list[int]:
    """The ids a single-row output generated after its prompt."""
    return row["output_ids"][0, prompt_len : int(row["unpadded_sequence_lengths"][0])].tolist()


async def samples_case(engine: HFGeneration, tokenizer: Tokenizer, n: int, max_new: int) -> list[BatchedDataDict]:
    """N seeded samples of one ~500-token prompt, sent as one request."""
    prompt = chat_ids(tokenizer, [*header(2), {"role": "user", "content": "What is 23 + 19?"}])
    return await rows_of(engine, batch([prompt] * n, list(range(n)), max_new))


async def multi_turn_case(
    engine: HFGeneration, tokenizer: Tokenizer, rollouts: int, turns: int, max_new: int
) -> list[BatchedDataDict]:
    """R rollouts of T turns over one shared header; each turn extends the rollout's previous prompt and output."""
    histories = [
        chat_ids(tokenizer, [*header(1), {"role": "user", "content": f"What is {11 * (r + 2)} + {r + 5}?"}])
        for r in range(rollouts)
    ]
    outputs: list[BatchedDataDict] = []
    for turn in range(turns):
        rows = await rows_of(engine, batch(histories, [100 * turn + r for r in range(rollouts)], max_new))
        outputs += rows
        observation = tokenizer.encode(
            f"<|im_end|>\n<|im_start|>user\nCheck step {turn + 1} again and give the result.<|im_end|>\n"
            "<|im_start|>assistant\n",
            add_special_tokens=False,
        )
        histories = [h + generated(row, len(h)) + list(observation) for h, row in zip(histories, rows, strict=True)]
    return outputs


def timed(
    make: Callable[[bool], HFGeneration],
    case: Callable[[HFGeneration], Coroutine[Any, Any, list[BatchedDataDict]]],
    warm: Callable[[HFGeneration], Coroutine[Any, Any, list[BatchedDataDict]]],
    sharing: bool,
) -> Run:
    """``case`` on a fresh engine with sharing on or off, after ``warm`` (whose counts are left out)."""
    engine = make(sharing)
    try:
        asyncio.run(warm(engine))
        base = engine.prefix_cache_counts()
        start, cpu = time.perf_counter(), time.process_time()
        outputs = asyncio.run(case(engine))
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu
        counts = engine.prefix_cache_counts()
    finally:
        engine.shutdown()
    return Run(wall, cpu, outputs, counts.queries - base.queries, counts.hits - base.hits)


def compare(off: Run, on: Run) -> float:
    """The largest logprob difference between the two settings' rows; their tokens must be equal."""
    worst = 0.0
    for a, b in zip(off.outputs, on.outputs, strict=True):
        n = int(a["unpadded_sequence_lengths"][0])
        if not torch.equal(a["output_ids"][0, :n], b["output_ids"][0, :n]):
            raise SystemExit("prefix sharing changed a row's tokens")
        worst = max(worst, float((a["logprobs"][0, :n] - b["logprobs"][0, :n]).abs().max()))
    return worst


def main() -> None:
    """Run both cases with sharing off and on and print the table."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", help="a built-in model name or a folder (default smollm2)")
    parser.add_argument("--n", type=int, default=8, help="samples of the one prompt (default 8)")
    parser.add_argument("--rollouts", type=int, default=4, help="multi-turn rollouts (default 4)")
    parser.add_argument("--turns", type=int, default=3, help="turns per rollout (default 3)")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--reps", type=int, default=3, help="timed runs per setting (default 3)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    if args.threads:
        torch.set_num_threads(args.threads)
    path = resolve_model_path(args.model)
    tokenizer, model = load_causal_lm(str(path), "float32")

    def make(sharing: bool) -> HFGeneration:
        cfg = HFGenerationConfig(
            model=str(path), temperature=1.0, enable_prefix_caching=sharing, batch_wait_s=0.0, max_batch_size=32
        )
        return HFGeneration(cfg, model=model, tokenizer=tokenizer)

    def warm(engine: HFGeneration) -> Coroutine[Any, Any, list[BatchedDataDict]]:
        return rows_of(engine, batch([chat_ids(tokenizer, [{"role": "user", "content": "Hello"}])], [0], 4))

    cases: dict[str, Callable[[HFGeneration], Coroutine[Any, Any, list[BatchedDataDict]]]] = {
        "samples": lambda e: samples_case(e, tokenizer, args.n, args.max_new_tokens),
        "multi-turn": lambda e: multi_turn_case(e, tokenizer, args.rollouts, args.turns, args.max_new_tokens),
    }
    sample_len = len(chat_ids(tokenizer, [*header(2), {"role": "user", "content": "What is 23 + 19?"}]))
    print(f"model {args.model} ({path}), torch threads {torch.get_num_threads()}, {args.reps} reps per setting")
    print(f"samples: {args.n} x {sample_len}-token prompt; multi-turn: {args.rollouts} rollouts x {args.turns} turns")
    print(f"{'case':<12}{'wall off/on s':>16}{'speedup':>9}{'CPU off/on s':>16}{'CPU ratio':>11}", end="")
    print(f"{'hit rate':>10}{'max |dlogprob|':>16}")
    for name, case in cases.items():
        off_runs: list[Run] = []
        on_runs: list[Run] = []
        for _ in range(args.reps):
            off_runs.append(timed(make, case, warm, sharing=False))
            on_runs.append(timed(make, case, warm, sharing=True))
        off_s, on_s = (statistics.median(r.wall_s for r in runs) for runs in (off_runs, on_runs))
        off_cpu, on_cpu = (statistics.median(r.cpu_s for r in runs) for runs in (off_runs, on_runs))
        worst = max(compare(a, b) for a, b in zip(off_runs, on_runs, strict=True))
        hit_rate = on_runs[0].hits / on_runs[0].queries
        print(f"{name:<12}{f'{off_s:.2f}/{on_s:.2f}':>16}{off_s / on_s:>8.2f}x", end="")
        print(f"{f'{off_cpu:.2f}/{on_cpu:.2f}':>16}{off_cpu / on_cpu:>10.2f}x{hit_rate:>10.1%}{worst:>16.2e}")


if __name__ == "__main__":
    main()
