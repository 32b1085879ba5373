"""CPU cost per row of turning a NeMo-Gym ``/run`` result into a ``Completion``, on synthetic results.

The synthetic result follows Gym 0.4.0's schema (see ``convert.py``): each model
call's last output item carries ``prompt_token_ids`` (the whole prompt so far),
``generation_token_ids`` and ``generation_log_probs``; earlier calls are tool calls
followed by their tool output, the last call is an assistant message. Token ids
come from encoding real text with the tokenizer, and every turn's prompt extends
the previous prompt and generation, so conversion takes its normal path.

Per row it times, with ``time.process_time`` over many iterations: JSON parsing
(the actor's ``json.loads``), ``convert_gym_result`` (message log and the typed ``GymRowResult``), a pickle round
trip of the
converted result (a stand-in for Ray's transfer from actor to driver; torch
pickles every tensor through ``torch.save``), the same round trip with the
tensors sent as numpy arrays and rebuilt on arrival (what the actor could send
instead), building the ``Completion`` (``gym_completion``)
and the group metrics (per row of a 16-row group), with the garbage collector off. "Conversion"
is ``convert_gym_result`` plus the ``Completion``.

Run alone: ``uv run python benchmarks/conversion_cost.py``.
"""

from __future__ import annotations

import gc
import json
import pickle
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gym_bridge.gym.protocol.convert import convert_gym_result
from gym_bridge.rollout.nemo_gym import group_metrics, gym_completion

GROUP = 16
_TEXT = (
    "The weather in San Francisco is cold and foggy in the morning, with a light wind from the west. "
    "By the afternoon the sun breaks through, and the temperature climbs to about eighteen degrees. "
    "Tomorrow looks similar, though forecasters expect some drizzle near the coast after midnight. "
)


@dataclass(frozen=True)
class ConversionCost:
    """Microseconds of CPU per row for each step of one synthetic case."""

    case: str
    turns: int
    tokens: int
    parse_us: float
    convert_us: float
    transfer_us: float
    transfer_nemo_rl_us: float
    completion_us: float
    metrics_us: float

    @property
    def conversion_ms(self) -> float:
        return (self.convert_us + self.completion_us) / 1000.0


def _logprobs(n: int, offset: int) -> list[float]:
    return [-0.01 * ((offset + i) * 7 % 50) for i in range(n)]


def synthetic_result(tokenizer: Any, turns: int, total_tokens: int = 2000) -> bytes:
    """A Gym result of ``turns`` model calls whose last prompt plus generation is ``total_tokens`` long."""
    stream: list[int] = []
    while len(stream) < total_tokens:
        stream += tokenizer.encode(_TEXT, add_special_tokens=False)
    per_turn = total_tokens // turns
    history: list[int] = []
    output: list[dict[str, Any]] = []
    for turn in range(turns):
        new_prompt = per_turn // 2
        generated = (total_tokens - len(history) - new_prompt) if turn == turns - 1 else per_turn - new_prompt
        prompt = history + stream[len(history) : len(history) + new_prompt]
        generation = stream[len(prompt) : len(prompt) + generated]
        tokens = {
            "prompt_token_ids": prompt,
            "generation_token_ids": generation,
            "generation_log_probs": _logprobs(len(generation), turn),
            "routed_experts": None,
        }
        if turn < turns - 1:
            call_id = f"chatcmpl-tool-{turn:012x}"
            output.append(
                {
                    **tokens,
                    "arguments": json.dumps({"city": "San Francisco"}),
                    "call_id": call_id,
                    "name": "get_weather",
                    "type": "function_call",
                    "id": call_id,
                    "status": "completed",
                }
            )
            output.append(
                {
                    "call_id": call_id,
                    "output": json.dumps({"city": "San Francisco", "weather_description": "cold"}),
                    "type": "function_call_output",
                    "id": None,
                    "status": None,
                }
            )
        else:
            text = tokenizer.decode(generation)
            output.append(
                {
                    **tokens,
                    "id": f"msg_{turn:032x}",
                    "content": [{"annotations": [], "text": text, "type": "output_text", "logprobs": None}],
                    "role": "assistant",
                    "status": "completed",
                    "type": "message",
                }
            )
        history = prompt + generation
    result = {
        "responses_create_params": {
            "input": [{"content": tokenizer.decode(stream[: per_turn // 2]), "role": "user", "type": "message"}],
            "max_output_tokens": None,
            "temperature": 1.0,
            "tools": [],
            "top_p": 1.0,
        },
        "response": {
            "id": "resp_synthetic",
            "created_at": 1795332417.0,
            "error": None,
            "incomplete_details": None,
            "model": "tiny",
            "object": "response",
            "output": output,
            "usage": {"input_tokens": len(history) - len(generation), "output_tokens": len(generation)},
        },
        "reward": 1.0,
        "expected_answer": "cold",
    }
    return json.dumps(result).encode()


def _cpu_us_per_row(step: Callable[[], Any], rows: int) -> tuple[Any, float]:
    """CPU per row of ``step`` with the garbage collector off, as ``timeit`` does.

    A full collection walks the whole heap (hundreds of ms in a process that imported
    torch, transformers and Ray), and would land on whichever step triggered it.
    """
    gc.collect()
    gc.disable()
    try:
        start = time.process_time()
        value = step()
        return value, (time.process_time() - start) * 1e6 / rows
    finally:
        gc.enable()


def measure(tokenizer: Any, case: str, turns: int, total_tokens: int = 2000, iterations: int = 512) -> ConversionCost:
    """Time each step over ``iterations`` copies of one synthetic result (a multiple of 16 rows)."""
    body = synthetic_result(tokenizer, turns, total_tokens)
    parsed, parse_us = _cpu_us_per_row(lambda: [json.loads(body) for _ in range(iterations)], iterations)
    converted, convert_us = _cpu_us_per_row(
        lambda: [convert_gym_result(r, tokenizer, row_index=i % GROUP) for i, r in enumerate(parsed)], iterations
    )
    moved, transfer_us = _cpu_us_per_row(
        lambda: [pickle.loads(pickle.dumps((0, c, None), protocol=5))[1] for c in converted], iterations
    )
    _, transfer_nemo_rl_us = _cpu_us_per_row(
        lambda: [pickle.loads(pickle.dumps((0, c.as_nemo_rl_result(), None), protocol=5))[1] for c in converted],
        iterations,
    )
    completions, completion_us = _cpu_us_per_row(
        lambda: [
            gym_completion(c, max_seq_len=total_tokens * 2, mask_env_flagged_samples=True)
            for c in moved
        ],
        iterations,
    )
    _, metrics_us = _cpu_us_per_row(
        lambda: [group_metrics(completions[i : i + GROUP], ["agent"] * GROUP) for i in range(0, iterations, GROUP)],
        iterations,
    )
    return ConversionCost(
        case, turns, total_tokens, parse_us, convert_us, transfer_us, transfer_nemo_rl_us, completion_us, metrics_us
    )


TURN_COUNTS = (1, 2, 4, 8, 16)


def measure_all(
    tokenizer: Any, iterations: int = 512, turn_counts: tuple[int, ...] = TURN_COUNTS
) -> list[ConversionCost]:
    """Warm up, then rows of 2,000 tokens with each turn count (the multi-turn ones are tool calls)."""
    measure(tokenizer, "warm-up", 2, 200, iterations=GROUP)
    return [
        measure(tokenizer, "1 turn" if turns == 1 else f"{turns} turns (tool calls)", turns, 2000, iterations)
        for turns in turn_counts
    ]


def markdown(costs: list[ConversionCost], target_ms: float) -> str:
    lines = [
        "| case | tokens | parse µs | convert µs | pickle round trip µs (NeMo-RL's per-row dict) | Completion µs "
        f"| group metrics µs | conversion (convert + Completion) ms | target < {target_ms:g} ms |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for c in costs:
        verdict = "met" if c.conversion_ms < target_ms else "MISSED"
        lines.append(
            f"| {c.case} | {c.tokens} | {c.parse_us:.0f} | {c.convert_us:.0f} | "
            f"{c.transfer_us:.0f} ({c.transfer_nemo_rl_us:.0f}) | "
            f"{c.completion_us:.0f} | {c.metrics_us:.0f} | {c.conversion_ms:.3f} | {verdict} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    from transformers import AutoTokenizer

    from gym_bridge.models.registry import resolve_model_path

    print(markdown(measure_all(AutoTokenizer.from_pretrained(resolve_model_path("tiny"))), target_ms=1.0))
