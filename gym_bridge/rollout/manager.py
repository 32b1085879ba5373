"""RolloutManager: picks a rollout backend by name and rolls out one prompt group at a time."""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Protocol

from gym_bridge.failures import (
    ConfigFailureWatch,
    EndpointConfigError,
    FailureClass,
    GymBridgeError,
    GymServerCrashLoop,
    RolloutDataFailure,
    RolloutRedispatchExhausted,
    RolloutRetryPolicy,
    RolloutStats,
    RolloutTimeouts,
    RunConfigurationError,
    SettingError,
    classify_rollout_failure,
)
from gym_bridge.interfaces import GenerationInterface, RolloutBackend
from gym_bridge.rollout.backend import RolloutContext, backend_options
from gym_bridge.rollout.registry import load_backend
from gym_bridge.rollout.sink import ReplayBuffer, RolloutSink
from gym_bridge.types import ActorHandle, DatumSpec, GenerationConfig, PromptGroupRecord, Tokenizer

logger = logging.getLogger(__name__)

NATIVE_BACKEND = "native"
NEMO_GYM_BACKEND = "nemo_gym"

type InflightRegistry = dict[str, tuple[asyncio.Task[object], int]]
"""Slot id -> (the attempt's task, the weight version it started on), while the attempt rolls out."""


class BackendContractError(GymBridgeError, RuntimeError):
    """A rollout backend returned a group that breaks the :class:`RolloutBackend` contract (the wrong size)."""


def backend_name_for(use_nemo_gym: bool, backend: str | None) -> str:
    """Resolve the backend name: an explicit ``backend`` wins; ``use_nemo_gym`` means ``nemo_gym``."""
    if backend is not None:
        if use_nemo_gym and backend != NEMO_GYM_BACKEND:
            raise SettingError(f"use_nemo_gym=True conflicts with backend={backend!r}; pass one or the other")
        return backend
    return NEMO_GYM_BACKEND if use_nemo_gym else NATIVE_BACKEND


class RolloutOutcome(enum.StrEnum):
    """How :meth:`RolloutManager.generate_and_push` (or ``collect``) finished for one prompt (NeMo-RL's enum).

    ``SKIPPED`` committed nothing: the caller owns the prompt's backpressure permit and the step's shortfall.
    """

    COMMITTED = "committed"
    SKIPPED = "skipped"


class RolloutManager:
    """Rolls out prompts through one backend from the ``gym_bridge.rollout_backends`` registry.

    The positional order is NeMo-RL's. The manager builds one :class:`RolloutContext` from them and hands it to
    the backend's ``from_context`` with the keyword options, validated by the backend's ``Options`` model first:
    an unknown or mistyped option is a :class:`BackendOptionsError` naming it. ``max_rollout_turns=None``
    sets no turn limit of ours (Gym's agent, or the environment, ends the episode).
    The retry policy defaults to a single attempt of everything.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        task_to_env: Mapping[str, ActorHandle] | None,
        num_generations_per_prompt: int,
        max_seq_len: int,
        max_rollout_turns: int | None = 1,
        policy_generation: GenerationInterface | None = None,
        generation_config: GenerationConfig | None = None,
        use_nemo_gym: bool = False,
        mask_env_flagged_samples: bool = True,
        tq_buffer: ReplayBuffer | None = None,
        timeouts: RolloutTimeouts | None = None,
        retry_policy: RolloutRetryPolicy | None = None,
        *,
        backend: str | None = None,
        **backend_options_given: object,
    ) -> None:
        if num_generations_per_prompt < 1:
            raise SettingError(f"num_generations_per_prompt must be >= 1, got {num_generations_per_prompt}")
        if max_rollout_turns is not None and max_rollout_turns < 1:
            raise SettingError(f"max_rollout_turns must be >= 1 or None, got {max_rollout_turns}")
        if tq_buffer is not None and not isinstance(tq_buffer, ReplayBuffer):
            raise TypeError(
                f"tq_buffer must implement the replay-buffer contract (reserve, async commit, async remove_group) "
                f"of gym_bridge.ReplayBuffer; got {type(tq_buffer).__name__}"
            )
        self._tq_buffer = tq_buffer
        self.backend_name = backend_name_for(use_nemo_gym, backend)
        backend_cls = load_backend(self.backend_name)
        options = backend_options(backend_cls, self.backend_name, backend_options_given)
        self.timeouts = timeouts or RolloutTimeouts()
        self.retry_policy = retry_policy or RolloutRetryPolicy.single_attempt()
        self.stats = RolloutStats()
        self._skipped_prompts = 0
        self._consecutive_infra_drops = 0
        self._config_watch = ConfigFailureWatch(self.retry_policy.stop_after_config_failures)
        self._weight_version = 0
        self.context = RolloutContext(
            tokenizer=tokenizer,
            task_to_env=dict(task_to_env or {}),
            num_generations_per_prompt=num_generations_per_prompt,
            max_seq_len=max_seq_len,
            max_rollout_turns=max_rollout_turns,
            policy_generation=policy_generation,
            generation_config=generation_config,
            mask_env_flagged_samples=mask_env_flagged_samples,
            timeouts=self.timeouts,
            retry_policy=self.retry_policy,
            stats=self.stats,
        )
        self.backend: RolloutBackend = backend_cls.from_context(self.context, options)
        self.num_generations_per_prompt = num_generations_per_prompt

    @property
    def weight_version(self) -> int:
        """The policy weights' version that rollouts started now are tagged with (0 until set)."""
        return self._weight_version

    def set_weight_version(self, version: int) -> None:
        """Tag groups from now on with ``version`` (call after each refit of the serving engine)."""
        self._weight_version = int(version)

    async def run_rollout(self, datum: DatumSpec) -> PromptGroupRecord:
        """Roll out one prompt: a complete group of N completions, or a typed failure."""
        record = await self.backend.run_rollout(datum)
        if len(record.completions) != self.num_generations_per_prompt:
            raise BackendContractError(
                f"backend {self.backend_name!r} returned {len(record.completions)} completions "
                f"for prompt_idx={record.prompt_idx}; expected {self.num_generations_per_prompt}"
            )
        return record

    async def generate_and_push(
        self,
        input_sample: DatumSpec,
        *,
        target_step: int | None = None,
        inflight_registry: InflightRegistry | None = None,
    ) -> RolloutOutcome:
        """Roll out one prompt under the retry policy and commit it to ``tq_buffer`` (NeMo-RL's signature).

        Each attempt reserves a fresh slot tagged with the weight version and ``target_step``;
        ``inflight_registry`` (when given) maps the attempt's slot id to ``(task, start weight
        version)`` while it rolls out, so a controller can cancel stale attempts. Otherwise as
        :meth:`collect`.
        """
        if self._tq_buffer is None:
            raise SettingError("generate_and_push needs the tq_buffer given to RolloutManager(...)")
        return await self._push(input_sample, _BufferSlots(self._tq_buffer, target_step), inflight_registry)

    async def collect(self, datum: DatumSpec, sink: RolloutSink) -> RolloutOutcome:
        """Roll out one prompt under the retry policy and commit the complete group to ``sink``.

        Every attempt reserves a fresh slot; a failed attempt's slot is discarded, so
        the sink never holds a partial group. Infrastructure failures back off and
        retry; when their budget is spent the prompt is dropped (SKIPPED), unless too
        many prompts in a row were dropped (:class:`RolloutRedispatchExhausted`).
        Data failures retry without backoff; when their budget is spent the prompt
        is SKIPPED, unless the run-wide skip budget is spent, which re-raises. An
        ``EndpointConfigError`` is not retried; when the run's first prompts all end
        with the same one, :class:`RunConfigurationError` stops the run.
        Cancellation is never retried. The commit carries the weight version when the
        committed attempt started and when it finished (see :meth:`set_weight_version`).
        """
        return await self._push(datum, _SinkSlots(sink, int(datum["idx"])), None)

    async def _push(
        self,
        datum: DatumSpec,
        slots: _Slots,
        inflight_registry: InflightRegistry | None,
    ) -> RolloutOutcome:
        """The one retry loop behind :meth:`generate_and_push` and :meth:`collect`; :func:`next_action` decides."""
        policy = self.retry_policy
        prompt_idx = int(datum["idx"])
        attempts = Attempts()
        while True:
            start_version = self._weight_version
            slot = slots.open(start_version)
            try:
                await self._attempt(datum, slots, slot, start_version, inflight_registry)
            except (RunConfigurationError, GymServerCrashLoop) as exc:  # terminal for the run (a config error,
                # Gym's max_mask_fraction abort, a Gym server past its last restart)
                await _drop_quietly(slots, slot, exc)
                raise
            except Exception as exc:
                await _drop_quietly(slots, slot, exc)
                action, attempts = next_action(exc, attempts, policy, self._skipped_prompts)
                reason = type(exc).__name__
                if action is RetryAction.BACK_OFF:
                    self.stats.record_redispatch(reason)
                    delay = policy.backoff_for(attempts.infra)
                    logger.warning("prompt_idx=%d: %s: %s; retrying in %.1fs", prompt_idx, reason, exc, delay)
                    await asyncio.sleep(delay)
                elif action is RetryAction.RETRY:
                    self.stats.record_data_retry(reason)
                elif action is RetryAction.DROP:
                    return self._dropped(prompt_idx, exc, attempts)
                else:
                    return self._data_budget_spent(prompt_idx, exc, attempts, action)
            except BaseException as exc:
                await _drop_quietly(slots, slot, exc)
                raise
            else:
                self.stats.committed += 1
                self._config_watch.other_outcome()
                self._consecutive_infra_drops = 0
                return RolloutOutcome.COMMITTED

    async def _attempt(
        self,
        datum: DatumSpec,
        slots: _Slots,
        slot: str,
        start_version: int,
        inflight_registry: InflightRegistry | None,
    ) -> None:
        """One attempt: roll out, then commit the complete group with its start and end weight versions."""
        if inflight_registry is not None:
            task = asyncio.current_task()
            assert task is not None  # _push always runs inside a task
            inflight_registry[slot] = (task, start_version)
        try:
            record = await self.run_rollout(datum)
        finally:
            if inflight_registry is not None:
                inflight_registry.pop(slot, None)
        await slots.commit(slot, record, start_version, self._weight_version)

    def _data_budget_spent(
        self, prompt_idx: int, exc: Exception, attempts: Attempts, action: RetryAction
    ) -> RolloutOutcome:
        """The prompt's data budget is spent: count it, let the config watch see it, then skip it or re-raise."""
        reason = type(exc).__name__
        self.stats.record_data_failure(reason)
        if isinstance(exc, EndpointConfigError):
            self._config_watch.config_failure(exc)  # may stop the run
        else:
            self._config_watch.other_outcome()
        if action is RetryAction.RAISE:
            if self.retry_policy.max_skipped_prompts == 0:
                raise exc
            raise RolloutDataFailure(
                f"prompt_idx={prompt_idx} failed ({reason}: {exc}) after {self._skipped_prompts} skipped "
                f"prompts, exceeding max_skipped_prompts={self.retry_policy.max_skipped_prompts}"
            ) from exc
        self._skipped_prompts += 1
        self.stats.skipped += 1
        logger.warning("prompt_idx=%d skipped after %d data failures: %s: %s", prompt_idx, attempts.data, reason, exc)
        return RolloutOutcome.SKIPPED

    def _dropped(self, prompt_idx: int, exc: Exception, attempts: Attempts) -> RolloutOutcome:
        """The prompt's infrastructure budget is spent: drop it, unless too many were dropped in a row."""
        policy = self.retry_policy
        self._consecutive_infra_drops += 1
        self._config_watch.other_outcome()
        reason = type(exc).__name__
        if self._consecutive_infra_drops > policy.max_consecutive_dropped_prompts:
            raise RolloutRedispatchExhausted(
                f"prompt_idx={prompt_idx}: {policy.max_infra_attempts} infrastructure attempt(s) failed "
                f"({reason}: {exc}); {self._consecutive_infra_drops} prompt(s) dropped in a row, exceeding "
                f"max_consecutive_dropped_prompts={policy.max_consecutive_dropped_prompts}"
            ) from exc
        self.stats.record_infra_drop(reason, self._consecutive_infra_drops)
        self.stats.skipped += 1
        logger.warning("prompt_idx=%d dropped after %d infrastructure failures: %s", prompt_idx, attempts.infra, reason)
        return RolloutOutcome.SKIPPED


class RetryAction(enum.StrEnum):
    """What the retry loop does after a failed attempt."""

    BACK_OFF = "back_off"
    """Infrastructure: wait ``policy.backoff_for(attempts.infra)``, then try again."""
    RETRY = "retry"
    """Data: try again at once."""
    DROP = "drop"
    """Infrastructure budget spent: drop the prompt (or stop the run after too many drops in a row)."""
    SKIP = "skip"
    """Data budget spent: skip the prompt."""
    RAISE = "raise"
    """Data budget spent and the run's skip budget too: the failure ends the run."""


@dataclass(frozen=True)
class Attempts:
    """A prompt's failed attempts so far, by class."""

    infra: int = 0
    data: int = 0


def next_action(
    error: Exception, attempts: Attempts, policy: RolloutRetryPolicy, skipped_prompts: int
) -> tuple[RetryAction, Attempts]:
    """The retry policy as a pure function: from one failure, the prompt's attempts and the run's skipped
    prompts, what to do next and the attempts counted with this one.

    INFRA (``classify_rollout_failure``) backs off until ``max_infra_attempts``, then drops. DATA retries
    until ``max_data_attempts`` (an ``EndpointConfigError`` never), then skips while the run has skipped
    fewer than ``max_skipped_prompts``, else raises.
    """
    if classify_rollout_failure(error) is FailureClass.INFRA:
        counted = replace(attempts, infra=attempts.infra + 1)
        spent = counted.infra >= policy.max_infra_attempts
        return (RetryAction.DROP if spent else RetryAction.BACK_OFF), counted
    counted = replace(attempts, data=attempts.data + 1)
    if counted.data < policy.max_data_attempts and not isinstance(error, EndpointConfigError):
        return RetryAction.RETRY, counted
    return (RetryAction.RAISE if skipped_prompts >= policy.max_skipped_prompts else RetryAction.SKIP), counted


class _Slots(Protocol):
    """Where one prompt's attempts go: a fresh slot per attempt, committed once or dropped."""

    def open(self, weight_version: int) -> str: ...

    async def commit(self, slot: str, record: PromptGroupRecord, start_version: int, end_version: int) -> None: ...

    async def drop(self, slot: str, error: BaseException) -> None: ...


@dataclass(frozen=True)
class _SinkSlots:
    sink: RolloutSink
    prompt_idx: int

    def open(self, weight_version: int) -> str:
        return self.sink.reserve(self.prompt_idx)

    async def commit(self, slot: str, record: PromptGroupRecord, start_version: int, end_version: int) -> None:
        self.sink.commit(slot, record, start_weight_version=start_version, end_weight_version=end_version)

    async def drop(self, slot: str, error: BaseException) -> None:
        self.sink.discard(slot, error)


@dataclass(frozen=True)
class _BufferSlots:
    buffer: ReplayBuffer
    target_step: int | None

    def open(self, weight_version: int) -> str:
        return self.buffer.reserve(weight_version=weight_version, target_step=self.target_step)

    async def commit(self, slot: str, record: PromptGroupRecord, start_version: int, end_version: int) -> None:
        await self.buffer.commit(slot, record, start_weight_version=start_version, end_weight_version=end_version)

    async def drop(self, slot: str, error: BaseException) -> None:
        await self.buffer.remove_group(slot)


async def _drop_quietly(slots: _Slots, slot: str, error: BaseException) -> None:
    """Drop a failed attempt's slot; a failing drop is logged, never masks the real error."""
    try:
        await slots.drop(slot, error)
    except Exception as exc:
        logger.error("dropping slot %s failed: %s: %s", slot, type(exc).__name__, exc)
