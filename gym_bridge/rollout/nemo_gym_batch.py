"""NeMo-RL's whole-batch Gym functions: ``run_async_nemo_gym_rollout`` and ``run_nemo_gym_rollout_sync``.

NeMo-RL's GRPO (sync and async), validation, distillation and trajectory collector call
these with a batch whose ``extra_env_info`` holds one Gym row per generation,
``num_generations`` contiguous rows per prompt. Each prompt group goes through the same
:class:`~gym_bridge.gym.transport.client.GymClient` and :func:`~gym_bridge.rollout.nemo_gym.gym_completion`
as the ``nemo_gym`` rollout backend, so both paths check, re-dispatch and convert rows
alike. Groups come back in completion order, their rows in input order, as
:class:`NemoGymRolloutResult` with NeMo-RL's ``final_batch`` keys and metric names.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Mapping, Sequence

import orjson

from gym_bridge.batched import BatchedDataDict
from gym_bridge.failures import GymBridgeError
from gym_bridge.gym.protocol.rows import stamped_row
from gym_bridge.gym.transport.client import GymClient, GymGroupResult
from gym_bridge.json_types import JsonMapping, JsonObject
from gym_bridge.rollout.nemo_gym import TIMER_PREFIX, nemo_gym_actors
from gym_bridge.rollout.nemo_gym_batch_input import (
    LossMultiplier,
    check_message_logs,
    checked_sampling,
    engine_max_model_len,
    loss_multiplier_column,
    split_groups,
)
from gym_bridge.rollout.nemo_gym_batch_result import GroupPost, NemoGymRolloutResult
from gym_bridge.rollout.reward_shaper import RewardShaper
from gym_bridge.rollout.reward_shaping import EffortLevelsConfig, PenaltyConfig
from gym_bridge.types import (
    ActorHandle,
    DatumSpec,
    GenerationConfig,
    GenerationSamplingParams,
    Tokenizer,
)

logger = logging.getLogger(__name__)


class EmptyRolloutStream(GymBridgeError, RuntimeError):
    """The rollout stream ended without a single group (a ``RuntimeError``, as NeMo-RL raises here)."""


async def run_async_nemo_gym_rollout(
    policy_generation: object,
    input_batch: BatchedDataDict[DatumSpec],
    tokenizer: Tokenizer,
    task_to_env: Mapping[str, ActorHandle],
    generation_config: GenerationConfig,
    num_generations: int,
    log_full_result_tables: bool,
    max_seq_len: int | None = None,
    max_rollout_turns: int | None = None,
    greedy: bool = False,
    effort_config: EffortLevelsConfig | JsonMapping | None = None,
    reward_penalty_config: PenaltyConfig | None = None,
    thinking_tags: Sequence[str] | None = None,
    mask_env_flagged_samples: bool = True,
    returns_entire_batch: bool = False,
    sampling_params: GenerationSamplingParams | None = None,
    deduplicate_multimodal_data: bool = False,
    debug_payload_metrics: bool = False,
) -> AsyncIterator[NemoGymRolloutResult]:
    """Yield complete prompt groups of ``input_batch["extra_env_info"]`` in completion order (NeMo-RL's signature).

    Rows are stamped with ``sampling_params`` (default: the training profile of ``generation_config``) and
    ``max_output_tokens = min(row's, max_new_tokens)`` on copies; the caller's rows are not changed. The last result
    carries the timing metrics. As in NeMo-RL, each row gets one attempt: the first group that fails ends the stream
    and cancels the others. ``policy_generation`` is read for its ``cfg`` only (the engine's ``max_model_len``).

    Raises:
        SettingError: an option the Gym path cannot honour (``greedy``, ``max_rollout_turns``, stop strings,
            ``top_k``), a batch that does not split into groups, or a group mixing agents or task indices; a
            ``ValueError``, as NeMo-RL's callers expect.
        InvalidGymRow: a row that cannot be dispatched, named by its index and field.
        RolloutFailure: the typed failure of the first group that failed (see :mod:`gym_bridge.failures`).
    """
    rows = list(input_batch["extra_env_info"])
    engine_max_len = engine_max_model_len(policy_generation, max_seq_len)
    sampling = checked_sampling(
        generation_config, sampling_params, greedy, max_rollout_turns, max_seq_len, engine_max_len
    )
    groups = split_groups(rows, num_generations, returns_entire_batch)
    check_message_logs(input_batch, len(rows))
    max_new_tokens = generation_config.get("max_new_tokens")
    shaping = RewardShaper(
        tokenizer, effort_levels=effort_config, reward_penalties=reward_penalty_config, thinking_tags=thinking_tags
    )
    loss_multiplier = loss_multiplier_column(input_batch, len(rows))
    client = GymClient(
        nemo_gym_actors(task_to_env), max_gym_row_attempts=1, timer_prefix=TIMER_PREFIX, resend_env_infra_failures=False
    )
    rows = await _routed(client, rows)
    stamped = [
        [stamped_row(rows[start + i], i, sampling, max_new_tokens) for i in range(end - start)] for start, end in groups
    ]
    post = GroupPost(tokenizer, engine_max_len, mask_env_flagged_samples, log_full_result_tables, shaping)

    started = time.perf_counter()
    timing: dict[str, float] = {}
    awaited = 0.0
    debug = {"debug/nemo_gym_request_bytes": float(len(orjson.dumps(stamped)))} if debug_payload_metrics else {}
    tasks = {
        asyncio.create_task(client.run_group(group_rows, prompt_idx=g, deadline_s=None)): g
        for g, group_rows in enumerate(stamped)
    }
    pending = set(tasks)
    try:
        while pending:
            waiting = time.perf_counter()
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            awaited += time.perf_counter() - waiting
            for task in sorted(done, key=tasks.__getitem__):
                start, end = groups[tasks[task]]
                result = _post_group(post, timing, task.result(), rows[start:end], loss_multiplier[start:end])
                if not pending and task is max(done, key=tasks.__getitem__):
                    result.rollout_metrics.update(_final_timing(timing, awaited, time.perf_counter() - started))
                    result.rollout_metrics.update(debug)
                yield result
    finally:
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)


def run_nemo_gym_rollout_sync(
    policy_generation: object,
    input_batch: BatchedDataDict[DatumSpec],
    tokenizer: Tokenizer,
    task_to_env: Mapping[str, ActorHandle],
    generation_config: GenerationConfig,
    log_full_result_tables: bool,
    max_seq_len: int | None = None,
    max_rollout_turns: int | None = None,
    greedy: bool = False,
    effort_config: EffortLevelsConfig | JsonMapping | None = None,
    reward_penalty_config: PenaltyConfig | None = None,
    thinking_tags: Sequence[str] | None = None,
    sampling_params: GenerationSamplingParams | None = None,
    mask_env_flagged_samples: bool = True,
    deduplicate_multimodal_data: bool = False,
    debug_payload_metrics: bool = False,
) -> NemoGymRolloutResult:
    """The whole batch as one (possibly mixed-agent) group, in input order (NeMo-RL's signature and order).

    Raises ``RuntimeError`` when called from a running event loop (use the async function there).
    """

    async def drain() -> NemoGymRolloutResult:
        last = None
        async for result in run_async_nemo_gym_rollout(
            policy_generation,
            input_batch,
            tokenizer,
            task_to_env,
            generation_config,
            len(input_batch["extra_env_info"]),
            log_full_result_tables,
            max_seq_len=max_seq_len,
            max_rollout_turns=max_rollout_turns,
            greedy=greedy,
            effort_config=effort_config,
            reward_penalty_config=reward_penalty_config,
            thinking_tags=thinking_tags,
            mask_env_flagged_samples=mask_env_flagged_samples,
            returns_entire_batch=True,
            sampling_params=sampling_params,
            deduplicate_multimodal_data=deduplicate_multimodal_data,
            debug_payload_metrics=debug_payload_metrics,
        ):
            last = result
        if last is None:
            raise EmptyRolloutStream("NeMo-Gym returned no rollouts")
        return last

    return asyncio.run(drain())


async def _routed(client: GymClient, rows: list[JsonObject]) -> list[JsonObject]:
    """The rows with ``agent_ref`` where the Gym config routes them (``task_source`` rows gain it once, here, so
    metrics and ``final_batch`` name the agent); the rows as they are when the Gym routes nothing."""
    routes = await client.routes()
    if routes is None:
        return rows
    return [routes.routed(row, where=f"row {i}") for i, row in enumerate(rows)]


def should_log_nemo_gym_full_result_tables(*, wandb_enabled: bool, wandb_config: JsonMapping) -> bool:
    """NeMo-RL's rule: ``{agent}/full_result`` tables only when wandb logs and ``log_nemo_gym_full_result_tables``."""
    return bool(wandb_enabled) and bool(wandb_config.get("log_nemo_gym_full_result_tables"))


def _post_group(
    post: GroupPost,
    timing: dict[str, float],
    gym_group: GymGroupResult,
    rows: list[JsonObject],
    loss_multiplier: LossMultiplier,
) -> NemoGymRolloutResult:
    """One finished group as NeMo-RL's result, its transport and post-processing seconds added to ``timing``."""
    _add_timing(timing, gym_group.timing)
    result = post.result(rows, gym_group, loss_multiplier)
    _add_timing(timing, post.timing(result))
    return result


def _add_timing(total: dict[str, float], timing: Mapping[str, float]) -> None:
    """Sum seconds over groups (percentages are recomputed at the end)."""
    for key, value in timing.items():
        if not key.endswith("_pct"):
            total[key] = total.get(key, 0.0) + value


def _final_timing(summed: dict[str, float], awaited: float, elapsed: float) -> dict[str, float]:
    """NeMo-RL's timing keys for the whole call: ``await_results`` is the wall time this call waited for
    groups (not the actors' waits summed over concurrent groups), ``postprocess_results`` the actors'
    conversion time summed, its ``_pct`` a share of the call's wall time, as NeMo-RL's actor divides by
    its one stream's total; the per-group post-processing steps summed."""
    out = dict(summed)
    out[f"{TIMER_PREFIX}/await_results"] = awaited
    postprocess = out.get(f"{TIMER_PREFIX}/postprocess_results", 0.0)
    out[f"{TIMER_PREFIX}/postprocess_results_pct"] = 100.0 * postprocess / elapsed if elapsed > 0 else 0.0
    out[f"{TIMER_PREFIX}/run_rollouts"] = elapsed
    out[f"{TIMER_PREFIX}/total"] = elapsed
    return out
