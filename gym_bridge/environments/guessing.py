"""A number-guessing game: a multi-turn environment with per-turn observations, stop strings and metadata.

The policy guesses a secret integer; the last integer in its latest reply is the
guess. A right guess earns 1.0 and ends the game. A wrong (or missing) guess
earns 0.0 and, while ``guesses_left`` > 0, the environment answers with a hint
("higher" / "lower") as a new user turn in ChatML markup, the next turn's stop
strings, and metadata narrowed to the interval the hint leaves.
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
_MAX_SCAN_CHARS = 4096

HINT_TEMPLATE = "<|im_end|>\n<|im_start|>user\n{hint}<|im_end|>\n<|im_start|>assistant\n"


class GuessingMetadata(TypedDict, total=False):
    """The secret, the interval the hints leave, the guesses left and the turn."""

    target: int
    low: int
    high: int
    guesses_left: int
    turn: int


def parse_guess(text: str) -> int | None:
    """The last integer in the final ``_MAX_SCAN_CHARS`` characters of ``text``, or None."""
    found = _INTEGER.findall(text[-_MAX_SCAN_CHARS:])
    return int(found[-1]) if found else None


class GuessingGameEnvironment(EnvironmentInterface[GuessingMetadata | None]):
    """Number guessing; run it as a Ray actor with :func:`guessing_env_actor`.

    ``stop_strings_per_turn[k]`` are the stop strings sent for turn ``k + 1``
    (the last entry repeats); ``None`` sends no stop strings (the sample keeps its own).
    ``valid_guess_reward`` is paid for a wrong guess that is a number (reward shaping).
    """

    def __init__(
        self, stop_strings_per_turn: list[list[str] | None] | None = None, valid_guess_reward: float = 0.0
    ) -> None:
        self.stop_strings_per_turn = stop_strings_per_turn
        self.valid_guess_reward = valid_guess_reward

    def _next_stops(self, turn: int) -> list[str] | None:
        """The stop strings to send for turn ``turn + 1``."""
        if not self.stop_strings_per_turn:
            return None
        return self.stop_strings_per_turn[min(turn, len(self.stop_strings_per_turn) - 1)]

    def step(
        self, message_log_batch: list[LLMMessageLogType], metadata: list[GuessingMetadata | None]
    ) -> EnvironmentReturn[GuessingMetadata | None]:
        """Score each log's last guess; a wrong one with guesses left gets a hint, narrowed metadata and stops."""
        observations: list[dict[str, str]] = []
        next_metadata: list[GuessingMetadata | None] = []
        next_stops: list[list[str] | None] = []
        rewards: list[float] = []
        terminateds: list[bool] = []
        answers: list[str | None] = []
        for log, meta in zip(message_log_batch, metadata, strict=True):
            if meta is None or "target" not in meta:
                raise KeyError("guessing-game metadata needs a 'target' field")
            reply = next((m["content"] for m in reversed(log) if m["role"] == "assistant"), "")
            guess = parse_guess(reply)
            target = int(meta["target"])
            low, high = int(meta.get("low", 1)), int(meta.get("high", 100))
            guesses_left = int(meta.get("guesses_left", 0))
            turn = int(meta.get("turn", 0))
            won = guess == target
            done = won or guesses_left <= 0
            if done:
                observations.append({"role": "environment", "content": "You win." if won else "Game over."})
                next_metadata.append(None)
                next_stops.append(None)
            else:
                if guess is None:
                    hint = f"No number found. Guess between {low} and {high}."
                elif guess < target:
                    low = max(low, guess + 1)
                    hint = f"{guess} is too low. Guess between {low} and {high}."
                else:
                    high = min(high, guess - 1)
                    hint = f"{guess} is too high. Guess between {low} and {high}."
                observations.append({"role": "user", "content": HINT_TEMPLATE.format(hint=hint)})
                next_metadata.append(
                    {**meta, "low": low, "high": high, "guesses_left": guesses_left - 1, "turn": turn + 1}
                )
                next_stops.append(self._next_stops(turn))
            rewards.append(1.0 if won else (self.valid_guess_reward if guess is not None else 0.0))
            terminateds.append(done)
            answers.append(None if guess is None else str(guess))
        return EnvironmentReturn(
            observations=observations,
            metadata=next_metadata,
            next_stop_strings=next_stops,
            rewards=torch.tensor(rewards, dtype=torch.float32),
            terminateds=torch.tensor(terminateds, dtype=torch.bool),
            answers=answers,
        )

    def global_post_process_and_metrics(
        self, batch: BatchedDataDict[FinishedBatchSpec]
    ) -> tuple[BatchedDataDict[FinishedBatchSpec], dict[str, float]]:
        """The batch unchanged, and ``win_rate``: the share of samples with a positive total reward."""
        rewards = batch.get("total_reward")
        win_rate = float((torch.as_tensor(rewards) > 0).float().mean()) if rewards is not None and len(rewards) else 0.0
        return batch, {"win_rate": win_rate}


def guessing_env_actor(
    stop_strings_per_turn: list[list[str] | None] | None = None, valid_guess_reward: float = 0.0
) -> ActorHandle:
    """Start a :class:`GuessingGameEnvironment` as a Ray actor (needs Ray running)."""
    return start_env_actor(
        GuessingGameEnvironment, stop_strings_per_turn=stop_strings_per_turn, valid_guess_reward=valid_guess_reward
    )
