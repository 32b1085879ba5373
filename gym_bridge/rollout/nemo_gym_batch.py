"""NeMo-RL's whole-batch Gym functions: ``run_async_nemo_gym_rollout`` and ``run_nemo_gym_rollout_sync``.

NeMo-RL's GRPO (sync and async), validation, distillation and trajectory collector call
these with a batch whose ``extra_env_info`` holds one Gym row per generation,
``num_generations`` contiguous rows per prompt. Each prompt group goes through the same
:class:`~gym_bridge.gym.client.GymClient` and :func:`~gym_bridge.rollout.nemo_gym.gym_completion`
as the ``nemo_gym`` rollout backend, so both paths check, re-dispatch and convert rows
alike. Groups come back in completion order, their rows in input order, as
:class:`NemoGymRolloutResult` with NeMo-RL's ``final_batch`` keys and metric names.
"""

from __future__ import annotations

import asyncio
import logging
import time
import warnings
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import NotRequired, TypedDict

import orjson
import torch

from gym_bridge.batched import BatchedDataDict, batched_message_log_to_flat_message
from gym_bridge.failures import GymBridgeError, SettingError
from gym_bridge.gym.client import GymClient, GymGroupResult
from gym_bridge.gym.result import GymRowResult
from gym_bridge.gym.routing import routing_basis
from gym_bridge.gym.rows import stamped_row, validate_row
from gym_bridge.gym.versions import TASK_INDEX_KEY
from gym_bridge.json_types import JsonMapping, JsonObject
from gym_bridge.rollout.nemo_gym import (
    TIMER_PREFIX,
    full_result_table,
    group_metrics as gym_group_metrics,
    gym_completion,
    nemo_gym_actors,
)
from gym_bridge.rollout.reward_shaping import (
    EffortLevelsConfig,
    PenaltyConfig,
    apply_effort_shaping,
    apply_reward_penalties,
    build_reward_component_columns,
    effort_metrics,
    extract_reward_components,
    penalty_metrics,
    resolve_reward_penalty_config,
    validate_reward_components_match_scalar,
)
from gym_bridge.types import (
    ActorHandle,
    DatumSpec,
    GenerationConfig,
    GenerationSamplingParams,
    LLMMessageLogType,
    Tokenizer,
    padding_id,
)

__all__ = [
    "EmptyRolloutStream",
    "NemoGymFinalBatch",
    "NemoGymRolloutResult",
    "full_result_table",
    "run_async_nemo_gym_rollout",
    "run_nemo_gym_rollout_sync",
    "should_log_nemo_gym_full_result_tables",
]

logger = logging.getLogger(__name__)

_ENGINE_CONFIG_KEYS = ("vllm_cfg", "trtllm_cfg", "mcore_generation_config")
_POSTPROCESS_TIMERS = tuple(
    f"{TIMER_PREFIX}/{step}"
    for step in ("prepare_for_metrics_calculation", "aggregate_metrics", "per_agent_misc_metrics")
)
"""NeMo-RL's timers of one group's post-processing, summed over the call's groups."""

type LossMultiplier = torch.Tensor | Sequence[float]
"""The batch's ``loss_multiplier`` column: a tensor, or one float per row."""


class EmptyRolloutStream(GymBridgeError, RuntimeError):
    """The rollout stream ended without a single group (a ``RuntimeError``, as NeMo-RL raises here)."""


class NemoGymFinalBatch(TypedDict):
    """NeMo-RL's ``final_batch`` keys on the Gym path; ``reward/<name>`` columns join them per reward component."""

    agent_ref: list[JsonObject]
    message_log: list[LLMMessageLogType]
    length: torch.Tensor
    loss_multiplier: LossMultiplier
    total_reward: torch.Tensor
    truncated: torch.Tensor
    mask_sample: NotRequired[torch.Tensor]


@dataclass
class NemoGymRolloutResult:
    """One prompt group (or, with ``returns_entire_batch``, the whole batch) in input-row order."""

    input_ids: torch.Tensor
    """The first user message of each row, flattened and right-padded with the tokenizer's pad id: [B, L]."""
    final_batch: BatchedDataDict[NemoGymFinalBatch]
    """NeMo-RL's keys: ``agent_ref``, ``message_log``, ``length``, ``loss_multiplier``, ``total_reward``,
    ``truncated``, ``mask_sample`` (when masking) and ``reward/<name>`` per reward component."""
    rollout_metrics: JsonObject
    task_index: int | None
    """The group's ``_ng_task_index`` (NeMo-RL's async collector identity); None when the rows carry none."""


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

    Rows are stamped with ``sampling_params`` (default: the training profile of
    ``generation_config``) and ``max_output_tokens = min(row's, max_new_tokens)`` on copies;
    the caller's rows are not changed. The last result carries the timing metrics.
    As in NeMo-RL, each row gets one attempt: the first group that fails ends the stream and
    cancels the others.

    ``policy_generation`` is read for its ``cfg`` only (the engine's ``max_model_len``).

    Raises:
        SettingError: an option the Gym path cannot honour (``greedy``, ``max_rollout_turns``, stop strings,
            ``top_k``), a batch that does not split into groups, or a group mixing agents or task indices; a
            ``ValueError``, as NeMo-RL's callers expect.
        InvalidGymRow: a row that cannot be dispatched, named by its index and field.
        RolloutFailure: the typed failure of the first group that failed (see :mod:`gym_bridge.failures`).
    """
    rows = list(input_batch["extra_env_info"])
    engine_max_len = _engine_max_model_len(policy_generation, max_seq_len)
    _check_options(generation_config, sampling_params, greedy, max_rollout_turns, max_seq_len, engine_max_len)
    sampling = sampling_params or GenerationSamplingParams.from_generation_config(generation_config)
    if sampling.top_k:
        raise SettingError("sampling_params.top_k is not supported on the NeMo-Gym path (not an OpenAI parameter)")
    groups = _split(rows, num_generations, returns_entire_batch)
    message_logs = input_batch.get("message_log")
    if message_logs is not None and len(message_logs) != len(rows):
        raise SettingError(f"input_batch has {len(message_logs)} message logs for {len(rows)} NeMo-Gym rows")
    max_new_tokens = generation_config.get("max_new_tokens")
    shaping = _Shaping(tokenizer, effort_config, reward_penalty_config, thinking_tags)
    loss_multiplier = _loss_multiplier(input_batch, len(rows))
    client = GymClient(
        nemo_gym_actors(task_to_env),
        max_row_attempts=1,
        timer_prefix=TIMER_PREFIX,
        resend_env_infra_failures=False,
    )
    routes = await client.routes()
    if routes is not None:  # task_source rows gain agent_ref once, here: metrics and final_batch name the agent
        rows = [routes.routed(row, where=f"row {i}") for i, row in enumerate(rows)]
    stamped = [
        [stamped_row(rows[start + i], i, sampling, max_new_tokens) for i in range(end - start)] for start, end in groups
    ]
    post = _GroupPost(tokenizer, engine_max_len, mask_env_flagged_samples, log_full_result_tables, shaping)

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
                g = tasks[task]
                start, end = groups[g]
                gym_group = task.result()
                _add_timing(timing, gym_group.timing)
                result = post.result(rows[start:end], gym_group, loss_multiplier[start:end])
                _add_timing(timing, post.timing(result))
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


class _Shaping:
    """Effort shaping and reward penalties, resolved once per call (NeMo-RL's order: effort, then penalties)."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        effort_config: EffortLevelsConfig | JsonMapping | None,
        reward_penalty_config: PenaltyConfig | None,
        thinking_tags: Sequence[str] | None,
    ) -> None:
        if isinstance(effort_config, Mapping):
            effort_config = EffortLevelsConfig.model_validate(effort_config)
        self.effort = effort_config
        tags = list(thinking_tags) if thinking_tags is not None else None
        self.penalties = resolve_reward_penalty_config(reward_penalty_config, tokenizer, thinking_tags=tags)

    def apply(self, rows: list[JsonObject], gym_rows: list[GymRowResult]) -> dict[str, float]:
        """Shape the rewards of one group in place (Gym's ``reward`` and ours); return NeMo-RL's shaping metrics."""
        if self.effort is None and not self.penalties:
            return {}
        results = [{"message_log": r.message_log, "full_result": r.full_result} for r in gym_rows]
        effort = apply_effort_shaping(results, rows, self.effort)
        counts = apply_reward_penalties(results, self.penalties)
        for row in gym_rows:
            reward = float(row.full_result["reward"])
            row.reward = reward
            row.metrics["reward"] = reward
        return {**effort_metrics(effort), **penalty_metrics(self.penalties, counts, len(gym_rows))}


@dataclass(frozen=True)
class _GroupPost:
    """Turns one finished group into NeMo-RL's ``NemoGymRolloutResult``."""

    tokenizer: Tokenizer
    engine_max_len: int | None
    mask_env_flagged_samples: bool
    log_full_result_tables: bool
    shaping: _Shaping

    @staticmethod
    def timing(result: NemoGymRolloutResult) -> dict[str, float]:
        """The post-processing steps' seconds of one group, as NeMo-RL's timer names them."""
        return {key: result.rollout_metrics.pop(key) for key in _POSTPROCESS_TIMERS}

    def result(
        self, rows: list[JsonObject], group: GymGroupResult, loss_multiplier: LossMultiplier
    ) -> NemoGymRolloutResult:
        t0 = time.perf_counter()
        full_results = [r.full_result for r in group.rows]
        components = [extract_reward_components(r) for r in full_results]
        if any(c is not None for c in components):
            # The verifier's contract (reward == sum of components) is checked before shaping changes the reward.
            validate_reward_components_match_scalar(full_results)
        metrics: JsonObject = self.shaping.apply(rows, group.rows)
        completions = [
            gym_completion(r, max_seq_len=self.engine_max_len, mask_env_flagged_samples=self.mask_env_flagged_samples)
            for r in group.rows
        ]
        agents = [row["agent_ref"]["name"] for row in rows]
        t1 = time.perf_counter()
        metrics.update(gym_group_metrics(completions, agents, fields=[r.metrics for r in group.rows]))
        t2 = time.perf_counter()
        if self.log_full_result_tables:
            for agent in sorted(set(agents)):
                mine = [c.env_extras for c, name in zip(completions, agents, strict=True) if name == agent]
                metrics[f"{agent}/full_result"] = full_result_table(mine)
        t3 = time.perf_counter()
        metrics.update(zip(_POSTPROCESS_TIMERS, (t1 - t0, t2 - t1, t3 - t2), strict=True))
        final_batch: BatchedDataDict[NemoGymFinalBatch] = BatchedDataDict(
            {
                "agent_ref": [row["agent_ref"] for row in rows],
                "message_log": [c.message_log for c in completions],
                "length": torch.tensor([int(r.input_message_log[0]["token_ids"].numel()) for r in group.rows]),
                "loss_multiplier": loss_multiplier,
                "total_reward": torch.tensor([r.full_result["reward"] for r in group.rows]),
                "truncated": torch.tensor([c.truncated for c in completions], dtype=torch.bool),
            }
        )
        if self.mask_env_flagged_samples:
            final_batch["mask_sample"] = torch.tensor([c.masked for c in completions], dtype=torch.bool)
        if any(c is not None for c in components):
            final_batch.update(build_reward_component_columns(components))
        flat, _ = batched_message_log_to_flat_message(
            [r.input_message_log for r in group.rows], pad_value_dict={"token_ids": padding_id(self.tokenizer)}
        )
        return NemoGymRolloutResult(
            input_ids=flat["token_ids"],
            final_batch=final_batch,
            rollout_metrics=metrics,
            task_index=_task_index(rows),
        )


def should_log_nemo_gym_full_result_tables(*, wandb_enabled: bool, wandb_config: JsonMapping) -> bool:
    """NeMo-RL's rule: ``{agent}/full_result`` tables only when wandb logs and ``log_nemo_gym_full_result_tables``."""
    return bool(wandb_enabled) and bool(wandb_config.get("log_nemo_gym_full_result_tables"))


def _check_options(
    generation_config: GenerationConfig,
    sampling_params: GenerationSamplingParams | None,
    greedy: bool,
    max_rollout_turns: int | None,
    max_seq_len: int | None,
    engine_max_len: int | None,
) -> None:
    if greedy:
        raise SettingError(
            "greedy is not supported on the NeMo-Gym path; pass sampling_params for a validation profile"
        )
    if max_rollout_turns is not None:
        raise SettingError("max_rollout_turns must be None on the NeMo-Gym path: the Gym agent ends each episode")
    for key in ("stop_strings", "stop_token_ids"):
        if generation_config.get(key):
            raise SettingError(
                f"generation_config.{key} is not supported on the NeMo-Gym path (Gym's model server does not "
                "forward it); setup_nemo_gym_config clears it"
            )
    if max_seq_len is not None and engine_max_len is not None and max_seq_len > engine_max_len:
        warnings.warn(
            f"policy max_total_sequence_length ({max_seq_len}) is greater than the generation engine's "
            f"max_model_len ({engine_max_len}); the engine truncates at its own limit",
            stacklevel=3,
        )


def _split(rows: list[JsonObject], num_generations: int, returns_entire_batch: bool) -> list[tuple[int, int]]:
    """The ``(start, end)`` of each group; every row is validated (in ``rows``, as a ``ValidGymRow``) before
    anything is sent."""
    if num_generations <= 0:
        raise SettingError(f"num_generations must be greater than zero, got {num_generations}")
    if not rows:
        raise SettingError("the NeMo-Gym rollout batch (extra_env_info) is empty")
    if len(rows) % num_generations:
        raise SettingError(
            f"the NeMo-Gym batch has {len(rows)} rows, not divisible by num_generations={num_generations}"
        )
    if returns_entire_batch and len(rows) != num_generations:
        raise SettingError(
            f"returns_entire_batch needs num_generations ({num_generations}) to equal the batch size ({len(rows)})"
        )
    rows[:] = [validate_row(row, prompt_idx=i // num_generations) for i, row in enumerate(rows)]
    groups = [(start, start + num_generations) for start in range(0, len(rows), num_generations)]
    if not returns_entire_batch:
        for g, (start, end) in enumerate(groups):
            agents = [routing_basis(row) for row in rows[start:end]]
            if len(set(agents)) != 1:
                raise SettingError(f"prompt group {g} (rows {start}..{end - 1}) mixes NeMo-Gym agents: {agents}")
            _task_index(rows[start:end])
    return groups


def _task_index(rows: Sequence[JsonMapping]) -> int | None:
    """The group's ``_ng_task_index``, checked equal across its rows; None when the first row has none."""
    if not rows or TASK_INDEX_KEY not in rows[0]:
        return None
    indices = [row.get(TASK_INDEX_KEY) for row in rows]
    first = int(rows[0][TASK_INDEX_KEY])
    if any(index is None or int(index) != first for index in indices):
        raise SettingError(f"expected one {TASK_INDEX_KEY} per prompt group, got {indices}")
    return first


def _engine_max_model_len(policy_generation: object, max_seq_len: int | None) -> int | None:
    """The engine's ``max_model_len`` from NeMo-RL's generation config, else ``max_total_sequence_length``,
    else ``max_seq_len`` (our engines carry no such config)."""
    cfg = getattr(policy_generation, "cfg", None)
    if isinstance(cfg, Mapping):
        for key in _ENGINE_CONFIG_KEYS:
            if isinstance(cfg.get(key), Mapping) and cfg[key].get("max_model_len") is not None:
                return int(cfg[key]["max_model_len"])
        if cfg.get("max_total_sequence_length") is not None:
            return int(cfg["max_total_sequence_length"])
    return max_seq_len


def _loss_multiplier(input_batch: BatchedDataDict[DatumSpec], n: int) -> LossMultiplier:
    """The batch's ``loss_multiplier`` column, else ones (NeMo-RL's datasets always set 1.0)."""
    value = input_batch.get("loss_multiplier")
    if value is None:
        return torch.ones(n)
    if len(value) != n:
        raise SettingError(f"input_batch has {len(value)} loss_multiplier values for {n} NeMo-Gym rows")
    column: LossMultiplier = value
    return column


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
