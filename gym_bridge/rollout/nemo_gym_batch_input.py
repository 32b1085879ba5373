"""NeMo-RL's whole-batch Gym arguments checked, and the batch split into prompt groups, before any row is sent."""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from gym_bridge.batched import BatchedDataDict
from gym_bridge.failures import SettingError
from gym_bridge.gym.protocol.routing import routing_basis
from gym_bridge.gym.protocol.rows import validate_row
from gym_bridge.gym_versions import TASK_INDEX_KEY
from gym_bridge.json_types import JsonMapping, JsonObject
from gym_bridge.types import DatumSpec, GenerationConfig, GenerationSamplingParams

ENGINE_CONFIG_SECTIONS = ("vllm_cfg", "trtllm_cfg", "mcore_generation_config")
"""NeMo-RL's engine sections of a generation config (``policy.generation``), in the order NeMo-RL reads their
``max_model_len``: the one list of them (:func:`engine_context_lengths`)."""
CONTEXT_LENGTH_FIELD = "max_total_sequence_length"
"""NeMo-RL's name for the run's context length (``policy.max_total_sequence_length``)."""

type LossMultiplier = torch.Tensor | Sequence[float]
"""The batch's ``loss_multiplier`` column: a tensor, or one float per row."""


def checked_sampling(
    generation_config: GenerationConfig,
    sampling_params: GenerationSamplingParams | None,
    greedy: bool,
    max_rollout_turns: int | None,
    max_seq_len: int | None,
    engine_max_len: int | None,
) -> GenerationSamplingParams:
    """The rows' sampling: ``sampling_params``, else the training profile of ``generation_config``. Refuse an option
    the Gym path cannot honour (``SettingError``); warn when ``max_seq_len`` is over the engine's ``max_model_len``."""
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
    sampling = sampling_params or GenerationSamplingParams.from_generation_config(generation_config)
    if sampling.top_k:
        raise SettingError("sampling_params.top_k is not supported on the NeMo-Gym path (not an OpenAI parameter)")
    return sampling


def split_groups(rows: list[JsonObject], num_generations: int, returns_entire_batch: bool) -> list[tuple[int, int]]:
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
            group_task_index(rows[start:end])
    return groups


def check_message_logs(input_batch: BatchedDataDict[DatumSpec], n: int) -> None:
    """Refuse a batch whose ``message_log`` column (when it has one) does not hold one log per Gym row."""
    message_logs = input_batch.get("message_log")
    if message_logs is not None and len(message_logs) != n:
        raise SettingError(f"input_batch has {len(message_logs)} message logs for {n} NeMo-Gym rows")


def group_task_index(rows: Sequence[JsonMapping]) -> int | None:
    """The group's ``_ng_task_index``, checked equal across its rows; None when the first row has none."""
    if not rows or TASK_INDEX_KEY not in rows[0]:
        return None
    indices = [row.get(TASK_INDEX_KEY) for row in rows]
    first = int(rows[0][TASK_INDEX_KEY])
    if any(index is None or int(index) != first for index in indices):
        raise SettingError(f"expected one {TASK_INDEX_KEY} per prompt group, got {indices}")
    return first


def engine_context_lengths(generation: object) -> dict[str, Any]:
    """Each ``<section>.max_model_len`` that a NeMo-RL generation config sets (None and absent left out), keyed by its
    path under the config, in NeMo-RL's order (:data:`ENGINE_CONFIG_SECTIONS`): the one reader of those keys, for the
    training config's context length (:func:`~gym_bridge.config.training.context_length`) and the engine's limit
    here alike."""
    if not isinstance(generation, Mapping):
        return {}
    found: dict[str, Any] = {}
    for section in ENGINE_CONFIG_SECTIONS:
        body = generation.get(section)
        if isinstance(body, Mapping) and body.get("max_model_len") is not None:
            found[f"{section}.max_model_len"] = body["max_model_len"]
    return found


def engine_max_model_len(policy_generation: object, max_seq_len: int | None) -> int | None:
    """The engine's ``max_model_len`` from NeMo-RL's generation config (:func:`engine_context_lengths`), else
    ``max_total_sequence_length``, else ``max_seq_len`` (our engines carry no such config)."""
    cfg = getattr(policy_generation, "cfg", None)
    if isinstance(cfg, Mapping):
        first = next(iter(engine_context_lengths(cfg).values()), None)
        if first is not None:
            return int(first)
        if cfg.get(CONTEXT_LENGTH_FIELD) is not None:
            return int(cfg[CONTEXT_LENGTH_FIELD])
    return max_seq_len


def loss_multiplier_column(input_batch: BatchedDataDict[DatumSpec], n: int) -> LossMultiplier:
    """The batch's ``loss_multiplier`` column, else ones (NeMo-RL's datasets always set 1.0)."""
    value = input_batch.get("loss_multiplier")
    if value is None:
        return torch.ones(n)
    if len(value) != n:
        raise SettingError(f"input_batch has {len(value)} loss_multiplier values for {n} NeMo-Gym rows")
    column: LossMultiplier = value
    return column
