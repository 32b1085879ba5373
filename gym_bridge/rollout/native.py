"""AsyncRolloutImpl: N concurrent multi-turn trajectories per prompt, natively (no Gym).

Each trajectory alternates ``generate_async`` on the policy with an environment
step (a Ray actor call awaited on the event loop) until the environment
terminates it, the sequence budget ``max_seq_len`` is spent, or
``max_rollout_turns`` is reached. A failed trajectory fails the whole group: its
siblings are cancelled, because a zero-reward stand-in would bias every
sibling's GRPO baseline.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Self

import torch
from pydantic import StrictBool

from gym_bridge.batched import BatchedDataDict
from gym_bridge.failures import (
    RolloutDataFailure,
    RolloutRetryPolicy,
    RolloutStats,
    RolloutTimeout,
    RolloutTimeouts,
    SettingError,
    classify_environment_failure,
    classify_generation_failure,
    deadline,
    gather_cancel_siblings,
)
from gym_bridge.interfaces import GenerationInterface
from gym_bridge.json_types import JsonObject
from gym_bridge.metrics import calculate_single_metric, pct, summarize
from gym_bridge.rollout.backend import BackendOptions, RolloutContext
from gym_bridge.rollout.env_step import EnvMetadata, calculate_rewards_async, environment_for
from gym_bridge.rollout.truncation import fit_observation
from gym_bridge.types import (
    ActorHandle,
    Completion,
    DatumSpec,
    GenerationDatumSpec,
    LLMMessageLogType,
    MessageEntry,
    PromptGroupRecord,
    Tokenizer,
    token_tensor,
)

UNLIMITED_TURNS = 999999
"""NeMo-RL's default turn budget of the native paths (no practical limit)."""


@dataclass
class TrajectoryStats:
    """What one trajectory did, turn by turn; aggregated into the group's metrics."""

    turn_count: int = 0
    assistant_tokens: int = 0
    env_tokens: int = 0
    terminated: bool = False
    truncated: bool = False
    max_turns_reached: bool = False
    total_reward: float = 0.0
    turn_gen_tokens: list[int] = field(default_factory=list)
    turn_input_tokens: list[int] = field(default_factory=list)
    per_worker_token_counts: dict[int, int] = field(default_factory=dict)

    @property
    def total_tokens(self) -> int:
        return self.turn_input_tokens[0] + self.assistant_tokens + self.env_tokens if self.turn_input_tokens else 0

    @property
    def turn_total_tokens(self) -> list[int]:
        return [i + g for i, g in zip(self.turn_input_tokens, self.turn_gen_tokens, strict=True)]


@dataclass
class _Trajectory:
    message_log: LLMMessageLogType
    extra_env_info: EnvMetadata
    stop_strings: list[str] | None
    stats: TrajectoryStats = field(default_factory=TrajectoryStats)


class NativeOptions(BackendOptions):
    """The ``native`` backend's own keyword: ``greedy`` decoding (each turn takes the most likely token)."""

    greedy: StrictBool = False


class AsyncRolloutImpl:
    """The ``native`` rollout backend: one prompt group per ``run_rollout`` call."""

    Options = NativeOptions

    def __init__(
        self,
        tokenizer: Tokenizer,
        task_to_env: Mapping[str, ActorHandle],
        num_generations_per_prompt: int,
        max_seq_len: int,
        max_rollout_turns: int | None = 999999,
        policy_generation: GenerationInterface | None = None,
        timeouts: RolloutTimeouts | None = None,
        *,
        greedy: bool = False,
        retry_policy: RolloutRetryPolicy | None = None,
        stats: RolloutStats | None = None,
    ) -> None:
        """NeMo-RL's positional order; ``max_rollout_turns=None`` means no turn limit.

        ``retry_policy`` and ``stats`` are accepted where NeMo-RL passes them: retries
        of a failed group are :class:`~gym_bridge.rollout.manager.RolloutManager`'s job.
        """
        if policy_generation is None:
            raise SettingError("the native rollout backend needs policy_generation (a GenerationInterface)")
        if max_rollout_turns is not None and max_rollout_turns < 1:
            raise SettingError(f"max_rollout_turns must be >= 1 or None, got {max_rollout_turns}")
        self.tokenizer = tokenizer
        self.task_to_env = task_to_env
        self.num_generations = num_generations_per_prompt
        self.max_seq_len = max_seq_len
        self.max_rollout_turns = max_rollout_turns if max_rollout_turns is not None else UNLIMITED_TURNS
        self.policy_generation = policy_generation
        self.timeouts = timeouts or RolloutTimeouts()
        self.greedy = greedy
        self.retry_policy = retry_policy or RolloutRetryPolicy.single_attempt()
        self.stats = stats or RolloutStats()

    @classmethod
    def from_context(cls, context: RolloutContext, options: NativeOptions) -> Self:
        """The backend from the manager's context and its validated options."""
        return cls(
            context.tokenizer,
            context.task_to_env,
            context.num_generations_per_prompt,
            context.max_seq_len,
            context.max_rollout_turns,
            context.policy_generation,
            context.timeouts,
            greedy=options.greedy,
            retry_policy=context.retry_policy,
            stats=context.stats,
        )

    async def run_rollout(self, datum: DatumSpec) -> PromptGroupRecord:
        task_name = datum.get("task_name")
        environment_for(task_name, self.task_to_env)
        t_total = time.perf_counter()
        trajectories = await gather_cancel_siblings(
            *(self._run_single_rollout(datum, traj_idx) for traj_idx in range(self.num_generations))
        )
        t_run = time.perf_counter() - t_total
        t_agg = time.perf_counter()
        metrics = aggregate_trajectory_metrics([t.stats for t in trajectories])
        metrics["timing/rollout/run_rollouts"] = t_run
        metrics["timing/rollout/aggregate_metrics"] = time.perf_counter() - t_agg
        metrics["timing/rollout/total"] = time.perf_counter() - t_total
        completions = [
            Completion(
                message_log=t.message_log,
                env_extras=t.extra_env_info,
                truncated=t.stats.truncated,
                reward=t.stats.total_reward,
            )
            for t in trajectories
        ]
        return PromptGroupRecord(
            prompt_idx=int(datum["idx"]),
            prompt=datum["message_log"],
            extra_env_info=datum.get("extra_env_info"),
            metadata={"task_name": task_name},
            completions=completions,
            rollout_metrics=metrics,
        )

    async def _run_single_rollout(self, datum: DatumSpec, traj_idx: int) -> _Trajectory:
        traj = _Trajectory(
            message_log=copy.deepcopy(datum["message_log"]),
            extra_env_info=copy.deepcopy(datum.get("extra_env_info")),
            stop_strings=datum.get("stop_strings"),
        )
        stats = traj.stats
        prompt_idx = datum["idx"]
        for _ in range(self.max_rollout_turns):
            if stats.terminated or stats.truncated:
                break
            stats.turn_count += 1
            input_ids = torch.cat([m["token_ids"] for m in traj.message_log]) if traj.message_log else token_tensor([])
            input_len = int(input_ids.numel())
            async with deadline(self.timeouts.generation_s, "generation turn"):
                assistant, gen_truncated, worker = await self._generate(traj, input_ids, prompt_idx, traj_idx)
            gen_len = int(assistant["token_ids"].numel())
            traj.message_log.append(assistant)
            stats.turn_input_tokens.append(input_len)
            stats.turn_gen_tokens.append(gen_len)
            stats.assistant_tokens += gen_len
            if worker is not None:
                stats.per_worker_token_counts[worker] = stats.per_worker_token_counts.get(worker, 0) + gen_len

            try:
                async with deadline(self.timeouts.env_s, "environment step"):
                    env_return = await calculate_rewards_async(
                        [traj.message_log], [traj.extra_env_info], [datum.get("task_name")], self.task_to_env
                    )
            except RolloutTimeout:
                raise
            except Exception as exc:
                raise classify_environment_failure(exc, prompt_idx, traj_idx) from exc
            if isinstance(env_return.rewards, dict):
                raise RolloutDataFailure(
                    f"the native rollout backend supports scalar rewards only; prompt_idx={prompt_idx} "
                    f"got reward components {sorted(env_return.rewards)}"
                )
            stats.total_reward += float(env_return.rewards[0])
            stats.terminated = bool(env_return.terminateds[0])

            observation = env_return.observations[0]
            fit = fit_observation(
                token_tensor(self.tokenizer(observation["content"], add_special_tokens=False)["input_ids"]),
                input_len=input_len,
                gen_len=gen_len,
                max_seq_len=self.max_seq_len,
                response_truncated=gen_truncated,
            )
            obs_ids = fit.token_ids
            stats.truncated = stats.truncated or fit.truncated
            traj.message_log.append(
                MessageEntry(role=observation["role"], content=observation["content"], token_ids=obs_ids)
            )
            stats.env_tokens += int(obs_ids.numel())

            if not stats.terminated and not stats.truncated:
                next_stops = env_return.next_stop_strings[0] if env_return.next_stop_strings is not None else None
                if next_stops is not None:
                    traj.stop_strings = next_stops
                if env_return.metadata[0] is not None:
                    traj.extra_env_info = env_return.metadata[0]
        else:
            stats.max_turns_reached = True
        return traj

    async def _generate(
        self, traj: _Trajectory, input_ids: torch.Tensor, prompt_idx: int, traj_idx: int
    ) -> tuple[MessageEntry, bool, int | None]:
        data: BatchedDataDict[GenerationDatumSpec] = BatchedDataDict(
            {
                "input_ids": input_ids.unsqueeze(0),
                "input_lengths": torch.tensor([input_ids.numel()], dtype=torch.int64),
                "stop_strings": [traj.stop_strings],
            }
        )
        output = None
        try:
            async for _, last in self.policy_generation.generate_async(data, greedy=self.greedy):
                output = last
            if output is None:
                raise RolloutDataFailure("generate_async yielded no output")
        except Exception as exc:
            raise classify_generation_failure(exc, prompt_idx, traj_idx) from exc
        start, end = int(input_ids.numel()), int(output["unpadded_sequence_lengths"][0])
        gen_ids = token_tensor(output["output_ids"][0, start:end])
        assistant = MessageEntry(
            role="assistant",
            content=self.tokenizer.decode(gen_ids.tolist(), skip_special_tokens=True),
            token_ids=gen_ids,
            generation_logprobs=output["logprobs"][0, start:end].to(torch.float32),
        )
        truncated = bool(output["truncated"][0]) if "truncated" in output else False
        worker = output.get("gen_leader_worker_idx")
        return assistant, truncated, (int(worker[0]) if worker is not None else None)


def aggregate_trajectory_metrics(samples: list[TrajectoryStats]) -> JsonObject:
    """Group metrics with NeMo-RL's ``AsyncRolloutImpl`` key names (means over the N samples)."""
    if not samples:
        raise SettingError("cannot aggregate metrics over zero trajectories")
    n = len(samples)
    turns = [s.turn_count for s in samples]
    max_gen_per_turn = [max(s.turn_gen_tokens, default=0) for s in samples]
    metrics: JsonObject = {}
    metrics.update(calculate_single_metric([s.total_reward for s in samples], n, "total_reward"))
    metrics["total_turns"] = sum(turns)
    metrics.update(summarize(turns, "turns_per_sample"))
    metrics.update(calculate_single_metric([s.total_tokens for s in samples], n, "total_tokens_per_sample"))
    metrics.update(calculate_single_metric([s.assistant_tokens for s in samples], n, "gen_tokens_per_sample"))
    metrics.update(calculate_single_metric([s.env_tokens for s in samples], n, "env_tokens_per_sample"))
    metrics["max_gen_tokens_per_turn/max"] = max(max_gen_per_turn)
    metrics["max_gen_tokens_per_turn/mean"] = sum(max_gen_per_turn) / n
    metrics["max_gen_tokens_per_turn/p95"] = pct(max_gen_per_turn, 95)
    metrics["truncation_rate"] = sum(s.truncated for s in samples) / n
    metrics["natural_termination_rate"] = sum(s.terminated for s in samples) / n
    metrics["max_turns_reached_rate"] = sum(s.max_turns_reached for s in samples) / n
    worker_counts: dict[int, int] = {}
    for s in samples:
        for worker, count in s.per_worker_token_counts.items():
            worker_counts[worker] = worker_counts.get(worker, 0) + count
    metrics["per_worker_token_counts"] = worker_counts
    metrics["histogram/gen_tokens_length"] = [g for s in samples for g in s.turn_gen_tokens]
    metrics["histogram/input_tokens_length"] = [i for s in samples for i in s.turn_input_tokens]
    metrics["histogram/total_tokens_length"] = [t for s in samples for t in s.turn_total_tokens]
    metrics["mean_gen_tokens_per_sample"] = metrics["gen_tokens_per_sample/mean"]
    return metrics
