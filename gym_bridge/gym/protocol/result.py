"""The typed results that cross from the NemoGym actor to the driver: one Gym row, a streamed batch.

The actor builds them (:func:`gym_bridge.gym.protocol.convert.convert_gym_result` reads Gym's
result schema). A :class:`GymRowResult` pickles its message log's tensors as numpy arrays and
unpickles them as tensors again: Ray pickles an array out of band (~0.1 ms) but a tensor through
``torch.save`` (~0.3 ms each way, several per row), and neither end converts by hand.
:meth:`GymRowResult.as_nemo_rl_result` is the per-row dict NeMo-RL's own actor streams.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, TypedDict, cast

import numpy as np
import torch

from gym_bridge.gym.protocol.token_capture import CaptureBuild
from gym_bridge.json_types import JsonObject
from gym_bridge.types import LLMMessageLogType


class NemoRLRowResult(TypedDict):
    """One element of NeMo-RL's actor stream, ``(rowidx, result, timing)``: its ``result``.

    Token fields are numpy arrays, which NeMo-RL's consumers turn into tensors (``_tensorize_by_key``)."""

    message_log: list[dict[str, Any]]
    input_message_log: list[dict[str, Any]]
    full_result: JsonObject


@dataclass(slots=True)
class GymRowResult:
    """One Gym row, converted: NeMo-RL's message log plus what the driver reads from Gym's result."""

    row_index: int
    """The row's ``_rowidx`` (its position in the group)."""
    message_log: LLMMessageLogType
    """User/assistant pairs, one per model call, with int64 ``token_ids`` and float32 ``generation_logprobs``."""
    full_result: JsonObject
    """Gym's ``/run`` result, token arrays popped and ``prompt_str`` / ``generation_str`` added."""
    reward: float
    """Gym's ``reward``, checked finite."""
    token_drift: JsonObject | None = None
    """The first drift (``on_drift="truncate"``): the log ends before that turn."""
    incomplete_reason: str | None = None
    """Gym's ``response.incomplete_details.reason`` (``max_output_tokens``, ...), if any."""
    metrics: dict[str, float] = field(default_factory=dict)
    """The numeric and boolean top-level fields of the result (``reward``, verifier scores)."""
    reward_components: dict[str, float] | None = None
    """A multi-reward verifier's ``reward_components`` (name -> finite score), what NeMo-RL's GDPO reads as
    ``reward/<name>``; None for a single-reward result."""
    mask_sample: bool = False
    """The environment flagged the reward as no valid measurement: Gym 0.7's ``mask_sample``, or the older
    ``instance_config.mask_sample``. Such a sample stays out of the loss and of its group's baseline."""
    failure_kind: str | None = None
    """Gym 0.7's ``failure_kind`` (``session_lost``, ``judge_failed``, ...), independent of ``mask_sample``."""
    failure_reason: str | None = None
    """Gym's human-readable ``failure_reason``: a diagnosis, never a metric label."""
    agent: str | None = None
    """The agent the row was sent to (its ``agent_ref.name`` as routed, a ``task_source`` row's resolved agent
    included), set by the actor that posted it; None for a materialized row, which goes to an environment server,
    and for a result converted outside an actor."""
    capture: CaptureBuild | None = None
    """With ``token_id_capture`` on: what Gym's finaliser made of this result (None: it made no build), counted
    against ``max_mask_fraction`` by the client (:class:`~gym_bridge.gym.protocol.token_capture.MaskFractionWatch`)."""

    @property
    def input_message_log(self) -> LLMMessageLogType:
        """The first user message: the prompt as NeMo-RL records it."""
        return self.message_log[:1]

    def __getstate__(self) -> dict[str, Any]:
        """The fields, with the message log's tensors as numpy arrays (pickled out of band by Ray)."""
        state = {name: getattr(self, name) for name in self.__dataclass_fields__}
        state["message_log"] = log_as_numpy(_copied(self.message_log))
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        for name, value in state.items():
            object.__setattr__(self, name, value)
        log_as_tensors(self.message_log)

    def as_nemo_rl_result(self) -> NemoRLRowResult:
        """The dict NeMo-RL's ``NemoGym.run_rollouts`` yields for this row, token fields as numpy arrays."""
        log = cast(list[dict[str, Any]], log_as_numpy(_copied(self.message_log)))
        return {"message_log": log, "input_message_log": log[:1], "full_result": self.full_result}


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


def _copied(message_log: LLMMessageLogType) -> LLMMessageLogType:
    """A shallow copy of each message, so a converted copy leaves the original's tensors alone."""
    return cast(LLMMessageLogType, [dict(m) for m in message_log])
