"""A native rollout end to end: the tiny model, the arithmetic environment, RolloutManager.

Run with `make demo` (or `uv run python examples/native_rollout.py`). Everything
is local and offline: the tiny model is built on first use and cached.
"""

from __future__ import annotations

import asyncio
import logging

from gym_bridge import (
    HFGeneration,
    HFGenerationConfig,
    RolloutManager,
    arithmetic_env_actor,
    datum_from_chat,
    init_ray,
)

QUESTIONS = [("What is 12 + 7?", "19"), ("What is 6 * 7?", "42"), ("What is 100 - 1?", "99")]


async def main() -> None:
    init_ray(num_cpus=2)
    generation = HFGeneration(HFGenerationConfig(model="tiny", max_new_tokens=24, temperature=1.0, seed=0))
    tokenizer = generation.tokenizer
    manager = RolloutManager(
        tokenizer=tokenizer,
        task_to_env={"arithmetic": arithmetic_env_actor()},
        num_generations_per_prompt=4,
        max_seq_len=256,
        max_rollout_turns=2,
        policy_generation=generation,
    )
    data = [
        datum_from_chat(
            tokenizer,
            [{"role": "user", "content": f"{question} Answer with a number."}],
            idx=i,
            task_name="arithmetic",
            extra_env_info={"ground_truth": answer, "attempts_left": 1},
        )
        for i, (question, answer) in enumerate(QUESTIONS)
    ]
    records = await asyncio.gather(*(manager.run_rollout(datum) for datum in data))
    for record in records:
        print(f"\nprompt {record.prompt_idx}: {QUESTIONS[record.prompt_idx][0]}")
        for i, completion in enumerate(record.completions):
            reply = completion.message_log[1]["content"].replace("\n", " ")[:60]
            turns = sum(m["role"] == "assistant" for m in completion.message_log)
            print(f"  completion {i}: reward={completion.reward:.1f} turns={turns} first reply={reply!r}")
        keys = ("total_reward/mean", "turns_per_sample/mean", "gen_tokens_per_sample/mean", "truncation_rate",
                "natural_termination_rate", "max_turns_reached_rate", "timing/rollout/total")
        print("  metrics: " + ", ".join(f"{k}={record.rollout_metrics[k]:.3g}" for k in keys))
    print("\nThe tiny model is random-initialised, so rewards of 0 are expected: the point is the pipeline.")
    print("Pass any GenerationInterface as policy_generation (a real model) for meaningful rewards.")
    generation.shutdown()


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    asyncio.run(main())
