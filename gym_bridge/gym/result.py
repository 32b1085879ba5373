"""The typed results that cross from the NemoGym actor to the driver: one Gym row, a streamed batch.

The actor builds them (:func:`gym_bridge.gym.convert.convert_gym_result` reads Gym's
result schema) with the message log's tensors swapped for numpy arrays: Ray pickles
an array out of band (~0.1 ms) but a tensor through ``torch.save`` (~0.3 ms each way,
several per row). :class:`gym_bridge.gym.client.GymClient` restores the tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
import torch

from gym_bridge.types import LLMMessageLogType

__all__ = ["GymRowBatch", "GymRowResult", "log_as_numpy", "log_as_tensors"]


@dataclass(slots=True)
class GymRowResult:
    """One Gym row, converted: NeMo-RL's message log plus what the driver reads from Gym's result."""

    row_index: int
    """The row's ``_rowidx`` (its position in the group)."""
    message_log: LLMMessageLogType
    """User/assistant pairs, one per model call; numpy arrays in transit, tensors after :meth:`with_tensors`."""
    full_result: dict[str, Any]
    """Gym's ``/run`` result, token arrays popped and ``prompt_str`` / ``generation_str`` added."""
    reward: float
    """Gym's ``reward``, checked finite."""
    token_drift: dict[str, Any] | None = None
    """The first drift (``on_drift="truncate"``): the log ends before that turn."""
    incomplete_reason: str | None = None
    """Gym's ``response.incomplete_details.reason`` (``max_output_tokens``, ...), if any."""
    metrics: dict[str, float] = field(default_factory=dict)
    """The numeric and boolean top-level fields of the result (``reward``, verifier scores)."""
    mask_sample: bool = False
    """The environment flagged the reward as no valid measurement: Gym 0.7's ``mask_sample``, or the older
    ``instance_config.mask_sample``. Such a sample stays out of the loss and of its group's baseline."""
    failure_kind: str | None = None
    """Gym 0.7's ``failure_kind`` (``session_lost``, ``judge_failed``, ...), independent of ``mask_sample``."""
    failure_reason: str | None = None
    """Gym's human-readable ``failure_reason``: a diagnosis, never a metric label."""

    @property
    def input_message_log(self) -> LLMMessageLogType:
        """The first user message: the prompt as NeMo-RL records it."""
        return self.message_log[:1]

    def with_numpy(self) -> GymRowResult:
        """Swap the message log's tensors for numpy arrays, in place, for the trip through Ray."""
        log_as_numpy(self.message_log)
        return self

    def with_tensors(self) -> GymRowResult:
        """Swap numpy arrays back for tensors, in place (copying read-only arrays out of Ray's store)."""
        log_as_tensors(self.message_log)
        return self


@dataclass(slots=True)
class GymRowBatch:
    """One element of the actor's stream: the rows that finished together, and the actor's timing on the last."""

    rows: list[GymRowResult]
    timing: dict[str, float] | None = None


def log_as_numpy(message_log: LLMMessageLogType) -> LLMMessageLogType:
    """Replace every tensor of a message log by its numpy view, in place."""
    for message in message_log:
        entry = cast(dict[str, Any], message)
        for key, value in entry.items():
            if isinstance(value, torch.Tensor):
                entry[key] = value.numpy()
    return message_log


def log_as_tensors(message_log: LLMMessageLogType) -> LLMMessageLogType:
    """Replace every numpy array of a message log by a tensor, in place.

    Arrays Ray hands over are read-only views of its object store: those are copied, so
    the tensors are writable and do not pin the store's memory.
    """
    for message in message_log:
        entry = cast(dict[str, Any], message)
        for key, value in entry.items():
            if isinstance(value, np.ndarray):
                entry[key] = torch.from_numpy(value if value.flags.writeable else value.copy())
    return message_log
