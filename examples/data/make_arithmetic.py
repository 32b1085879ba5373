"""Generate the GRPO demo's arithmetic task: two-digit addition as Gym rows for ``math_with_judge``.

    python examples/data/make_arithmetic.py [--seed 0] [--out examples/data]

Writes three JSONL files of Gym rows (``responses_create_params``, ``question``,
``expected_answer``, ``agent_ref``), graded by Gym's ``math_with_judge`` with math-verify
(the answer must be in ``\\boxed{}``):

- ``arith_train.jsonl``: 512 problems ``a + b`` with ``a, b`` in 20..99, built only from
  the training operands;
- ``arith_heldout.jsonl``: 128 problems whose operands both come from a held-out set of
  16 numbers that no training problem uses (disjoint operands), same wording;
- ``arith_heldout_wording.jsonl``: 64 more held-out-operand problems asked in other words.

Every prompt opens with the same two solved examples (a fixed 2-shot chat), which is
what makes a 135M model answer in ``\\boxed{}`` at all; what it has to learn is the sum.
SmolLM2-135M-Instruct, measured on 48 such problems (2026-11-24): greedy 44 %, pass@8 62 %.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

AGENT = {"type": "responses_api_agents", "name": "math_with_judge_simple_agent"}
OPERANDS = range(20, 100)
HELDOUT_OPERANDS = 16
TRAIN_PROBLEMS, HELDOUT_PROBLEMS, WORDING_PROBLEMS = 512, 128, 64
MAX_OUTPUT_TOKENS = 24
QUESTION = "What is {a} + {b}?"
OTHER_WORDINGS = ("Add {a} and {b}.", "Compute the sum of {a} and {b}.", "{a} plus {b} equals what?")
SHOTS = (
    ({"a": 3, "b": 4}, "3 + 4 = 7. The answer is \\boxed{7}."),
    ({"a": 25, "b": 6}, "25 + 6 = 31. The answer is \\boxed{31}."),
)


def row(a: int, b: int, wording: str) -> dict[str, object]:
    """One Gym row: the 2-shot chat, then the question."""
    messages: list[dict[str, str]] = []
    for operands, answer in SHOTS:
        messages.append({"role": "user", "content": QUESTION.format(**operands)})
        messages.append({"role": "assistant", "content": answer})
    question = wording.format(a=a, b=b)
    messages.append({"role": "user", "content": question})
    return {
        "responses_create_params": {"input": messages, "max_output_tokens": MAX_OUTPUT_TOKENS},
        "question": question,
        "expected_answer": str(a + b),
        "agent_ref": AGENT,
    }


def pairs(rng: random.Random, numbers: list[int], count: int) -> list[tuple[int, int]]:
    """``count`` distinct ordered pairs drawn from ``numbers``."""
    every = [(a, b) for a in numbers for b in numbers]
    if count > len(every):
        raise ValueError(f"{count} problems asked from {len(every)} possible pairs")
    return rng.sample(every, count)


def generate(seed: int) -> dict[str, list[dict[str, object]]]:
    """The three splits, reproducible from ``seed``."""
    rng = random.Random(seed)
    heldout = sorted(rng.sample(list(OPERANDS), HELDOUT_OPERANDS))
    train_numbers = [n for n in OPERANDS if n not in heldout]
    heldout_pairs = pairs(rng, heldout, HELDOUT_PROBLEMS + WORDING_PROBLEMS)
    return {
        "arith_train": [row(a, b, QUESTION) for a, b in pairs(rng, train_numbers, TRAIN_PROBLEMS)],
        "arith_heldout": [row(a, b, QUESTION) for a, b in heldout_pairs[:HELDOUT_PROBLEMS]],
        "arith_heldout_wording": [
            row(a, b, OTHER_WORDINGS[i % len(OTHER_WORDINGS)])
            for i, (a, b) in enumerate(heldout_pairs[HELDOUT_PROBLEMS:])
        ],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent)
    args = parser.parse_args()
    for name, rows in generate(args.seed).items():
        path = args.out / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        print(f"{path}: {len(rows)} rows")


if __name__ == "__main__":
    main()
