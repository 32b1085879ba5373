"""Stepping environments: group samples by task, step every group at once, restore input order."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from typing import Any

import ray
import torch

from gym_bridge.batched import BatchedDataDict, get_keys_from_message_log
from gym_bridge.failures import GymBridgeError, SettingError
from gym_bridge.json_types import JsonObject
from gym_bridge.types import ActorHandle, DatumSpec, EnvironmentReturn, LLMMessageLogType

type EnvMetadata = JsonObject | None
"""One sample's environment metadata (its ``extra_env_info``): a JSON object, or None where it has none."""

type _StepCall = tuple[list[int], ray.ObjectRef[EnvironmentReturn[EnvMetadata]]]
"""The samples one environment steps (their input positions) and the Ray future of its return."""


class UnknownTaskError(GymBridgeError, KeyError):
    """A sample names a ``task_name`` that has no environment in ``task_to_env``."""

    def __str__(self) -> str:
        return str(self.args[0])


class EnvironmentReturnError(GymBridgeError, ValueError):
    """An environment's step returned a different number of observations than it was given samples."""


def environment_for(task_name: str | None, task_to_env: Mapping[str, ActorHandle]) -> ActorHandle:
    """The environment registered for ``task_name``, or an error that names it and the known tasks."""
    if task_name is not None:
        with contextlib.suppress(KeyError):
            return task_to_env[task_name]
    known = ", ".join(sorted(task_to_env)) or "(none)"
    raise UnknownTaskError(f"no environment for task_name={task_name!r}; known tasks: {known}")


def _dispatch(
    message_logs: Sequence[LLMMessageLogType],
    metadata: Sequence[EnvMetadata],
    task_names: Sequence[str | None],
    task_to_env: Mapping[str, ActorHandle],
) -> list[_StepCall]:
    groups: dict[str | None, list[int]] = {}
    for i, name in enumerate(task_names):
        groups.setdefault(name, []).append(i)
    calls = []
    for name, indices in groups.items():
        env = environment_for(name, task_to_env)
        logs = [get_keys_from_message_log(message_logs[i], ["role", "content"]) for i in indices]
        calls.append((indices, env.step.remote(logs, [metadata[i] for i in indices])))
    return calls


def _stack_rewards(values: list[Any]) -> torch.Tensor | dict[str, torch.Tensor]:
    if all(isinstance(v, dict) for v in values):
        names = sorted(values[0])
        return {name: torch.stack([torch.as_tensor(v[name], dtype=torch.float32) for v in values]) for name in names}
    if any(isinstance(v, dict) for v in values):
        raise TypeError("environments returned a mix of dict and scalar rewards in one batch")
    return torch.stack([torch.as_tensor(v, dtype=torch.float32).reshape(()) for v in values])


def _merge(
    batch_size: int, calls: list[_StepCall], returns: Sequence[EnvironmentReturn[EnvMetadata]]
) -> EnvironmentReturn[EnvMetadata]:
    # Any: placeholders until every sample's value arrives; the values are what the environments returned.
    observations: list[Any] = [None] * batch_size
    metadata: list[EnvMetadata] = [None] * batch_size
    stops: list[list[str] | None] = [None] * batch_size
    rewards: list[Any] = [None] * batch_size
    terminateds: list[bool] = [False] * batch_size
    answers: list[str | None] = [None] * batch_size
    for (indices, _), ret in zip(calls, returns, strict=True):
        obs, meta, next_stops, rew, term, ans = _six_fields(ret)
        if len(obs) != len(indices):
            raise EnvironmentReturnError(f"environment returned {len(obs)} observations for {len(indices)} samples")
        for j, i in enumerate(indices):
            observations[i] = obs[j]
            metadata[i] = meta[j] if meta is not None else None
            stops[i] = next_stops[j] if next_stops is not None else None
            rewards[i] = {k: v[j] for k, v in rew.items()} if isinstance(rew, dict) else rew[j]
            terminateds[i] = bool(term[j])
            answers[i] = ans[j] if ans is not None else None
    return EnvironmentReturn(
        observations=observations,
        metadata=metadata,
        next_stop_strings=stops,
        rewards=_stack_rewards(rewards) if batch_size else torch.zeros(0),
        terminateds=torch.tensor(terminateds, dtype=torch.bool),
        answers=answers,
    )


def _six_fields(ret: Sequence[Any]) -> tuple[Any, ...]:
    """An environment's return as six fields: the documented five (``answers`` None) or HEAD's six."""
    fields = tuple(ret)
    if len(fields) == 5:
        return (*fields, None)
    if len(fields) != 6:
        raise TypeError(
            f"an environment's step returned {len(fields)} fields; expected EnvironmentReturn's 5 (observations, "
            "metadata, next_stop_strings, rewards, terminateds) or 6 (with answers)"
        )
    return fields


def step_by_task(
    message_logs: Sequence[LLMMessageLogType],
    metadata: Sequence[EnvMetadata],
    task_names: Sequence[str | None],
    task_to_env: Mapping[str, ActorHandle],
) -> EnvironmentReturn[EnvMetadata]:
    """Step every sample's environment (Ray actors, all groups in flight at once); blocks."""
    calls = _dispatch(message_logs, metadata, task_names, task_to_env)
    return _merge(len(message_logs), calls, ray.get([ref for _, ref in calls]))


def calculate_rewards(
    batch: BatchedDataDict[DatumSpec], task_to_env: Mapping[str, ActorHandle]
) -> EnvironmentReturn[EnvMetadata]:
    """NeMo-RL's ``calculate_rewards(batch, task_to_env)``: step the batch's samples, results in input order.

    ``batch`` (a :class:`~gym_bridge.batched.BatchedDataDict` or any mapping) holds
    ``message_log`` and ``extra_env_info`` per sample and, optionally, ``task_name``.
    Blocks; async code should await :func:`calculate_rewards_async` instead.
    """
    logs = list(batch["message_log"])
    size = len(logs)
    metadata = list(batch.get("extra_env_info") or [None] * size)
    task_names = list(batch.get("task_name") or [None] * size)
    if len(metadata) != size or len(task_names) != size:
        raise SettingError(
            f"batch has {size} message logs but {len(metadata)} extra_env_info and {len(task_names)} task_name entries"
        )
    return step_by_task(logs, metadata, task_names, task_to_env)


async def calculate_rewards_async(
    message_logs: Sequence[LLMMessageLogType],
    metadata: Sequence[EnvMetadata],
    task_names: Sequence[str | None],
    task_to_env: Mapping[str, ActorHandle],
) -> EnvironmentReturn[EnvMetadata]:
    """As :func:`step_by_task`, awaiting the actors instead of blocking a thread."""
    calls = _dispatch(message_logs, metadata, task_names, task_to_env)
    returns = [await ref for _, ref in calls]
    return _merge(len(message_logs), calls, returns)
