"""NeMo-RL's failure and async sections of a training config, read into our retry policy, timeouts and loop settings.

- ``async_rl.rollout_failure`` (NeMo-RL's ``RolloutFailureConfig``, same keys and defaults) becomes a
  :class:`~gym_bridge.failures.RolloutRetryPolicy` and :class:`~gym_bridge.failures.RolloutTimeouts`;
- ``async_rl.watchdog.stall_timeout_s`` / ``stall_action`` become the GRPO loop's stall watchdog;
- ``grpo.async_grpo`` (``enabled``, ``max_trajectory_age_steps``, ``max_generation_failures``,
  ``in_flight_weight_updates``, ``recompute_kv_cache_after_weight_updates``) becomes :class:`AsyncGRPOSettings`.

A key in these sections that we do not know is an error naming it; a setting we cannot honour
(``on_dropped_prompt: replace``) is refused with one line saying why.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt, PositiveFloat, PositiveInt, model_validator

from gym_bridge.failures import RolloutRetryPolicy, RolloutTimeouts

__all__ = ["AsyncGRPOSettings", "RolloutFailureSettings", "WatchdogSettings"]


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class _NativeFailure(_Section):
    generation_timeout_s: PositiveFloat | None = None
    env_timeout_s: PositiveFloat | None = None


class _GymFailure(_Section):
    rollout_timeout_s: PositiveFloat | None = None
    max_row_attempts: PositiveInt = 3


class RolloutFailureSettings(_Section):
    """``async_rl.rollout_failure``: NeMo-RL's keys and defaults."""

    max_infra_attempts_per_prompt: PositiveInt = 5
    max_data_attempts_per_prompt: PositiveInt = 2
    backoff_base_s: PositiveFloat = 1.0
    max_backoff_s: PositiveFloat = 30.0
    max_skipped_prompts: NonNegativeInt = 0
    max_consecutive_dropped_prompts: NonNegativeInt = 0
    min_step_batch_fraction: float = Field(0.9, gt=0.0, le=1.0)
    """Read by the GRPO loop: a step whose committed groups fall below this share of its prompts fails the run."""
    on_dropped_prompt: Literal["shrink"] = "shrink"
    """Only ``shrink``: the loop trains a step on the groups it has; ``replace`` (a fresh prompt) is refused."""
    max_replacement_attempts: NonNegativeInt = 1
    """Read only with ``on_dropped_prompt: replace``, which is refused: accepted for NeMo-RL's configs."""
    replacement_reserve_prompts: NonNegativeInt = 1
    """As ``max_replacement_attempts``."""
    native: _NativeFailure = _NativeFailure()
    nemo_gym: _GymFailure = _GymFailure()

    @model_validator(mode="before")
    @classmethod
    def _refuse_replace(cls, data: Any) -> Any:
        if isinstance(data, Mapping) and data.get("on_dropped_prompt") == "replace":
            raise ValueError(
                "on_dropped_prompt: replace is not supported: gym-bridge's GRPO loop trains a step on the groups "
                "it committed (shrink), bounded by min_step_batch_fraction"
            )
        return data

    @model_validator(mode="after")
    def _backoff_order(self) -> RolloutFailureSettings:
        if self.max_backoff_s < self.backoff_base_s:
            raise ValueError(f"max_backoff_s ({self.max_backoff_s}) must be >= backoff_base_s ({self.backoff_base_s})")
        return self

    def retry_policy(self, *, max_consecutive_dropped_prompts: int | None = None) -> RolloutRetryPolicy:
        """The manager's retry policy; ``max_consecutive_dropped_prompts`` overrides this section's."""
        dropped = self.max_consecutive_dropped_prompts
        return RolloutRetryPolicy(
            max_infra_attempts=self.max_infra_attempts_per_prompt,
            max_data_attempts=self.max_data_attempts_per_prompt,
            max_gym_row_attempts=self.nemo_gym.max_row_attempts,
            backoff_base_s=self.backoff_base_s,
            max_backoff_s=self.max_backoff_s,
            max_skipped_prompts=self.max_skipped_prompts,
            max_consecutive_dropped_prompts=dropped
            if max_consecutive_dropped_prompts is None
            else max_consecutive_dropped_prompts,
        )

    def timeouts(self) -> RolloutTimeouts:
        return RolloutTimeouts(
            rollout_s=self.nemo_gym.rollout_timeout_s,
            generation_s=self.native.generation_timeout_s,
            env_s=self.native.env_timeout_s,
        )


class WatchdogSettings(_Section):
    """``async_rl.watchdog``: the stall deadline the GRPO loop enforces (``RolloutStall``)."""

    model_config = ConfigDict(extra="ignore", frozen=True)  # its other keys tune NeMo-RL's SingleController

    stall_timeout_s: PositiveFloat | None = None
    stall_action: Literal["warn", "abort"] = "warn"


class AsyncGRPOSettings(_Section):
    """``grpo.async_grpo``: NeMo-RL's keys and defaults, as our GRPO loop honours them.

    ``in_flight_weight_updates``: true refits the engine as soon as a step has trained, while the next
    step's rollouts are in flight (a request in flight finishes on the old weights; a multi-turn rollout
    may span versions, and its group records both); false first waits for those rollouts to finish.
    ``recompute_kv_cache_after_weight_updates``: our engine never keeps a KV cache across a refit, so
    either value holds. ``max_generation_failures``: prompts dropped in a row for infrastructure failures
    before the run stops (the retry policy's ``max_consecutive_dropped_prompts`` when async is on).
    """

    enabled: bool = False
    max_trajectory_age_steps: NonNegativeInt = 1
    max_generation_failures: NonNegativeInt = 0
    in_flight_weight_updates: bool = False
    recompute_kv_cache_after_weight_updates: bool = False
