"""Server throughput: our OpenAI-compatible server against raw batched generation of the same model.

For each model (``tiny``, ``smollm2``) and concurrency C in (1, 8, 32): C clients send
chat requests in a loop for a fixed number of rounds; we report requests/s and generated
tokens/s, next to the raw ``HFGeneration.generate`` of batches of C prompts of the same
length, and the ratio (server / raw). The load average before and after goes with the
table: on a shared machine both sides are slowed, not necessarily alike. Results are
appended to ``benchmarks/history/<date>-server-throughput.md``.

Run: ``make bench-serve`` (or ``uv run python benchmarks/serve_throughput.py --model tiny``).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import time
from datetime import date

import httpx
import torch
from results_file import publish

from gym_bridge.batched import BatchedDataDict
from gym_bridge.generation.hf import HFGeneration
from gym_bridge.generation.hf_config import HFGenerationConfig
from gym_bridge.serving import OpenAIServer

MESSAGES = [{"role": "user", "content": "Tell me about the weather in Paris today."}]


def raw_generate(generation: HFGeneration, prompt_ids: list[int], batch: int, rounds: int) -> tuple[float, int]:
    ids = torch.tensor([prompt_ids] * batch, dtype=torch.int64)
    data = BatchedDataDict({"input_ids": ids, "input_lengths": torch.full((batch,), len(prompt_ids))})
    start, tokens = time.perf_counter(), 0
    for _ in range(rounds):
        tokens += int(generation.generate(data)["generation_lengths"].sum())
    return time.perf_counter() - start, tokens


async def served(base_url: str, model: str, concurrency: int, rounds: int, max_tokens: int) -> tuple[float, int]:
    body = {"model": model, "messages": MESSAGES, "max_tokens": max_tokens, "temperature": 1.0, "top_p": 1.0}
    tokens = 0
    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(base_url=base_url, timeout=120, limits=limits) as client:

        async def worker() -> None:
            nonlocal tokens
            for _ in range(rounds):
                response = await client.post("/chat/completions", json=body)
                response.raise_for_status()
                tokens += response.json()["usage"]["completion_tokens"]

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return time.perf_counter() - start, tokens


async def main(model: str, max_tokens: int, rounds: int, concurrencies: list[int]) -> str:
    load_before = os.getloadavg()
    cfg = HFGenerationConfig(model=model, max_new_tokens=max_tokens, temperature=1.0, seed=0, stop_token_ids=[])
    generation = HFGeneration(cfg)
    tokenizer = generation.tokenizer
    prompt_ids = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    prompt_ids = tokenizer(prompt_ids, add_special_tokens=False)["input_ids"]
    rows = []
    # The server gets its own thread and event loop, as it would have its own process in production.
    server = OpenAIServer(generation, tokenizer, served_model_name=model)
    base_url = server.start_in_thread()
    try:
        await served(base_url, model, 1, 1, max_tokens)  # warm-up
        for concurrency in concurrencies:
            s_time, s_tokens = await served(base_url, model, concurrency, rounds, max_tokens)
            r_time, r_tokens = raw_generate(generation, prompt_ids, concurrency, rounds)
            requests = concurrency * rounds
            rows.append(
                f"| {concurrency} | {requests / s_time:.1f} | {s_tokens / s_time:.0f} | "
                f"{requests / r_time:.1f} | {r_tokens / r_time:.0f} | {(s_tokens / s_time) / (r_tokens / r_time):.2f} |"
            )
    finally:
        server.stop_thread()
        generation.shutdown()
    mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1024**3
    header = (
        f"\n## Server throughput, {date.today()} ({os.cpu_count()} cores, {mem_gib:.0f} GiB, "
        f"{platform.processor() or platform.machine()}, {model} model, {max_tokens} tokens per request, "
        f"prompt {len(prompt_ids)} tokens, {rounds} rounds per client)\n\n"
        f"Load average before {load_before[0]:.1f}, after {os.getloadavg()[0]:.1f} (1 min).\n\n"
        "| concurrent requests | server req/s | server tok/s | raw generate rows/s | raw tok/s | ratio (server/raw tok/s) |\n"
        "|---|---|---|---|---|---|\n"
    )
    return header + "\n".join(rows) + "\n"


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--model", choices=["tiny", "smollm2"], action="append", help="default: both")
    parser.add_argument("--concurrency", type=int, action="append", help="default: 1, 8 and 32")
    args = parser.parse_args()
    for model in args.model or ["tiny", "smollm2"]:
        table = asyncio.run(main(model, args.max_tokens, args.rounds, args.concurrency or [1, 8, 32]))
        publish(table, topic="server-throughput")
