"""Validation as NeMo-RL runs it: held-out Gym rows through the same Gym path, with the validation sampling
profile (greedy when ``val_temperature`` is 0), scored by the environment's reward.

Each validation set gives ``val/accuracy`` (the first set) or ``val/<set>/accuracy``, plus
``format_rate`` (the environment extracted an answer: Gym's ``extracted_answer`` is set),
``lenient_accuracy`` (the last integer of the reply equals ``expected_answer``: correctness
without the format) and ``mean_tokens``, and each agent's metrics (``val/<agent>/reward/mean``, ...:
:mod:`~gym_bridge.training.agent_metrics`) when the set spans environments. Every answer is written to
``val_results.jsonl`` so that two validations can be compared problem by problem (McNemar's test). With a
:class:`~gym_bridge.rollout.reward_shaper.RewardShaper`, rewards are shaped (effort levels, reward penalties)
before they are scored, as NeMo-RL's ``validate`` shapes them.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from gym_bridge.boundary.files import open_append
from gym_bridge.boundary.json_io import dumps
from gym_bridge.failures.errors import SettingError
from gym_bridge.gym.protocol.rows import build_rows
from gym_bridge.gym.transport.client import GymClient
from gym_bridge.json_types import JsonMapping, JsonObject
from gym_bridge.rollout.nemo_gym import gym_completion
from gym_bridge.rollout.reward_shaper import RewardShaper
from gym_bridge.training.agent_metrics import agent_metrics
from gym_bridge.types import Completion, GenerationSamplingParams

_INTEGER = re.compile(r"-?\d+")


class Validator(Protocol):
    """What the GRPO loop calls: the metrics of one validation at ``step`` with weights ``weight_version``."""

    async def __call__(self, step: int, weight_version: int) -> dict[str, float]: ...


def reply_text(completion: Completion) -> str:
    """The text the environment graded: every ``output_text`` of the Gym response's messages, joined."""
    response = (completion.env_extras or {}).get("response") or {}
    return "".join(
        str(part.get("text") or "")
        for item in response.get("output") or []
        if item.get("type") == "message"
        for part in item.get("content") or []
        if part.get("type") == "output_text"
    )


def lenient_correct(reply: str, expected: object) -> bool | None:
    """The last integer in ``reply`` equals ``expected``; None when ``expected`` is not an integer."""
    if not isinstance(expected, str) or not _INTEGER.fullmatch(expected.strip()):
        return None
    found = _INTEGER.findall(reply)
    return bool(found) and int(found[-1]) == int(expected)


@dataclass(frozen=True)
class Answer:
    """One graded validation answer: a sample of a problem of a set."""

    problem: int
    sample: int
    reward: float
    correct: bool
    """The reward reaches ``pass_threshold``."""
    formatted: bool
    """The environment extracted an answer (Gym's ``extracted_answer`` is set)."""
    lenient: bool | None
    """:func:`lenient_correct`; None when the expected answer is not an integer."""
    tokens: int
    """Generated tokens: those of the assistant messages."""
    reply: str

    def record(self) -> JsonObject:
        """Its line in ``val_results.jsonl`` (after ``step``, ``weight_version`` and ``set``)."""
        return {
            "problem": self.problem,
            "sample": self.sample,
            "reward": self.reward,
            "correct": self.correct,
            "lenient": self.lenient,
            "reply": self.reply,
        }


def set_metrics(prefix: str, answers: Sequence[Answer]) -> dict[str, float]:
    """A validation set's ``accuracy``, ``format_rate``, ``mean_tokens`` and, where some expected answers are
    integers, ``lenient_accuracy``, each under ``prefix``."""
    lenient = [a.lenient for a in answers if a.lenient is not None]
    metrics = {
        f"{prefix}accuracy": sum(a.correct for a in answers) / len(answers),
        f"{prefix}format_rate": sum(a.formatted for a in answers) / len(answers),
        f"{prefix}mean_tokens": sum(a.tokens for a in answers) / len(answers),
    }
    if lenient:
        metrics[f"{prefix}lenient_accuracy"] = sum(lenient) / len(lenient)
    return metrics


@dataclass(frozen=True)
class ValidationSet:
    """Named held-out Gym rows; the first set of a validator reports as plain ``val/*``."""

    name: str
    rows: Sequence[JsonMapping]


class GymValidator:
    """Runs every validation set through ``client`` and scores it; one line per answer in ``results_path``."""

    def __init__(
        self,
        client: GymClient,
        sets: Sequence[ValidationSet],
        *,
        sampling: GenerationSamplingParams,
        max_new_tokens: int | None,
        num_generations: int = 1,
        pass_threshold: float = 1.0,
        results_path: Path | None = None,
        reward_shaper: RewardShaper | None = None,
        deadline_s: float | None = None,
        seed: int | None = None,
    ) -> None:
        if not sets or any(not s.rows for s in sets):
            raise SettingError("validation needs at least one set, each with rows")
        if num_generations < 1:
            raise SettingError(f"val_num_generations_per_prompt must be >= 1, got {num_generations}")
        self.client, self.sets = client, list(sets)
        self.sampling, self.max_new_tokens = sampling, max_new_tokens
        self.num_generations, self.pass_threshold = num_generations, pass_threshold
        self.results_path = results_path
        self.reward_shaper = reward_shaper
        self.deadline_s, self.seed = deadline_s, seed

    async def _problem(self, row: JsonMapping, prompt_idx: int, scope: str) -> list[Completion]:
        """``num_generations`` rollouts of one held-out row through Gym, rewards shaped when configured. ``scope``
        keeps the rollout ids of this validation's set apart from other rows in flight (training rows, other sets:
        their task indices restart), so Gym's token capture keys them apart."""
        rows = build_rows(
            dict(row),
            self.num_generations,
            self.sampling,
            self.max_new_tokens,
            run_seed=self.seed,
            task_index=prompt_idx,
            scope=scope,
        )
        group = await self.client.run_group(rows, prompt_idx=prompt_idx, deadline_s=self.deadline_s)
        agent = group.agent
        completions = [
            gym_completion(r, max_seq_len=None, mask_env_flagged_samples=False, agent=agent) for r in group.rows
        ]
        if self.reward_shaper is not None:
            completions, _ = self.reward_shaper.shape([row] * len(completions), completions)
        return completions

    def _answer(self, row: JsonMapping, completion: Completion, problem: int, sample: int) -> Answer:
        """One validation answer, graded: by the reward, by Gym's extracted answer and by the last integer."""
        generated = [m for m in completion.message_log if m.get("role") == "assistant"]
        reply = reply_text(completion)
        return Answer(
            problem=problem,
            sample=sample,
            reward=float(completion.reward),
            correct=float(completion.reward) >= self.pass_threshold,
            formatted=(completion.env_extras.get("extracted_answer") if completion.env_extras else None) is not None,
            lenient=lenient_correct(reply, row.get("expected_answer")),
            tokens=sum(len(m["token_ids"]) for m in generated),
            reply=reply,
        )

    async def __call__(self, step: int, weight_version: int) -> dict[str, float]:
        """Every set's metrics (``val/*`` for the first, ``val/<set>/*`` for the others); every answer is appended
        to ``results_path`` as one line."""
        metrics: dict[str, float] = {}
        records: list[JsonObject] = []
        # Every set's rows go out at once: the engine decodes them in one batch.
        all_groups = await asyncio.gather(
            *(
                asyncio.gather(*(self._problem(row, i, f"val{step}-{n}") for i, row in enumerate(vset.rows)))
                for n, vset in enumerate(self.sets)
            )
        )
        for n, (vset, groups) in enumerate(zip(self.sets, all_groups, strict=True)):
            answers = [
                self._answer(row, completion, problem, sample)
                for problem, (row, completions) in enumerate(zip(vset.rows, groups, strict=True))
                for sample, completion in enumerate(completions)
            ]
            prefix = "val/" if n == 0 else f"val/{vset.name}/"
            metrics.update(set_metrics(prefix, answers))
            metrics.update(agent_metrics([c for completions in groups for c in completions], prefix))
            records.extend(
                {"step": step, "weight_version": weight_version, "set": vset.name, **answer.record()}
                for answer in answers
            )
        if self.results_path is not None:  # a training folder: a link planted as the file is refused, not followed
            with open_append(self.results_path) as out:
                out.writelines(dumps(r) + b"\n" for r in records)
        return metrics
