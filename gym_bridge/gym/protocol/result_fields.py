"""What the driver reads from a Gym ``/run`` result beside its message log: the reward (checked), the reward
components, the environment's mask and failure kind, the incomplete reason and the scalar fields, as a typed
:class:`~gym_bridge.gym.protocol.result.GymRowResult`. The one reader of Gym's result schema;
:func:`gym_bridge.gym.protocol.convert.convert_gym_result` builds the message log and calls it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, cast

from gym_bridge.boundary.text import shown
from gym_bridge.failures import GymResultError, shorten
from gym_bridge.gym.protocol.result import GymRowResult
from gym_bridge.gym_versions import ROLLOUT_IDENTITY_KEYS
from gym_bridge.json_types import JsonMapping, JsonObject
from gym_bridge.types import LLMMessageLogType

_IDENTITY_KEYS = frozenset(ROLLOUT_IDENTITY_KEYS)


def gym_row_result(
    row_index: int,
    message_log: LLMMessageLogType | list[dict[str, Any]],
    full_result: JsonObject,
    *,
    token_drift: JsonObject | None = None,
) -> GymRowResult:
    """The typed row of a Gym result whose message log is built: Gym's reward (checked), flags and scalar fields.

    The one reader of Gym's result schema; :func:`convert_gym_result` calls it, and so do tests that build a
    message log by hand.
    """
    if "reward" not in full_result:
        raise GymResultError("the Gym result has no 'reward'")
    reward = _reward(full_result["reward"])
    return GymRowResult(
        row_index=row_index,
        message_log=cast(LLMMessageLogType, message_log),
        full_result=full_result,
        reward=reward,
        token_drift=token_drift,
        incomplete_reason=incomplete_reason(full_result),
        metrics=scalar_fields(full_result),
        reward_components=reward_components(full_result),
        mask_sample=_env_flagged(full_result),
        failure_kind=_optional_str(full_result, "failure_kind"),
        failure_reason=_optional_str(full_result, "failure_reason"),
    )


def _reward(value: object) -> float:
    """Gym's reward as a float: a finite JSON number, never a bool nor text (``"1.0"`` is no reward)."""
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise GymResultError(f"the Gym reward {shown(shorten(repr(value)))} is not a number")
    if isinstance(value, int) and abs(value) > 2**53:
        raise GymResultError("the Gym result's reward is an integer too large to be a float reward")
    if not math.isfinite(value):
        raise GymResultError(f"the Gym result's reward is {value}, not a finite number")
    return float(value)


def reward_components(full_result: JsonMapping) -> dict[str, float] | None:
    """Gym's ``reward_components`` as ``{name: score}``, each a finite number (a bool or text is none); None when
    the result has none or an empty mapping (a single-reward verifier), as NeMo-RL reads it."""
    components = full_result.get("reward_components")
    if components is None or components == {}:
        return None
    if not isinstance(components, Mapping):
        raise GymResultError(f"the Gym result's reward_components is {shown(shorten(repr(components)))}, not an object")
    scores = {}
    for name, score in components.items():
        try:
            scores[str(name)] = _reward(score)
        except GymResultError:
            raise GymResultError(
                f"the Gym result's reward_components[{shown(shorten(repr(name)))}] is "
                f"{shown(shorten(repr(score)))}, not a finite number"
            ) from None
    return scores


def _env_flagged(full_result: JsonMapping) -> bool:
    """Whether the environment masked this sample: top-level ``mask_sample`` (Gym 0.7) or
    ``instance_config.mask_sample`` (the field NeMo-RL reads for older Gyms)."""
    instance_config = full_result.get("instance_config")
    nested = instance_config.get("mask_sample") if isinstance(instance_config, Mapping) else None
    return bool(full_result.get("mask_sample")) or bool(nested)


def _optional_str(full_result: JsonMapping, key: str) -> str | None:
    value = full_result.get(key)
    if value is not None and not isinstance(value, str):
        raise GymResultError(f"the Gym result's {key} is {value!r}, not a string")
    return value


def incomplete_reason(full_result: JsonMapping | None) -> str | None:
    """Gym's ``response.incomplete_details.reason`` (``max_output_tokens``, ...), or None."""
    response = (full_result or {}).get("response") or {}
    details = response.get("incomplete_details") if isinstance(response, Mapping) else None
    reason = details.get("reason") if isinstance(details, Mapping) else None
    return reason if isinstance(reason, str) else None


def scalar_fields(full_result: JsonMapping) -> dict[str, float]:
    """The numeric and boolean top-level fields of a Gym result (``reward``, verifier scores), as floats: what
    NeMo-RL summarises per agent. Gym's rollout identity (``_ng_task_index``, ..., stamped on every result) is no
    verifier field and is left out, as Gym's collection leaves it out of its per-agent metrics."""
    return {
        key: float(value)
        for key, value in full_result.items()
        if isinstance(value, (int, float, bool)) and key not in _IDENTITY_KEYS
    }


def caller_fields(metrics: Mapping[str, float], full_result: JsonMapping, caller_row: JsonMapping) -> dict[str, float]:
    """``metrics`` (:func:`scalar_fields`) plus the rollout identity fields the caller's row carried before the
    bridge stamped its own (NeMo-RL's async collector stamps ``_ng_task_index``, Gym echoes it): NeMo-RL's batch
    functions summarise every numeric field of a result, and their rows hold only what their caller put there."""
    carried = {
        key: float(value)
        for key in _IDENTITY_KEYS
        if key in caller_row and isinstance(value := full_result.get(key), (int, float, bool))
    }
    return {**metrics, **carried}
