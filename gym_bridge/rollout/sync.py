"""The native batched rollout: every active sample generates one turn together, then every environment steps.

:func:`run_multi_turn_rollout` follows NeMo-RL's ``run_multi_turn_rollout``
(the synchronous, whole-batch-per-turn path) with these deliberate differences:

- **The caller's batch is not mutated.** Message logs, ``extra_env_info`` and
  ``stop_strings`` are deep-copied first; the returned ``final_batch`` holds the
  extended copies. (NeMo-RL appends to the caller's message logs in place.)
- **Environment stop strings are always honoured**, also when the input batch has
  no ``stop_strings`` key, and an environment's ``None`` keeps the sample's
  previous stop strings (as the async paths do) instead of clearing them.
- **Observation tokens are int64**, empty ones included.
- Truncation follows :func:`~gym_bridge.rollout.truncation.fit_observation`, the
  rule the native path uses too (NeMo-RL's: ``input + generated + observation >=
  max_seq_len`` cuts the observation and ends the sample).
- **``natural_termination_rate``** counts samples their environment terminated,
  as in :class:`~gym_bridge.rollout.native.AsyncRolloutImpl`; NeMo-RL's sync path
  also counted sequence-length truncations as terminations.
- Environment steps are bounded by ``timeouts.env_s`` (a
  :class:`~gym_bridge.failures.RolloutTimeout` on expiry).

Kept from the reference (and different from ``AsyncRolloutImpl``): a response
that hit the generation cap marks the sample ``truncated`` but does not end it;
``max_turns_reached`` means "still active when the turn budget ran out".
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
from collections.abc import Coroutine, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from gym_bridge.batched import BatchedDataDict, batched_message_log_to_flat_message
from gym_bridge.failures import RolloutTimeouts, SettingError, deadline
from gym_bridge.interfaces import GenerationInterface
from gym_bridge.json_types import JsonObject
from gym_bridge.rollout.env_step import (
    EnvMetadata,
    calculate_rewards_async,
    environment_for,
    step_by_task,
)
from gym_bridge.rollout.native import TrajectoryStats
from gym_bridge.rollout.truncation import fit_observation
from gym_bridge.types import (
    ActorHandle,
    DatumSpec,
    EnvironmentReturn,
    GenerationDatumSpec,
    LLMMessageLogType,
    MessageEntry,
    Tokenizer,
    padding_id,
    token_tensor,
)


def generate_responses(
    policy_generation: GenerationInterface,
    generation_input_data: BatchedDataDict[GenerationDatumSpec],
    batch: BatchedDataDict[DatumSpec],
    tokenizer: Tokenizer,
    input_lengths: torch.Tensor,
    include_logprobs: bool = True,
    greedy: bool = False,
) -> tuple[BatchedDataDict[DatumSpec], list[torch.Tensor], JsonObject]:
    """Generate one turn for every row and append it to ``batch["message_log"][i]`` in place.

    Stop strings: ``batch["stop_strings"]`` when present replace those of
    ``generation_input_data``; otherwise the generation input's own are kept
    (NeMo-RL overwrote them with None). Returns ``(batch, generated ids per row,
    metrics)``: NeMo-RL's ``mean_generation_length`` and ``max_seqlen`` (the longest prompt plus
    generation), our ``total_generated_tokens``, and ``_response_truncated``, the per-row ``truncated``
    tensor, for the caller to pop.
    """
    size = int(generation_input_data["input_ids"].shape[0])
    if "stop_strings" in batch:
        generation_input_data["stop_strings"] = list(batch["stop_strings"])
    elif "stop_strings" not in generation_input_data:
        generation_input_data["stop_strings"] = [None] * size
    output = policy_generation.generate(generation_input_data, greedy=greedy)
    generated: list[torch.Tensor] = []
    for i in range(size):
        start, end = int(input_lengths[i]), int(output["unpadded_sequence_lengths"][i])
        ids = token_tensor(output["output_ids"][i, start:end])
        generated.append(ids)
        message = MessageEntry(
            role="assistant",
            content=tokenizer.decode(ids.tolist(), skip_special_tokens=True),
            token_ids=ids,
        )
        if include_logprobs and "logprobs" in output:
            message["generation_logprobs"] = output["logprobs"][i, start:end].to(torch.float32)
        batch["message_log"][i].append(message)
    lengths = [int(g.numel()) for g in generated]
    truncated = output.get("truncated")
    metrics = {
        "mean_generation_length": sum(lengths) / size if size else 0.0,
        "max_seqlen": int(output["unpadded_sequence_lengths"].max()) if size else 0,
        "total_generated_tokens": sum(lengths),
        "_response_truncated": (
            torch.as_tensor(truncated, dtype=torch.bool)
            if truncated is not None
            else torch.zeros(size, dtype=torch.bool)
        ),
    }
    return batch, generated, metrics


def _run_sync[T](coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` to completion from synchronous code, also when called inside a running event loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coro).result()


def step_environments(
    message_logs: list[LLMMessageLogType],
    metadata: list[EnvMetadata],
    task_names: list[str | None],
    task_to_env: Mapping[str, ActorHandle],
    env_s: float | None = None,
) -> EnvironmentReturn[EnvMetadata]:
    """:func:`~gym_bridge.rollout.env_step.step_by_task`, bounded by ``env_s`` seconds (``None``: wait forever)."""
    if env_s is None:
        return step_by_task(message_logs, metadata, task_names, task_to_env)

    async def bounded() -> EnvironmentReturn[EnvMetadata]:
        async with deadline(env_s, "environment step"):
            return await calculate_rewards_async(message_logs, metadata, task_names, task_to_env)

    return _run_sync(bounded())


def _owned_copy(input_batch: BatchedDataDict[DatumSpec]) -> BatchedDataDict[DatumSpec]:
    batch = input_batch.copy()
    size = len(batch["message_log"])
    batch["message_log"] = copy.deepcopy(list(batch["message_log"]))
    batch["extra_env_info"] = copy.deepcopy(list(batch.get("extra_env_info") or [None] * size))
    batch["stop_strings"] = copy.deepcopy(list(batch.get("stop_strings") or [None] * size))
    if "task_name" not in batch:
        batch["task_name"] = [None] * size
    return batch


def run_multi_turn_rollout(
    policy_generation: GenerationInterface,
    input_batch: BatchedDataDict[DatumSpec],
    tokenizer: Tokenizer,
    task_to_env: Mapping[str, ActorHandle],
    max_seq_len: int,
    max_rollout_turns: int | None = 999999,
    greedy: bool = False,
    deduplicate_multimodal_data: bool = False,
    *,
    timeouts: RolloutTimeouts | None = None,
) -> tuple[BatchedDataDict[DatumSpec], dict[str, float]]:
    """Roll out a batch turn by turn; returns ``(final_batch, metrics)``. NeMo-RL's positional order.

    ``input_batch`` needs ``message_log`` (tokenised prompts) and may carry
    ``task_name``, ``extra_env_info`` and ``stop_strings`` (one per sample). It is
    not modified. ``final_batch`` holds the input keys (with the rolled-out copies
    of ``message_log``, ``extra_env_info`` and the final ``stop_strings``), plus
    ``total_reward`` (float32 ``[B]``), ``truncated`` (bool ``[B]``) and, for
    environments returning dict rewards, one float32 ``[B]`` tensor per component.

    Metrics: ``total_turns``, ``avg_turns_per_sample``, ``max_turns_per_sample``,
    ``natural_termination_rate``, ``truncation_rate``, ``max_turns_reached_rate``,
    ``mean_total_tokens_per_sample``, ``mean_gen_tokens_per_sample``,
    ``max_gen_tokens_per_sample``, ``mean_env_tokens_per_sample``.
    The generation engine must not generate past ``max_seq_len`` (give it
    ``max_model_len <= max_seq_len``); a sequence that does raises :class:`SettingError` (a ``ValueError``).
    An unknown ``task_name`` raises :class:`~gym_bridge.rollout.env_step.UnknownTaskError`
    before anything is generated.
    """
    if deduplicate_multimodal_data:
        raise SettingError(
            "deduplicate_multimodal_data: multimodal payloads are not supported by run_multi_turn_rollout"
        )
    timeouts = timeouts or RolloutTimeouts()
    max_rollout_turns = 999999 if max_rollout_turns is None else max_rollout_turns
    batch = _owned_copy(input_batch)
    size = len(batch["message_log"])
    if size == 0:
        raise SettingError("cannot roll out an empty batch")
    for name in dict.fromkeys(batch["task_name"]):
        environment_for(name, task_to_env)

    samples = [TrajectoryStats() for _ in range(size)]
    total_reward = torch.zeros(size, dtype=torch.float32)
    components: dict[str, torch.Tensor] = {}
    active = list(range(size))
    for _ in range(max_rollout_turns):
        if not active:
            break
        turn = _generate_turn(policy_generation, batch, active, tokenizer, greedy)
        env_return = step_environments(
            turn.batch["message_log"],
            turn.batch["extra_env_info"],
            turn.batch["task_name"],
            task_to_env,
            env_s=timeouts.env_s,
        )
        _accumulate_rewards(env_return.rewards, active, total_reward, components)
        active = [
            i
            for j, i in enumerate(active)
            if _absorb_turn(batch, i, samples[i], turn, j, env_return, tokenizer, max_seq_len)
        ]

    batch["total_reward"] = total_reward
    batch["truncated"] = torch.tensor([s.truncated for s in samples], dtype=torch.bool)
    for name, values in components.items():
        batch[name] = values
    total_tokens = [sum(int(m["token_ids"].numel()) for m in log) for log in batch["message_log"]]
    return batch, _rollout_metrics(samples, total_tokens, still_active=active)


@dataclass(frozen=True)
class _Turn:
    """One generation turn of the active samples: the batch with their responses, and what each generated."""

    batch: BatchedDataDict[DatumSpec]
    input_lengths: torch.Tensor
    generated: list[torch.Tensor]
    response_truncated: torch.Tensor


def _generate_turn(
    policy_generation: GenerationInterface,
    batch: BatchedDataDict[DatumSpec],
    active: list[int],
    tokenizer: Tokenizer,
    greedy: bool,
) -> _Turn:
    """Every active sample generates one response together, appended to its message log."""
    active_batch = batch.select_indices(active)
    token_logs = [[{"token_ids": m["token_ids"]} for m in log] for log in active_batch["message_log"]]
    flat, input_lengths = batched_message_log_to_flat_message(
        token_logs, pad_value_dict={"token_ids": padding_id(tokenizer)}
    )
    generation_input: BatchedDataDict[GenerationDatumSpec] = BatchedDataDict(
        {"input_ids": flat["token_ids"], "input_lengths": input_lengths.to(torch.int64)}
    )
    active_batch, generated, gen_metrics = generate_responses(
        policy_generation, generation_input, active_batch, tokenizer, input_lengths, greedy=greedy
    )
    return _Turn(active_batch, input_lengths, generated, gen_metrics.pop("_response_truncated"))


def _absorb_turn(
    batch: BatchedDataDict[DatumSpec],
    i: int,
    sample: TrajectoryStats,
    turn: _Turn,
    j: int,
    env_return: EnvironmentReturn[EnvMetadata],
    tokenizer: Tokenizer,
    max_seq_len: int,
) -> bool:
    """Count sample ``i``'s turn (``j``-th of the active ones), append its observation, carry the
    environment's stop strings and metadata; True while the sample goes on."""
    input_len, gen_len = int(turn.input_lengths[j]), int(turn.generated[j].numel())
    if input_len + gen_len > max_seq_len:
        raise SettingError(
            f"sample {i}: {input_len} input + {gen_len} generated tokens exceed max_seq_len={max_seq_len}; "
            "give the generation engine max_model_len <= max_seq_len"
        )
    sample.turn_count += 1
    sample.assistant_tokens += gen_len
    sample.truncated |= bool(turn.response_truncated[j])
    observation = env_return.observations[j]
    fit = fit_observation(
        token_tensor(tokenizer(observation["content"], add_special_tokens=False)["input_ids"]),
        input_len=input_len,
        gen_len=gen_len,
        max_seq_len=max_seq_len,
    )
    sample.truncated |= fit.truncated
    batch["message_log"][i].append(
        MessageEntry(role=observation["role"], content=observation["content"], token_ids=fit.token_ids)
    )
    sample.env_tokens += int(fit.token_ids.numel())
    sample.terminated |= bool(env_return.terminateds[j])
    if fit.truncated or sample.terminated:
        return False
    next_stops = env_return.next_stop_strings[j] if env_return.next_stop_strings is not None else None
    if next_stops is not None:
        batch["stop_strings"][i] = next_stops
    if env_return.metadata[j] is not None:
        batch["extra_env_info"][i] = env_return.metadata[j]
    return True


def _accumulate_rewards(
    rewards: torch.Tensor | dict[str, torch.Tensor],
    active: list[int],
    total_reward: torch.Tensor,
    components: dict[str, torch.Tensor],
) -> None:
    index = torch.tensor(active, dtype=torch.long)
    if isinstance(rewards, dict):
        for name, values in rewards.items():
            acc = components.setdefault(name, torch.zeros_like(total_reward))
            acc[index] += values.to(torch.float32)
            total_reward[index] += values.to(torch.float32)
    else:
        total_reward[index] += rewards.to(torch.float32).reshape(-1)


def _rollout_metrics(
    samples: list[TrajectoryStats], total_tokens: list[int], *, still_active: list[int]
) -> dict[str, float]:
    """NeMo-RL's sync rollout metrics; ``max_turns_reached`` is a sample still active when the turns ran out."""
    n = len(samples)
    turns = [s.turn_count for s in samples]
    gen_tokens = [s.assistant_tokens for s in samples]
    return {
        "total_turns": sum(turns),
        "avg_turns_per_sample": sum(turns) / n,
        "max_turns_per_sample": max(turns),
        "natural_termination_rate": sum(s.terminated for s in samples) / n,
        "truncation_rate": sum(s.truncated for s in samples) / n,
        "max_turns_reached_rate": len(still_active) / n,
        "mean_total_tokens_per_sample": sum(total_tokens) / n,
        "mean_gen_tokens_per_sample": sum(gen_tokens) / n,
        "max_gen_tokens_per_sample": float(max(gen_tokens)),
        "mean_env_tokens_per_sample": sum(s.env_tokens for s in samples) / n,
    }
