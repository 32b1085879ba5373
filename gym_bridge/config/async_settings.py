"""NeMo-RL's failure and async sections of a training config, read into our retry policy, timeouts and loop settings.

- ``async_rl.rollout_failure`` (NeMo-RL's ``RolloutFailureConfig``, same keys and defaults) becomes a
  :class:`~gym_bridge.failures.RolloutRetryPolicy` and :class:`~gym_bridge.failures.RolloutTimeouts`: NeMo-RL's
  key names map onto the policy's fields (:meth:`RolloutFailureSettings.retry_policy`), and a default is the
  policy's own, except the attempt budgets, which the policy leaves to its caller: NeMo-RL's (5, 2, 3);
- ``async_rl.stall_watchdog`` becomes the GRPO loop's stall watchdog (:class:`StallWatchdogSettings`);
- the rest of ``async_rl`` (:class:`AsyncRLSettings`): NeMo-RL's SingleController knobs, each honoured, or
  refused when set to something gym-bridge cannot do;
- ``grpo.async_grpo`` (``enabled``, ``max_trajectory_age_steps``, ``max_generation_failures``,
  ``in_flight_weight_updates``, ``recompute_kv_cache_after_weight_updates``) becomes :class:`AsyncGRPOSettings`.

A key in these sections that we do not know is an error naming it, a key NeMo-RL renamed is an error naming
the new name (as NeMo-RL's own check), and a setting we cannot honour is refused with one line saying why.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt, model_validator

from gym_bridge.config.keys import TrainingConfigError, config_value
from gym_bridge.config.values import Count, Seconds, count, seconds
from gym_bridge.failures import RolloutRetryPolicy, RolloutTimeouts, SettingError
from gym_bridge.json_types import JsonMapping, JsonObject

_RENAMED_FAILURE_KEYS = {
    "max_attempts_per_prompt": "max_infra_attempts_per_prompt",
    "on_data_exhausted": "max_skipped_prompts (fail_fast is 0)",
    "max_gym_row_attempts": "nemo_gym.max_row_attempts",
}
_RENAMED_ASYNC_RL_KEYS = {
    "watchdog": "stall_watchdog",
    "fleet_health": "generation_fleet_health",
    "policy_router": "generation_router",
    "rollout_timeout_s": "rollout_failure.nemo_gym.rollout_timeout_s",
    "generation_timeout_s": "rollout_failure.native.generation_timeout_s",
    "env_timeout_s": "rollout_failure.native.env_timeout_s",
}


_POLICY_DEFAULTS = RolloutRetryPolicy.single_attempt()
"""The retry settings' own defaults: a NeMo-RL key takes them where NeMo-RL's default is the same."""


def _refuse_renamed(data: JsonMapping, renamed: Mapping[str, str], prefix: str) -> None:
    """NeMo-RL's check: a key from before its renames is an error naming the new key, not an unknown key."""
    stale = [f"{prefix}.{old} -> {prefix}.{new}" for old, new in renamed.items() if old in data]
    if stale:
        raise SettingError(f"renamed in NeMo-RL: {'; '.join(stale)}")


class _Section(BaseModel):
    """A section of NeMo-RL's: unknown keys refused, every number finite."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class _NativeFailure(_Section):
    generation_timeout_s: Seconds | None = None
    env_timeout_s: Seconds | None = None


class _GymFailure(_Section):
    rollout_timeout_s: Seconds | None = None
    max_row_attempts: Count = 3
    """The policy's ``max_gym_row_attempts``; NeMo-RL's default."""


class RolloutFailureSettings(_Section):
    """``async_rl.rollout_failure``: NeMo-RL's keys and defaults, each the retry policy's field of the same meaning
    (:meth:`retry_policy` maps the names)."""

    max_infra_attempts_per_prompt: Count = 5
    """The policy's ``max_infra_attempts``; NeMo-RL's default."""
    max_data_attempts_per_prompt: Count = 2
    """The policy's ``max_data_attempts``; NeMo-RL's default."""
    backoff_base_s: Seconds = _POLICY_DEFAULTS.backoff_base_s
    max_backoff_s: Seconds = _POLICY_DEFAULTS.max_backoff_s
    max_skipped_prompts: NonNegativeInt = _POLICY_DEFAULTS.max_skipped_prompts
    max_consecutive_dropped_prompts: NonNegativeInt = _POLICY_DEFAULTS.max_consecutive_dropped_prompts
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
    def _refuse_replace(cls, data: object) -> object:
        if isinstance(data, Mapping):
            _refuse_renamed(data, _RENAMED_FAILURE_KEYS, "async_rl.rollout_failure")
        if isinstance(data, Mapping) and data.get("on_dropped_prompt") == "replace":
            raise SettingError(
                "on_dropped_prompt: replace is not supported: gym-bridge's GRPO loop trains a step on the groups "
                "it committed (shrink), bounded by min_step_batch_fraction"
            )
        return data

    @model_validator(mode="after")
    def _backoff_order(self) -> RolloutFailureSettings:
        if self.max_backoff_s < self.backoff_base_s:
            raise SettingError(
                f"max_backoff_s ({self.max_backoff_s}) must be >= backoff_base_s ({self.backoff_base_s})"
            )
        return self

    def retry_policy(self, *, max_consecutive_dropped_prompts: int | None = None) -> RolloutRetryPolicy:
        """The manager's retry policy: each NeMo-RL key onto its policy field (``nemo_gym.max_row_attempts`` onto
        ``max_gym_row_attempts``); ``max_consecutive_dropped_prompts`` overrides this section's."""
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


class StallWatchdogSettings(_Section):
    """``async_rl.stall_watchdog``: NeMo-RL's keys and defaults; the GRPO loop raises ``RolloutStall`` (``abort``)
    or warns when a step's rollouts commit nothing for ``stall_timeout_s``, checking every ``interval_s``."""

    interval_s: Seconds = 30.0
    stall_timeout_s: Seconds | None = 600.0
    """None (only when the section is absent): no stall watch."""
    stall_action: Literal["warn", "abort"] = "warn"
    gym_subprocess_check: Literal[True] = True
    """Always on: the NemoGym actor polls its Gym servers' processes while rows are in flight."""

    @model_validator(mode="before")
    @classmethod
    def _refuse_unchecked_gym(cls, data: object) -> object:
        if isinstance(data, Mapping) and data.get("gym_subprocess_check") is False:
            raise SettingError(
                "gym_subprocess_check: false is not supported: gym-bridge's NemoGym actor always watches its Gym "
                "servers' processes while rows are in flight, so a dead server is named instead of stalling"
            )
        return data

    @model_validator(mode="after")
    def _timeout_after_interval(self) -> StallWatchdogSettings:
        if self.stall_timeout_s is not None and self.stall_timeout_s <= self.interval_s:
            raise SettingError(
                f"stall_timeout_s ({self.stall_timeout_s}) must be > interval_s ({self.interval_s}); otherwise the "
                "watchdog reports a stall before it has had a chance to observe one"
            )
        return self

    @classmethod
    def off(cls) -> StallWatchdogSettings:
        """No ``async_rl.stall_watchdog`` section: no stall watch (our default; NeMo-RL's SingleController has one)."""
        return cls(stall_timeout_s=None)


class _Switch(BaseModel):
    """A NeMo-RL block gym-bridge lacks: accepted while ``enabled`` is false (its other keys are then inert, as in
    NeMo-RL), refused when true."""

    model_config = ConfigDict(extra="allow", frozen=True)

    enabled: bool = False


class AsyncRLSettings(_Section):
    """``async_rl`` (NeMo-RL's ``AsyncRLConfig``) as gym-bridge's GRPO loop and rollout layer honour it.

    Honoured: ``rollout_failure``, ``stall_watchdog``, ``recompute_kv_cache_after_weight_updates`` (our engine
    keeps no KV cache across a refit, so either value holds). Refused when switched on: ``generation_router``,
    ``generation_fleet_health``, ``diagnostics``. Accepted but without effect, with one warning: the
    SingleController pump's ``sampler``, ``min_groups_for_streaming_train``, ``max_inflight_prompts`` and
    ``max_buffered_rollouts`` (our loop dispatches a step's prompts together; staleness is bounded by
    ``grpo.async_grpo.max_trajectory_age_steps``).
    """

    rollout_failure: RolloutFailureSettings = RolloutFailureSettings()
    stall_watchdog: StallWatchdogSettings = StallWatchdogSettings.off()
    recompute_kv_cache_after_weight_updates: bool = False
    generation_router: _Switch = _Switch()
    generation_fleet_health: _Switch = _Switch()
    diagnostics: bool = False
    sampler: JsonObject | None = None
    min_groups_for_streaming_train: int | None = None
    max_inflight_prompts: int | None = None
    max_buffered_rollouts: int | None = None

    @model_validator(mode="before")
    @classmethod
    def _nemo_rl_checks(cls, data: object) -> object:
        if not isinstance(data, Mapping):
            return data
        _refuse_renamed(data, _RENAMED_ASYNC_RL_KEYS, "async_rl")
        refused = {
            "generation_router": "gym-bridge hands Gym the endpoints themselves; it has no router in front of them",
            "generation_fleet_health": "gym-bridge does not quarantine shards; the NemoGym actor probes the "
            "endpoints while rows are in flight (EndpointWatch) and fails the group when one stops answering",
        }
        for name, why in refused.items():
            if isinstance(data.get(name), Mapping) and data[name].get("enabled"):
                raise SettingError(f"{name}.enabled: true is not supported: {why}")
        if data.get("diagnostics"):
            raise SettingError(
                "diagnostics: true is not supported: gym-bridge reports through logging; set the 'gym_bridge' "
                "logger to DEBUG instead"
            )
        return data

    @model_validator(mode="after")
    def _stall_outlasts_rollouts(self) -> AsyncRLSettings:
        """NeMo-RL's rule: the stall deadline must exceed every rollout deadline, or slow rollouts read as stalls."""
        stall = self.stall_watchdog.stall_timeout_s
        deadlines = {
            "rollout_failure.nemo_gym.rollout_timeout_s": self.rollout_failure.nemo_gym.rollout_timeout_s,
            "rollout_failure.native.generation_timeout_s": self.rollout_failure.native.generation_timeout_s,
            "rollout_failure.native.env_timeout_s": self.rollout_failure.native.env_timeout_s,
        }
        for name, value in deadlines.items():
            if stall is not None and value is not None and stall <= value:
                raise SettingError(f"stall_watchdog.stall_timeout_s ({stall}) must be > async_rl.{name} ({value})")
        return self

    def without_effect(self) -> list[str]:
        """The SingleController pump keys that are set: accepted, without effect on gym-bridge's loop."""
        names = ("sampler", "min_groups_for_streaming_train", "max_inflight_prompts", "max_buffered_rollouts")
        return [name for name in names if getattr(self, name) is not None]


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


def failure_policy(
    config: JsonMapping, async_rl: AsyncRLSettings, async_grpo: AsyncGRPOSettings
) -> tuple[RolloutRetryPolicy, RolloutTimeouts]:
    """NeMo-RL's ``async_rl.rollout_failure`` when present; else our ``env.nemo_gym`` keys over one attempt
    (``single_attempt()``), with ``env.nemo_gym.max_row_attempts`` defaulting to NeMo-RL's row budget.

    ``grpo.async_grpo.max_generation_failures`` (async on) bounds the prompts dropped in a row, as
    ``async_rl.rollout_failure.max_consecutive_dropped_prompts`` does; both set to different values is an error.
    """
    ours = {key: config_value(config, f"env.nemo_gym.{key}", None) for key in ("rollout_timeout_s", "max_row_attempts")}
    failure = async_rl.rollout_failure
    generation_failures = (
        async_grpo.max_generation_failures
        if async_grpo.enabled and "max_generation_failures" in async_grpo.model_fields_set
        else None
    )
    if config_value(config, "async_rl.rollout_failure", None) is not None:
        clash = [key for key, value in ours.items() if value is not None]
        if clash:
            raise TrainingConfigError(
                f"env.nemo_gym.{clash[0]} and async_rl.rollout_failure.nemo_gym.{clash[0]} both set; keep NeMo-RL's"
            )
        dropped = failure.max_consecutive_dropped_prompts
        both_set = generation_failures is not None and "max_consecutive_dropped_prompts" in failure.model_fields_set
        if both_set and generation_failures != dropped:
            raise TrainingConfigError(
                f"grpo.async_grpo.max_generation_failures ({generation_failures}) and "
                f"async_rl.rollout_failure.max_consecutive_dropped_prompts ({dropped}) set the same budget; keep one"
            )
        return failure.retry_policy(max_consecutive_dropped_prompts=generation_failures), failure.timeouts()
    timeout = ours["rollout_timeout_s"]
    row_attempts = ours["max_row_attempts"] or failure.nemo_gym.max_row_attempts
    policy = RolloutRetryPolicy.single_attempt(
        max_gym_row_attempts=count(row_attempts, "env.nemo_gym.max_row_attempts")
    )
    if async_grpo.enabled:
        policy = replace(policy, max_consecutive_dropped_prompts=async_grpo.max_generation_failures)
    rollout_s = seconds(timeout, "env.nemo_gym.rollout_timeout_s") if timeout is not None else None
    return policy, RolloutTimeouts(rollout_s=rollout_s)


def refuse_native_failure_keys(config: JsonMapping) -> None:
    """NeMo-RL's rule: ``async_rl.rollout_failure.native`` settings on a Gym run would be silently ignored."""
    native = config_value(config, "async_rl.rollout_failure.native", None) or {}
    populated = [f"{key}={value!r}" for key, value in native.items() if value is not None]
    if populated:
        raise TrainingConfigError(
            f"async_rl.rollout_failure.native.{', '.join(populated)}: this run uses the nemo_gym rollout path, where "
            "native-only deadlines do nothing; move them under async_rl.rollout_failure.nemo_gym or remove them"
        )
