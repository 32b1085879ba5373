"""The VLM environment: single-turn answers scored by a weighted sum of named reward functions.

Scoring is spread over ``num_workers`` :class:`VLMVerifyWorker` Ray actors in
contiguous chunks, starting at a different worker on every call (round-robin).
Every reward function runs through :func:`~gym_bridge.environments.rewards.bounded_call`
(length cap, time limit, failures score 0), so adversarial text cannot hang or
crash the environment. Messages may carry images as OpenAI content parts; only
their text parts are read.

Differences from NeMo-RL's ``VLMEnvironment``: the observation says "correct" from
the correctness flags, not from a non-zero score (a partial format score is not
"correct"); the config's ``stop_strings`` are returned as the next stop strings;
the answers returned are the ``<answer>`` contents.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable
from typing import NotRequired, TypedDict, cast

import ray
import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator

from gym_bridge.batched import BatchedDataDict
from gym_bridge.environments import FinishedBatchSpec
from gym_bridge.environments.rewards import REWARD_FUNCTIONS, bounded_call, extract_tag
from gym_bridge.failures.errors import SettingError
from gym_bridge.interfaces import EnvironmentInterface
from gym_bridge.json_types import JsonMapping, JsonObject
from gym_bridge.types import ActorHandle, EnvironmentReturn, LLMMessageLogType


class RewardFunctionSpec(BaseModel):
    """One named reward function with its weight and keyword arguments."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    weight: float = Field(1.0, ge=0.0)
    kwargs: JsonObject = Field(default_factory=dict)

    @field_validator("name")
    @classmethod
    def _known(cls, name: str) -> str:
        if name not in REWARD_FUNCTIONS:
            raise SettingError(f"unknown reward function {name!r}; known: {', '.join(sorted(REWARD_FUNCTIONS))}")
        return name


class VLMEnvConfig(TypedDict):
    """The environment's config as NeMo-RL types it (a plain dict); :class:`VLMEnvSettings` checks it."""

    num_workers: int
    stop_strings: NotRequired[list[str] | None]
    reward_functions: list[JsonObject]
    """``{"name": ..., "weight": ..., "kwargs": {...}}`` per reward function."""
    max_chars: NotRequired[int]
    reward_time_limit_s: NotRequired[float | None]


class VLMEnvSettings(BaseModel):
    """:class:`VLMEnvConfig`, validated: unknown keys and reward functions are errors naming them."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    num_workers: int = Field(1, ge=1)
    stop_strings: list[str] | None = None
    reward_functions: list[RewardFunctionSpec]
    max_chars: int = Field(20_000, ge=1, description="Texts are cut to this many characters before scoring.")
    reward_time_limit_s: float | None = Field(1.0, gt=0.0, description="Per reward-function call; None: no limit.")

    @field_validator("reward_functions")
    @classmethod
    def _non_empty(cls, specs: list[RewardFunctionSpec]) -> list[RewardFunctionSpec]:
        if not specs:
            raise SettingError("reward_functions must name at least one reward function")
        if sum(s.weight for s in specs) <= 0:
            raise SettingError("reward function weights must not all be zero")
        return specs


class VLMEnvironmentMetadata(TypedDict):
    """The answer a sample is scored against."""

    ground_truth: str


class ScoredResponse(TypedDict):
    """One response's score: the weighted ``reward``, whether it is ``correct`` and each function's score."""

    reward: float
    correct: bool
    components: dict[str, float]


class WorkerStats(TypedDict):
    """What a verify worker reports of itself."""

    items_scored: int
    main_thread: bool
    """Whether it scores on its main thread, where reward functions' time limits hold."""


def message_text(content: str | Iterable[object] | None) -> str:
    """The text of a message's content: a string, or the ``text`` parts of OpenAI content parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(
        str(part.get("text", "")) for part in content if isinstance(part, dict) and part.get("type") == "text"
    )


class VLMVerifyWorkerImpl:
    """Scores responses against ground truths; :data:`VLMVerifyWorker` is it as a Ray actor class."""

    def __init__(self, cfg: VLMEnvConfig | VLMEnvSettings | JsonMapping) -> None:
        self.cfg = VLMEnvSettings.model_validate(cfg)
        total = sum(s.weight for s in self.cfg.reward_functions)
        self.weights = [s.weight / total for s in self.cfg.reward_functions]
        self.items_scored = 0

    def score(self, pred_responses: list[str], ground_truths: list[str]) -> list[ScoredResponse]:
        """Per pair: ``reward`` (weighted sum), ``correct`` and each function's ``components`` score."""
        out: list[ScoredResponse] = []
        for response, truth in zip(pred_responses, ground_truths, strict=True):
            components: dict[str, float] = {}
            flags: list[bool] = []
            reward = 0.0
            for spec, weight in zip(self.cfg.reward_functions, self.weights, strict=True):
                score, correct = bounded_call(
                    spec.name,
                    REWARD_FUNCTIONS[spec.name],
                    truth,
                    response,
                    spec.kwargs,
                    max_chars=self.cfg.max_chars,
                    time_limit_s=self.cfg.reward_time_limit_s,
                )
                components[spec.name] = score
                reward += weight * score
                if correct is not None:
                    flags.append(bool(correct))
            out.append({"reward": reward, "correct": all(flags) if flags else reward > 0, "components": components})
        self.items_scored += len(out)
        return out

    def verify(self, pred_responses: list[str], ground_truths: list[str]) -> list[float]:
        """The weighted reward of each response."""
        return [r["reward"] for r in self.score(pred_responses, ground_truths)]

    def stats(self) -> WorkerStats:
        """How many items this worker scored, and whether it can enforce time limits (main thread)."""
        return {"items_scored": self.items_scored, "main_thread": threading.current_thread() is threading.main_thread()}


VLMVerifyWorker = ray.remote(num_cpus=0)(VLMVerifyWorkerImpl)
"""The Ray actor class, as NeMo-RL declares it: ``VLMVerifyWorker.remote(cfg)``, then ``.verify.remote(...)``."""


def _tokens(log: LLMMessageLogType, *, assistant: bool) -> int:
    """Token count of the assistant messages, or of the messages before the first assistant one (the prompt)."""
    if assistant:
        return sum(int(torch.as_tensor(m.get("token_ids", [])).numel()) for m in log if m["role"] == "assistant")
    count = 0
    for message in log:
        if message["role"] == "assistant":
            break
        count += int(torch.as_tensor(message.get("token_ids", [])).numel())
    return count


def _prompt_text(log: LLMMessageLogType) -> str:
    """The text before the first assistant message: which prompt a sample answers."""
    parts = []
    for message in log:
        if message["role"] == "assistant":
            break
        parts.append(message_text(message.get("content")))
    return "\n".join(parts)


def chunk_to_workers[T](items: list[T], num_workers: int) -> list[list[T]]:
    """Contiguous chunks of ``ceil(len / num_workers)`` items, one list per worker (possibly empty)."""
    size = max(1, math.ceil(len(items) / num_workers))
    return [items[w * size : (w + 1) * size] for w in range(num_workers)]


class VLMEnvironmentImpl(EnvironmentInterface[VLMEnvironmentMetadata]):
    """The environment's code; :data:`VLMEnvironment` is it as a Ray actor class. Starts ``num_workers`` verify
    workers."""

    def __init__(self, cfg: VLMEnvConfig | VLMEnvSettings | JsonMapping) -> None:
        self.cfg = VLMEnvSettings.model_validate(cfg)
        # Ray types an actor's handle as ``ActorHandle[T] | type[T]``, whose methods lack ``.remote``
        self.workers = [cast(ActorHandle, VLMVerifyWorker.remote(self.cfg)) for _ in range(self.cfg.num_workers)]
        self._next_worker = 0

    def _score(self, responses: list[str], truths: list[str]) -> list[ScoredResponse]:
        """Score on the workers, contiguous chunks each, starting one worker further on every call."""
        n = len(self.workers)
        start = self._next_worker
        self._next_worker = (start + 1) % n
        refs = []
        for w, (resp, gt) in enumerate(zip(chunk_to_workers(responses, n), chunk_to_workers(truths, n), strict=True)):
            if resp:
                refs.append(self.workers[(start + w) % n].score.remote(resp, gt))
        return [r for chunk in ray.get(refs) for r in chunk]

    def step(
        self, message_log_batch: list[LLMMessageLogType], metadata: list[VLMEnvironmentMetadata]
    ) -> EnvironmentReturn[VLMEnvironmentMetadata]:
        """Score each log's assistant text against its ground truth; every episode ends after one turn."""
        responses = [
            "".join(message_text(m.get("content")) for m in log if m["role"] == "assistant")
            for log in message_log_batch
        ]
        truths = [str(meta["ground_truth"]) for meta in metadata]
        results = self._score(responses, truths)
        observations = [
            {"role": "environment", "content": "Environment: " + ("correct" if r["correct"] else "incorrect")}
            for r in results
        ]
        answers = [extract_tag(resp[-self.cfg.max_chars :]) for resp in responses]
        return EnvironmentReturn(
            observations=observations,
            metadata=list(metadata),
            next_stop_strings=[self.cfg.stop_strings] * len(results),
            rewards=torch.tensor([r["reward"] for r in results], dtype=torch.float32),
            terminateds=torch.ones(len(results), dtype=torch.bool),
            answers=answers,
        )

    def global_post_process_and_metrics(
        self, batch: BatchedDataDict[FinishedBatchSpec]
    ) -> tuple[BatchedDataDict[FinishedBatchSpec], dict[str, float | list[float]]]:
        """Zero the rewards of samples that did not end properly (``truncated``), and score the batch.

        NeMo-RL's metrics: ``accuracy``, ``pass@samples_per_prompt`` (share of prompts with a correct sample),
        ``fraction_of_samples_properly_ended``, ``num_problems_in_batch``, ``generation_lengths`` and
        ``prompt_lengths`` (mean tokens), ``correct_solution_generation_lengths``; and ours: ``mean_reward``,
        ``reward/<name>/mean``, ``histogram/reward`` (a plain list), ``num_samples``.
        Reads ``message_log``, ``extra_env_info`` and ``total_reward``.
        """
        logs, infos = batch["message_log"], batch["extra_env_info"]
        size = len(logs)
        if size == 0:
            return batch, {"num_samples": 0, "num_problems_in_batch": 0}
        responses = ["".join(message_text(m.get("content")) for m in log if m["role"] == "assistant") for log in logs]
        results = self._score(responses, [str(i["ground_truth"]) for i in infos])
        ended = ~torch.as_tensor(batch.get("truncated", torch.zeros(size, dtype=torch.bool))).bool()
        rewards = torch.as_tensor(batch.get("total_reward", [r["reward"] for r in results]), dtype=torch.float32)
        batch["total_reward"] = rewards * ended.float()
        correct = [bool(r["correct"]) and bool(e) for r, e in zip(results, ended, strict=True)]
        generated = [_tokens(log, assistant=True) for log in logs]
        prompt_keys = [(_prompt_text(log), str(info["ground_truth"])) for log, info in zip(logs, infos, strict=True)]
        solved = {key for key, ok in zip(prompt_keys, correct, strict=True) if ok}
        correct_lengths = [g for g, ok in zip(generated, correct, strict=True) if ok]
        metrics: dict[str, float | list[float]] = {
            "accuracy": sum(correct) / size,
            "pass@samples_per_prompt": len(solved) / len(set(prompt_keys)),
            "fraction_of_samples_properly_ended": float(ended.float().mean()),
            "num_problems_in_batch": size,
            "generation_lengths": sum(generated) / size,
            "prompt_lengths": sum(_tokens(log, assistant=False) for log in logs) / size,
            "correct_solution_generation_lengths": sum(correct_lengths) / len(correct_lengths)
            if correct_lengths
            else 0,
            "mean_reward": float(batch["total_reward"].mean()),
            "num_samples": size,
            "histogram/reward": [float(v) for v in batch["total_reward"]],
        }
        for spec in self.cfg.reward_functions:
            metrics[f"reward/{spec.name}/mean"] = sum(r["components"][spec.name] for r in results) / size
        return batch, metrics

    def worker_stats(self) -> list[WorkerStats]:
        """Each verify worker's :class:`WorkerStats`."""
        return ray.get([w.stats.remote() for w in self.workers])

    def shutdown(self) -> None:
        for worker in self.workers:
            ray.kill(cast("ray.actor.ActorHandle[object]", worker))  # Ray types the argument as its own class
        self.workers = []


VLMEnvironment = ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=-1)(VLMEnvironmentImpl)
"""The Ray actor class, as NeMo-RL declares it: ``VLMEnvironment.remote(cfg)`` or ``.options(...).remote(cfg)``."""
