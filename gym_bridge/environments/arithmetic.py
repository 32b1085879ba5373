"""An exact-match arithmetic environment with optional retries.

The policy answers a question; the last integer in its latest reply is compared
with ``ground_truth``. A correct answer earns reward 1.0 and ends the episode.
A wrong one earns 0.0 and, while ``attempts_left`` > 0, the environment answers
with a retry prompt (a new user turn in the tokenizer's chat markup), which makes
the episode multi-turn.
"""

from __future__ import annotations

import re
from typing import TypedDict

import torch

from gym_bridge.batched import BatchedDataDict
from gym_bridge.environments import FinishedBatchSpec, start_env_actor
from gym_bridge.interfaces import EnvironmentInterface
from gym_bridge.types import ActorHandle, EnvironmentReturn, LLMMessageLogType

_INTEGER = re.compile(r"-?\d+")

# Closes the assistant turn if the policy did not, then opens a user turn and the next assistant turn.
DEFAULT_RETRY_TEMPLATE = "<|im_end|>\n<|im_start|>user\n{feedback}<|im_end|>\n<|im_start|>assistant\n"


class ArithmeticMetadata(TypedDict, total=False):
    """A question's expected answer and how many retries it has left."""

    ground_truth: str
    attempts_left: int


def extract_answer(text: str) -> str | None:
    """The last integer in ``text``, or None."""
    found = _INTEGER.findall(text)
    return found[-1] if found else None


def score_answer(text: str, ground_truth: str) -> float:
    """1.0 when the last integer in ``text`` equals ``ground_truth`` exactly, else 0.0."""
    return 1.0 if extract_answer(text) == str(ground_truth).strip() else 0.0


class ArithmeticEnvironment(EnvironmentInterface[ArithmeticMetadata | None]):
    """Exact-match arithmetic; use :func:`arithmetic_env_actor` to run it as a Ray actor."""

    def __init__(self, retry_template: str = DEFAULT_RETRY_TEMPLATE, stop_strings: list[str] | None = None) -> None:
        self.retry_template = retry_template
        self.stop_strings = stop_strings

    def step(
        self, message_log_batch: list[LLMMessageLogType], metadata: list[ArithmeticMetadata | None]
    ) -> EnvironmentReturn[ArithmeticMetadata | None]:
        """Score each log's last assistant reply; a wrong one with attempts left gets a retry prompt."""
        observations: list[dict[str, str]] = []
        next_metadata: list[ArithmeticMetadata | None] = []
        rewards: list[float] = []
        terminateds: list[bool] = []
        answers: list[str | None] = []
        for log, meta in zip(message_log_batch, metadata, strict=True):
            if meta is None or "ground_truth" not in meta:
                raise KeyError("arithmetic environment metadata needs a 'ground_truth' field")
            reply = next((m["content"] for m in reversed(log) if m["role"] == "assistant"), "")
            reward = score_answer(reply, meta["ground_truth"])
            attempts_left = int(meta.get("attempts_left", 0))
            done = reward == 1.0 or attempts_left <= 0
            if done:
                observations.append({"role": "environment", "content": ""})
                next_metadata.append(None)
            else:
                feedback = f"{extract_answer(reply) or 'That'} is wrong. Try again."
                observations.append({"role": "user", "content": self.retry_template.format(feedback=feedback)})
                next_metadata.append({**meta, "attempts_left": attempts_left - 1})
            rewards.append(reward)
            terminateds.append(done)
            answers.append(extract_answer(reply))
        return EnvironmentReturn(
            observations=observations,
            metadata=next_metadata,
            next_stop_strings=[self.stop_strings] * len(observations),
            rewards=torch.tensor(rewards, dtype=torch.float32),
            terminateds=torch.tensor(terminateds, dtype=torch.bool),
            answers=answers,
        )

    def global_post_process_and_metrics(
        self, batch: BatchedDataDict[FinishedBatchSpec]
    ) -> tuple[BatchedDataDict[FinishedBatchSpec], dict[str, float]]:
        """The batch unchanged, and ``accuracy``: the share of samples whose total reward is 1."""
        rewards = batch.get("total_reward")
        accuracy = (
            float((torch.as_tensor(rewards) == 1.0).float().mean()) if rewards is not None and len(rewards) else 0.0
        )
        return batch, {"accuracy": accuracy}


def arithmetic_env_actor(
    retry_template: str = DEFAULT_RETRY_TEMPLATE, stop_strings: list[str] | None = None
) -> ActorHandle:
    """Start an :class:`ArithmeticEnvironment` as a Ray actor (needs Ray running)."""
    return start_env_actor(ArithmeticEnvironment, retry_template=retry_template, stop_strings=stop_strings)
