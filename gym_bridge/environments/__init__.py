"""Built-in environments (Ray actors implementing EnvironmentInterface), and the finished batch they read."""

from __future__ import annotations

from typing import TYPE_CHECKING, TypedDict, cast

if TYPE_CHECKING:  # the reward functions' module stays free of torch and Ray
    import torch

    from gym_bridge.json_types import JsonObject
    from gym_bridge.types import ActorHandle, LLMMessageLogType


class FinishedBatchSpec(TypedDict, total=False):
    """The columns of a finished rollout batch that ``global_post_process_and_metrics`` reads (NeMo-RL's names):
    each sample's ``message_log`` and ``extra_env_info``, ``total_reward`` ``[B]`` and ``truncated`` ``[B]``."""

    message_log: list[LLMMessageLogType]
    extra_env_info: list[JsonObject]
    total_reward: torch.Tensor
    truncated: torch.Tensor


def start_env_actor(cls: type, **kwargs: object) -> ActorHandle:
    """``cls(**kwargs)`` started as a Ray actor that reserves no CPU (needs Ray running).

    Ray types the handle as ``ActorHandle[T] | type[T]``, whose methods lack ``.remote``: callers get our
    :class:`~gym_bridge.types.ActorHandle` protocol instead."""
    import ray

    return cast("ActorHandle", ray.remote(num_cpus=0)(cls).remote(**kwargs))
